"""The OpenAI-compatible HTTP API: a thin quart-trio router over :class:`gateway.serving.GatewayService`.

Every error leaves through :func:`_error_response`, the one place exceptions
become HTTP statuses::

    GatewayError (gateway.errors)   -> its status, OpenAI body, Retry-After when it has one
    RequestEntityTooLarge           -> 413
    other HTTPException (404, 405)  -> its own status, OpenAI body
    anything else                   -> 500 (logged)

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health`` (200 only while a model has a complete
route), ``GET /healthz`` (liveness), ``GET /metrics`` (docs/gateway.md), ``GET /``: the chat page,
and ``GET /about``: a small page linking the swarm dashboard the tracker serves. The Responses API,
Ollama's API and several-prompt completions are registered by ``gateway.client_apis``.

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
from pathlib import Path
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from common.logs import event
from common.metrics import CONTENT_TYPE
from gateway import client_apis, ollama_api, openai_http, protocol
from gateway.api_keys import Principal
from gateway.conversation_turns import ConversationTurns
from gateway.errors import (
    GatewayError,
    InternalFailure,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
)
from gateway.jobs import Job, Reply
from gateway.openai_http import Streamed, json_response, public_error, streamed_response
from gateway.protocol import GenerationRequest
from gateway.serving import GatewayService

log = logging.getLogger("swarm.gateway")
DRAIN_FACTOR = 4


def _request_id() -> str:
    """The id a client can quote: its job's (``chatcmpl-...``), else one made when the request arrived."""
    job = getattr(request, "job", None)
    if job is not None:
        return str(job.request_id)
    rid = getattr(request, "request_id", None)
    if rid is None:
        rid = request.request_id = "req-" + secrets.token_hex(12)  # type: ignore[attr-defined]
    return str(rid)


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
    body = public_error(err, _request_id())
    if request.path.startswith("/api/"):  # Ollama's API: its clients read {"error": "..."}
        body = ollama_api.error_body(body["error"]["message"])
    return json_response(body, err.status, headers or None)


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
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "access-control-request-headers", "authorization, content-type"
            )
            response.headers["Access-Control-Max-Age"] = "600"
            if "*" not in cors:
                response.headers["Vary"] = "Origin"
        if service.config.access_log and not isinstance(response.response, Streamed):
            openai_http.access(response.status_code, getattr(request, "job", None), _where())
        return response

    def dashboards() -> list[str]:
        return [url + "/" for url in getattr(service.tracker, "urls", ())]

    chat_page = (Path(__file__).parent / "static" / "chat.html").read_text("utf-8")

    @app.get("/")
    async def chat() -> Response:
        """The chat page (gateway/static/chat.html: one file, no build step, no external assets)."""
        links = "".join(
            f'<a class="dashboard" href="{html.escape(u, quote=True)}">Swarm dashboard</a>'
            for u in dashboards()[:1]
        )
        return Response(chat_page.replace("<!--DASHBOARD-->", links), mimetype="text/html")

    @app.get("/about")
    async def about() -> Response:
        links = "".join(
            f'<li><a href="{html.escape(u, quote=True)}">{html.escape(u)}</a></li>' for u in dashboards()
        )
        page = (
            '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Swarm gateway</title>'
            "<style>body{font:15px/1.5 system-ui,sans-serif;background:#0e1116;color:#e6edf3;margin:40px}"
            "a{color:#58a6ff}code{background:#161b22;padding:2px 6px;border-radius:4px}</style></head><body>"
            '<h1>Swarm gateway</h1><p><a href="/">Chat</a></p>'
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
            models = await service.catalog.tracker_models(max_age_s=2.0)
        except GatewayError as err:
            return json_response({"status": "unavailable", "reason": err.message}, 503)
        ready = [protocol.model_id(str(m.get("name", ""))) for m in models if m.get("routable")]
        if not ready:
            return json_response({"status": "unavailable", "reason": "no model has a complete route"}, 503)
        return json_response({"status": "ok", "models": ready})

    @app.get("/healthz")
    async def healthz() -> Response:
        stats = service.gate.statistics()
        return json_response(
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
        return json_response(await service.catalog.list_models())

    @app.get("/v1/models/<path:model>")
    async def model(model: str) -> Response:
        await principal()
        for entry in (await service.catalog.list_models())["data"]:
            if model in (entry["id"], entry.get("fingerprint"), entry.get("name")):
                return json_response(entry)
        raise ModelNotFound(f"The model '{model}' does not exist or no node serves it", param="model")

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        who = await principal()  # 401 before the body is even parsed
        req = protocol.parse_chat_request(await read_json())
        if req.conversation_id is None and request.headers.get("X-Conversation-Id"):
            cid = protocol.conversation_id(request.headers["X-Conversation-Id"])
            req = dataclasses.replace(req, conversation_id=cid)
        if req.conversation_id is not None:
            return await conversations.respond(req, who, client_key(), start, where())
        return await _generate(req, who)

    @app.post("/v1/completions")
    async def completions() -> Response:
        who = await principal()
        batch = protocol.parse_completion_batch(await read_json())
        if len(batch) > 1:
            return await client_apis.completion_batch(ctx, batch, who)
        return await _generate(batch[0], who)

    async def start(
        req: GenerationRequest,
        who: Principal,
        client: str | None = None,
        *,
        kv_key: str = "",
        reply: Reply | None = None,
    ) -> Job:
        """Admit and start one generation for ``who`` (the same for every client API); ``client``
        given: outside the request's context (a later prompt of a streamed batch); ``kv_key`` and
        ``reply``: a conversation's turn (gateway.conversation_turns)."""
        if req.ignored:
            event(log, "fields_ignored", level=logging.DEBUG, fields=list(req.ignored))
        access.cap(who, req.max_tokens)  # 400 above the principal's cap
        if req.max_tokens is None and who.limits.max_tokens:
            # No max_tokens: up to what the prompt leaves on the route, and at most the cap.
            req = dataclasses.replace(req, max_tokens_cap=who.limits.max_tokens)
        job = await service.start_job(req, client or client_key(), who, kv_key=kv_key, reply=reply)
        if client is None:
            request.job = job  # type: ignore[attr-defined]
        return job

    def where() -> openai_http.Where | None:
        return _where() if service.config.access_log else None

    async def _generate(req: GenerationRequest, who: Principal) -> Response:
        job = await start(req, who)
        if req.stream:
            return streamed_response(openai_http.sse(job, where()))
        try:
            return json_response(await openai_http.collect(job))
        finally:
            job.cancel()
            job.events.close()

    conversations = ConversationTurns(service)
    ctx = client_apis.Context(service, read_json, principal, start, where, client_key)
    client_apis.register(app, ctx)
    return app


def _where() -> openai_http.Where:
    return request.method, request.path, getattr(request, "started_s", None)
