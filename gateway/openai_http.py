"""One job's HTTP body in OpenAI's shapes, shared by every client API of the gateway (I/O shell).

``collect`` gathers a job's events into a ``chat.completion`` or ``text_completion``
object; ``sse`` streams them as OpenAI's server-sent events; ``Streamed`` marks a
streamed body, whose access-log line (``access``) is written when it ends rather
than when the response starts. ``gateway.app`` (chat and completions) and
``gateway.client_apis`` (Responses, Ollama, several-prompt completions) use the same
functions, so every API reads a job the same way.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from quart import Response

from common.logs import event
from gateway import protocol
from gateway.errors import ClientStalled, GatewayError, InternalFailure, public_body
from gateway.generation import ChoiceEnd, Delta, Failed, Finished
from gateway.jobs import Job
from gateway.tools import assistant_message

log = logging.getLogger("swarm.gateway")

Where = tuple[str, str, float | None]  # method, path, arrival (monotonic)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate somewhere: JSON's \u escapes carry it
        text = json.dumps(body, separators=(",", ":"))
    return Response(
        text,
        status=status,
        mimetype="application/json",
        headers=headers,
    )


def public_error(err: GatewayError, request_id: str) -> dict[str, Any]:
    """The body a client gets for ``err``; a server-side failure's details go to the log under the id."""
    if err.status >= 500:
        event(
            log,
            "request_failed",
            level=logging.WARNING,
            request_id=request_id,
            status=err.status,
            code=err.code,
            node_id=getattr(err, "node_id", None),
            error=err.message,
        )
    return public_body(err, request_id)


class Streamed:
    """A streamed body (its access-log line is written when the stream ends)."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self._body = body

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._body


def streamed_response(body: AsyncIterator[bytes], mimetype: str = "text/event-stream") -> Response:
    response = Response(
        Streamed(body),
        mimetype=mimetype,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None
    return response


def access(status: int, job: Job | None, where: Where) -> None:
    method, path, started = where
    fields: dict[str, Any] = {"method": method, "path": path, "status": status}
    if started is not None:
        fields["total_s"] = round(time.monotonic() - started, 4)
    if job is not None:
        fields.update(
            request_id=job.request_id,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens,
            ttft_s=None if job.ttft_s is None else round(job.ttft_s, 4),
            reused_tokens=job.reused_tokens or None,
            route=job.route_label,
        )
    event(log, "request_done", **fields)


async def collect(job: Job) -> dict[str, Any]:
    req = job.request
    texts: list[list[str]] = [[] for _ in range(req.n)]
    logprobs: list[list[protocol.TokenLogprob]] = [[] for _ in range(req.n)]
    ends: dict[int, ChoiceEnd] = {}
    async for item in job.events:
        if isinstance(item, Delta):
            texts[item.index].append(item.text)
            logprobs[item.index].extend(item.logprobs)
        elif isinstance(item, ChoiceEnd):
            ends[item.index] = item
        elif isinstance(item, Failed):
            raise item.error
        elif isinstance(item, Finished):
            build = protocol.chat_completion if req.kind == "chat" else protocol.text_completion
            body = build(
                job.request_id,
                job.created,
                req.model,
                "".join(texts[0]),
                item.finish_reason,
                logprobs[0] if req.logprobs else None,
                item.prompt_tokens,
                item.completion_tokens,
                job.system_fingerprint,
            )
            choices = []
            for i in range(req.n):
                end = ends.get(i, ChoiceEnd(i, item.finish_reason))
                choice = {**body["choices"][0], "index": i, "finish_reason": end.finish_reason}
                lp = logprobs[i] if req.logprobs else None
                text = "".join(texts[i])
                if req.kind == "chat":
                    choice["message"] = (
                        assistant_message(text, end.tool_calls)
                        if end.tool_calls
                        else {"role": "assistant", "content": text, "refusal": None}
                    )
                    choice["logprobs"] = None if lp is None else protocol.chat_logprobs(lp)
                else:
                    choice["text"] = text
                    choice["logprobs"] = None if lp is None else protocol.completion_logprobs(lp, 0)
                choices.append(choice)
            body["choices"] = choices
            return body
    raise InternalFailure("the generation ended without a result")


def dump(obj: Any) -> bytes:
    return protocol.sse_event(json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


@dataclass
class Batch:
    """Several prompts streamed as one response (``sse`` once per prompt): the id every chunk
    carries, where this prompt's choice indices start, whether it is the last prompt, and the
    usage so far (summed into the last prompt's usage chunk)."""

    request_id: str
    index_base: int = 0
    last: bool = True
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failed: bool = False


async def sse(
    job: Job, where: Where | None = None, batch: Batch | None = None, extra: dict[str, Any] | None = None
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's streaming format, ending with ``data: [DONE]`` (with ``batch``:
    only after the last prompt, or after a failure, which ends the batch). ``extra``: fields added to
    each choice's first chunk (a conversation's state)."""
    req = job.request
    base = (batch.request_id if batch else job.request_id, job.created, req.model, job.system_fingerprint)
    usage_kw: dict[str, Any] = {"include_usage": req.include_usage}
    chat = req.kind == "chat"
    offsets = [0] * req.n
    status = 200
    index_base = batch.index_base if batch else 0
    last = batch is None or batch.last

    def indexed(chunk: dict[str, Any], index: int) -> bytes:
        for choice in chunk["choices"]:
            choice["index"] = index_base + index
        return dump(chunk)

    try:
        if chat:
            for i in range(req.n):
                first = protocol.chat_chunk(*base, delta={"role": "assistant", "content": ""}, **usage_kw)
                yield indexed({**first, **(extra or {})}, i)
        async for item in job.events:
            if isinstance(item, Delta):
                lp = item.logprobs if req.logprobs else None
                if chat:
                    chunk = protocol.chat_chunk(*base, delta={"content": item.text}, logprobs=lp, **usage_kw)
                else:
                    chunk = protocol.completion_chunk(
                        *base, text=item.text, logprobs=lp, text_offset=offsets[item.index], **usage_kw
                    )
                yield indexed(chunk, item.index)
                offsets[item.index] += len(item.text)
            elif isinstance(item, ChoiceEnd):
                if chat and item.tool_calls:
                    calls = [
                        {
                            "index": j,
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for j, c in enumerate(item.tool_calls)
                    ]
                    yield indexed(
                        protocol.chat_chunk(*base, delta={"tool_calls": calls}, **usage_kw), item.index
                    )
                if chat:
                    chunk = protocol.chat_chunk(*base, delta={}, finish_reason=item.finish_reason, **usage_kw)
                else:
                    chunk = protocol.completion_chunk(*base, finish_reason=item.finish_reason, **usage_kw)
                yield indexed(chunk, item.index)
            elif isinstance(item, Finished):
                prompt_tokens, completion_tokens = item.prompt_tokens, item.completion_tokens
                if batch is not None:
                    batch.prompt_tokens += item.prompt_tokens
                    batch.completion_tokens += item.completion_tokens
                    prompt_tokens, completion_tokens = batch.prompt_tokens, batch.completion_tokens
                if req.include_usage and last:
                    usage = protocol.usage(prompt_tokens, completion_tokens)
                    build = protocol.chat_chunk if chat else protocol.completion_chunk
                    yield dump(build(*base, usage_block=usage, include_usage=True, usage_only=True))
                break
            elif isinstance(item, Failed):
                status = item.error.status
                yield dump(public_error(item.error, job.request_id))
                break
        else:
            if job.stalled:  # cut for not reading: say so rather than end like a complete answer
                status = 408
                yield dump(public_error(ClientStalled(job.stall_s), job.request_id))
        if status != 200 and batch is not None:
            batch.failed = True
        if last or status != 200:
            yield protocol.sse_event("[DONE]")
    finally:
        job.cancel()
        job.events.close()
        if where is not None:
            access(status, job, where)
