"""The registry's storage: synchronous SQLAlchemy, one short transaction per operation.

This is the SQLAlchemy adapter: the only module that talks to the database. It
is synchronous on purpose; :class:`tracker.service.Registry` calls it through
``trio.to_thread.run_sync`` with a limiter (1 thread for SQLite, a few for
PostgreSQL). Every write validates first and commits once, so a refused
request leaves the database untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, event, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from proto.announce import Announce, Heartbeat, UsageReport
from tracker.errors import Conflict, UnknownNode
from tracker.migrate import upgrade_if_needed
from tracker.models import NODE_EXPIRED, NODE_LIVE, Gateway, Model, Node, Shard, Usage
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            if ":memory:" not in url and url not in ("sqlite://", "sqlite:///"):
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


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


class Store:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def upgrade(self) -> tuple[str | None, str | None]:
        return upgrade_if_needed(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # --- writes ---------------------------------------------------------------------------------

    def announce(self, a: Announce, now_s: float) -> AnnounceResult:
        try:
            return self._announce(a, now_s)
        except IntegrityError:
            # Another tracker replica inserted the same node or model concurrently: retry as an update.
            return self._announce(a, now_s)

    def _announce(self, a: Announce, now_s: float) -> AnnounceResult:
        with Session(self.engine) as s, s.begin():
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
            node.last_seen_s = now_s
            node.state = NODE_LIVE
            s.flush()
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
            shard.updated_s = now_s
        return AnnounceResult(created=created, restored=restored)

    def heartbeat(self, h: Heartbeat, now_s: float) -> bool:
        """Record load; returns True when the node was expired and is now restored.

        Core statements rather than the ORM: this is the hottest write path.
        """
        with self.engine.begin() as conn:
            state = conn.execute(select(Node.state).where(Node.id == h.node_id)).scalar_one_or_none()
            if state is None:
                raise UnknownNode(f"node {h.node_id} is not registered: announce first")
            conn.execute(update(Node).where(Node.id == h.node_id).values(last_seen_s=now_s, state=NODE_LIVE))
            conn.execute(
                update(Shard)
                .where(Shard.node_id == h.node_id)
                .values(
                    active_sessions=h.active_sessions,
                    queue_depth=h.queue_depth,
                    kv_free_tokens=h.kv_free_tokens,
                    tokens_served_total=Shard.tokens_served_total + h.tokens_served,
                    updated_s=now_s,
                )
            )
        return state != NODE_LIVE

    def expire(self, now_s: float, timeout_s: float) -> list[str]:
        """Mark live nodes silent for longer than ``timeout_s`` as expired; returns their ids."""
        cutoff = now_s - timeout_s
        with Session(self.engine) as s, s.begin():
            ids = list(s.scalars(select(Node.id).where(Node.state == NODE_LIVE, Node.last_seen_s < cutoff)))
            if ids:
                s.execute(
                    update(Node).where(Node.id.in_(ids), Node.last_seen_s < cutoff).values(state=NODE_EXPIRED)
                )
        return ids

    def record_usage(self, r: UsageReport, now_s: float) -> UsageResult:
        with Session(self.engine) as s, s.begin():
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
                    )
                )
                recorded += 1
        return UsageResult(recorded=recorded, duplicates=len(r.entries) - recorded)

    # --- reads ----------------------------------------------------------------------------------

    def snapshot(
        self,
        now_s: float,
        timeout_s: float,
        *,
        default_latency_ms: float = 5.0,
        relay_penalty_ms: float = 10.0,
    ) -> SwarmSnapshot:
        """Models and the shards of nodes that are live and heard from within ``timeout_s``."""
        cutoff = now_s - timeout_s
        with Session(self.engine) as s:
            models = tuple(
                ModelInfo(
                    fingerprint=m.fingerprint,
                    name=m.name,
                    n_layers=m.n_layers,
                    n_embd=m.n_embd,
                    architecture=m.architecture,
                )
                for m in s.scalars(select(Model).order_by(Model.fingerprint))
            )
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
                )
                .join(Node, Node.id == Shard.node_id)
                .where(Node.state == NODE_LIVE, Node.last_seen_s >= cutoff)
                .order_by(Shard.node_id, Shard.model_fingerprint)
            ).all()
        shards = tuple(
            ShardView(
                node_id=r[0],
                model_fingerprint=r[1],
                start=r[2],
                end=r[3],
                decode_ms_per_token=r[4],
                prefill_tokens_per_s=r[5],
                active_sessions=r[6],
                max_sessions=r[7],
                queue_depth=r[8],
                kv_free_tokens=r[9],
                relayed=r[10],
                address=_route_address(r[10], r[11], r[12]),
            )
            for r in rows
        )
        return SwarmSnapshot(
            models=models,
            shards=shards,
            default_latency_ms=default_latency_ms,
            relay_penalty_ms=relay_penalty_ms,
        )

    def node_rows(self) -> list[dict[str, Any]]:
        with Session(self.engine) as s:
            out = []
            for node, shard in s.execute(
                select(Node, Shard).outerjoin(Shard, Shard.node_id == Node.id).order_by(Node.id)
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
                        "first_seen_s": node.first_seen_s,
                        "last_seen_s": node.last_seen_s,
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
                            "tokens_served_total": shard.tokens_served_total,
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

    def table_counts(self) -> dict[str, int]:
        """Row counts per table (tests use it to check refused requests wrote nothing)."""
        with Session(self.engine) as s:
            return {
                t.__tablename__: s.scalar(select(func.count()).select_from(t)) or 0
                for t in (Model, Gateway, Node, Shard, Usage)
            }
