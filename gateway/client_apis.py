"""The client APIs beyond chat completions, on the same port (I/O shell over the pure translations).

- ``POST /v1/completions`` with several prompts (:func:`completion_batch`): one
  job per prompt, one after another (a batch holds one Route Session of its
  client at a time), merged into one response whose choice ``j`` of prompt ``i``
  has index ``i * n + j``; usage summed.
- ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``: OpenAI's Responses
  API (``gateway.responses_api``), with the kept conversations of
  ``gateway.response_store`` behind ``previous_response_id``.
- ``POST /api/chat``, ``POST /api/generate``, ``GET /api/tags``, ``POST /api/show``,
  ``GET /api/ps``, ``GET /api/version``: Ollama's API (``gateway.ollama_api``),
  NDJSON streams.

Every generation starts through ``Context.start`` (the API key's caps and
quotas, admission, the route) exactly as a chat completion does, and its events
are read the same way (``gateway.openai_http``). Errors raised here leave through
``gateway.app``'s one error handler (Ollama's paths get Ollama's ``{"error"}``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response
from quart_trio import QuartTrio

from gateway import ollama_api, responses_api
from gateway.api_keys import Principal
from gateway.errors import ClientStalled, GatewayError, InvalidRequest, ModelNotFound, NotFound
from gateway.generation import ChoiceEnd, Delta, Failed, Finished
from gateway.jobs import Job
from gateway.openai_http import (
    Batch,
    Where,
    access,
    collect,
    dump,
    json_response,
    public_error,
    sse,
    streamed_response,
)
from gateway.protocol import GenerationRequest, ToolCall, merge_completions, sse_event
from gateway.response_store import ResponseStore
from gateway.serving import GatewayService


@dataclass(frozen=True)
class Context:
    """What the handlers share with ``gateway.app``."""

    service: GatewayService
    read_json: Callable[[], Awaitable[Any]]
    principal: Callable[[], Awaitable[Principal]]
    start: Callable[[GenerationRequest, Principal, str | None], Awaitable[Job]]  # client: see below
    where: Callable[[], Where | None]  # in the request's context only, as are start(..., None) and client
    client: Callable[[], str]  # who the request is from, for start outside the request's context


def _calls(message: dict[str, Any]) -> tuple[ToolCall, ...]:
    return tuple(
        ToolCall(str(c["id"]), str(c["function"]["name"]), str(c["function"]["arguments"]))
        for c in message.get("tool_calls") or ()
    )


async def _collected(job: Job) -> dict[str, Any]:
    try:
        return await collect(job)
    finally:
        job.cancel()
        job.events.close()


# --------------------------------------------------------------------------- several prompts


async def completion_batch(ctx: Context, batch: tuple[GenerationRequest, ...], who: Principal) -> Response:
    n = batch[0].n
    first = await ctx.start(batch[0], who, None)  # refusals of the first prompt are the request's status
    if batch[0].stream:
        return streamed_response(_batch_stream(ctx, batch, who, first, n, ctx.client(), ctx.where()))
    bodies = [await _collected(first)]
    for req in batch[1:]:
        bodies.append(await _collected(await ctx.start(req, who, None)))
    return json_response(merge_completions(bodies, n))


async def _batch_stream(
    ctx: Context,
    batch: tuple[GenerationRequest, ...],
    who: Principal,
    first: Job,
    n: int,
    client: str,
    where: Where | None,
) -> AsyncIterator[bytes]:
    """The prompts' streams one after another under one id; a prompt that cannot start ends the
    stream with its error event (the response's status went out with the first prompt's chunks)."""
    state = Batch(first.request_id, last=len(batch) == 1)
    job: Job | None = first
    for i, req in enumerate(batch):
        if job is None:
            try:
                job = await ctx.start(req, who, client)
            except GatewayError as err:
                yield dump(public_error(err, state.request_id)) + sse_event("[DONE]")
                return
        state.index_base, state.last = i * n, i == len(batch) - 1
        async for chunk in sse(job, where, state):
            yield chunk
        job = None
        if state.failed:
            return


# --------------------------------------------------------------------------- Responses


def _response_id(job: Job) -> str:
    return "resp_" + job.request_id.split("-", 1)[-1]


def register(app: QuartTrio, ctx: Context) -> None:
    service = ctx.service
    config = service.config
    store = ResponseStore(
        config.responses_store_max, config.responses_store_ttl_s, config.responses_store_max_chars
    )

    def owner_of(who: Principal) -> str:
        """Whose stored responses a request reads: its API key's, else (no keys required) its own
        bearer token's or address's, as the per-client limit counts it."""
        return ctx.client() if who.anonymous else who.id

    def keep(
        owner: str,
        rr: responses_api.ResponsesRequest,
        body: dict[str, Any],
        text: str,
        calls: tuple[ToolCall, ...],
    ) -> None:
        if rr.store:
            history = (*rr.turn, responses_api.assistant_turn(text, calls))
            store.put(owner, str(body["id"]), history, body, trio.current_time())

    @app.post("/v1/responses")
    async def create_response() -> Response:
        who = await ctx.principal()
        body = await ctx.read_json()
        previous = responses_api.previous_id(body)
        history: tuple[Any, ...] = ()
        if previous is not None:
            stored = store.get(owner_of(who), previous, trio.current_time())
            if stored is None:
                raise InvalidRequest(
                    f"Previous response with id '{previous}' not found (kept for "
                    f"{config.responses_store_ttl_s:g} s, and only with store true).",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = stored.history
        rr = responses_api.parse_request(body, history)
        job = await ctx.start(rr.chat, who, None)
        rid = _response_id(job)
        if rr.stream:
            return streamed_response(_responses_stream(job, rr, rid, owner_of(who), keep, ctx.where()))
        chat = await _collected(job)
        choice = chat["choices"][0]
        text = choice["message"].get("content") or ""
        calls = _calls(choice["message"])
        status, details = responses_api.status_of(choice["finish_reason"])
        usage = responses_api.usage(
            chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"], job.reused_tokens
        )
        out = responses_api.response_object(
            rid,
            job.created,
            rr,
            status=status,
            output=responses_api.output_items(rid, text, calls),
            usage_block=usage,
            incomplete_details=details,
        )
        keep(owner_of(who), rr, out, text, calls)
        return json_response(out)

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        who = await ctx.principal()
        stored = store.get(owner_of(who), response_id, trio.current_time())
        if stored is None:
            raise NotFound(f"No response with id '{response_id}' found.", param="response_id")
        return json_response(dict(stored.body))

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        who = await ctx.principal()
        if not store.delete(owner_of(who), response_id, trio.current_time()):
            raise NotFound(f"No response with id '{response_id}' found.", param="response_id")
        return json_response({"id": response_id, "object": "response", "deleted": True})

    # ----------------------------------------------------------------------- Ollama

    async def models() -> list[dict[str, Any]]:
        """``/v1/models`` entries, with the architecture the tracker knows."""
        data = list((await service.catalog.list_models())["data"])
        arch = {
            str(m.get("fingerprint")): m.get("architecture")
            for m in await service.catalog.tracker_models(10.0)
        }
        return [{**m, "architecture": arch.get(str(m.get("fingerprint")))} for m in data]

    async def generation(kind: str, parse: Callable[[Any], ollama_api.OllamaRequest]) -> Response:
        who = await ctx.principal()
        req = parse(await ctx.read_json())
        if req.request is None:
            if ollama_api.find(await models(), req.model) is None:
                raise ModelNotFound(f"model '{req.model}' not found", param="model")
            return json_response(ollama_api.loaded(kind, req.model, time.time()))
        job = await ctx.start(req.request, who, None)
        if req.stream:
            return streamed_response(_ndjson(job, kind, req.model, ctx.where()), "application/x-ndjson")
        chat = await _collected(job)
        choice = chat["choices"][0]
        message = choice.get("message") or {}
        text = choice["text"] if "text" in choice else (message.get("content") or "")  # raw: a completion
        return json_response(
            ollama_api.final(
                kind,
                req.model,
                time.time(),
                text=text,
                done_reason=choice["finish_reason"],
                prompt_tokens=chat["usage"]["prompt_tokens"],
                completion_tokens=chat["usage"]["completion_tokens"],
                timing=ollama_api.Timing.of(time.monotonic() - job.arrived_s, job.ttft_s),
                calls=_calls(message),
            )
        )

    @app.post("/api/chat")
    async def ollama_chat() -> Response:
        return await generation("chat", ollama_api.parse_chat)

    @app.post("/api/generate")
    async def ollama_generate() -> Response:
        return await generation("generate", ollama_api.parse_generate)

    @app.get("/api/tags")
    async def ollama_tags() -> Response:
        await ctx.principal()
        return json_response(ollama_api.tags(await models(), time.time()))

    @app.get("/api/ps")
    async def ollama_ps() -> Response:
        await ctx.principal()
        return json_response(ollama_api.running(await models(), time.time()))

    @app.post("/api/show")
    async def ollama_show() -> Response:
        await ctx.principal()
        body = await ctx.read_json()
        name = body.get("model") or body.get("name") if isinstance(body, dict) else None
        entry = ollama_api.find(await models(), name)
        if entry is None:
            raise ModelNotFound(f"model '{name}' not found", param="model")
        vocab = service.vocabs.loaded().get(str(entry.get("fingerprint")))
        template = vocab.template.source if vocab is not None else None
        return json_response(ollama_api.show(entry, template, time.time()))

    @app.get("/api/version")
    async def ollama_version() -> Response:
        return json_response({"version": ollama_api.VERSION})


async def _responses_stream(
    job: Job,
    rr: responses_api.ResponsesRequest,
    rid: str,
    owner: str,
    keep: Callable[[str, responses_api.ResponsesRequest, dict[str, Any], str, tuple[ToolCall, ...]], None],
    where: Where | None,
) -> AsyncIterator[bytes]:
    machine = responses_api.EventStream(rid, job.created, rr)
    status = 200
    reason = "stop"
    try:
        for ev in machine.start():
            yield responses_api.sse_frame(ev)
        async for item in job.events:
            if isinstance(item, Delta):
                for ev in machine.delta(item.text):
                    yield responses_api.sse_frame(ev)
            elif isinstance(item, ChoiceEnd):
                reason = item.finish_reason
                for ev in machine.end(item.tool_calls):
                    yield responses_api.sse_frame(ev)
            elif isinstance(item, Finished):
                usage = responses_api.usage(item.prompt_tokens, item.completion_tokens, job.reused_tokens)
                last, body = machine.finish(reason, usage)
                keep(owner, rr, body, machine.text, machine.calls)
                yield responses_api.sse_frame(last)
                break
            elif isinstance(item, Failed):
                status = item.error.status
                for ev in machine.fail(public_error(item.error, job.request_id)["error"]):
                    yield responses_api.sse_frame(ev)
                break
        else:
            if job.stalled:
                status = 408
                for ev in machine.fail(public_error(ClientStalled(job.stall_s), job.request_id)["error"]):
                    yield responses_api.sse_frame(ev)
    finally:
        job.cancel()
        job.events.close()
        if where is not None:
            access(status, job, where)


async def _ndjson(job: Job, kind: str, model: str, where: Where | None) -> AsyncIterator[bytes]:
    status = 200
    reason = "stop"
    calls: tuple[ToolCall, ...] = ()

    def line(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"

    try:
        async for item in job.events:
            if isinstance(item, Delta):
                if item.text:
                    yield line(ollama_api.chunk(kind, model, time.time(), item.text))
            elif isinstance(item, ChoiceEnd):
                reason, calls = item.finish_reason, item.tool_calls
            elif isinstance(item, Finished):
                timing = ollama_api.Timing.of(time.monotonic() - job.arrived_s, job.ttft_s)
                yield line(
                    ollama_api.final(
                        kind,
                        model,
                        time.time(),
                        text="",
                        done_reason=reason,
                        prompt_tokens=item.prompt_tokens,
                        completion_tokens=item.completion_tokens,
                        timing=timing,
                        calls=calls,
                    )
                )
                break
            elif isinstance(item, Failed):
                status = item.error.status
                yield line(
                    ollama_api.error_body(public_error(item.error, job.request_id)["error"]["message"])
                )
                break
        else:
            if job.stalled:
                status = 408
                err = ClientStalled(job.stall_s)
                yield line(ollama_api.error_body(public_error(err, job.request_id)["error"]["message"]))
    finally:
        job.cancel()
        job.events.close()
        if where is not None:
            access(status, job, where)
