"""The tracker's HTTP API: a thin quart-trio router over :class:`tracker.service.Registry`.

Every error leaves through :func:`_error_response`, the one place exceptions
become HTTP statuses::

    RateLimited (tracker.errors)       -> 429 rate_limited with Retry-After (tracker/ratelimit.py)
    TrackerError (tracker.errors)      -> its status_hint (400/401/403/404/409/413/503)
    SignatureError (proto.signing)     -> 400 malformed_envelope, 503 nonce_cache_full, else 401
    RequestEntityTooLarge              -> 413 payload_too_large
    other HTTPException (404/405 ...)  -> its own code

Quotas per source address are taken here, before a request is read (signed messages and
everything else in separate buckets, ``/healthz`` free); quotas per key in
:mod:`tracker.service`, once a signature checked out.

Error bodies are ``{"error": {"code": "...", "message": "..."}}`` (plus
``"reason"`` for signature refusals). Endpoints are documented in docs/tracker.md;
the dashboard (``/``, ``/static/*``, ``/v1/dashboard/*``) in docs/operations.md.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import time
from typing import Any

import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from common.logs import event
from common.metrics import CONTENT_TYPE
from common.prefix_chain import is_head
from proto.signing import SignatureError
from tracker import relay_challenges
from tracker.dashboard import STATIC_FILES, DashboardFeed
from tracker.errors import BadRequest, NotFound, PayloadTooLarge, RateLimited, TrackerError
from tracker.json_input import parse_json
from tracker.ratelimit import TokenBuckets
from tracker.reachability import MAX_CONCURRENT_PROBES, probe
from tracker.routing import MAX_ROUTE_PREFIX_HEADS
from tracker.service import Registry

log = logging.getLogger("swarm.tracker")


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status=status, mimetype="application/json")


def _error_response(err: BaseException) -> Response:
    if isinstance(err, SignatureError):
        status = {"malformed_envelope": 400, "nonce_cache_full": 503}.get(err.reason, 401)
        return _json(
            {"error": {"code": "signature_refused", "reason": err.reason, "message": err.message}}, status
        )
    if isinstance(err, RateLimited):
        response = _json({"error": {"code": err.code, "message": err.message}}, 429)
        response.headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        return response
    if isinstance(err, TrackerError):
        return _json({"error": {"code": err.code, "message": err.message}}, err.status_hint)
    if isinstance(err, RequestEntityTooLarge):
        return _json({"error": {"code": PayloadTooLarge.code, "message": "request body too large"}}, 413)
    if isinstance(err, HTTPException):
        code = err.code or 500
        return _json(
            {
                "error": {
                    "code": (err.name or "error").lower().replace(" ", "_"),
                    "message": err.description or "",
                }
            },
            code,
        )
    event(log, "internal_error", level=logging.ERROR, error=repr(err))
    return _json({"error": {"code": "internal", "message": "internal error"}}, 500)


def create_app(registry: Registry, feed: DashboardFeed | None = None) -> QuartTrio:
    """The HTTP API; with a ``feed`` (running in the server's nursery) also the dashboard."""
    app = QuartTrio("swarm_tracker", static_folder=None)
    limit = registry.config.max_body_bytes
    # The largest any endpoint takes (a model registration carries its manifest); each endpoint reads
    # at most its own limit (read_json stops reading past it).
    app.config["MAX_CONTENT_LENGTH"] = max(limit, registry.config.registry_max_body_bytes)
    metrics = registry.metrics

    async def read_json(max_bytes: int = limit) -> Any:
        length = request.content_length
        if length is not None and length > max_bytes:
            raise PayloadTooLarge(f"request body of {length} bytes exceeds the {max_bytes}-byte limit")
        chunks = bytearray()
        async for chunk in request.body:
            chunks += chunk
            if len(chunks) > max_bytes:
                raise PayloadTooLarge(f"request body exceeds the {max_bytes}-byte limit")
        return parse_json(bytes(chunks))  # nesting and lone surrogates refused here (400)

    @app.errorhandler(Exception)
    async def _on_error(err: Exception) -> Response:
        return _error_response(err)

    config = registry.config
    reads = TokenBuckets(
        config.address_reads_per_s, config.address_reads_burst, config.rate_limit_max_identities
    )
    writes = TokenBuckets(
        config.address_writes_per_s, config.address_writes_burst, config.rate_limit_max_identities
    )

    @app.before_request
    async def _admit() -> None:
        g.swarm_t0 = time.perf_counter()
        # Per source address, before anything is read or verified: signed messages (POST, except a
        # route request) and everything else (GET, route requests). /healthz is free.
        if request.path == "/healthz":
            return
        write = request.method == "POST" and request.path != "/v1/routes"
        buckets = writes if write else reads
        decision = buckets.take(address_identity(request.remote_addr), time.monotonic())
        if not decision.allowed:
            if request.method == "POST":
                # Answering before the body is read leaves it in the connection, and the client's
                # next request on that keep-alive connection stalls: read it (bounded by
                # MAX_CONTENT_LENGTH) and drop it.
                async for _chunk in request.body:
                    pass
            scope = "address_write" if write else "address_read"
            metrics.inc("swarm_tracker_rate_limited_total", scope=scope)
            raise RateLimited(
                f"too many {'signed messages' if write else 'requests'} from this address; slow down",
                decision.retry_after_s,
            )

    @app.after_request
    async def _count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        metrics.inc("swarm_tracker_http_requests_total", endpoint=rule, status=str(response.status_code))
        t0: float | None = getattr(g, "swarm_t0", None)
        if t0 is not None and response.mimetype != "text/event-stream":
            metrics.observe("swarm_tracker_http_request_seconds", time.perf_counter() - t0, endpoint=rule)
        return response

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok", "tracker_id": registry.tracker_id, "replica_id": registry.replica_id})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        gauges = await registry.gauges()
        if feed is not None:
            gauges["swarm_tracker_dashboard_clients"] = {(): float(feed.clients)}
        return Response(metrics.render(gauges), content_type=CONTENT_TYPE)

    @app.post("/v1/leave")
    async def leave() -> Response:
        return _json(await registry.leave(await read_json()))

    @app.post("/v1/gateway-stats")
    async def gateway_stats() -> Response:
        return _json(await registry.report_gateway_stats(await read_json()))

    @app.get("/v1/usage")
    async def usage_summary() -> Response:
        args = request.args
        unknown = set(args) - {"by", "since", "until", "node", "model", "gateway", "limit", "offset"}
        if unknown:
            raise BadRequest(f"unknown parameter(s) {sorted(unknown)}")
        return _json(
            await registry.usage_summary(
                args.get("by", "node"),
                _float_arg("since", args.get("since")),
                _float_arg("until", args.get("until")),
                node_id=args.get("node") or None,
                model=args.get("model") or None,
                gateway_id=args.get("gateway") or None,
                limit=_int_arg("limit", args.get("limit", "100")),
                offset=_int_arg("offset", args.get("offset", "0")),
            )
        )

    @app.get("/v1/usage/nodes/<node_id>")
    async def node_usage(node_id: str) -> Response:
        return _json(await registry.node_usage(_node_id(node_id)))

    @app.get("/v1/replicas")
    async def replicas() -> Response:
        return _json({"replica_id": registry.replica_id, "replicas": await registry.replicas()})

    if feed is not None:

        @app.get("/")
        async def dashboard() -> Response:
            return _static("dashboard.html")

        @app.get("/static/<name>")
        async def dashboard_static(name: str) -> Response:
            return _static(name)

        @app.get("/v1/dashboard/state")
        async def dashboard_state() -> Response:
            return _json(await registry.dashboard_state())

        @app.get("/v1/dashboard/events")
        async def dashboard_events() -> Response:
            response = Response(
                feed.stream(),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
            response.timeout = None
            return response

    @app.post("/v1/announce")
    async def announce() -> Response:
        return _json(await registry.announce(await read_json(), remote=str(request.remote_addr or "")))

    @app.post("/v1/checks")
    async def checks() -> Response:
        return _json(await registry.trust.report_checks(await read_json()))

    @app.post("/v1/evidence")
    async def evidence() -> Response:
        return _json(await registry.trust.report_evidence(await read_json()))

    @app.post("/v1/relay/challenges")
    async def relay_challenge_poll() -> Response:
        return _json(await relay_challenges.poll(registry, await read_json()))

    @app.post("/v1/relay/challenge-results")
    async def relay_challenge_result() -> Response:
        body = await read_json(registry.config.registry_max_body_bytes)
        return _json(await relay_challenges.result(registry, body))

    @app.get("/v1/trust/nodes/<node_id>")
    async def node_trust(node_id: str) -> Response:
        return _json(await registry.trust.node_trust(_node_id(node_id)))

    @app.get("/v1/trust/bans")
    async def bans() -> Response:
        return _json(await registry.trust.bans())

    @app.get("/v1/usage/nodes/<node_id>/ledger")
    async def node_ledger(node_id: str) -> Response:
        args = request.args
        unknown = set(args) - {"since", "limit"}
        if unknown:
            raise BadRequest(f"unknown parameter(s) {sorted(unknown)}")
        return _json(
            await registry.trust.ledger(
                _node_id(node_id),
                _float_arg("since", args.get("since")) or 0.0,
                _int_arg("limit", args.get("limit", "100")),
            )
        )

    @app.post("/v1/heartbeat")
    async def heartbeat() -> Response:
        return _json(await registry.heartbeat(await read_json()))

    @app.post("/v1/rebalance")
    async def rebalance() -> Response:
        return _json(await registry.rebalance.answer(await read_json()))

    @app.post("/v1/usage")
    async def usage() -> Response:
        return _json(await registry.report_usage(await read_json()))

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(await registry.list_models(*_page_args()))

    @app.get("/v1/swarm")
    async def swarm() -> Response:
        return _json(await registry.swarm_state(*_page_args()))

    @app.route("/v1/routes", methods=["GET", "POST"])
    async def routes() -> Response:
        bound = False
        if request.method == "POST":
            body = await read_json()
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            if set(body) == {"payload", "signature", "public_key"}:
                # Signed by a gateway's key: the tickets will name it (docs/tracker.md, Route tickets).
                body = registry.open_route_request(body)
                bound = True
                envelope_fields = {"kind", "gateway_id", "timestamp", "nonce"}
                unknown = set(body) - {"model", "k", "exclude", "kv_tokens", "prefix_heads"} - envelope_fields
            else:
                registry.require_signed_route_request()
                unknown = set(body) - {"model", "k", "exclude", "gateway_id", "kv_tokens", "prefix_heads"}
            if unknown:
                raise BadRequest(f"unknown field(s) {sorted(unknown)}")
            model, k, exclude = body.get("model"), body.get("k", 1), body.get("exclude", [])
            gateway_id = body.get("gateway_id")
            kv_tokens = body.get("kv_tokens", 0)
            prefix_heads = body.get("prefix_heads", [])
        else:
            prefix_heads = []
            registry.require_signed_route_request()
            model = request.args.get("model")
            k = _int_arg("k", request.args.get("k", "1"))
            raw = request.args.get("exclude", "")
            exclude = [x for x in raw.split(",") if x]
            gateway_id = request.args.get("gateway_id")
            kv_tokens = _int_arg("kv_tokens", request.args.get("kv_tokens", "0"))
        if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or not 0 <= kv_tokens <= 1 << 30:
            raise BadRequest("kv_tokens must be an integer in 0..2**30 (KV positions the request needs)")
        if gateway_id is not None and (not isinstance(gateway_id, str) or len(gateway_id) > 64):
            raise BadRequest("gateway_id must be a gateway's id (64 hex characters)")
        if not isinstance(model, str) or not model:
            raise BadRequest("model (fingerprint or name) is required")
        if isinstance(k, bool) or not isinstance(k, int):
            raise BadRequest("k must be an integer")
        if (
            not isinstance(exclude, list)
            or not all(isinstance(x, str) for x in exclude)
            or len(exclude) > 1024
        ):
            raise BadRequest("exclude must be a list of at most 1024 node ids")
        if (
            not isinstance(prefix_heads, list)
            or len(prefix_heads) > MAX_ROUTE_PREFIX_HEADS
            or not all(is_head(x) for x in prefix_heads)
        ):
            raise BadRequest(
                f"prefix_heads must be a list of at most {MAX_ROUTE_PREFIX_HEADS} heads of the prompt's "
                "blocks (32 lowercase hex digits each, in order)"
            )
        result = await registry.routes(
            model,
            k,
            frozenset(exclude),
            gateway_id or None,
            bound=bound,
            kv_tokens=kv_tokens,
            prefix_heads=tuple(prefix_heads),
        )
        return _json(result, 200 if result["routes"] else 503)

    probes = trio.CapacityLimiter(MAX_CONCURRENT_PROBES)

    @app.get("/v1/reachability")
    async def reachability() -> Response:
        # Dials the caller's own address only (tracker/reachability.py): a node asks whether it is reachable.
        port = _int_arg("port", request.args.get("port"))
        if not 1 <= port <= 65535:
            raise BadRequest("port must be in 1..65535")
        host = str(request.remote_addr or "")
        if not host:
            raise BadRequest("the caller's address is unknown")
        return _json({"address": f"{host}:{port}", "reachable": await probe(host, port, probes)})

    @app.get("/v1/recommend")
    async def recommend() -> Response:
        model = request.args.get("model")
        if not model:
            raise BadRequest("model (fingerprint or name) is required")
        capacity = _int_arg("capacity_layers", request.args.get("capacity_layers"))
        memory = request.args.get("memory_bytes")
        return _json(
            await registry.recommend(
                model,
                capacity,
                _int_arg("memory_bytes", memory) if memory is not None else None,
                _int_arg("kv_bytes_per_layer", request.args.get("kv_bytes_per_layer", "0")),
            )
        )

    @app.post("/v1/registry/models")
    async def register_model() -> Response:
        return _json(await registry.register_model(await read_json(registry.config.registry_max_body_bytes)))

    @app.get("/v1/registry/models")
    async def registry_models() -> Response:
        unknown = set(request.args) - {"source"}
        if unknown:
            raise BadRequest(f"unknown parameter(s) {sorted(unknown)}")
        return _json(await registry.registry_models(request.args.get("source") or None))

    @app.get("/v1/registry/models/<path:model>")
    async def registry_model(model: str) -> Response:
        return _json(await registry.registry_model(model))

    @app.post("/v1/registry/remove")
    async def remove_registration() -> Response:
        return _json(await registry.remove_registration(await read_json()))

    return app


def address_identity(remote: str | None) -> str:
    """Whom a per-address quota charges: the IPv4 address, or the IPv6 /64 (one subscriber's usual
    allocation: per-address limits would mean nothing if each of 2**64 addresses had its own)."""
    host = str(remote or "")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


def _page_args() -> tuple[int | None, int]:
    args = request.args
    unknown = set(args) - {"limit", "offset"}
    if unknown:
        raise BadRequest(f"unknown parameter(s) {sorted(unknown)}")
    limit = args.get("limit")
    return (
        _int_arg("limit", limit) if limit is not None else None,
        _int_arg("offset", args.get("offset", "0")),
    )


def _static(name: str) -> Response:
    entry = STATIC_FILES.get(name)
    if entry is None:
        raise NotFound(f"no static file {name!r}")
    body, mimetype = entry
    return Response(body, mimetype=mimetype, headers={"Cache-Control": "no-cache"})


def _node_id(node_id: str) -> str:
    if len(node_id) != 64 or any(c not in "0123456789abcdef" for c in node_id):
        raise BadRequest("node id must be 64 lowercase hex characters")
    return node_id


def _float_arg(name: str, value: str | None) -> float | None:
    if value is None or value == "":
        return None
    try:
        out = float(value)
    except ValueError as err:
        raise BadRequest(f"{name} must be a number of UNIX seconds") from err
    if out != out or out in (float("inf"), float("-inf")):
        raise BadRequest(f"{name} must be finite")
    return out


def _int_arg(name: str, value: str | None) -> int:
    if value is None:
        raise BadRequest(f"{name} is required")
    try:
        return int(value)
    except ValueError as err:
        raise BadRequest(f"{name} must be an integer") from err
