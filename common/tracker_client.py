"""A small trio client for the tracker API, used by nodes and gateways; fails over between replicas.

::

    async with TrackerClient("http://t1:7460,http://t2:7460", signing_key) as tracker:
        await tracker.announce(announce)            # proto.announce.Announce
        await tracker.heartbeat(heartbeat)          # proto.announce.Heartbeat
        await tracker.leave(leave)                  # proto.announce.Leave
        routes = await tracker.routes(model, k=2)   # dict, see docs/tracker.md
        start, end = await tracker.recommend(model, capacity_layers=10)
        entry = await tracker.registry_model("SmolLM2")  # manifest, sources, peers
        await tracker.report_usage(report)          # proto.announce.UsageReport (gateway key)
        await tracker.report_stats(stats)           # proto.announce.GatewayStats (gateway key)
        await tracker.report_checks(results)        # proto.announce.CheckResults (gateway key)
        await tracker.report_evidence(evidence)     # proto.announce.Evidence (gateway key)
        ledger = await tracker.node_ledger(node_id) # rows with the signed reports (proto.ledger)

Replicas: the client takes one URL or several (a sequence, or one string with
commas). It talks to one replica at a time and sticks to it; when that replica
cannot be reached (connection refused or reset, a read that fails) or answers
502/503/504, the same call is made on the next replica, each replica at most
once per call. Signed messages are signed afresh for every attempt (a new
nonce), so a replica that did record the first attempt refuses nothing: the
ledger and the registry are idempotent where it matters (usage rows are unique
per gateway, request and node).

HTTPS: ``tls`` (:class:`common.tls.HttpTls`) says how an https:// tracker's
certificate is trusted: pinned by its sha256 (``tracker_tls_fingerprint``, what
``swarm-tracker tls-fingerprint`` prints; checked on every connection before
anything is sent; a wrong one raises ``httpx.ConnectError`` whose message names
the certificate shown and the pin, and fails over like an unreachable replica),
else the system CAs or a CA file (docs/tls.md, "The tracker over HTTPS").

No timeouts inside: wrap calls in ``trio.fail_after``. Errors: every non-2xx
answer raises :class:`TrackerClientError` with the status and the error body;
``routes()`` returns the body for 503 "no route" instead, so callers can read
``uncovered``. When every replica failed, the last transport failure surfaces as
``httpx.TransportError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
import nacl.signing

from common.config import parse_urls
from common.tls import HttpTls
from common.tls_http import async_client
from proto.announce import Announce, CheckResults, Evidence, GatewayStats, Heartbeat, Leave, UsageReport
from proto.rebalance import REQUEST_KIND, RebalanceRequest
from proto.signing import make_payload, public_key_hex, sign_envelope

_FAILOVER_STATUSES = frozenset({502, 503, 504})


class TrackerClientError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.status = status
        self.code = err.get("code", "unknown")
        self.reason = err.get("reason")
        self.body = body
        super().__init__(f"tracker answered {status} {self.code}: {err.get('message', body)}")


def parse_tracker_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """``"http://a:7460, http://b:7460"`` (or a list) -> validated, de-duplicated base URLs."""
    return parse_urls(urls, "tracker URL")


class TrackerClient:
    def __init__(
        self,
        base_urls: str | Sequence[str],
        key: nacl.signing.SigningKey,
        *,
        clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
        tls: HttpTls | None = None,
    ) -> None:
        self.key = key
        self.key_id = public_key_hex(key)
        self.clock = clock
        self.urls = parse_tracker_urls(base_urls)
        self._current = 0
        self.failovers = 0
        self.tls = tls or HttpTls()
        # Timeouts belong to the caller (trio.fail_after); httpx's own are disabled.
        self._http = async_client(self.tls, transport=transport)

    @property
    def url(self) -> str:
        """The replica calls go to now."""
        return self.urls[self._current]

    async def __aenter__(self) -> TrackerClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def signed(self, kind: str, body: dict[str, Any], signer_field: str = "node_id") -> dict[str, str]:
        return sign_envelope(self.key, make_payload(kind, signer_field, self.key, self.clock(), body))

    async def _call(
        self,
        method: str,
        path: str,
        *,
        ok: tuple[int, ...] = (200,),
        body: Callable[[], Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        """One call, on the current replica and then on each other one until one answers."""
        last: httpx.TransportError | None = None
        failed: TrackerClientError | None = None
        # Where this call starts: a concurrent call may fail over meanwhile, and reading _current per
        # attempt would then send this one back to the replica it just found dead, never to the other.
        first = self._current
        for attempt in range(len(self.urls)):
            index = (first + attempt) % len(self.urls)
            try:
                response = await self._http.request(
                    method,
                    self.urls[index] + path,
                    json=body() if body is not None else None,
                    params=params,
                )
            except httpx.TransportError as err:
                last = err
                continue
            try:
                answer = response.json()
            except ValueError:
                answer = {"error": {"code": "not_json", "message": response.text[:200]}}
            # A replica in trouble (its database away, a proxy without upstream): try the next one. A 503
            # that is a real answer (routes: "no route", without an "error" object) is returned.
            trouble = response.status_code not in ok or (isinstance(answer, dict) and "error" in answer)
            if response.status_code in _FAILOVER_STATUSES and trouble:
                failed = TrackerClientError(response.status_code, answer)
                continue
            if index != self._current:
                self._current = index
                self.failovers += 1
            if response.status_code not in ok:
                raise TrackerClientError(response.status_code, answer)
            return answer
        if failed is not None:
            raise failed
        assert last is not None
        raise last

    async def _object(
        self,
        method: str,
        path: str,
        *,
        ok: tuple[int, ...] = (200,),
        body: Callable[[], Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``_call`` for the endpoints that answer a JSON object: anything else is the tracker's error."""
        answer = await self._call(method, path, ok=ok, body=body, params=params)
        if not isinstance(answer, dict):
            raise TrackerClientError(200, {"error": {"code": "not_an_object", "message": repr(answer)[:200]}})
        return answer

    async def announce(self, announce: Announce) -> dict[str, Any]:
        payload = announce.to_json()
        return await self._object("POST", "/v1/announce", body=lambda: self.signed("announce", payload))

    async def heartbeat(self, heartbeat: Heartbeat) -> dict[str, Any]:
        payload = heartbeat.to_json()
        return await self._object("POST", "/v1/heartbeat", body=lambda: self.signed("heartbeat", payload))

    async def leave(self, leave: Leave) -> dict[str, Any]:
        payload = leave.to_json()
        return await self._object("POST", "/v1/leave", body=lambda: self.signed("leave", payload))

    async def rebalance(self, request: RebalanceRequest) -> tuple[dict[str, Any], str]:
        """Ask whether to move (``POST /v1/rebalance``): the tracker's signed advice envelope and
        the nonce this question was signed with (the advice must repeat it)."""
        payload = make_payload(REQUEST_KIND, "node_id", self.key, self.clock(), request.to_json())
        envelope = sign_envelope(self.key, payload)
        answer = await self._call("POST", "/v1/rebalance", body=lambda: envelope)
        return answer, str(payload["nonce"])

    async def _gateway_report(self, path: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST a report this gateway signs (its key is the signer, ``gateway_id``)."""
        return await self._object(
            "POST", path, body=lambda: self.signed(kind, payload, signer_field="gateway_id")
        )

    async def report_usage(self, report: UsageReport) -> dict[str, Any]:
        return await self._gateway_report("/v1/usage", "usage", report.to_json())

    async def report_stats(self, stats: GatewayStats) -> dict[str, Any]:
        return await self._gateway_report("/v1/gateway-stats", "gateway_stats", stats.to_json())

    async def report_checks(self, results: CheckResults) -> dict[str, Any]:
        """Nodes that passed spot checks here (``POST /v1/checks``; registered gateways only)."""
        return await self._gateway_report("/v1/checks", "check_results", results.to_json())

    async def report_evidence(self, evidence: Evidence) -> dict[str, Any]:
        """A spot check's verdict (``POST /v1/evidence``): a conclusive one bans the liar."""
        return await self._gateway_report("/v1/evidence", "evidence", evidence.to_json())

    async def relay_challenges(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The join challenges this gateway is to carry to the nodes it relays
        (``POST /v1/relay/challenges``, tracker/relay_challenges.py)."""
        return await self._gateway_report("/v1/relay/challenges", "relay_challenge_poll", payload)

    async def relay_challenge_result(self, payload: dict[str, Any]) -> dict[str, Any]:
        """What a relayed node answered to a challenge this gateway carried."""
        return await self._gateway_report("/v1/relay/challenge-results", "relay_challenge_result", payload)

    async def node_trust(self, node_id: str) -> dict[str, Any]:
        """Checks passed and failed, probation, ban, challenges and evidence of one node."""
        return dict(await self._call("GET", f"/v1/trust/nodes/{node_id}"))

    async def bans(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/v1/trust/bans"))

    async def node_ledger(self, node_id: str, since_s: float = 0.0, limit: int = 100) -> dict[str, Any]:
        """A node's ledger rows with the gateways' signed reports and the tracker's receipts
        (check each with ``proto.ledger.verify_ledger_entry``)."""
        return dict(
            await self._call(
                "GET", f"/v1/usage/nodes/{node_id}/ledger", params={"since": since_s, "limit": limit}
            )
        )

    async def routes(
        self,
        model: str,
        k: int = 1,
        exclude: frozenset[str] | set[str] = frozenset(),
        gateway_id: str | None = None,
        *,
        sign: bool = False,
        kv_tokens: int = 0,
        prefix_heads: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Routes for ``model``; with ``gateway_id`` priced from that gateway's network position.

        ``kv_tokens``: KV positions the request needs on every stage (0: any); routes whose nodes
        announced less room are left out. ``prefix_heads``: heads of the prompt's blocks, in order
        (common.prefix_chain.head): routes holding the longest prefix of it are preferred.

        ``sign``: sign the request with this client's key as a gateway (``route_request``): the
        tickets then name this key, and a tracker with registered gateways answers only such requests.
        """
        request: dict[str, Any] = {"model": model, "k": k, "exclude": sorted(exclude)}
        if kv_tokens:
            request["kv_tokens"] = kv_tokens
        if prefix_heads:
            request["prefix_heads"] = list(prefix_heads)
        if sign:
            # 503 here is "no route" (the body says which layers are uncovered), not a replica in trouble.
            return await self._object(
                "POST",
                "/v1/routes",
                ok=(200, 503),
                body=lambda: self.signed("route_request", request, signer_field="gateway_id"),
            )
        if gateway_id:
            request["gateway_id"] = gateway_id
        return await self._object("POST", "/v1/routes", ok=(200, 503), body=lambda: request)

    async def recommend(
        self,
        model: str,
        capacity_layers: int,
        *,
        memory_bytes: int | None = None,
        kv_bytes_per_layer: int | None = None,
    ) -> tuple[int, int]:
        """A span of at most ``capacity_layers``; with ``memory_bytes`` (what the node has for weights and
        KV) and ``kv_bytes_per_layer`` the tracker also checks the span's bytes for a registered model."""
        params: dict[str, Any] = {"model": model, "capacity_layers": capacity_layers}
        if memory_bytes is not None:
            params["memory_bytes"] = memory_bytes
            params["kv_bytes_per_layer"] = kv_bytes_per_layer or 0
        body = await self._call("GET", "/v1/recommend", params=params)
        return int(body["start"]), int(body["end"])

    async def registry_models(self, source: str | None = None) -> list[dict[str, Any]]:
        """Registered models (``swarm-tracker model add``), optionally only those listing ``source``."""
        params = {"source": source} if source else None
        return list((await self._call("GET", "/v1/registry/models", params=params))["models"])

    async def registry_model(self, model: str) -> dict[str, Any]:
        """A registered model by name or fingerprint: manifest, source URLs, live peers (404 if unknown)."""
        return dict(await self._call("GET", f"/v1/registry/models/{quote(model, safe='')}"))

    async def register_model(self, registration: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
        """Register a model (``registration``: the payload to sign; signed here with this client's key)."""
        return dict(
            await self._call(
                "POST",
                "/v1/registry/models",
                body=lambda: {
                    "registration": self.signed("model_registration", registration, signer_field="signer_id"),
                    "manifest": manifest,
                },
            )
        )

    async def unregister_model(self, model: str) -> dict[str, Any]:
        payload = {"model": model}
        return dict(
            await self._call(
                "POST",
                "/v1/registry/remove",
                body=lambda: self.signed("model_removal", payload, signer_field="signer_id"),
            )
        )

    async def models(self, *, max_pages: int = 20) -> list[dict[str, Any]]:
        """Every model the tracker lists, page by page (``GET /v1/models`` is paginated; at most
        ``max_pages`` pages, so a tracker full of junk cannot keep a caller reading)."""
        out: list[dict[str, Any]] = []
        offset = 0
        for _ in range(max_pages):
            page = await self._call("GET", "/v1/models", params={"offset": offset} if offset else None)
            out.extend(page["models"])
            following = page.get("next_offset")  # absent from trackers before pagination
            if not isinstance(following, int) or following <= offset:
                break
            offset = following
        return out

    async def swarm(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/v1/swarm"))

    async def node_usage(self, node_id: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/v1/usage/nodes/{node_id}"))

    async def healthz(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/healthz"))

    async def reachable(self, port: int) -> bool:
        """Ask the tracker to dial this machine's ``port`` (tracker/reachability.py)."""
        body = await self._call("GET", "/v1/reachability", params={"port": port})
        return body.get("reachable") is True
