"""The tracker's logic between HTTP and storage: verify, validate, store, route.

The registry is one room among collaborators, each with a public interface and
none reaching into another's underscored members:

* :class:`tracker.gatekeeper.Gatekeeper` (``Registry.gate``): opens signed
  envelopes (signature, clock, per-key quotas, this replica's nonce cache),
  runs signed writes and every blocking store call in a worker thread behind
  one :class:`trio.CapacityLimiter`; shared by every room below.
* :class:`tracker.store.Store` (``Registry.store``): the SQLAlchemy adapter;
  its trust tables are ``Store.trust`` (:class:`tracker.trust_store.TrustStore`),
  on the same :class:`tracker.database.Database`.
* :class:`tracker.trust.TrustService` (``Registry.trust``): registered
  gateways, spot checks, evidence and bans, usage receipts, the ledger.
* :class:`tracker.advice.RebalanceService` (``Registry.rebalance``) and
  :class:`tracker.challenger.Challenger` (``Registry.challenger``, set by the
  server): they read the registry's snapshot and call the gate and the store.

Signed messages are verified and validated *before* any database call, so a
refused request writes nothing. The clock is injected (wall-clock seconds,
because signed timestamps come from other machines).

Replicas: several processes may serve one database. Replay protection is
shared: a message's nonce is refused at once if this replica saw it (memory,
bounded by ``nonce_cache_max_entries``) and otherwise inserted into the
``nonces`` table in the same transaction as the write it authorises (bounded
per key by ``nonces_per_key_max``), so a replay is refused by every replica.
Quotas (tracker/ratelimit.py): once a message's signature checked out, its key
is charged (``key_messages_per_s``; registered gateways exempt) and may hold at
most ``nonces_per_key_max`` nonces in memory, so one key cannot fill the cache
everyone shares; over either, 429 for that key alone. Every database call a
request makes waits at most ``db_timeout_s``. Periodic work (expiry, purges,
pruning of long-dead nodes and unused models) is claimed per period through the database
(:meth:`tracker.store.Store.claim_task`), so it runs once however many replicas
there are. Each replica records itself in ``tracker_replicas``; one whose key
differs from a live replica's refuses to start (nodes trust one tracker key).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import nacl.signing
import trio
from sqlalchemy.exc import IntegrityError

from common.logs import event
from proto.announce import Announce, GatewayStats, Heartbeat, Leave, PayloadError, RttSample, UsageReport
from proto.signing import RouteTicket, SignatureError, TicketHop, sign_route_ticket
from tracker import overview
from tracker.advice import RebalanceService
from tracker.config import TrackerConfig
from tracker.errors import (
    BadRequest,
    Conflict,
    GatewaySignatureRequired,
    StorageUnavailable,
    UnknownModel,
)
from tracker.gatekeeper import Gatekeeper
from tracker.handouts import HandoutLedger
from tracker.metrics import MAX_KV_NODES, Labels, Metrics
from tracker.models import NODE_CHALLENGING, NODE_LIVE, NODE_STATES
from tracker.names import resolve_names
from tracker.placement import SpanMemory, layer_coverage, recommend_span
from tracker.rebalance import removable
from tracker.registry import KIND as REGISTRATION_KIND
from tracker.registry import REMOVAL_KIND, SIGNER_FIELD, ModelRegistration, check_name, profile
from tracker.routing import RouteSelection, kv_contexts, select_routes
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot
from tracker.store import RttResult, Store, UsageGroup
from tracker.trust import TrustService

if TYPE_CHECKING:
    from tracker.challenger import Challenger

log = logging.getLogger("swarm.tracker")
T = TypeVar("T")
MAX_REGISTRY_PEERS = 32


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
        # Signed messages and database calls, for this room and the others (tracker/gatekeeper.py).
        self.gate = Gatekeeper(config, self.metrics, clock)
        # GET /v1/models is computed once per snapshot, in a worker thread (route search per model).
        self._models_cache: tuple[SwarmSnapshot, list[dict[str, Any]]] | None = None
        self._models_lock = trio.Lock()
        self._cpu = trio.CapacityLimiter(1)
        self._route_cpu = trio.CapacityLimiter(1)  # route searches and placement, in a worker thread
        # Sessions handed out since each node's last heartbeat: routing counts them as load.
        self.handouts = HandoutLedger(max_age_s=2.0 * config.heartbeat_interval_s)
        self._snapshot: SwarmSnapshot | None = None
        self._snapshot_at = 0.0
        # Structural changes (announce, restore, leave, expiry) bump the generation: a snapshot
        # older than the caller's generation is never served. Load figures only age (ttl).
        self._generation = 0
        self._snapshot_generation = -1
        self._snapshot_lock = trio.Lock()
        self.replica_id = uuid.uuid4().hex
        self.url = ""  # set by the server once it listens
        # Who may report, what a report earns, what it costs a liar (tracker/trust.py).
        self.trust = TrustService(
            self.gate, store.trust, config, self.metrics, key, on_change=self.invalidate_snapshot
        )
        # Rebalancing advice (POST /v1/rebalance) and the demand per model it weighs.
        self.rebalance = RebalanceService(self)
        # Set by the server when challenges are on (tracker/challenger.py); without one, announced
        # nodes go live at once (in-process uses, challenge_nodes = false).
        self.challenger: Challenger | None = None

    # --- plumbing -------------------------------------------------------------------------------

    async def on_route_cpu(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread, one at a time with route searches and placement (CPU-bound
        decisions over a large snapshot must not hold the event loop)."""
        return await trio.to_thread.run_sync(fn, limiter=self._route_cpu)

    def statistics(self) -> RegistryStatistics:
        return RegistryStatistics(
            nonce_cache_entries=len(self.gate.nonces),
            snapshot_age_s=None if self._snapshot is None else max(0.0, self.clock() - self._snapshot_at),
            snapshot_shards=0 if self._snapshot is None else len(self._snapshot.shards),
            db_threads_busy=self.gate.limiter.borrowed_tokens,
        )

    async def start(self) -> None:
        """Bring the schema to head (runs alembic in a worker thread)."""
        before, after = await self.gate.run_db(self.store.upgrade, bounded=False)  # a migration may take long
        event(log, "db_ready", dialect=self.store.dialect, revision_before=before, revision=after)
        self.trust.warn_if_open()

    async def join(self, url: str) -> None:
        """Record this replica; refuse to serve next to a live replica that signs with another key."""
        self.url = url
        now = self.clock()
        live = await self.gate.run_db(self.store.replicas, now, self._replica_live_s())
        others = {r["tracker_id"] for r in live if r["replica_id"] != self.replica_id}
        if others and self.tracker_id not in others:
            raise Conflict(
                f"another tracker replica on this database signs with key {sorted(others)[0]}, this one with "
                f"{self.tracker_id}: replicas must share one key (copy its tracker.key, or set key_file)"
            )
        await self.gate.run_db(self.store.touch_replica, self.replica_id, self.tracker_id, url, now)
        event(log, "replica_joined", replica_id=self.replica_id, url=url, other_replicas=len(live))

    async def replicas(self) -> list[dict[str, Any]]:
        """The replicas heard from recently (this one included once it joined)."""
        return await self.gate.run_db(self.store.replicas, self.clock(), self._replica_live_s())

    async def leave_cluster(self) -> None:
        await self.gate.run_db(self.store.drop_replica, self.replica_id)

    def _replica_live_s(self) -> float:
        return 3 * self.config.replica_heartbeat_interval_s

    # --- writes ---------------------------------------------------------------------------------

    def _challenges(self, relayed: bool) -> bool:
        """Whether a node must answer a challenge before it is routable (a relayed node's is carried
        by the gateway relaying it: tracker/relay_challenges.py)."""
        return self.config.challenge_nodes and self.challenger is not None

    async def announce(self, envelope: Any, *, remote: str = "") -> dict[str, Any]:
        payload, nonce = self.gate.open_envelope(envelope, "announce")
        try:
            a = Announce.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        challenge = self._challenges(a.relay)
        result = await self.gate.signed_write(
            "announce",
            functools.partial(
                self.store.announce, a, self.clock(), nonce, remote=remote, challenge=challenge
            ),
        )
        self.invalidate_snapshot()
        if challenge and self.challenger is not None:
            self.challenger.enqueue(a.node_id)
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
            "state": NODE_CHALLENGING if challenge else NODE_LIVE,
            "created": result.created,
            "restored": result.restored,
            "tracker_id": self.tracker_id,
            "heartbeat_interval_s": self.config.heartbeat_interval_s,
            "heartbeat_timeout_s": self.config.heartbeat_timeout_s,
        }

    async def heartbeat(self, envelope: Any) -> dict[str, Any]:
        payload, nonce = self.gate.open_envelope(envelope, "heartbeat")
        try:
            h = Heartbeat.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        challenge = self._challenges(False)
        restored = await self.gate.signed_write(
            "heartbeat", functools.partial(self.store.heartbeat, h, self.clock(), nonce, challenge=challenge)
        )
        self.metrics.inc("swarm_tracker_heartbeats_total")
        self.handouts.reported(h.node_id)  # its load figures now include the sessions handed out
        if restored:
            self.invalidate_snapshot()
            self.metrics.inc("swarm_tracker_restorations_total")
            event(log, "node_restored", node_id=h.node_id, challenge=challenge)
            if challenge and self.challenger is not None:
                self.challenger.enqueue(h.node_id)  # a relayed node's challenge waits for its gateway
        rtt = await self._record_rtt(h.node_id, h.rtt_samples)
        return {
            "node_id": h.node_id,
            "state": NODE_CHALLENGING if restored and challenge else NODE_LIVE,
            "restored": restored,
            "heartbeat_interval_s": self.config.heartbeat_interval_s,
            "probe": await self._probe_hints(h.node_id, rtt),
        }

    async def _rechallenge(self, gateway_id: str, node_ids: tuple[str, ...]) -> None:
        """Nodes a gateway could not reach leave routing until they answer a challenge again, so the
        next clients do not pay the dial deadline for them (a node that answers is back in seconds);
        not a node that is the last live holder of a layer of its model (out of routing, its model
        could serve nobody)."""
        if not node_ids or not self._challenges(False) or self.challenger is None:
            return
        # The last live holder of a layer stays routable (tracker.rebalance.removable).
        named, spared = removable(await self.snapshot(), node_ids)
        for node_id in spared:
            event(log, "node_rechallenge_spared", level=logging.WARNING, node_id=node_id, reporter=gateway_id)
        moved = await self.gate.run_db(self.store.trust.rechallenge, tuple(named))
        if not moved:
            return
        self.invalidate_snapshot()
        for node_id in moved:
            self.challenger.enqueue(node_id)
            self.metrics.inc("swarm_tracker_rechallenges_total")
            event(log, "node_rechallenged", level=logging.WARNING, node_id=node_id, reporter=gateway_id)

    async def _record_rtt(self, reporter_id: str, samples: tuple[RttSample, ...]) -> RttResult | None:
        """Claims and the refit of the reporter's coordinate (its own transaction, after the signed
        write: a lost refit only delays a coordinate by one report)."""
        if not samples:
            return None
        result = await self.gate.run_db(
            functools.partial(
                self.store.record_rtt,
                reporter_id,
                samples,
                self.clock(),
                claim_ttl_s=self.config.rtt_claim_ttl_s,
                probe_back_max=self.config.rtt_probe_back_max,
            )
        )
        self.metrics.inc("swarm_tracker_rtt_samples_total", len(samples))
        return result

    async def _probe_hints(self, node_id: str, rtt: RttResult | None) -> list[dict[str, str]]:
        """Who the node should measure: peers that measured it (so each pair is checked from both
        sides), then half of ``rtt_probe_hints`` (rounded up) among its route neighbours -- shards
        a route may chain right before or after it, whose links routing prices, so those pairs are
        measured rather than only predicted -- and the rest among all live nodes (so coordinates
        span the whole swarm). Random draws, not scans."""
        hints: dict[str, str] = dict(rtt.probe) if rtt is not None else {}
        n = self.config.rtt_probe_hints
        if n:
            snap = await self.snapshot()
            base = len(hints)
            pools = ((snap.route_neighbours(node_id), base + (n + 1) // 2), (snap.shards, base + n))
            for pool, limit in pools:
                for _ in range(4 * n if pool else 0):
                    if len(hints) >= limit:
                        break
                    s = pool[self.rng.randrange(len(pool))]
                    if not s.relayed and s.address and s.node_id != node_id:
                        hints.setdefault(s.node_id, s.address)
        return [{"node_id": n, "address": a} for n, a in sorted(hints.items())]

    async def leave(self, envelope: Any) -> dict[str, Any]:
        payload, nonce = self.gate.open_envelope(envelope, "leave")
        try:
            msg = Leave.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        result = await self.gate.signed_write("leave", self.store.leave, msg, self.clock(), nonce)
        self.invalidate_snapshot()
        self.metrics.inc("swarm_tracker_leaves_total")
        event(log, "node_left", node_id=msg.node_id, reason=msg.reason, was_live=result.was_live)
        return {"node_id": msg.node_id, "state": "left"}

    async def report_gateway_stats(self, envelope: Any) -> dict[str, Any]:
        payload, nonce = self.gate.open_envelope(envelope, "gateway_stats", signer_field="gateway_id")
        try:
            g = GatewayStats.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        self.trust.require_gateway(g.gateway_id, "gateway_stats")  # its node speeds steer routing
        observed = await self.gate.signed_write(
            "gateway_stats",
            functools.partial(
                self.store.record_gateway_stats,
                g,
                self.clock(),
                nonce,
                speed_alpha=self.config.observed_speed_alpha,
            ),
        )
        self.metrics.inc("swarm_tracker_gateway_reports_total")
        await self._rechallenge(g.gateway_id, g.unreachable)
        rtt = await self._record_rtt(g.gateway_id, g.rtt_samples)
        if rtt is not None and rtt.coordinate is not None:
            self.invalidate_snapshot()  # routes for this gateway are priced from its new position
        # Random live nodes for the gateway to measure too (nodes cannot measure a gateway back).
        return {
            "recorded": True,
            "node_speeds": observed,
            "probe": await self._probe_hints(g.gateway_id, None),
        }

    async def report_usage(self, envelope: Any) -> dict[str, Any]:
        payload, nonce = self.gate.open_envelope(envelope, "usage", signer_field="gateway_id")
        try:
            r = UsageReport.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        self.trust.require_gateway(r.gateway_id, "usage")
        now = self.clock()
        result = await self.gate.signed_write(
            "usage",
            functools.partial(
                self.store.record_usage,
                r,
                now,
                nonce,
                envelope=dict(envelope),
                receipt=self.trust.usage_receipt(envelope, now),
            ),
        )
        tokens = sum(e.tokens for e in r.entries)
        if result.recorded:
            self.rebalance.looked_up(r.model_fingerprint, now)  # a request served: demand for its model
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
        expired = await self.gate.run_db(self.store.expire, self.clock(), self.config.heartbeat_timeout_s)
        if expired:
            self.invalidate_snapshot()
            self.metrics.inc("swarm_tracker_expirations_total", len(expired))
            for node_id in expired:
                event(log, "node_expired", node_id=node_id, timeout_s=self.config.heartbeat_timeout_s)
        return expired

    async def prune_once(self) -> dict[str, int]:
        """Delete one bounded batch of long-dead nodes and unused models (see Store.prune)."""
        try:
            pruned = await self.gate.run_db(
                functools.partial(
                    self.store.prune,
                    self.clock(),
                    after_s=self.config.prune_after_s,
                    batch_max=self.config.prune_batch_max,
                )
            )
        except IntegrityError:  # a replica announced a shard of a model this round was deleting
            return {}
        for table, n in pruned.items():
            if n:
                self.metrics.inc("swarm_tracker_pruned_total", n, table=table)
        if pruned["nodes"] or pruned["models"]:
            self.invalidate_snapshot()
            event(log, "pruned", **pruned)
        return pruned

    async def _claim(self, task: str, interval_s: float) -> bool:
        claimed = await self.gate.run_db(
            self.store.claim_task, task, self.replica_id, self.clock(), interval_s
        )
        self.metrics.inc("swarm_tracker_periodic_runs_total", outcome="ran" if claimed else "skipped")
        return claimed

    async def periodic_once(self) -> dict[str, Any]:
        """One round of periodic work; each task runs only if this replica claims its period."""
        done: dict[str, Any] = {}
        if await self._claim("expire", self.config.expiry_check_interval_s):
            done["expired"] = await self.expire_once()
        if await self._claim("purge", self.config.purge_interval_s):
            done["purged"] = await self.gate.run_db(
                functools.partial(
                    self.store.purge,
                    self.clock(),
                    reports_keep_s=self.config.reports_keep_s,
                    replicas_keep_s=max(3600.0, 10 * self._replica_live_s()),
                    claims_keep_s=self.config.rtt_claim_ttl_s,
                )
            )
            done["purged"].update(
                await self.gate.run_db(
                    functools.partial(
                        self.store.trust.purge_trust, self.clock(), keep_s=self.config.evidence_keep_s
                    )
                )
            )
            event(log, "purged", **done["purged"])
        if await self._claim("prune", self.config.prune_interval_s):
            done["pruned"] = await self.prune_once()
        if self.challenger is not None and await self._claim(
            "challenge_sweep", self.config.challenge_timeout_s
        ):
            waiting = await self.gate.run_db(
                functools.partial(
                    self.store.trust.challenging_nodes,
                    self.clock(),
                    live_within_s=self.config.heartbeat_timeout_s,
                    limit=self.config.challenge_queue_max,
                )
            )
            done["challenges_queued"] = sum(self.challenger.enqueue(n) for n in waiting)
        return done

    async def run_periodic(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Expiry and purges (claimed per period, so once across replicas), and this replica's
        own liveness row."""
        task_status.started()
        next_touch = 0.0
        while True:
            await trio.sleep(self.config.expiry_check_interval_s)
            try:
                if trio.current_time() >= next_touch and self.url:
                    await self.gate.run_db(
                        self.store.touch_replica, self.replica_id, self.tracker_id, self.url, self.clock()
                    )
                    next_touch = trio.current_time() + self.config.replica_heartbeat_interval_s
                await self.periodic_once()
            except StorageUnavailable:
                pass  # logged by the gate; the next round retries, and routing filters on last_seen anyway

    # --- reads ----------------------------------------------------------------------------------

    def invalidate_snapshot(self) -> None:
        """The registry changed shape: the next route request reads it afresh (waiting if need be)."""
        self._generation += 1

    async def snapshot(self) -> SwarmSnapshot:
        """The routing snapshot: at most ``snapshot_ttl_s`` old, and never older than the last
        structural change this replica made.

        Only one refresh runs at a time. While it runs, callers that need no newer structure get
        the current snapshot instead of waiting (its load figures are a refresh older): under load
        a slow database read must not turn every request into a wait for the next read."""
        now = self.clock()
        want = self._generation
        snap = self._snapshot
        if snap is not None and self._snapshot_generation >= want:
            if now - self._snapshot_at <= self.config.snapshot_ttl_s or self._snapshot_lock.locked():
                return snap
        async with self._snapshot_lock:  # one refresh at a time; the others reuse its result
            snap = self._snapshot
            if snap is not None and self._snapshot_generation >= want and self._snapshot_at >= now:
                return snap  # a refresh that began after this call finished while we waited
            return await self._refresh_snapshot(now)

    async def _refresh_snapshot(self, now: float) -> SwarmSnapshot:
        generation = self._generation
        try:
            snap = await self.gate.run_db(
                functools.partial(
                    self.store.snapshot,
                    now,
                    self.config.heartbeat_timeout_s,
                    default_latency_ms=self.config.default_latency_ms,
                    relay_penalty_ms=self.config.relay_penalty_ms,
                    probation_checks=self.config.probation_checks,
                    probation_penalty_ms=self.config.probation_penalty_ms,
                    observed_keep_s=self.config.observed_speed_keep_s,
                    trusted_nodes=self.config.trusted_node_keys(),
                )
            )
        except StorageUnavailable:
            # Ride out a short database outage on the last snapshot, but never on one older than
            # the heartbeat timeout: past that it may list nodes that have since died.
            if self._snapshot is not None and now - self._snapshot_at <= self.config.heartbeat_timeout_s:
                return self._snapshot
            raise
        self._snapshot, self._snapshot_at, self._snapshot_generation = snap, now, generation
        return snap

    def resolve_model(self, snap: SwarmSnapshot, model: str) -> ModelInfo:
        """A fingerprint, or a name: a registered name resolves only to its registered fingerprint;
        an unregistered one only by nodes that earned trust (tracker/names.py)."""
        found = snap.model(model)
        if found is not None:
            return found
        bound = snap.registered_names.get(model)
        if bound is not None:
            info = snap.model(bound)
            if info is None:  # registered moments ago: the snapshot lists registered models
                raise UnknownModel(f"model {model!r} is registered to {bound[:16]}, which is not known yet")
            return info
        resolution = resolve_names(snap, self.config.unregistered_names).get(model)
        if resolution is None:
            raise UnknownModel(f"no model with fingerprint or name {model!r}")
        info = snap.model(resolution.fingerprint) if resolution.fingerprint else None
        if info is None:
            raise UnknownModel(f"model name {model!r} is {resolution.reason}")
        return info

    def open_route_request(self, envelope: Any) -> dict[str, Any]:
        """A signed ``/v1/routes`` request (kind ``route_request``, signed by a gateway's key): its payload.

        Refuses (401) a bad signature, a stale timestamp or a replayed nonce, and (403) a gateway the
        operator did not register when any is registered. The tickets of the answer name the signer.
        """
        payload, _nonce = self.gate.open_envelope(envelope, "route_request", signer_field="gateway_id")
        self.trust.require_gateway(str(payload["gateway_id"]), "route_request")
        return payload

    def require_signed_route_request(self) -> None:
        """An unsigned route request: refused (401) once the operator registered any gateway."""
        if self.trust.gateways:
            self.metrics.inc("swarm_tracker_refusals_total", reason="unsigned_route_request")
            raise GatewaySignatureRequired(
                "route tickets are issued to registered gateways only: sign the request "
                "(a route_request envelope signed with the gateway's key; docs/tracker.md)"
            )

    async def routes(
        self,
        model: str,
        k: int,
        exclude: frozenset[str],
        gateway_id: str | None = None,
        *,
        bound: bool = False,
        kv_tokens: int = 0,
        prefix_heads: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Routes for ``model``; priced from ``gateway_id``'s network coordinate when it has one.

        ``prefix_heads``: heads of the request's prompt blocks, in order; routes whose stages hold
        the longest prefix of it are preferred, weighed against load (tracker.routing.select_routes).

        ``kv_tokens``: KV positions the request needs on every stage; shards announcing less free KV
        are left out (tracker.routing.select_routes).

        ``bound``: the request was signed by ``gateway_id`` (:meth:`open_route_request`), so every
        ticket names that gateway and nodes accept it only on OPENs that gateway signs.
        """
        if bound and not gateway_id:
            raise BadRequest("a bound route request needs the gateway's id")
        if not 1 <= k <= self.config.max_routes_k:
            raise BadRequest(f"k must be in 1..{self.config.max_routes_k}")
        snap = await self.snapshot()
        info = self.resolve_model(snap, model)
        origin = snap.gateway_coords.get(gateway_id) if gateway_id else None
        extra = self.handouts.extra(self.clock())
        self.rebalance.looked_up(info.fingerprint, self.clock())

        def search() -> tuple[RouteSelection, float]:
            t0 = time.perf_counter()
            found = select_routes(
                snap,
                info.fingerprint,
                k,
                exclude_nodes=exclude,
                rng=self.rng,
                origin=origin,
                extra_sessions=extra,
                kv_tokens=kv_tokens,
                prefix_heads=prefix_heads,
            )
            return found, time.perf_counter() - t0

        # In a worker thread: a search over a large swarm must not hold the event loop (/healthz,
        # heartbeats); one search at a time, apart from the model list's computation.
        selection, took_s = await trio.to_thread.run_sync(search, limiter=self._route_cpu)
        self.metrics.observe("swarm_tracker_route_selection_seconds", took_s)
        now = self.clock()
        self.handouts.record((r.node_ids for r in selection.routes), now)
        shard_of = {s.node_id: s for s in snap.shards if s.model_fingerprint == info.fingerprint}
        routes = []
        for route in selection.routes:
            ticket = RouteTicket(
                tracker_id=self.tracker_id,
                session_id=uuid.uuid4().hex,
                model_fingerprint=info.fingerprint,
                # The pins go under the signature too: a gateway dials only what a valid ticket names.
                hops=tuple(
                    TicketHop(h.node_id, h.start, h.end, h.address, shard_of[h.node_id].tls_fingerprint)
                    for h in route.hops
                ),
                issued_at_s=now,
                expires_at_s=now + self.config.route_ticket_ttl_s,
                gateway_id=gateway_id if bound and gateway_id else "",
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
                            # What the gateway (and the previous stage) pins when dialling this node.
                            "tls_fingerprint": shard_of[h.node_id].tls_fingerprint,
                            # The link into this stage (from the gateway for the first): estimated
                            # round trip and the sender's uplink; null where nothing was measured.
                            "rtt_ms": _ms(route.hop_rtt_ms[i]),
                            "bandwidth_mbit_s": route.hop_bandwidth_mbit_s[i],
                            "probation": shard_of[h.node_id].probation,
                            # Listed in the operator's trusted_nodes: gateways count it trusted
                            # without passes of their own (it is never on probation).
                            "operator_trusted": shard_of[h.node_id].operator_trusted,
                            # Free KV positions of its last heartbeat (null before the first), its
                            # pool's size and the most one session may hold there (null: not said).
                            "kv_free_tokens": shard_of[h.node_id].kv_free_tokens,
                            "kv_pool_tokens": shard_of[h.node_id].kv_pool_tokens,
                            "kv_session_max_tokens": shard_of[h.node_id].kv_session_max_tokens,
                            # Heads of the KV prefixes it keeps (its last heartbeat; common/prefix_chain.py):
                            # the gateway prefers the route holding the longest prefix of its prompt.
                            "prefix_heads": list(shard_of[h.node_id].prefix_heads),
                            # What the gateway re-prices the route's load with (common/route_cost.py):
                            # the stage's single-token time, session limit, reported load and queue,
                            # and the load this route was priced at (reported plus recent hand-outs).
                            "decode_ms_per_token": round(h.decode_ms_per_token, 3),
                            "max_sessions": h.max_sessions,
                            "active_sessions": h.active_sessions,
                            "queue_depth": h.queue_depth,
                            "priced_sessions": round(h.active_sessions + extra.get(h.node_id, 0.0), 3),
                        }
                        for i, h in enumerate(route.hops)
                    ],
                    "ring_rtt_ms": _ms(route.ring_rtt_ms),
                    "exit_rtt_ms": _ms(route.exit_rtt_ms),
                    "ticket": sign_route_ticket(self.key, ticket),
                    "expires_at": ticket.expires_at_s,
                }
            )
        outcome = "ok" if routes else "no_route"
        self.metrics.inc("swarm_tracker_route_requests_total", outcome=outcome)
        self.metrics.inc("swarm_tracker_routes_issued_total", len(routes))
        contexts = kv_contexts(snap, info)
        return {
            "model": _model_json(info),
            "routes": routes,
            "uncovered": [list(r) for r in selection.uncovered],
            # The largest context one session can have on any complete route of the swarm (whatever
            # k routes were handed out), and the largest some route has free now; null = unknown (no
            # node on the widest route announced a bound). A gateway names the first in a 413.
            "kv": {
                "session_max_tokens": contexts.session_max_tokens,
                "free_max_tokens": contexts.free_max_tokens,
            },
        }

    async def recommend(
        self,
        model: str,
        capacity_layers: int,
        memory_bytes: int | None = None,
        kv_bytes_per_layer: int = 0,
    ) -> dict[str, Any]:
        if capacity_layers < 1:
            raise BadRequest("capacity_layers must be >= 1")
        if memory_bytes is not None and (memory_bytes < 0 or kv_bytes_per_layer < 0):
            raise BadRequest("memory_bytes and kv_bytes_per_layer must be >= 0")
        snap = await self.snapshot()
        info = self.resolve_model(snap, model)
        memory = SpanMemory(memory_bytes, kv_bytes_per_layer) if memory_bytes is not None else None
        start, end = await trio.to_thread.run_sync(
            functools.partial(
                recommend_span, snap, info.fingerprint, capacity_layers, rng=self.rng, memory=memory
            ),
            limiter=self._route_cpu,
        )
        return {"model": _model_json(info), "start": start, "end": end}

    # --- the model registry -----------------------------------------------------------------------

    def _check_registry_signer(self, payload: dict[str, Any], kind: str) -> str:
        signer = str(payload.get(SIGNER_FIELD, ""))
        if signer != self.tracker_id and signer not in self.config.registry_key_ids():
            err = SignatureError(
                "untrusted_key",
                "only the tracker's key or one of its registry_keys may change the model registry",
            )
            self.gate.refused(kind, err)
            raise err
        return signer

    async def register_model(self, body: Any) -> dict[str, Any]:
        """``POST /v1/registry/models``: ``{"registration": <signed envelope>, "manifest": {...}}``."""
        from proto.manifest import Manifest, ManifestInvalid

        if not isinstance(body, dict) or set(body) != {"registration", "manifest"}:
            raise BadRequest("body must be an object with exactly registration and manifest")
        payload, nonce = self.gate.open_envelope(
            body["registration"], REGISTRATION_KIND, signer_field=SIGNER_FIELD
        )
        signer = self._check_registry_signer(payload, REGISTRATION_KIND)
        try:
            reg = ModelRegistration.from_json(payload)
            manifest = Manifest.from_json(body["manifest"])
        except (PayloadError, ManifestInvalid) as err:
            raise BadRequest(str(err)) from err
        if manifest.fingerprint() != reg.fingerprint:
            raise BadRequest(
                f"the manifest hashes to {manifest.fingerprint()}, "
                f"not the registered fingerprint {reg.fingerprint}"
            )
        prof = profile(manifest, reg.n_layers)
        if not all(prof.layer_bytes) or any(
            t.name.startswith(f"blk.{reg.n_layers}.") for t in manifest.tensors
        ):
            raise BadRequest(f"the manifest's blocks do not match n_layers={reg.n_layers}")
        import json

        entry = {
            "fingerprint": reg.fingerprint,
            "name": reg.name,
            "architecture": reg.architecture,
            "n_layers": reg.n_layers,
            "n_embd": reg.n_embd,
            "file_size": manifest.file_size,
            "split_points": list(reg.split_points) if reg.split_points is not None else None,
            "layer_bytes": list(prof.layer_bytes),
            "first_extra_bytes": prof.first_extra_bytes,
            "last_extra_bytes": prof.last_extra_bytes,
            "sources": list(reg.sources),
            "manifest": manifest.canonical_bytes().decode(),
            "registration": json.dumps(body["registration"], separators=(",", ":")),
            "signer_id": signer,
        }
        created = await self.gate.signed_write(
            REGISTRATION_KIND, self.store.register_model, entry, reg.replace, self.clock(), nonce
        )
        self.invalidate_snapshot()
        event(
            log,
            "model_registered",
            fingerprint=reg.fingerprint,
            model_name=reg.name,
            sources=len(reg.sources),
            created=created,
            signer=signer,
        )
        return {"fingerprint": reg.fingerprint, "name": reg.name, "created": created}

    async def remove_registration(self, envelope: Any) -> dict[str, Any]:
        """``POST /v1/registry/remove``: a signed ``{"model": name or fingerprint}``."""
        payload, nonce = self.gate.open_envelope(envelope, REMOVAL_KIND, signer_field=SIGNER_FIELD)
        self._check_registry_signer(payload, REMOVAL_KIND)
        model = payload.get("model")
        if set(payload) - {"model", SIGNER_FIELD, "kind", "timestamp", "nonce"} or not isinstance(model, str):
            raise BadRequest("a removal carries exactly model (a name or fingerprint)")
        removed = await self.gate.signed_write(
            REMOVAL_KIND, self.store.remove_registration, model, self.clock(), nonce
        )
        if removed is None:
            raise UnknownModel(f"no registered model {model!r}")
        self.invalidate_snapshot()
        event(log, "model_unregistered", fingerprint=removed, model=model)
        return {"fingerprint": removed, "removed": True}

    async def registry_models(self, source: str | None) -> dict[str, Any]:
        return {"models": await self.gate.run_db(self.store.registered_models, source)}

    async def registry_model(self, model: str) -> dict[str, Any]:
        """A registered model with its manifest, source URLs and live peers (nodes serving spans of it)."""
        if not model or len(model) > 256:
            raise BadRequest("model must be a name or fingerprint")
        if len(model) != 64:
            try:
                check_name(model, "model")
            except PayloadError as err:
                raise BadRequest(str(err)) from err
        entry = await self.gate.run_db(self.store.registered_model, model)
        if entry is None:
            raise UnknownModel(f"no registered model with name or fingerprint {model!r}")
        snap = await self.snapshot()
        peers = [
            {"node_id": s.node_id, "address": s.address, "start": s.start, "end": s.end}
            for s in snap.shards
            if s.model_fingerprint == entry["fingerprint"] and not s.relayed and s.address
        ]
        if len(peers) > MAX_REGISTRY_PEERS:
            peers = self.rng.sample(peers, MAX_REGISTRY_PEERS)
        return {**entry, "peers": peers}

    def _page(self, limit: int | None, offset: int) -> int:
        cap = self.config.list_max_rows
        limit = cap if limit is None else limit
        if not 1 <= limit <= cap:
            raise BadRequest(f"limit must be in 1..{cap}")
        if offset < 0:
            raise BadRequest("offset must be >= 0")
        return limit

    async def list_models(self, limit: int | None = None, offset: int = 0) -> dict[str, Any]:
        """``GET /v1/models``: a page of the models (by fingerprint), with ``total`` and ``next_offset``."""
        limit = self._page(limit, offset)
        rows = await self._model_rows(await self.snapshot())
        page = rows[offset : offset + limit]
        more = offset + len(page) < len(rows)
        return {
            "models": page,
            "total": len(rows),
            "limit": limit,
            "offset": offset,
            "next_offset": offset + len(page) if more else None,
        }

    async def _model_rows(self, snap: SwarmSnapshot) -> list[dict[str, Any]]:
        """Every model's row, computed once per snapshot in a worker thread (a route search per model
        must not hold the event loop); while one computation runs, callers get the previous result."""
        cached = self._models_cache
        if cached is not None and (cached[0] is snap or self._models_lock.locked()):
            return cached[1]
        async with self._models_lock:
            cached = self._models_cache
            if cached is not None and cached[0] is snap:
                return cached[1]
            rows = await trio.to_thread.run_sync(
                model_rows, snap, self.config.unregistered_names, limiter=self._cpu
            )
            self._models_cache = (snap, rows)
            return rows

    async def swarm_state(self, limit: int | None = None, offset: int = 0) -> dict[str, Any]:
        """``GET /v1/swarm``: the models (first page), node counts and a page of the nodes (by id)."""
        limit = self._page(limit, offset)
        models = await self.list_models()
        nodes = await self.gate.run_db(functools.partial(self.store.node_rows, limit=limit, offset=offset))
        counts = await self.gate.run_db(self.store.node_state_counts)
        total = sum(counts.values())
        return {
            "tracker_id": self.tracker_id,
            "time": self.clock(),
            "models": models["models"],
            "node_counts": counts,
            "nodes": nodes,
            "limit": limit,
            "offset": offset,
            "next_offset": offset + len(nodes) if offset + len(nodes) < total else None,
        }

    async def gauges(self) -> dict[str, dict[Labels, float]]:
        counts = await self.gate.run_db(self.store.node_state_counts)
        snap = await self.snapshot()
        replicas = await self.gate.run_db(self.store.replicas, self.clock(), self._replica_live_s())
        coverage: dict[Labels, float] = {}
        by_model = shards_by_model(snap)
        for m in snap.models:
            if m.fingerprint not in by_model:
                continue  # the gauge keeps 32 series at most: models that some node serves
            sub = dataclasses.replace(snap, shards=by_model[m.fingerprint])
            counts_per_layer = overview.coverage_counts(sub, m.fingerprint, m.n_layers)
            coverage[(("model", m.name[:64] or m.fingerprint[:16]),)] = float(
                min(counts_per_layer, default=0)
            )
        pool: dict[Labels, float] = {}
        used: dict[Labels, float] = {}
        free: dict[Labels, float] = {}
        preempted: dict[Labels, float] = {}
        refused: dict[Labels, float] = {}
        reporting = sorted(
            (s for s in snap.shards if s.kv_pool_tokens is not None or s.kv_free_tokens is not None),
            key=lambda s: s.node_id,
        )[:MAX_KV_NODES]
        for s in reporting:
            label: Labels = (("node", s.node_id[:16]),)
            for into, value in (
                (pool, s.kv_pool_tokens),
                (used, s.kv_used_tokens),
                (free, s.kv_free_tokens),
                (preempted, s.kv_preemptions),
                (refused, s.kv_refusals),
            ):
                if value is not None:
                    into[label] = float(value)
        contexts: dict[Labels, float] = {}
        for m in snap.models:
            if m.fingerprint not in by_model:
                continue
            found = kv_contexts(snap, m)
            name = m.name[:64] or m.fingerprint[:16]
            for kind, value in (("session", found.session_max_tokens), ("free", found.free_max_tokens)):
                if value is not None:
                    contexts[(("model", name), ("kind", kind))] = float(value)
        return {
            "swarm_tracker_node_kv_pool_tokens": pool,
            "swarm_tracker_node_kv_used_tokens": used,
            "swarm_tracker_node_kv_free_tokens": free,
            "swarm_tracker_node_kv_preemptions": preempted,
            "swarm_tracker_node_kv_refusals": refused,
            "swarm_tracker_kv_context_max_tokens": contexts,
            "swarm_tracker_nodes": {
                (("state", state),): float(counts.get(state, 0)) for state in NODE_STATES
            },
            "swarm_tracker_models": {(): float(len(snap.models))},
            "swarm_tracker_layer_coverage_min": coverage,
            "swarm_tracker_nonce_cache_entries": {(): float(len(self.gate.nonces))},
            "swarm_tracker_replicas": {(): float(len(replicas))},
        }

    # --- accounting -------------------------------------------------------------------------------

    async def usage_summary(
        self,
        by: str,
        since_s: float | None,
        until_s: float | None,
        *,
        node_id: str | None = None,
        model: str | None = None,
        gateway_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> dict[str, Any]:
        if by not in ("node", "model", "gateway"):
            raise BadRequest("by must be node, model or gateway")
        cap = self.config.usage_query_max_rows
        if not 1 <= limit <= cap:
            raise BadRequest(f"limit must be in 1..{cap}")
        if offset < 0:
            raise BadRequest("offset must be >= 0")
        until = self.clock() if until_s is None else until_s
        since = until - 86_400.0 if since_s is None else since_s
        if not since <= until:
            raise BadRequest("since must not be after until")
        group: UsageGroup = by  # type: ignore[assignment]  # checked above
        result = await self.gate.run_db(
            functools.partial(
                self.store.usage_summary,
                group,
                since,
                until,
                node_id=node_id,
                model=model,
                gateway_id=gateway_id,
                limit=limit,
                offset=offset,
            )
        )
        more = offset + len(result["rows"]) < result["total_rows"]
        return {
            "by": by,
            "since": since,
            "until": until,
            **result,
            "limit": limit,
            "offset": offset,
            "next_offset": offset + len(result["rows"]) if more else None,
        }

    async def node_usage(self, node_id: str) -> dict[str, Any]:
        windows = {"last_hour": 3600.0, "last_24h": 86_400.0, "last_30d": 30 * 86_400.0}
        result = await self.gate.run_db(self.store.node_contribution, node_id, self.clock(), windows)
        by_model = await self.usage_summary("model", 0.0, self.clock() + 1.0, node_id=node_id, limit=20)
        return {"node_id": node_id, **result, "by_model": by_model["rows"], "time": self.clock()}

    # --- dashboard --------------------------------------------------------------------------------

    async def dashboard_state(self) -> dict[str, Any]:
        """Everything the dashboard draws, in one JSON object (docs/operations.md)."""
        now = self.clock()
        snap = await self.snapshot()
        window = self.config.dashboard_series_window_s
        nodes = await self.gate.run_db(
            functools.partial(self.store.node_rows, limit=overview.MAX_NODE_ROWS + 1)
        )
        counts = await self.gate.run_db(self.store.node_state_counts)
        reports = await self.gate.run_db(self.store.gateway_reports, now - window)
        recent = await self.gate.run_db(self.store.recent_usage, now - overview.ROUTE_WINDOW_S)
        replicas = await self.gate.run_db(self.store.replicas, now, self._replica_live_s())
        top = await self.gate.run_db(
            functools.partial(self.store.usage_summary, "node", now - 86_400.0, now + 1.0, limit=10)
        )
        build = functools.partial(
            overview.build_state,
            now_s=now,
            tracker_id=self.tracker_id,
            replica_id=self.replica_id,
            snapshot=snap,
            nodes=nodes,
            node_counts=counts,
            reports=reports,
            recent_usage=recent,
            replicas=replicas,
            top_contributors=top,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            series_window_s=window,
            unregistered_names=self.config.unregistered_names,
        )
        return await trio.to_thread.run_sync(build, limiter=self._cpu)  # off the event loop


def shards_by_model(snap: SwarmSnapshot) -> dict[str, tuple[ShardView, ...]]:
    groups: dict[str, list[ShardView]] = {}
    for sh in snap.shards:
        groups.setdefault(sh.model_fingerprint, []).append(sh)
    return {fp: tuple(g) for fp, g in groups.items()}


def model_rows(snap: SwarmSnapshot, names: str = "trusted") -> list[dict[str, Any]]:
    """The rows of ``GET /v1/models``: each model's live nodes, routability and weakest layer, and
    whether its name resolves to it (``name_resolves``, ``name_reason``: tracker/names.py).

    One pass groups the shards by model, so each model's route search and coverage see only its own
    shards: linear in models + shards, not their product (1,000 junk models cost milliseconds)."""
    by_model = shards_by_model(snap)
    resolved = resolve_names(snap, names)
    out = []
    for m in snap.models:
        if snap.registered_names.get(m.name, m.fingerprint) != m.fingerprint:
            continue  # its name is registered to another model: listed (and reached) by that one
        shards = by_model.get(m.fingerprint, ())
        if shards:
            sub = dataclasses.replace(snap, shards=shards)
            cover = layer_coverage(sub, m.fingerprint, m.n_layers)
            routable = bool(select_routes(sub, m.fingerprint, 1, rng=random.Random(0)).routes)
        else:
            cover, routable = [], False
        name = resolved.get(m.name)
        mine = name is not None and name.fingerprint == m.fingerprint
        out.append(
            {
                **_model_json(m),
                "live_nodes": len({s.node_id for s in shards}),
                "trusted_nodes": len({s.node_id for s in shards if s.trusted}),
                "routable": routable,
                "min_layer_tokens_per_s": round(min(cover), 3) if cover else 0.0,
                "name_resolves": mine,
                "name_reason": (
                    name.reason
                    if name is not None and (mine or not name.fingerprint)
                    else f"the name resolves to {name.fingerprint[:16]}: {name.reason}"
                    if name is not None
                    else "no name"
                ),
            }
        )
    return out


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _model_json(m: ModelInfo) -> dict[str, Any]:
    return {
        "fingerprint": m.fingerprint,
        "name": m.name,
        "architecture": m.architecture,
        "n_layers": m.n_layers,
        "n_embd": m.n_embd,
    }
