"""The OpenAI-compatible HTTP API: a thin quart-trio router over :class:`gateway.serving.GatewayService`.

Every error leaves through :func:`_error_response`, the one place exceptions
become HTTP statuses::

    GatewayError (gateway.errors)   -> its status, OpenAI body, Retry-After when it has one
    RequestEntityTooLarge           -> 413
    other HTTPException (404, 405)  -> its own status, OpenAI body
    anything else                   -> 500 (logged)

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` (docs/gateway.md), and
``GET /``: a small page linking the swarm dashboard the tracker serves.
"""

from __future__ import annotations

import hashlib
import html
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from common.logs import event
from common.metrics import CONTENT_TYPE
from gateway import protocol
from gateway.errors import (
    GatewayError,
    InternalFailure,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    error_body,
)
from gateway.protocol import GenerationRequest
from gateway.serving import Delta, Failed, Finished, GatewayService, Job

log = logging.getLogger("swarm.gateway")
DRAIN_FACTOR = 4


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, separators=(",", ":"), ensure_ascii=False),
        status=status,
        mimetype="application/json",
        headers=headers,
    )


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
        event(log, "internal_error", level=logging.ERROR, error=repr(err))
        err = InternalFailure("internal error")
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else None
    return _json(error_body(err), err.status, headers)


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
            return json.loads(body)
        except (UnicodeDecodeError, ValueError) as err:
            raise InvalidRequest(
                "We could not parse the JSON body of your request: it is not valid JSON.", code="invalid_json"
            ) from err

    @app.errorhandler(Exception)
    async def _on_error(err: Exception) -> Response:
        return _error_response(err)

    @app.after_request
    async def _count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        metrics.inc("swarm_gateway_http_requests_total", endpoint=rule, status=str(response.status_code))
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
        return _json(await service.list_models())

    @app.get("/v1/models/<path:model>")
    async def model(model: str) -> Response:
        for entry in (await service.list_models())["data"]:
            if model in (entry["id"], entry.get("fingerprint")):
                return _json(entry)
        raise ModelNotFound(f"The model '{model}' does not exist or no node serves it", param="model")

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _generate(protocol.parse_chat_request(await read_json()))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _generate(protocol.parse_completion_request(await read_json()))

    async def _generate(req: GenerationRequest) -> Response:
        job = await service.start_job(req, client_key())
        if req.stream:
            response = Response(
                _sse(job),
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


async def _collect(job: Job) -> dict[str, Any]:
    req = job.request
    texts: list[str] = []
    logprobs: list[protocol.TokenLogprob] = []
    async for item in job.events:
        if isinstance(item, Delta):
            texts.append(item.text)
            logprobs.extend(item.logprobs)
        elif isinstance(item, Failed):
            raise item.error
        elif isinstance(item, Finished):
            build = protocol.chat_completion if req.kind == "chat" else protocol.text_completion
            return build(
                job.request_id,
                job.created,
                req.model,
                "".join(texts),
                item.finish_reason,
                logprobs if req.logprobs else None,
                item.prompt_tokens,
                item.completion_tokens,
                job.system_fingerprint,
            )
    raise InternalFailure("the generation ended without a result")


def _dump(obj: Any) -> bytes:
    return protocol.sse_event(json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


async def _sse(job: Job) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's streaming format, ending with ``data: [DONE]``."""
    req = job.request
    base = (job.request_id, job.created, req.model, job.system_fingerprint)
    usage_kw: dict[str, Any] = {"include_usage": req.include_usage}
    chat = req.kind == "chat"
    offset = 0
    try:
        if chat:
            yield _dump(protocol.chat_chunk(*base, delta={"role": "assistant", "content": ""}, **usage_kw))
        async for item in job.events:
            if isinstance(item, Delta):
                lp = item.logprobs if req.logprobs else None
                if chat:
                    yield _dump(
                        protocol.chat_chunk(*base, delta={"content": item.text}, logprobs=lp, **usage_kw)
                    )
                else:
                    yield _dump(
                        protocol.completion_chunk(
                            *base, text=item.text, logprobs=lp, text_offset=offset, **usage_kw
                        )
                    )
                offset += len(item.text)
            elif isinstance(item, Finished):
                if chat:
                    yield _dump(
                        protocol.chat_chunk(*base, delta={}, finish_reason=item.finish_reason, **usage_kw)
                    )
                else:
                    yield _dump(
                        protocol.completion_chunk(*base, finish_reason=item.finish_reason, **usage_kw)
                    )
                if req.include_usage:
                    usage = protocol.usage(item.prompt_tokens, item.completion_tokens)
                    build = protocol.chat_chunk if chat else protocol.completion_chunk
                    yield _dump(build(*base, usage_block=usage, include_usage=True, usage_only=True))
                break
            elif isinstance(item, Failed):
                yield _dump(error_body(item.error))
                break
        yield protocol.sse_event("[DONE]")
    finally:
        job.cancel()
        job.events.close()
