"""The registry's storage: synchronous SQLAlchemy, one short transaction per operation.

This is the SQLAlchemy adapter: the only module that talks to the database. It
is synchronous on purpose; :class:`tracker.service.Registry` calls it through
``trio.to_thread.run_sync`` with a limiter (1 thread for SQLite, a few for
PostgreSQL). Every write validates first and commits once, so a refused
request leaves the database untouched.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Engine, delete, func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from proto.announce import Announce, GatewayStats, Heartbeat, Leave, RttSample, UsageReport
from tracker import coordinates
from tracker.coordinates import NetCoord
from tracker.database import Database, NonceRecord
from tracker.database import make_engine as make_engine  # re-exported: the CLI and sim build engines here
from tracker.errors import Banned, Conflict, NameBound, UnknownNode
from tracker.models import (
    NODE_BANNED,
    NODE_CHALLENGE_FAILED,
    NODE_CHALLENGING,
    NODE_EXPIRED,
    NODE_LEFT,
    NODE_LIVE,
    BannedHost,
    ChallengeResult,
    Gateway,
    GatewayReport,
    Model,
    Node,
    Nonce,
    PeriodicTask,
    RegisteredModel,
    Replica,
    Reputation,
    RttClaim,
    Shard,
    TrustEvidence,
    Usage,
    UsageReportRow,
)
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot
from tracker.trust_store import TrustStore

UsageGroup = Literal["node", "model", "gateway"]


def _route_address(relay: bool, addresses: list[str], relay_via: str | None) -> str:
    """Where a gateway reaches the node: ``relay:<gateway id>`` for relayed nodes (they accept no
    inbound connections, whatever addresses they list), else the first announced gRPC address."""
    if relay:
        return f"relay:{relay_via or ''}"
    return addresses[0] if addresses else ""


@dataclass(frozen=True)
class AnnounceResult:
    created: bool  # first time this node was seen
    restored: bool  # the node was expired and is live again


@dataclass(frozen=True)
class UsageResult:
    recorded: int
    duplicates: int


@dataclass(frozen=True)
class RttResult:
    coordinate: NetCoord | None  # the reporter's coordinate after the refit (None: none yet)
    probe: tuple[tuple[str, str], ...]  # (node id, address) of peers that measured it and it should measure


@dataclass(frozen=True)
class LeaveResult:
    known: bool  # the node was registered
    was_live: bool


GATEWAY_COORD_KEEP_S = 86_400.0  # gateways heard from within this long keep their coordinate in snapshots
MAX_GATEWAY_COORDS = 10_000


def _coord(
    x: float | None, y: float | None, z: float | None, height: float | None, error: float | None
) -> NetCoord | None:
    if x is None or y is None or z is None or height is None or error is None:
        return None
    try:
        return NetCoord((x, y, z), height, error)
    except ValueError:  # a non-finite value never written by this code: treat as unknown
        return None


def _coord_json(c: NetCoord | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "vec": [round(v, 3) for v in c.vec],
        "height_ms": round(c.height_ms, 3),
        "error": round(c.error, 4),
    }


def _coord_of(row: Node | Gateway) -> NetCoord | None:
    return _coord(row.coord_x, row.coord_y, row.coord_z, row.coord_height_ms, row.coord_error)


def _set_coord(row: Node | Gateway, c: NetCoord, now_s: float) -> None:
    row.coord_x, row.coord_y, row.coord_z = c.vec
    row.coord_height_ms = c.height_ms
    row.coord_error = c.error
    row.coord_updated_s = now_s


class Store:
    """Nodes, models, shards, usage, the model registry, replicas and periodic-task claims.

    Holds the shared :class:`tracker.database.Database` and the trust tables' half of the adapter
    (``trust``, a :class:`tracker.trust_store.TrustStore` on the same database): a write that
    touches both (an announce's ban check, a statistics report's observed speeds) hands its own
    session to ``trust``, so it stays one transaction."""

    def __init__(self, engine: Engine) -> None:
        self.db = Database(engine)
        self.trust = TrustStore(self.db)

    @property
    def engine(self) -> Engine:
        return self.db.engine

    @property
    def dialect(self) -> str:
        return self.db.dialect

    def upgrade(self) -> tuple[str | None, str | None]:
        return self.db.upgrade()

    def close(self) -> None:
        self.db.close()

    # --- writes ---------------------------------------------------------------------------------

    def announce(
        self,
        a: Announce,
        now_s: float,
        nonce: NonceRecord | None = None,
        *,
        remote: str = "",
        challenge: bool = False,
    ) -> AnnounceResult:
        """Register or refresh the node and its shard. ``remote``: the address the announce came
        from (host bans); ``challenge``: the node waits in ``challenging`` until the tracker's
        challenge answered, instead of going live at once."""
        try:
            return self._announce(a, now_s, nonce, remote, challenge)
        except IntegrityError:
            # Another tracker replica inserted the same node or model concurrently: retry as an update.
            return self._announce(a, now_s, nonce, remote, challenge)

    def _announce(
        self, a: Announce, now_s: float, nonce: NonceRecord | None, remote: str, challenge: bool
    ) -> AnnounceResult:
        with Session(self.engine) as s, s.begin():
            self.trust.check_announce(s, a, remote, now_s)
            bound = s.scalars(
                select(RegisteredModel.fingerprint).where(RegisteredModel.name == a.model.name)
            ).first()
            if bound is not None and bound != a.model.fingerprint:
                raise NameBound(
                    f"the model name {a.model.name!r} is registered to fingerprint {bound[:16]}; this node "
                    f"serves {a.model.fingerprint[:16]} (announce it under another name)"
                )
            self.db.consume_nonce(s, nonce, now_s)
            model = s.get(Model, a.model.fingerprint)
            if model is None:
                s.add(
                    Model(
                        fingerprint=a.model.fingerprint,
                        name=a.model.name,
                        architecture=a.model.architecture,
                        n_layers=a.model.n_layers,
                        n_embd=a.model.n_embd,
                        first_seen_s=now_s,
                    )
                )
            elif (model.n_layers, model.n_embd, model.architecture) != (
                a.model.n_layers,
                a.model.n_embd,
                a.model.architecture,
            ):
                raise Conflict(
                    f"model {a.model.fingerprint} is registered with n_layers={model.n_layers}, "
                    f"n_embd={model.n_embd}, architecture={model.architecture!r}; the announce disagrees"
                )
            registered = s.get(RegisteredModel, a.model.fingerprint)
            if registered is not None and (
                registered.n_layers,
                registered.n_embd,
                registered.architecture,
            ) != (
                a.model.n_layers,
                a.model.n_embd,
                a.model.architecture,
            ):
                raise Conflict(
                    f"model {a.model.fingerprint} is registered with n_layers={registered.n_layers}, "
                    f"n_embd={registered.n_embd}, architecture={registered.architecture!r}; "
                    "the announce disagrees"
                )
            node = s.get(Node, a.node_id)
            created = node is None
            restored = node is not None and node.state != NODE_LIVE
            if node is None:
                node = Node(id=a.node_id, first_seen_s=now_s)
                s.add(node)
            node.addresses = list(a.addresses)
            node.relay = a.relay
            node.relay_via = a.relay_via
            node.hardware = a.hardware.to_json()
            node.software_version = a.software_version
            node.region = a.region
            node.uplink_mbit_s = a.uplink_mbit_s
            node.announced_from = remote[:64]
            node.tls_fingerprint = a.tls_fingerprint
            node.last_seen_s = now_s
            node.state = NODE_CHALLENGING if challenge else NODE_LIVE
            s.flush()
            # A node serves one shard: the one it announces. A shard of another model it served
            # before (it moved: tracker/rebalance.py) is no longer routable, so it goes.
            s.execute(
                delete(Shard).where(
                    Shard.node_id == a.node_id, Shard.model_fingerprint != a.model.fingerprint
                )
            )
            shard = s.scalars(
                select(Shard).where(
                    Shard.node_id == a.node_id, Shard.model_fingerprint == a.model.fingerprint
                )
            ).first()
            if shard is None:
                shard = Shard(node_id=a.node_id, model_fingerprint=a.model.fingerprint, tokens_served_total=0)
                s.add(shard)
            shard.layer_start = a.shard_start
            shard.layer_end = a.shard_end
            shard.decode_ms_per_token = a.decode_ms_per_token
            shard.prefill_tokens_per_s = a.prefill_tokens_per_s
            shard.max_sessions = a.max_sessions
            shard.active_sessions = 0
            shard.queue_depth = 0
            shard.kv_free_tokens = None
            shard.kv_used_tokens = None
            shard.kv_pool_tokens = None
            shard.kv_session_max_tokens = None
            shard.kv_preemptions = None
            shard.kv_refusals = None
            shard.prefix_heads = None
            shard.tokens_per_s = None
            shard.capacity_layers = a.capacity_layers or None
            shard.updated_s = now_s
        return AnnounceResult(created=created, restored=restored)

    def heartbeat(
        self, h: Heartbeat, now_s: float, nonce: NonceRecord | None = None, *, challenge: bool = False
    ) -> bool:
        """Record load; returns True when the node was expired and is now restored.

        A node that left must announce again (404), so a heartbeat still in flight
        when it said goodbye cannot bring it back; a banned node is refused (403). A
        node waiting for or failing its challenge keeps that state; a restored node
        waits for a new challenge when ``challenge``. Core statements rather than the
        ORM: this is the hottest write path.
        """
        with self.engine.begin() as conn:
            row = conn.execute(
                select(Node.state, Shard.updated_s)
                .outerjoin(Shard, Shard.node_id == Node.id)
                .where(Node.id == h.node_id)
                .limit(1)
            ).first()
            if row is None:
                raise UnknownNode(f"node {h.node_id} is not registered: announce first")
            state, previous_s = row
            if state == NODE_LEFT:
                raise UnknownNode(f"node {h.node_id} left the swarm: announce to rejoin")
            if state == NODE_BANNED:
                ban = self.trust.ban_of(conn, h.node_id, now_s)
                if ban is not None:
                    raise Banned(f"node {h.node_id[:16]} is banned for {ban[0] - now_s:.0f} s more: {ban[1]}")
                raise UnknownNode(f"node {h.node_id} was banned and the ban ran out: announce to rejoin")
            self.db.consume_nonce(conn, nonce, now_s)
            new_state = state
            if state == NODE_EXPIRED:
                new_state = NODE_CHALLENGING if challenge else NODE_LIVE
            conn.execute(update(Node).where(Node.id == h.node_id).values(last_seen_s=now_s, state=new_state))
            rate = None
            if previous_s is not None and now_s - previous_s > 0.05:
                rate = h.tokens_served / (now_s - previous_s)
            conn.execute(
                update(Shard)
                .where(Shard.node_id == h.node_id)
                .values(
                    active_sessions=h.active_sessions,
                    queue_depth=h.queue_depth,
                    kv_free_tokens=h.kv_free_tokens,
                    kv_used_tokens=h.kv_used_tokens,
                    kv_pool_tokens=h.kv_pool_tokens,
                    kv_session_max_tokens=h.kv_session_max_tokens,
                    kv_preemptions=h.kv_preemptions,
                    kv_refusals=h.kv_refusals,
                    prefix_heads=" ".join(h.prefix_heads) or None,
                    tokens_per_s=rate,
                    tokens_served_total=Shard.tokens_served_total + h.tokens_served,
                    updated_s=now_s,
                )
            )
        return state == NODE_EXPIRED

    def record_rtt(
        self,
        reporter_id: str,
        samples: tuple[RttSample, ...],
        now_s: float,
        *,
        claim_ttl_s: float,
        probe_back_max: int = 8,
    ) -> RttResult:
        """Keep a node's or gateway's RTT claims and refit its network coordinate from them and
        from the claims about it (tracker/coordinates.py); returns the new coordinate and the
        nodes it should measure back. The reporter must be registered (UnknownNode)."""
        with Session(self.engine) as s, s.begin():
            own_row: Any = s.get(Node, reporter_id)
            if own_row is None:
                own_row = s.get(Gateway, reporter_id)
            if own_row is None:
                raise UnknownNode(f"{reporter_id} is neither a registered node nor a known gateway")
            previous = {
                p: (r, t)
                for p, r, t in s.execute(
                    select(RttClaim.peer_id, RttClaim.rtt_ms, RttClaim.at_s).where(
                        RttClaim.reporter_id == reporter_id
                    )
                )
            }
            table = coordinates.merge_claims(
                previous, [(x.peer_id, x.rtt_ms) for x in samples], now_s, max_age_s=claim_ttl_s
            )
            gone = [p for p in previous if p not in table]
            if gone:
                s.execute(
                    delete(RttClaim).where(RttClaim.reporter_id == reporter_id, RttClaim.peer_id.in_(gone))
                )
            for peer_id, (rtt, at_s) in table.items():
                if at_s == now_s:
                    s.execute(
                        self.db.insert_ignore(RttClaim)
                        .values(reporter_id=reporter_id, peer_id=peer_id, rtt_ms=rtt, at_s=now_s)
                        .on_conflict_do_update(
                            index_elements=["reporter_id", "peer_id"], set_={"rtt_ms": rtt, "at_s": now_s}
                        )
                    )
            about = {
                r: v
                for r, v in s.execute(
                    select(RttClaim.reporter_id, RttClaim.rtt_ms)
                    .where(RttClaim.peer_id == reporter_id, RttClaim.at_s >= now_s - claim_ttl_s)
                    .order_by(RttClaim.at_s.desc())
                    .limit(coordinates.MAX_OBSERVATIONS)
                )
            }
            mine = {p: r for p, (r, _) in table.items()}
            peers = self._coordinates(s, set(mine) | set(about))
            own = _coord_of(own_row)
            vouched = isinstance(own_row, Gateway)  # nobody measures a gateway back: see observations()
            new = coordinates.refit(own, mine, about, peers, key=reporter_id, vouched=vouched)
            if new is not None and new != own:
                _set_coord(own_row, new, now_s)
            wanted = coordinates.probe_back(mine, about, 4 * probe_back_max)
            probe: list[tuple[str, str]] = []
            if wanted:
                for nid, addresses, relay in s.execute(
                    select(Node.id, Node.addresses, Node.relay)
                    .where(Node.id.in_(wanted), Node.state == NODE_LIVE)
                    .order_by(Node.id)
                ):
                    if not relay and addresses and len(probe) < probe_back_max:
                        probe.append((nid, addresses[0]))
        return RttResult(coordinate=new, probe=tuple(probe))

    @staticmethod
    def _coordinates(s: Session, ids: set[str]) -> dict[str, NetCoord | None]:
        """Known endpoints among ``ids`` (nodes, then gateways) -> their coordinate or None."""
        if not ids:
            return {}
        out: dict[str, NetCoord | None] = {}
        for table in (Node, Gateway):
            for row in s.execute(
                select(
                    table.id,
                    table.coord_x,
                    table.coord_y,
                    table.coord_z,
                    table.coord_height_ms,
                    table.coord_error,
                ).where(table.id.in_(sorted(ids)))
            ):
                out.setdefault(row[0], _coord(*row[1:]))
        return out

    def leave(self, msg: Leave, now_s: float, nonce: NonceRecord | None = None) -> LeaveResult:
        """Take the node out of routing now (state ``left``, or still ``banned``); its sessions drain
        on the node."""
        with self.engine.begin() as conn:
            state = conn.execute(select(Node.state).where(Node.id == msg.node_id)).scalar_one_or_none()
            if state is None:
                raise UnknownNode(f"node {msg.node_id} is not registered")
            self.db.consume_nonce(conn, nonce, now_s)
            # A banned node stays banned: leaving must not wipe the state its ban put it in.
            new_state = NODE_BANNED if state == NODE_BANNED else NODE_LEFT
            conn.execute(
                update(Node).where(Node.id == msg.node_id).values(state=new_state, last_seen_s=now_s)
            )
            conn.execute(
                update(Shard).where(Shard.node_id == msg.node_id).values(active_sessions=0, tokens_per_s=None)
            )
        return LeaveResult(known=True, was_live=state == NODE_LIVE)

    def expire(self, now_s: float, timeout_s: float) -> list[str]:
        """Mark live nodes silent for longer than ``timeout_s`` as expired; returns their ids."""
        cutoff = now_s - timeout_s
        waiting = (NODE_LIVE, NODE_CHALLENGING)  # a node silent during its challenge expires too
        with Session(self.engine) as s, s.begin():
            ids = list(s.scalars(select(Node.id).where(Node.state.in_(waiting), Node.last_seen_s < cutoff)))
            if ids:
                s.execute(
                    update(Node)
                    .where(Node.id.in_(ids), Node.state.in_(waiting), Node.last_seen_s < cutoff)
                    .values(state=NODE_EXPIRED)
                )
        return ids

    def _touch_gateway(self, s: Session, gateway_id: str, now_s: float) -> None:
        gw = s.get(Gateway, gateway_id)
        if gw is None:
            s.add(Gateway(id=gateway_id, first_seen_s=now_s, last_seen_s=now_s))
        else:
            gw.last_seen_s = now_s
        s.flush()

    def record_gateway_stats(
        self, g: GatewayStats, now_s: float, nonce: NonceRecord | None = None, *, speed_alpha: float = 0.3
    ) -> int:
        """Keep the report for the dashboard and fold its measured node speeds into the shards
        (EWMA with weight ``speed_alpha``); returns how many shards' observed speed changed."""
        try:
            return self._record_gateway_stats(g, now_s, nonce, speed_alpha)
        except IntegrityError:  # another replica inserted this gateway's first row concurrently
            return self._record_gateway_stats(g, now_s, nonce, speed_alpha)

    def _record_gateway_stats(
        self, g: GatewayStats, now_s: float, nonce: NonceRecord | None, speed_alpha: float
    ) -> int:
        with Session(self.engine) as s, s.begin():
            self.db.consume_nonce(s, nonce, now_s)
            self._touch_gateway(s, g.gateway_id, now_s)
            observed = self.trust.record_observed(s, g, now_s, speed_alpha)
            s.add(
                GatewayReport(
                    gateway_id=g.gateway_id,
                    at_s=now_s,
                    interval_s=g.interval_s,
                    sessions_active=g.sessions_active,
                    requests_queued=g.requests_queued,
                    requests=g.requests,
                    errors=g.errors,
                    prompt_tokens=g.prompt_tokens,
                    completion_tokens=g.completion_tokens,
                    ttft_p50_s=g.ttft_p50_s,
                    ttft_p95_s=g.ttft_p95_s,
                    routes=[{"route_id": r.route_id, "sessions": r.sessions} for r in g.routes],
                    url=g.url,
                )
            )
        return observed

    def record_usage(
        self,
        r: UsageReport,
        now_s: float,
        nonce: NonceRecord | None = None,
        *,
        envelope: dict[str, Any] | None = None,
        receipt: dict[str, Any] | None = None,
    ) -> UsageResult:
        """Ledger rows for the report's new (request, node) pairs; with ``envelope`` and ``receipt``
        the signed report and the tracker's countersignature are kept and linked to those rows."""
        try:
            return self._record_usage(r, now_s, nonce, envelope, receipt)
        except IntegrityError:
            # Another replica inserted this gateway, or the same request's rows (a retried report on
            # another replica), concurrently: the retry sees those rows and counts them as duplicates.
            return self._record_usage(r, now_s, nonce, envelope, receipt)

    def _record_usage(
        self,
        r: UsageReport,
        now_s: float,
        nonce: NonceRecord | None,
        envelope: dict[str, Any] | None,
        receipt: dict[str, Any] | None,
    ) -> UsageResult:
        with Session(self.engine) as s, s.begin():
            self.db.consume_nonce(s, nonce, now_s)
            gw = s.get(Gateway, r.gateway_id)
            if gw is None:
                s.add(Gateway(id=r.gateway_id, first_seen_s=now_s, last_seen_s=now_s))
            else:
                gw.last_seen_s = now_s
            s.flush()
            seen = set(
                s.scalars(
                    select(Usage.node_id).where(
                        Usage.gateway_id == r.gateway_id, Usage.request_id == r.request_id
                    )
                )
            )
            recorded = 0
            report_id: int | None = None
            if envelope is not None and receipt is not None and any(e.node_id not in seen for e in r.entries):
                row = UsageReportRow(
                    gateway_id=r.gateway_id,
                    request_id=r.request_id,
                    envelope=envelope,
                    receipt=receipt,
                    at_s=now_s,
                )
                s.add(row)
                s.flush()
                report_id = row.id
            for e in r.entries:
                if e.node_id in seen:
                    continue
                seen.add(e.node_id)
                s.add(
                    Usage(
                        request_id=r.request_id,
                        gateway_id=r.gateway_id,
                        node_id=e.node_id,
                        model_fingerprint=r.model_fingerprint,
                        tokens=e.tokens,
                        steps=e.steps,
                        at_s=now_s,
                        report_id=report_id,
                    )
                )
                recorded += 1
        return UsageResult(recorded=recorded, duplicates=len(r.entries) - recorded)

    # --- the model registry -------------------------------------------------------------------------

    def register_model(
        self, entry: dict[str, Any], replace: bool, now_s: float, nonce: NonceRecord | None
    ) -> bool:
        """Insert or update a registered model; returns True if it is new. A name bound to another
        fingerprint is a :class:`Conflict` unless ``replace`` (then that binding is dropped)."""
        with Session(self.engine) as s, s.begin():
            self.db.consume_nonce(s, nonce, now_s)
            other = s.scalars(
                select(RegisteredModel).where(
                    RegisteredModel.name == entry["name"], RegisteredModel.fingerprint != entry["fingerprint"]
                )
            ).first()
            if other is not None:
                if not replace:
                    raise Conflict(
                        f"the name {entry['name']!r} is registered to model {other.fingerprint}; "
                        "register with --replace to bind it to this one"
                    )
                s.delete(other)
                s.flush()
            row = s.get(RegisteredModel, entry["fingerprint"])
            created = row is None
            if row is None:
                row = RegisteredModel(fingerprint=entry["fingerprint"])
                s.add(row)
            for key, value in entry.items():
                setattr(row, key, value)
            row.registered_s = now_s
        return created

    def remove_registration(self, model: str, now_s: float, nonce: NonceRecord | None) -> str | None:
        """Drop the registration of a name or fingerprint; returns the fingerprint removed (None if none)."""
        with Session(self.engine) as s, s.begin():
            self.db.consume_nonce(s, nonce, now_s)
            row = (
                s.get(RegisteredModel, model)
                or s.scalars(select(RegisteredModel).where(RegisteredModel.name == model)).first()
            )
            if row is None:
                return None
            fingerprint = row.fingerprint
            s.delete(row)
        return fingerprint

    @staticmethod
    def _registered_json(r: RegisteredModel, *, manifest: bool) -> dict[str, Any]:
        import json

        out: dict[str, Any] = {
            "fingerprint": r.fingerprint,
            "name": r.name,
            "architecture": r.architecture,
            "n_layers": r.n_layers,
            "n_embd": r.n_embd,
            "file_size": r.file_size,
            "split_points": r.split_points,
            "sources": list(r.sources),
            "signer_id": r.signer_id,
            "registered_s": r.registered_s,
            "layer_bytes": list(r.layer_bytes),
            "first_extra_bytes": r.first_extra_bytes,
            "last_extra_bytes": r.last_extra_bytes,
        }
        if manifest:
            out["manifest"] = json.loads(r.manifest)
            out["registration"] = json.loads(r.registration)
        return out

    def registered_models(self, source: str | None = None, *, limit: int = 1000) -> list[dict[str, Any]]:
        """Registered models (without manifests), optionally those listing ``source`` (with manifests)."""
        with Session(self.engine) as s:
            rows = list(s.scalars(select(RegisteredModel).order_by(RegisteredModel.name).limit(limit)))
            if source is not None:
                return [self._registered_json(r, manifest=True) for r in rows if source in r.sources]
            return [self._registered_json(r, manifest=False) for r in rows]

    def registered_model(self, model: str) -> dict[str, Any] | None:
        """A registered model by fingerprint or name, with its manifest and signed registration."""
        with Session(self.engine) as s:
            row = (
                s.get(RegisteredModel, model)
                or s.scalars(select(RegisteredModel).where(RegisteredModel.name == model)).first()
            )
            return None if row is None else self._registered_json(row, manifest=True)

    # --- reads ----------------------------------------------------------------------------------

    def snapshot(
        self,
        now_s: float,
        timeout_s: float,
        *,
        default_latency_ms: float = 5.0,
        relay_penalty_ms: float = 10.0,
        probation_checks: int = 0,
        probation_penalty_ms: float = 0.0,
        observed_keep_s: float = 86_400.0,
        trusted_nodes: frozenset[str] = frozenset(),
    ) -> SwarmSnapshot:
        """Models and the shards of nodes that are live and heard from within ``timeout_s``.

        A shard's decode time is the larger of the node's claim and what registered gateways
        measured (when measured within ``observed_keep_s``): claiming to be fast gains nothing.
        A node with fewer than ``probation_checks`` passed spot checks is on probation, unless the
        operator lists it in ``trusted_nodes`` (trusted from its first announce)."""
        cutoff = now_s - timeout_s
        with Session(self.engine) as s:
            # Registered models carry what announces cannot: their split points and bytes per layer.
            registered = {
                r.fingerprint: ModelInfo(
                    fingerprint=r.fingerprint,
                    name=r.name,
                    n_layers=r.n_layers,
                    n_embd=r.n_embd,
                    architecture=r.architecture,
                    split_points=tuple(r.split_points) if r.split_points is not None else None,
                    layer_bytes=tuple(r.layer_bytes),
                    first_extra_bytes=r.first_extra_bytes,
                    last_extra_bytes=r.last_extra_bytes,
                )
                for r in s.scalars(select(RegisteredModel))
            }
            announced = {
                m.fingerprint: ModelInfo(
                    fingerprint=m.fingerprint,
                    name=m.name,
                    n_layers=m.n_layers,
                    n_embd=m.n_embd,
                    architecture=m.architecture,
                )
                for m in s.scalars(select(Model))
            }
            merged = {**announced, **registered}
            models = tuple(merged[fp] for fp in sorted(merged))
            rows = s.execute(
                select(
                    Shard.node_id,
                    Shard.model_fingerprint,
                    Shard.layer_start,
                    Shard.layer_end,
                    Shard.decode_ms_per_token,
                    Shard.prefill_tokens_per_s,
                    Shard.active_sessions,
                    Shard.max_sessions,
                    Shard.queue_depth,
                    Shard.kv_free_tokens,
                    Node.relay,
                    Node.addresses,
                    Node.relay_via,
                    Node.region,
                    Node.uplink_mbit_s,
                    Node.coord_x,
                    Node.coord_y,
                    Node.coord_z,
                    Node.coord_height_ms,
                    Node.coord_error,
                    Shard.observed_ms_per_token,
                    Shard.observed_at_s,
                    Reputation.checks_passed,
                    Node.tls_fingerprint,
                    ChallengeResult.outcome,
                    Shard.kv_pool_tokens,
                    Shard.kv_session_max_tokens,
                    Shard.kv_used_tokens,
                    ChallengeResult.route_recipe,
                    Shard.kv_preemptions,
                    Shard.kv_refusals,
                    Shard.prefix_heads,
                )
                .join(Node, Node.id == Shard.node_id)
                .outerjoin(Reputation, Reputation.node_id == Shard.node_id)
                .outerjoin(
                    ChallengeResult,
                    (ChallengeResult.node_id == Shard.node_id)
                    & (ChallengeResult.model_fingerprint == Shard.model_fingerprint),
                )
                .where(Node.state == NODE_LIVE, Node.last_seen_s >= cutoff)
                .order_by(Shard.node_id, Shard.model_fingerprint)
            ).all()
            gateway_coords = {
                g[0]: c
                for g in s.execute(
                    select(
                        Gateway.id,
                        Gateway.coord_x,
                        Gateway.coord_y,
                        Gateway.coord_z,
                        Gateway.coord_height_ms,
                        Gateway.coord_error,
                    )
                    .where(Gateway.coord_x.is_not(None), Gateway.last_seen_s >= now_s - GATEWAY_COORD_KEEP_S)
                    .order_by(Gateway.last_seen_s.desc())
                    .limit(MAX_GATEWAY_COORDS)
                )
                if (c := _coord(*g[1:])) is not None
            }
        fresh = now_s - observed_keep_s
        shards = tuple(
            ShardView(
                node_id=r[0],
                model_fingerprint=r[1],
                start=r[2],
                end=r[3],
                decode_ms_per_token=r[4] if r[20] is None or (r[21] or 0.0) < fresh else max(r[4], r[20]),
                prefill_tokens_per_s=r[5],
                active_sessions=r[6],
                max_sessions=r[7],
                queue_depth=r[8],
                kv_free_tokens=r[9],
                relayed=r[10],
                address=_route_address(r[10], r[11], r[12]),
                region=r[13],
                uplink_mbit_s=r[14],
                coord=_coord(r[15], r[16], r[17], r[18], r[19]),
                probation=r[0] not in trusted_nodes and (r[22] or 0) < probation_checks,
                tls_fingerprint=r[23] or "",
                trusted=probation_checks == 0
                or r[0] in trusted_nodes
                or (r[22] or 0) >= probation_checks
                or r[24] == "passed",
                kv_pool_tokens=r[25],
                kv_session_max_tokens=r[26],
                kv_used_tokens=r[27],
                recipe_fingerprint=r[28] or "",
                kv_preemptions=r[29],
                kv_refusals=r[30],
                prefix_heads=tuple((r[31] or "").split()),
                operator_trusted=r[0] in trusted_nodes,
            )
            for r in rows
        )
        # A hop to a node without a (trusted) coordinate costs a pessimistic typical latency.
        placed = [
            c for sh in shards if (c := sh.coord) is not None and c.error <= coordinates.UNTRUSTED_ERROR
        ]
        typical = coordinates.typical_one_way_ms(placed)
        return SwarmSnapshot(
            models=models,
            shards=shards,
            default_latency_ms=max(default_latency_ms, typical or 0.0),
            relay_penalty_ms=relay_penalty_ms,
            gateway_coords=gateway_coords,
            probation_penalty_ms=probation_penalty_ms,
            registered_names={m.name: fp for fp, m in registered.items()},
        )

    def node_rows(self, *, limit: int = 100_000, offset: int = 0) -> list[dict[str, Any]]:
        with Session(self.engine) as s:
            out = []
            for node, shard, passed, failed, banned_until in s.execute(
                select(
                    Node, Shard, Reputation.checks_passed, Reputation.checks_failed, Reputation.banned_until_s
                )
                .outerjoin(Shard, Shard.node_id == Node.id)
                .outerjoin(Reputation, Reputation.node_id == Node.id)
                .order_by(Node.id)
                .limit(limit)
                .offset(offset)
            ).all():
                out.append(
                    {
                        "node_id": node.id,
                        "state": node.state,
                        "addresses": node.addresses,
                        "relay": node.relay,
                        "relay_via": node.relay_via,
                        "hardware": node.hardware,
                        "software_version": node.software_version,
                        "region": node.region,
                        "uplink_mbit_s": node.uplink_mbit_s,
                        "coordinate": _coord_json(_coord_of(node)),
                        "first_seen_s": node.first_seen_s,
                        "last_seen_s": node.last_seen_s,
                        "checks_passed": int(passed or 0),
                        "checks_failed": int(failed or 0),
                        "banned_until_s": banned_until,
                        "shard": None
                        if shard is None
                        else {
                            "model_fingerprint": shard.model_fingerprint,
                            "start": shard.layer_start,
                            "end": shard.layer_end,
                            "decode_ms_per_token": shard.decode_ms_per_token,
                            "prefill_tokens_per_s": shard.prefill_tokens_per_s,
                            "active_sessions": shard.active_sessions,
                            "max_sessions": shard.max_sessions,
                            "queue_depth": shard.queue_depth,
                            "kv_free_tokens": shard.kv_free_tokens,
                            "kv_used_tokens": shard.kv_used_tokens,
                            "kv_pool_tokens": shard.kv_pool_tokens,
                            "kv_session_max_tokens": shard.kv_session_max_tokens,
                            "kv_preemptions": shard.kv_preemptions,
                            "kv_refusals": shard.kv_refusals,
                            # Heads of the KV prefixes it keeps, as its last heartbeat reported them.
                            "prefix_heads": (shard.prefix_heads or "").split(),
                            "tokens_per_s": shard.tokens_per_s,
                            "tokens_served_total": shard.tokens_served_total,
                            "updated_s": shard.updated_s,
                            "observed_ms_per_token": shard.observed_ms_per_token,
                        },
                    }
                )
        return out

    def node_state_counts(self) -> dict[str, int]:
        with Session(self.engine) as s:
            return {state: n for state, n in s.execute(select(Node.state, func.count()).group_by(Node.state))}

    def usage_totals(self) -> dict[str, tuple[int, int]]:
        """Per node id: (tokens, steps) over the whole ledger."""
        with Session(self.engine) as s:
            return {
                node: (int(t or 0), int(st or 0))
                for node, t, st in s.execute(
                    select(Usage.node_id, func.sum(Usage.tokens), func.sum(Usage.steps)).group_by(
                        Usage.node_id
                    )
                )
            }

    def table_counts(self, *, operations: bool = False) -> dict[str, int]:
        """Row counts per registry table, plus ``nonces`` and ``gateway_reports`` with ``operations``
        (tests use it to check refused requests wrote nothing)."""
        tables: tuple[Any, ...] = (Model, Gateway, Node, Shard, Usage)
        if operations:
            tables += (
                Nonce,
                GatewayReport,
                Reputation,
                TrustEvidence,
                BannedHost,
                ChallengeResult,
                UsageReportRow,
            )
        with Session(self.engine) as s:
            return {t.__tablename__: s.scalar(select(func.count()).select_from(t)) or 0 for t in tables}

    # --- replicas and periodic work ---------------------------------------------------------------

    def touch_replica(self, replica_id: str, tracker_id: str, url: str, now_s: float) -> None:
        with Session(self.engine) as s, s.begin():
            row = s.get(Replica, replica_id)
            if row is None:
                s.add(
                    Replica(id=replica_id, tracker_id=tracker_id, url=url, started_s=now_s, last_seen_s=now_s)
                )
            else:
                row.last_seen_s = now_s
                row.url = url

    def replicas(self, now_s: float, live_within_s: float) -> list[dict[str, Any]]:
        with Session(self.engine) as s:
            rows = s.scalars(
                select(Replica)
                .where(Replica.last_seen_s >= now_s - live_within_s)
                .order_by(Replica.started_s)
            )
            return [
                {
                    "replica_id": r.id,
                    "tracker_id": r.tracker_id,
                    "url": r.url,
                    "started_s": r.started_s,
                    "last_seen_s": r.last_seen_s,
                }
                for r in rows
            ]

    def drop_replica(self, replica_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(Replica).where(Replica.id == replica_id))

    def claim_task(self, name: str, holder: str, now_s: float, interval_s: float) -> bool:
        """True for exactly one replica per ``interval_s`` (the one that should run the task now).

        PostgreSQL: a transaction-scoped advisory lock first, so a replica never waits on
        another's claim, then a conditional update of the task's row (atomic in every
        database: of two concurrent claims one matches, the other sees the new time).
        SQLite serialises writers, so the conditional update alone is enough there."""
        with self.engine.begin() as conn:
            if self.db.dialect == "postgresql":
                key = zlib.crc32(f"swarm-tracker:{name}".encode()) & 0x7FFFFFFF
                if not conn.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": key}).scalar():
                    return False
            due = now_s - interval_s * 0.9  # replicas tick at slightly different moments
            claimed = conn.execute(
                update(PeriodicTask)
                .where(PeriodicTask.name == name, PeriodicTask.last_run_s <= due)
                .values(last_run_s=now_s, holder=holder)
            ).rowcount
            if claimed:
                return True
            inserted = conn.execute(
                self.db.insert_ignore(PeriodicTask)
                .values(name=name, last_run_s=now_s, holder=holder)
                .on_conflict_do_nothing(index_elements=["name"])
                .returning(PeriodicTask.name)
            ).first()
            return inserted is not None

    def purge(
        self,
        now_s: float,
        *,
        reports_keep_s: float,
        replicas_keep_s: float,
        claims_keep_s: float = 3600.0,
    ) -> dict[str, int]:
        """Delete expired nonces, old gateway reports, long-gone replicas and old RTT claims;
        returns rows deleted."""
        with self.engine.begin() as conn:
            claims = conn.execute(delete(RttClaim).where(RttClaim.at_s < now_s - claims_keep_s)).rowcount
            nonces = conn.execute(delete(Nonce).where(Nonce.expires_at_s < now_s)).rowcount
            reports = conn.execute(
                delete(GatewayReport).where(GatewayReport.at_s < now_s - reports_keep_s)
            ).rowcount
            replicas = conn.execute(
                delete(Replica).where(Replica.last_seen_s < now_s - replicas_keep_s)
            ).rowcount
        return {"nonces": nonces, "gateway_reports": reports, "replicas": replicas, "rtt_claims": claims}

    def prune(self, now_s: float, *, after_s: float, batch_max: int) -> dict[str, int]:
        """Delete at most ``batch_max`` nodes that expired, left or failed their challenge and have
        been silent for ``after_s``, with their shards, RTT claims and failed challenge results, then
        the announced models no shard and no registration uses any more, and gateways silent as long
        with no ledger rows; returns rows deleted.

        Kept: banned nodes (their ban is their row's state; reputations and bans live in tables
        of their own anyway), the usage ledger (accounting outlives nodes), passed challenge results
        (reference digests), and registered models. One bounded transaction per call, so a junk
        flood is worked off over several rounds without one long lock."""
        gone = (NODE_EXPIRED, NODE_LEFT, NODE_CHALLENGE_FAILED)
        with self.engine.begin() as conn:
            ids = list(
                conn.execute(
                    select(Node.id)
                    .where(Node.state.in_(gone), Node.last_seen_s < now_s - after_s)
                    .order_by(Node.last_seen_s)
                    .limit(batch_max)
                ).scalars()
            )
            counts = {"nodes": 0, "shards": 0, "rtt_claims": 0, "challenge_results": 0, "models": 0}
            if ids:
                counts["shards"] = conn.execute(delete(Shard).where(Shard.node_id.in_(ids))).rowcount
                counts["rtt_claims"] = conn.execute(
                    delete(RttClaim).where(RttClaim.reporter_id.in_(ids) | RttClaim.peer_id.in_(ids))
                ).rowcount
                counts["challenge_results"] = conn.execute(
                    delete(ChallengeResult).where(
                        ChallengeResult.node_id.in_(ids), ChallengeResult.outcome != "passed"
                    )
                ).rowcount
                counts["nodes"] = conn.execute(
                    delete(Node).where(Node.id.in_(ids), Node.state.in_(gone))
                ).rowcount
            unused = (
                select(Model.fingerprint)
                .where(
                    ~select(Shard.id).where(Shard.model_fingerprint == Model.fingerprint).exists(),
                    ~select(RegisteredModel.fingerprint)
                    .where(RegisteredModel.fingerprint == Model.fingerprint)
                    .exists(),
                    Model.first_seen_s < now_s - after_s,
                )
                .limit(batch_max)
            )
            fingerprints = list(conn.execute(unused).scalars())
            if fingerprints:
                counts["models"] = conn.execute(
                    delete(Model).where(Model.fingerprint.in_(fingerprints))
                ).rowcount
            # Gateways (any key, while registered_gateways is empty) silent as long, with nothing in
            # the ledger: their statistics reports go with them.
            idle = list(
                conn.execute(
                    select(Gateway.id)
                    .where(
                        Gateway.last_seen_s < now_s - after_s,
                        ~select(Usage.id).where(Usage.gateway_id == Gateway.id).exists(),
                    )
                    .limit(batch_max)
                ).scalars()
            )
            counts["gateways"] = 0
            if idle:
                conn.execute(delete(GatewayReport).where(GatewayReport.gateway_id.in_(idle)))
                conn.execute(
                    delete(RttClaim).where(RttClaim.reporter_id.in_(idle) | RttClaim.peer_id.in_(idle))
                )
                counts["gateways"] = conn.execute(delete(Gateway).where(Gateway.id.in_(idle))).rowcount
        return counts

    # --- accounting -------------------------------------------------------------------------------

    def usage_summary(
        self,
        by: UsageGroup,
        since_s: float,
        until_s: float,
        *,
        node_id: str | None = None,
        model: str | None = None,
        gateway_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> dict[str, Any]:
        """Ledger totals per node, model or gateway over ``[since_s, until_s)``, largest first.

        Returns ``rows`` (at most ``limit``, from ``offset``), ``total_rows`` (groups in
        all) and ``totals`` over every group."""
        column = {"node": Usage.node_id, "model": Usage.model_fingerprint, "gateway": Usage.gateway_id}[by]
        where = [Usage.at_s >= since_s, Usage.at_s < until_s]
        if node_id:
            where.append(Usage.node_id == node_id)
        if model:
            where.append(Usage.model_fingerprint == model)
        if gateway_id:
            where.append(Usage.gateway_id == gateway_id)
        tokens = func.coalesce(func.sum(Usage.tokens), 0)
        with Session(self.engine) as s:
            rows = s.execute(
                select(
                    column,
                    tokens.label("tokens"),
                    func.coalesce(func.sum(Usage.steps), 0),
                    func.count(func.distinct(Usage.request_id)),
                    func.min(Usage.at_s),
                    func.max(Usage.at_s),
                )
                .where(*where)
                .group_by(column)
                .order_by(tokens.desc(), column)
                .limit(limit)
                .offset(offset)
            ).all()
            total_rows = s.execute(select(func.count(func.distinct(column))).where(*where)).scalar_one()
            t_tokens, t_steps, t_requests = s.execute(
                select(
                    func.coalesce(func.sum(Usage.tokens), 0),
                    func.coalesce(func.sum(Usage.steps), 0),
                    func.count(func.distinct(Usage.request_id)),
                ).where(*where)
            ).one()
        return {
            "rows": [
                {
                    "key": r[0],
                    "tokens": int(r[1]),
                    "steps": int(r[2]),
                    "requests": int(r[3]),
                    "first_s": r[4],
                    "last_s": r[5],
                }
                for r in rows
            ],
            "total_rows": int(total_rows),
            "totals": {"tokens": int(t_tokens), "steps": int(t_steps), "requests": int(t_requests)},
        }

    def node_contribution(self, node_id: str, now_s: float, windows_s: dict[str, float]) -> dict[str, Any]:
        """One node's ledger totals over each named window (and all time), per model, and what its
        own heartbeats reported."""
        out: dict[str, Any] = {}
        with Session(self.engine) as s:
            for name, window in {**windows_s, "all_time": None}.items():
                where = [Usage.node_id == node_id]
                if window is not None:
                    where.append(Usage.at_s >= now_s - window)
                tokens, steps, requests = s.execute(
                    select(
                        func.coalesce(func.sum(Usage.tokens), 0),
                        func.coalesce(func.sum(Usage.steps), 0),
                        func.count(func.distinct(Usage.request_id)),
                    ).where(*where)
                ).one()
                out[name] = {"tokens": int(tokens), "steps": int(steps), "requests": int(requests)}
            served = s.execute(
                select(func.coalesce(func.sum(Shard.tokens_served_total), 0)).where(Shard.node_id == node_id)
            ).scalar_one()
            node = s.get(Node, node_id)
        out["heartbeat_tokens_served_total"] = int(served)
        out["registered"] = node is not None
        out["state"] = node.state if node is not None else None
        out["first_seen_s"] = node.first_seen_s if node is not None else None
        return out

    def recent_usage(self, since_s: float, *, limit: int = 20_000) -> list[tuple[str, str, str, int]]:
        """``(gateway_id, request_id, node_id, tokens)`` of ledger rows since ``since_s`` (newest first)."""
        with Session(self.engine) as s:
            return [
                (r[0], r[1], r[2], int(r[3]))
                for r in s.execute(
                    select(Usage.gateway_id, Usage.request_id, Usage.node_id, Usage.tokens)
                    .where(Usage.at_s >= since_s)
                    .order_by(Usage.at_s.desc())
                    .limit(limit)
                )
            ]

    def gateway_reports(self, since_s: float, *, limit: int = 50_000) -> list[dict[str, Any]]:
        with Session(self.engine) as s:
            rows = s.scalars(
                select(GatewayReport)
                .where(GatewayReport.at_s >= since_s)
                .order_by(GatewayReport.at_s.desc())
                .limit(limit)
            ).all()
            return [
                {
                    "gateway_id": r.gateway_id,
                    "at_s": r.at_s,
                    "interval_s": r.interval_s,
                    "sessions_active": r.sessions_active,
                    "requests_queued": r.requests_queued,
                    "requests": r.requests,
                    "errors": r.errors,
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens,
                    "ttft_p50_s": r.ttft_p50_s,
                    "ttft_p95_s": r.ttft_p95_s,
                    "routes": r.routes,
                    "url": r.url,
                }
                for r in reversed(rows)
            ]
