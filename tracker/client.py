"""A small trio client for the tracker API, used by nodes and gateways.

::

    async with TrackerClient("http://127.0.0.1:7460", signing_key) as tracker:
        await tracker.announce(announce)            # proto.announce.Announce
        await tracker.heartbeat(heartbeat)          # proto.announce.Heartbeat
        routes = await tracker.routes(model, k=2)   # dict, see docs/tracker.md
        start, end = await tracker.recommend(model, capacity_layers=10)
        await tracker.report_usage(report)          # proto.announce.UsageReport (gateway key)

No timeouts inside: wrap calls in ``trio.fail_after``. Errors: every non-2xx
answer raises :class:`TrackerClientError` with the status and the error body;
``routes()`` returns the body for 503 "no route" instead, so callers can read
``uncovered``. Transport failures surface as ``httpx.TransportError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import httpx
import nacl.signing

from proto.announce import Announce, Heartbeat, UsageReport
from proto.signing import make_payload, public_key_hex, sign_envelope


class TrackerClientError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        self.status = status
        self.code = err.get("code", "unknown")
        self.reason = err.get("reason")
        self.body = body
        super().__init__(f"tracker answered {status} {self.code}: {err.get('message', body)}")


class TrackerClient:
    def __init__(
        self,
        base_url: str,
        key: nacl.signing.SigningKey,
        *,
        clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.key = key
        self.key_id = public_key_hex(key)
        self.clock = clock
        # Timeouts belong to the caller (trio.fail_after); httpx's own are disabled.
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=None, transport=transport)

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

    async def _call(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kw: Any) -> Any:
        response = await self._http.request(method, path, **kw)
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"code": "not_json", "message": response.text[:200]}}
        if response.status_code not in ok:
            raise TrackerClientError(response.status_code, body)
        return body

    async def announce(self, announce: Announce) -> dict[str, Any]:
        return await self._call("POST", "/v1/announce", json=self.signed("announce", announce.to_json()))

    async def heartbeat(self, heartbeat: Heartbeat) -> dict[str, Any]:
        return await self._call("POST", "/v1/heartbeat", json=self.signed("heartbeat", heartbeat.to_json()))

    async def report_usage(self, report: UsageReport) -> dict[str, Any]:
        return await self._call(
            "POST", "/v1/usage", json=self.signed("usage", report.to_json(), signer_field="gateway_id")
        )

    async def routes(
        self, model: str, k: int = 1, exclude: frozenset[str] | set[str] = frozenset()
    ) -> dict[str, Any]:
        return await self._call(
            "POST", "/v1/routes", ok=(200, 503), json={"model": model, "k": k, "exclude": sorted(exclude)}
        )

    async def recommend(self, model: str, capacity_layers: int) -> tuple[int, int]:
        body = await self._call(
            "GET", "/v1/recommend", params={"model": model, "capacity_layers": capacity_layers}
        )
        return int(body["start"]), int(body["end"])

    async def models(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/v1/models"))["models"])

    async def swarm(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/v1/swarm"))

    async def healthz(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/healthz"))
