"""The tracker's logic between HTTP and storage: verify, validate, store, route.

Trio side of the SQLAlchemy adapter: every database call goes through
``trio.to_thread.run_sync`` with one :class:`trio.CapacityLimiter`. Signed
messages are verified and validated *before* any database call, so a refused
request writes nothing. The clock is injected (wall-clock seconds, because
signed timestamps come from other machines).
"""

from __future__ import annotations

import functools
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nacl.signing
import trio
from sqlalchemy.exc import InterfaceError, OperationalError

from common.logs import event
from proto.announce import Announce, Heartbeat, PayloadError, UsageReport
from proto.signing import NonceCache, RouteTicket, SignatureError, TicketHop, open_envelope, sign_route_ticket
from tracker.config import TrackerConfig
from tracker.errors import BadRequest, StorageUnavailable, UnknownModel
from tracker.metrics import Labels, Metrics
from tracker.placement import layer_coverage, recommend_span
from tracker.routing import select_routes
from tracker.snapshot import ModelInfo, SwarmSnapshot
from tracker.store import Store

log = logging.getLogger("swarm.tracker")
T = TypeVar("T")


@dataclass(frozen=True)
class RegistryStatistics:
    nonce_cache_entries: int
    snapshot_age_s: float | None
    snapshot_shards: int
    db_threads_busy: int


class Registry:
    def __init__(
        self,
        store: Store,
        config: TrackerConfig,
        key: nacl.signing.SigningKey,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.key = key
        self.tracker_id = bytes(key.verify_key).hex()
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.rng = rng or random.Random()
        self.nonces = NonceCache(config.nonce_cache_max_entries)
        self.limiter = trio.CapacityLimiter(config.resolved_db_threads())
        self._snapshot: SwarmSnapshot | None = None
        self._snapshot_at = 0.0
        self._snapshot_stale = True
        self._snapshot_lock = trio.Lock()

    # --- plumbing -------------------------------------------------------------------------------

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await trio.to_thread.run_sync(functools.partial(fn, *args), limiter=self.limiter)
        except (OperationalError, InterfaceError) as err:  # connection-level: the database is away
            event(log, "storage_unavailable", level=logging.ERROR, error=str(err).splitlines()[0][:300])
            raise StorageUnavailable("the tracker's database is unavailable; retry later") from err

    def _open(self, envelope: Any, kind: str, signer_field: str = "node_id") -> dict[str, Any]:
        try:
            return open_envelope(
                envelope,
                kind=kind,
                now_s=self.clock(),
                skew_s=self.config.signature_skew_s,
                nonces=self.nonces,
                signer_field=signer_field,
                max_payload_bytes=self.config.max_body_bytes,
            )
        except SignatureError as err:
            self.metrics.inc("swarm_tracker_refusals_total", reason=err.reason)
            event(
                log,
                "signed_message_refused",
                level=logging.WARNING,
                kind=kind,
                reason=err.reason,
                detail=err.message,
            )
            raise

    def statistics(self) -> RegistryStatistics:
        return RegistryStatistics(
            nonce_cache_entries=len(self.nonces),
            snapshot_age_s=None if self._snapshot is None else max(0.0, self.clock() - self._snapshot_at),
            snapshot_shards=0 if self._snapshot is None else len(self._snapshot.shards),
            db_threads_busy=self.limiter.borrowed_tokens,
        )

    async def start(self) -> None:
        """Bring the schema to head (runs alembic in a worker thread)."""
        before, after = await self._db(self.store.upgrade)
        event(log, "db_ready", dialect=self.store.dialect, revision_before=before, revision=after)

    # --- writes ---------------------------------------------------------------------------------

    async def announce(self, envelope: Any) -> dict[str, Any]:
        payload = self._open(envelope, "announce")
        try:
            a = Announce.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        result = await self._db(self.store.announce, a, self.clock())
        self._snapshot_stale = True
        self.metrics.inc("swarm_tracker_announces_total")
        if result.restored:
            self.metrics.inc("swarm_tracker_restorations_total")
        event(
            log,
            "node_announced",
            node_id=a.node_id,
            model=a.model.fingerprint,
            start=a.shard_start,
            end=a.shard_end,
            relay=a.relay,
            created=result.created,
            restored=result.restored,
        )
        return {
            "node_id": a.node_id,
            "state": "live",
            "created": result.created,
            "restored": result.restored,
            "tracker_id": self.tracker_id,
            "heartbeat_interval_s": self.config.heartbeat_interval_s,
            "heartbeat_timeout_s": self.config.heartbeat_timeout_s,
        }

    async def heartbeat(self, envelope: Any) -> dict[str, Any]:
        payload = self._open(envelope, "heartbeat")
        try:
            h = Heartbeat.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        restored = await self._db(self.store.heartbeat, h, self.clock())
        self.metrics.inc("swarm_tracker_heartbeats_total")
        if restored:
            self._snapshot_stale = True
            self.metrics.inc("swarm_tracker_restorations_total")
            event(log, "node_restored", node_id=h.node_id)
        return {
            "node_id": h.node_id,
            "state": "live",
            "restored": restored,
            "heartbeat_interval_s": self.config.heartbeat_interval_s,
        }

    async def report_usage(self, envelope: Any) -> dict[str, Any]:
        payload = self._open(envelope, "usage", signer_field="gateway_id")
        try:
            r = UsageReport.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        result = await self._db(self.store.record_usage, r, self.clock())
        tokens = sum(e.tokens for e in r.entries)
        self.metrics.inc("swarm_tracker_usage_tokens_total", tokens)
        event(
            log,
            "usage_recorded",
            gateway_id=r.gateway_id,
            request_id=r.request_id,
            entries=result.recorded,
            duplicates=result.duplicates,
            tokens=tokens,
        )
        return {"recorded": result.recorded, "duplicates": result.duplicates}

    async def expire_once(self) -> list[str]:
        expired = await self._db(self.store.expire, self.clock(), self.config.heartbeat_timeout_s)
        if expired:
            self._snapshot_stale = True
            self.metrics.inc("swarm_tracker_expirations_total", len(expired))
            for node_id in expired:
                event(log, "node_expired", node_id=node_id, timeout_s=self.config.heartbeat_timeout_s)
        return expired

    async def run_expiry(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.config.expiry_check_interval_s)
            try:
                await self.expire_once()
            except StorageUnavailable:
                pass  # logged by _db; the next round retries, and routing filters on last_seen anyway

    # --- reads ----------------------------------------------------------------------------------

    async def snapshot(self) -> SwarmSnapshot:
        now = self.clock()
        fresh = (
            self._snapshot is not None
            and not self._snapshot_stale
            and now - self._snapshot_at <= self.config.snapshot_ttl_s
        )
        if fresh and self._snapshot is not None:
            return self._snapshot
        async with self._snapshot_lock:  # one refresh at a time; the others reuse its result
            if self._snapshot is not None and self._snapshot_at >= now and not self._snapshot_stale:
                return self._snapshot
            return await self._refresh_snapshot(now)

    async def _refresh_snapshot(self, now: float) -> SwarmSnapshot:
        self._snapshot_stale = False
        try:
            snap = await self._db(
                functools.partial(
                    self.store.snapshot,
                    now,
                    self.config.heartbeat_timeout_s,
                    default_latency_ms=self.config.default_latency_ms,
                    relay_penalty_ms=self.config.relay_penalty_ms,
                )
            )
        except StorageUnavailable:
            # Ride out a short database outage on the last snapshot, but never on one older than
            # the heartbeat timeout: past that it may list nodes that have since died.
            if self._snapshot is not None and now - self._snapshot_at <= self.config.heartbeat_timeout_s:
                self._snapshot_stale = True
                return self._snapshot
            raise
        self._snapshot, self._snapshot_at = snap, now
        return snap

    @staticmethod
    def resolve_model(snap: SwarmSnapshot, model: str) -> ModelInfo:
        """A fingerprint, or a name (the fingerprint with the most live shards wins)."""
        found = snap.model(model)
        if found is not None:
            return found
        named = [m for m in snap.models if m.name == model]
        if not named:
            raise UnknownModel(f"no model with fingerprint or name {model!r}")
        counts = {m.fingerprint: 0 for m in named}
        for s in snap.shards:
            if s.model_fingerprint in counts:
                counts[s.model_fingerprint] += 1
        return max(named, key=lambda m: (counts[m.fingerprint], m.fingerprint))

    async def routes(self, model: str, k: int, exclude: frozenset[str]) -> dict[str, Any]:
        if not 1 <= k <= self.config.max_routes_k:
            raise BadRequest(f"k must be in 1..{self.config.max_routes_k}")
        snap = await self.snapshot()
        info = self.resolve_model(snap, model)
        t0 = time.perf_counter()
        selection = select_routes(snap, info.fingerprint, k, exclude_nodes=exclude, rng=self.rng)
        self.metrics.observe("swarm_tracker_route_selection_seconds", time.perf_counter() - t0)
        now = self.clock()
        shard_of = {s.node_id: s for s in snap.shards if s.model_fingerprint == info.fingerprint}
        routes = []
        for route in selection.routes:
            ticket = RouteTicket(
                tracker_id=self.tracker_id,
                session_id=uuid.uuid4().hex,
                model_fingerprint=info.fingerprint,
                hops=tuple(TicketHop(h.node_id, h.start, h.end, h.address) for h in route.hops),
                issued_at_s=now,
                expires_at_s=now + self.config.route_ticket_ttl_s,
            )
            routes.append(
                {
                    "session_id": ticket.session_id,
                    "expected_ms_per_token": round(route.expected_ms_per_token, 3),
                    "hops": [
                        {
                            "node_id": h.node_id,
                            "start": h.start,
                            "end": h.end,
                            "address": h.address,
                            "relay": shard_of[h.node_id].relayed,
                        }
                        for h in route.hops
                    ],
                    "ticket": sign_route_ticket(self.key, ticket),
                    "expires_at": ticket.expires_at_s,
                }
            )
        outcome = "ok" if routes else "no_route"
        self.metrics.inc("swarm_tracker_route_requests_total", outcome=outcome)
        self.metrics.inc("swarm_tracker_routes_issued_total", len(routes))
        return {
            "model": _model_json(info),
            "routes": routes,
            "uncovered": [list(r) for r in selection.uncovered],
        }

    async def recommend(self, model: str, capacity_layers: int) -> dict[str, Any]:
        if capacity_layers < 1:
            raise BadRequest("capacity_layers must be >= 1")
        snap = await self.snapshot()
        info = self.resolve_model(snap, model)
        start, end = recommend_span(snap, info.fingerprint, capacity_layers, rng=self.rng)
        return {"model": _model_json(info), "start": start, "end": end}

    async def list_models(self) -> dict[str, Any]:
        snap = await self.snapshot()
        out = []
        for m in snap.models:
            shards = [s for s in snap.shards if s.model_fingerprint == m.fingerprint]
            cover = layer_coverage(snap, m.fingerprint, m.n_layers)
            routable = bool(select_routes(snap, m.fingerprint, 1, rng=random.Random(0)).routes)
            out.append(
                {
                    **_model_json(m),
                    "live_nodes": len({s.node_id for s in shards}),
                    "routable": routable,
                    "min_layer_tokens_per_s": round(min(cover), 3) if cover else 0.0,
                }
            )
        return {"models": out}

    async def swarm_state(self) -> dict[str, Any]:
        models = await self.list_models()
        nodes = await self._db(self.store.node_rows)
        counts = await self._db(self.store.node_state_counts)
        return {
            "tracker_id": self.tracker_id,
            "time": self.clock(),
            "models": models["models"],
            "node_counts": counts,
            "nodes": nodes,
        }

    async def gauges(self) -> dict[str, dict[Labels, float]]:
        counts = await self._db(self.store.node_state_counts)
        snap = await self.snapshot()
        return {
            "swarm_tracker_nodes": {
                (("state", state),): float(counts.get(state, 0)) for state in ("live", "expired")
            },
            "swarm_tracker_models": {(): float(len(snap.models))},
            "swarm_tracker_nonce_cache_entries": {(): float(len(self.nonces))},
        }


def _model_json(m: ModelInfo) -> dict[str, Any]:
    return {
        "fingerprint": m.fingerprint,
        "name": m.name,
        "architecture": m.architecture,
        "n_layers": m.n_layers,
        "n_embd": m.n_embd,
    }
