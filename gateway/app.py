"""The OpenAI-compatible HTTP API: a thin quart-trio router over :class:`gateway.serving.GatewayService`.

Every error leaves through :func:`_error_response`, the one place exceptions
become HTTP statuses::

    GatewayError (gateway.errors)   -> its status, OpenAI body, Retry-After when it has one
    RequestEntityTooLarge           -> 413
    other HTTPException (404, 405)  -> its own status, OpenAI body
    anything else                   -> 500 (logged)

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health`` (200 only while a model has a complete
route), ``GET /healthz`` (liveness), ``GET /metrics`` (docs/gateway.md), and
``GET /``: a small page linking the swarm dashboard the tracker serves.

CORS (``cors_origins``): allowed origins get ``Access-Control-Allow-*`` headers
and their preflight ``OPTIONS`` requests a 204. Every request ends with one
access-log line (``request_done``: method, path, status, tokens, time to first
token, total time) unless ``access_log`` is off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from common.logs import event
from common.metrics import CONTENT_TYPE
from gateway import protocol
from gateway.api_keys import Principal
from gateway.errors import (
    ClientStalled,
    GatewayError,
    InternalFailure,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    public_body,
)
from gateway.protocol import GenerationRequest
from gateway.serving import ChoiceEnd, Delta, Failed, Finished, GatewayService, Job
from gateway.tools import assistant_message

log = logging.getLogger("swarm.gateway")
DRAIN_FACTOR = 4


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
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


def _request_id() -> str:
    """The id a client can quote: its job's (``chatcmpl-...``), else one made when the request arrived."""
    job = getattr(request, "job", None)
    if job is not None:
        return str(job.request_id)
    rid = getattr(request, "request_id", None)
    if rid is None:
        rid = request.request_id = "req-" + secrets.token_hex(12)  # type: ignore[attr-defined]
    return str(rid)


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


def _error_response(err: BaseException) -> Response:
    if isinstance(err, RequestEntityTooLarge):
        err = PayloadTooLarge("request body too large")
    elif isinstance(err, HTTPException):
        if err.code == 404:
            err = NotFound(f"Invalid URL ({request.method} {request.path})")
        elif err.code == 405:
            err = MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}")
        else:
            err = InvalidRequest(err.description or "bad request", code=str(err.code))
    elif not isinstance(err, GatewayError):
        event(log, "internal_error", level=logging.ERROR, request_id=_request_id(), error=repr(err))
        err = InternalFailure("internal error")
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else {}
    if err.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="swarm-gateway"'
    return _json(public_error(err, _request_id()), err.status, headers or None)


def client_key() -> str:
    """Who a request is from, for the per-client limit: a hash of its API key, else its address."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer ") and len(auth) > 7:
        return "key:" + hashlib.sha256(auth[7:].encode()).hexdigest()[:16]
    return "addr:" + str(request.remote_addr or "unknown")


def create_app(service: GatewayService) -> QuartTrio:
    app = QuartTrio("swarm_gateway")
    limit = service.config.max_request_bytes
    # Bodies up to DRAIN_FACTOR x the limit are read (and dropped) so the client can read the 413;
    # beyond that the request is refused without reading, and the client may only see the connection close.
    app.config["MAX_CONTENT_LENGTH"] = DRAIN_FACTOR * limit
    app.config["RESPONSE_TIMEOUT"] = None  # generations stream for as long as they take
    app.config["BODY_TIMEOUT"] = 60
    metrics = service.metrics

    async def read_json() -> Any:
        length = request.content_length
        if length is not None and length > DRAIN_FACTOR * limit:
            raise PayloadTooLarge(f"request body of {length} bytes exceeds the {limit}-byte limit")
        body = await request.get_data(cache=False)
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        try:
            value = json.loads(body)
        except RecursionError as err:
            raise InvalidRequest(
                f"The JSON body of your request nests deeper than {protocol.MAX_JSON_DEPTH} levels.",
                code="invalid_json",
            ) from err
        except (UnicodeDecodeError, ValueError) as err:
            raise InvalidRequest(
                "We could not parse the JSON body of your request: it is not valid JSON.", code="invalid_json"
            ) from err
        protocol.check_json_value(value)
        return value

    access = service.access

    async def principal() -> Principal:
        return await access.principal(
            request.headers.get("authorization", ""), str(request.remote_addr or "unknown")
        )

    cors = service.config.cors()

    @app.errorhandler(Exception)
    async def _on_error(err: Exception) -> Response:
        return _error_response(err)

    @app.before_request
    async def _preflight() -> Response | None:
        request.started_s = time.monotonic()  # type: ignore[attr-defined]
        if request.method == "OPTIONS" and cors:
            return Response("", status=204)
        return None

    @app.after_request
    async def _count(response: Response) -> Response:
        response.headers["X-Request-Id"] = _request_id()
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        metrics.inc("swarm_gateway_http_requests_total", endpoint=rule, status=str(response.status_code))
        origin = request.headers.get("origin")
        if cors and origin and ("*" in cors or origin in cors):
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in cors else origin
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "access-control-request-headers", "authorization, content-type"
            )
            response.headers["Access-Control-Max-Age"] = "600"
            if "*" not in cors:
                response.headers["Vary"] = "Origin"
        if service.config.access_log and not isinstance(response.response, _Streamed):
            _access(response.status_code, getattr(request, "job", None), _where())
        return response

    def dashboards() -> list[str]:
        return [url + "/" for url in getattr(service.tracker, "urls", ())]

    @app.get("/")
    async def index() -> Response:
        links = "".join(
            f'<li><a href="{html.escape(u, quote=True)}">{html.escape(u)}</a></li>' for u in dashboards()
        )
        page = (
            '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Swarm gateway</title>'
            "<style>body{font:15px/1.5 system-ui,sans-serif;background:#0e1116;color:#e6edf3;margin:40px}"
            "a{color:#58a6ff}code{background:#161b22;padding:2px 6px;border-radius:4px}</style></head><body>"
            "<h1>Swarm gateway</h1>"
            "<p>OpenAI-compatible API at <code>/v1</code> "
            f"(gateway <code>{html.escape(service.gateway_id[:16])}</code>).</p>"
            "<p>Swarm dashboard (served by the tracker):</p>"
            f"<ul>{links}</ul>"
            '<p><a href="/v1/models">/v1/models</a> · <a href="/healthz">/healthz</a> · '
            '<a href="/metrics">/metrics</a></p></body></html>'
        )
        return Response(page, mimetype="text/html")

    @app.get("/health")
    async def health() -> Response:
        """200 only while some model has a complete route (load balancers, readiness probes)."""
        try:
            models = await service.tracker_models(max_age_s=2.0)
        except GatewayError as err:
            return _json({"status": "unavailable", "reason": err.message}, 503)
        ready = [protocol.model_id(str(m.get("name", ""))) for m in models if m.get("routable")]
        if not ready:
            return _json({"status": "unavailable", "reason": "no model has a complete route"}, 503)
        return _json({"status": "ok", "models": ready})

    @app.get("/healthz")
    async def healthz() -> Response:
        stats = service.gate.statistics()
        return _json(
            {
                "status": "ok",
                "gateway_id": service.gateway_id,
                "sessions_active": stats.active,
                "requests_queued": stats.queued,
                "dashboard": next(iter(dashboards()), None),
            }
        )

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(service.gauges()), content_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        await principal()
        return _json(await service.list_models())

    @app.get("/v1/models/<path:model>")
    async def model(model: str) -> Response:
        await principal()
        for entry in (await service.list_models())["data"]:
            if model in (entry["id"], entry.get("fingerprint"), entry.get("name")):
                return _json(entry)
        raise ModelNotFound(f"The model '{model}' does not exist or no node serves it", param="model")

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        who = await principal()  # 401 before the body is even parsed
        return await _generate(protocol.parse_chat_request(await read_json()), who)

    @app.post("/v1/completions")
    async def completions() -> Response:
        who = await principal()
        return await _generate(protocol.parse_completion_request(await read_json()), who)

    async def _generate(req: GenerationRequest, who: Principal) -> Response:
        if req.ignored:
            event(log, "fields_ignored", level=logging.DEBUG, fields=list(req.ignored))
        access.cap(who, req.max_tokens)  # 400 above the principal's cap
        if req.max_tokens is None and who.limits.max_tokens:
            # No max_tokens: up to what the prompt leaves on the route, and at most the cap.
            req = dataclasses.replace(req, max_tokens_cap=who.limits.max_tokens)
        job = await service.start_job(req, client_key(), who)
        request.job = job  # type: ignore[attr-defined]
        if req.stream:
            response = Response(
                _Streamed(_sse(job, _where() if service.config.access_log else None)),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
            response.timeout = None
            return response
        try:
            return _json(await _collect(job))
        finally:
            job.cancel()
            job.events.close()

    return app


class _Streamed:
    """An SSE body (its access-log line is written when the stream ends)."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self._body = body

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._body


def _where() -> tuple[str, str, float | None]:
    return request.method, request.path, getattr(request, "started_s", None)


def _access(status: int, job: Job | None, where: tuple[str, str, float | None]) -> None:
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


async def _collect(job: Job) -> dict[str, Any]:
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


def _dump(obj: Any) -> bytes:
    return protocol.sse_event(json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


async def _sse(job: Job, access: tuple[str, str, float | None] | None = None) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's streaming format, ending with ``data: [DONE]``."""
    req = job.request
    base = (job.request_id, job.created, req.model, job.system_fingerprint)
    usage_kw: dict[str, Any] = {"include_usage": req.include_usage}
    chat = req.kind == "chat"
    offsets = [0] * req.n
    status = 200

    def indexed(chunk: dict[str, Any], index: int) -> bytes:
        for choice in chunk["choices"]:
            choice["index"] = index
        return _dump(chunk)

    try:
        if chat:
            for i in range(req.n):
                yield indexed(
                    protocol.chat_chunk(*base, delta={"role": "assistant", "content": ""}, **usage_kw), i
                )
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
                if req.include_usage:
                    usage = protocol.usage(item.prompt_tokens, item.completion_tokens)
                    build = protocol.chat_chunk if chat else protocol.completion_chunk
                    yield _dump(build(*base, usage_block=usage, include_usage=True, usage_only=True))
                break
            elif isinstance(item, Failed):
                status = item.error.status
                yield _dump(public_error(item.error, job.request_id))
                break
        else:
            if job.stalled:  # cut for not reading: say so rather than end like a complete answer
                status = 408
                yield _dump(public_error(ClientStalled(job.stall_s), job.request_id))
        yield protocol.sse_event("[DONE]")
    finally:
        job.cancel()
        job.events.close()
        if access is not None:
            _access(status, job, access)
