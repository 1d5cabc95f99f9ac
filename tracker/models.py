"""SQLAlchemy table definitions for the tracker registry.

The schema is created and changed only by the alembic migrations in
``migrations/``; a test checks these models match the migrated schema exactly
(``alembic.autogenerate.compare_metadata`` finds no differences). Times are
UNIX seconds stored as double precision, so the injected clock and the database
agree without time-zone handling.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names, identical on SQLite and PostgreSQL, so migrations can refer to them.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

NODE_LIVE = "live"
NODE_EXPIRED = "expired"
NODE_LEFT = "left"  # said goodbye (signed leave): out of routing at once, back only by announcing
NODE_BANNED = "banned"  # caught lying (conclusive evidence): out of routing, its announces refused
NODE_CHALLENGING = "challenging"  # announced; not routable until the tracker's challenge answered
NODE_CHALLENGE_FAILED = "challenge_failed"  # answered the challenge wrongly (or not at all): out
NODE_STATES = (NODE_LIVE, NODE_EXPIRED, NODE_LEFT, NODE_BANNED, NODE_CHALLENGING, NODE_CHALLENGE_FAILED)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Model(Base):
    __tablename__ = "models"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    architecture: Mapped[str] = mapped_column(String(64))
    n_layers: Mapped[int] = mapped_column(Integer)
    n_embd: Mapped[int] = mapped_column(Integer)
    first_seen_s: Mapped[float] = mapped_column(Double)


class RegisteredModel(Base):
    """A model an operator registered (``swarm-tracker model add``): its manifest and where to fetch it.

    ``name`` is bound to one fingerprint (unique); the signed registration is kept as sent."""

    __tablename__ = "registered_models"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    architecture: Mapped[str] = mapped_column(String(64))
    n_layers: Mapped[int] = mapped_column(Integer)
    n_embd: Mapped[int] = mapped_column(Integer)
    file_size: Mapped[int] = mapped_column(BigInteger)
    split_points: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    layer_bytes: Mapped[list[int]] = mapped_column(JSON)
    first_extra_bytes: Mapped[int] = mapped_column(BigInteger)
    last_extra_bytes: Mapped[int] = mapped_column(BigInteger)
    sources: Mapped[list[str]] = mapped_column(JSON)
    manifest: Mapped[str] = mapped_column(Text)  # canonical JSON; sha256 of it is the fingerprint
    registration: Mapped[str] = mapped_column(Text)  # the signed envelope, as received
    signer_id: Mapped[str] = mapped_column(String(64))
    registered_s: Mapped[float] = mapped_column(Double)


class Gateway(Base):
    __tablename__ = "gateways"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex ed25519 public key
    first_seen_s: Mapped[float] = mapped_column(Double)
    last_seen_s: Mapped[float] = mapped_column(Double)
    # Network coordinate (tracker/coordinates.py); all NULL until the first RTT samples arrive.
    coord_x: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_y: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_z: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_height_ms: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_error: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_updated_s: Mapped[float | None] = mapped_column(Double, nullable=True)


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex ed25519 public key
    addresses: Mapped[list[str]] = mapped_column(JSON)
    relay: Mapped[bool] = mapped_column(Boolean)
    relay_via: Mapped[str | None] = mapped_column(String(200), nullable=True)
    hardware: Mapped[dict[str, Any]] = mapped_column(JSON)
    software_version: Mapped[str] = mapped_column(String(64))
    first_seen_s: Mapped[float] = mapped_column(Double)
    last_seen_s: Mapped[float] = mapped_column(Double)
    state: Mapped[str] = mapped_column(String(16), index=True)
    region: Mapped[str] = mapped_column(String(64), server_default="")
    uplink_mbit_s: Mapped[float | None] = mapped_column(Double, nullable=True)  # as announced
    # Network coordinate (tracker/coordinates.py); all NULL until the first RTT samples arrive.
    coord_x: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_y: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_z: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_height_ms: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_error: Mapped[float | None] = mapped_column(Double, nullable=True)
    coord_updated_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    # The address the last announce came from (host bans use it, with the announced addresses).
    announced_from: Mapped[str] = mapped_column(String(64), server_default="")
    # sha256 of the node's gRPC TLS certificate as announced ("" = plaintext): diallers pin it.
    tls_fingerprint: Mapped[str] = mapped_column(String(64), server_default="")


class Shard(Base):
    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("node_id", "model_fingerprint"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(String(64), ForeignKey("nodes.id", ondelete="CASCADE"))
    model_fingerprint: Mapped[str] = mapped_column(String(64), ForeignKey("models.fingerprint"), index=True)
    layer_start: Mapped[int] = mapped_column(Integer)
    layer_end: Mapped[int] = mapped_column(Integer)
    decode_ms_per_token: Mapped[float] = mapped_column(Double)
    prefill_tokens_per_s: Mapped[float] = mapped_column(Double)
    active_sessions: Mapped[int] = mapped_column(Integer)
    max_sessions: Mapped[int] = mapped_column(Integer)
    queue_depth: Mapped[int] = mapped_column(Integer)
    kv_free_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tokens_served_total: Mapped[int] = mapped_column(BigInteger)
    updated_s: Mapped[float] = mapped_column(Double)
    kv_used_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The node's KV pool size and the most positions one session may hold there, from its last
    # heartbeat (None: not reported, e.g. an older node).
    kv_pool_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    kv_session_max_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Since the node started, from its last heartbeat: sessions preempted to make room in its KV pool,
    # and steps refused because the pool had no room (None: not reported).
    kv_preemptions: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    kv_refusals: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # Heads of the KV block chains the node keeps (common/prefix_chain.py), space-separated, from its
    # last heartbeat (None: none reported); gateways match a prompt's heads against them.
    prefix_heads: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Positions per second between the last two heartbeats (None until two have arrived).
    tokens_per_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    # Decode time registered gateways measured (EWMA of their reports) and when it was last
    # reported; routing uses max(claim, observed) while the observation is fresh.
    observed_ms_per_token: Mapped[float | None] = mapped_column(Double, nullable=True)
    observed_at_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    # Most layers of this model the node's memory holds, as it announced (None = not said).
    capacity_layers: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Usage(Base):
    """The ledger: which node served how much of which request, as reported by a gateway."""

    __tablename__ = "usage"
    __table_args__ = (
        UniqueConstraint("gateway_id", "request_id", "node_id"),
        Index("ix_usage_node_id_at_s", "node_id", "at_s"),
        Index("ix_usage_at_s", "at_s"),
        Index("ix_usage_model_fingerprint_at_s", "model_fingerprint", "at_s"),
        Index("ix_usage_gateway_id_at_s", "gateway_id", "at_s"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128))
    gateway_id: Mapped[str] = mapped_column(String(64), ForeignKey("gateways.id"))
    node_id: Mapped[str] = mapped_column(String(64))
    model_fingerprint: Mapped[str] = mapped_column(String(64))
    tokens: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(BigInteger)
    at_s: Mapped[float] = mapped_column(Double)
    # The signed report this row came from (usage_reports.id); None for rows older than receipts.
    report_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Nonce(Base):
    """Replay protection shared by every tracker replica: one row per (signer, nonce) until it expires.

    A signed message's nonce is inserted in the same transaction as the write it
    authorises, so a replay is refused by whichever replica sees it; rows expire
    with the signature window and are purged by the periodic task."""

    __tablename__ = "nonces"

    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at_s: Mapped[float] = mapped_column(Double, index=True)


class Replica(Base):
    """A running ``swarm-tracker serve`` process on this database (its own liveness row)."""

    __tablename__ = "tracker_replicas"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # random per process
    tracker_id: Mapped[str] = mapped_column(String(64))  # the public key it signs tickets with
    url: Mapped[str] = mapped_column(String(255))
    started_s: Mapped[float] = mapped_column(Double)
    last_seen_s: Mapped[float] = mapped_column(Double)


class PeriodicTask(Base):
    """When each periodic task last ran, so that it runs once per period across all replicas."""

    __tablename__ = "tracker_tasks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_run_s: Mapped[float] = mapped_column(Double)
    holder: Mapped[str] = mapped_column(String(32))


class GatewayReport(Base):
    """A gateway's periodic statistics (proto.announce.GatewayStats), kept for the dashboard's series."""

    __tablename__ = "gateway_reports"
    __table_args__ = (Index("ix_gateway_reports_at_s", "at_s"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    gateway_id: Mapped[str] = mapped_column(String(64), ForeignKey("gateways.id", ondelete="CASCADE"))
    at_s: Mapped[float] = mapped_column(Double)
    interval_s: Mapped[float] = mapped_column(Double)
    sessions_active: Mapped[int] = mapped_column(Integer)
    requests_queued: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    ttft_p50_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    ttft_p95_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    routes: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    url: Mapped[str] = mapped_column(String(255))


class RttClaim(Base):
    """The latest round trip a node or gateway (``reporter_id``) reported to a peer.

    At most ``tracker.coordinates.MAX_CLAIMS_PER_REPORTER`` per reporter, none older
    than the tracker's ``rtt_claim_ttl_s`` (trimmed on every report and by the purge);
    the refit of an endpoint reads its own claims and the claims about it (the index
    on ``peer_id``). Ids are not foreign keys: a peer may be a node or a gateway."""

    __tablename__ = "rtt_claims"
    __table_args__ = (Index("ix_rtt_claims_peer_id_at_s", "peer_id", "at_s"),)

    reporter_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    peer_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    rtt_ms: Mapped[float] = mapped_column(Double)
    at_s: Mapped[float] = mapped_column(Double)


class UsageReportRow(Base):
    """A gateway's signed usage report as received, with the tracker's countersignature (receipt):
    the evidence behind ledger rows, which a node can fetch and check (``GET .../ledger``)."""

    __tablename__ = "usage_reports"
    __table_args__ = (Index("ix_usage_reports_gateway_id_request_id", "gateway_id", "request_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    gateway_id: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(128))
    envelope: Mapped[dict[str, Any]] = mapped_column(JSON)  # exactly as the gateway signed it
    receipt: Mapped[dict[str, Any]] = mapped_column(JSON)  # the tracker's signed receipt of it
    at_s: Mapped[float] = mapped_column(Double, index=True)


class Reputation(Base):
    """What the swarm has learnt about a node: spot checks passed and failed, a ban, its challenge.

    Keyed by node id without a foreign key: a ban outlives whatever happens to the node's row."""

    __tablename__ = "node_reputation"

    node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    checks_passed: Mapped[int] = mapped_column(BigInteger, server_default="0")
    checks_failed: Mapped[int] = mapped_column(BigInteger, server_default="0")
    banned_until_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    ban_reason: Mapped[str] = mapped_column(String(400), server_default="")
    updated_s: Mapped[float] = mapped_column(Double)


class TrustEvidence(Base):
    """A gateway's signed verdict about a node (bounded per node; the oldest go first)."""

    __tablename__ = "trust_evidence"
    __table_args__ = (Index("ix_trust_evidence_node_id_at_s", "node_id", "at_s"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(String(64))
    gateway_id: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(128))
    conclusive: Mapped[bool] = mapped_column(Boolean)
    at_s: Mapped[float] = mapped_column(Double, index=True)
    envelope: Mapped[dict[str, Any]] = mapped_column(JSON)  # exactly as the gateway signed it


class BannedHost(Base):
    """A host a node caught lying announced from: new keys from it are refused until ``until_s``."""

    __tablename__ = "banned_hosts"

    host: Mapped[str] = mapped_column(String(255), primary_key=True)
    since_s: Mapped[float] = mapped_column(Double)
    until_s: Mapped[float] = mapped_column(Double, index=True)
    reason: Mapped[str] = mapped_column(String(400))
    node_id: Mapped[str] = mapped_column(String(64))


class ChallengeResult(Base):
    """The tracker's challenge of a node's shard: the input it sent and the digest it got back.

    Digests of trusted nodes (off probation, not banned) with the same model, recipe, span and
    input are the reference a newcomer's digest is compared with."""

    __tablename__ = "challenge_results"
    __table_args__ = (
        Index(
            "ix_challenge_results_reference",
            "model_fingerprint",
            "recipe_fingerprint",
            "layer_start",
            "layer_end",
            "input_id",
        ),
    )

    node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    recipe_fingerprint: Mapped[str] = mapped_column(String(64))
    layer_start: Mapped[int] = mapped_column(Integer)
    layer_end: Mapped[int] = mapped_column(Integer)
    input_id: Mapped[str] = mapped_column(String(32))
    digest: Mapped[str] = mapped_column(String(64))  # hex; "" when the node gave no usable answer
    # recipe_fingerprint above is the *check* fingerprint (recipe + CPU features: who computes the
    # same bits); this is the recipe's own fingerprint (what the stages of one route must share).
    route_recipe: Mapped[str] = mapped_column(String(64), server_default="")
    outcome: Mapped[str] = mapped_column(String(24))  # passed, no_reference, mismatch, failed
    detail: Mapped[str] = mapped_column(String(400))
    at_s: Mapped[float] = mapped_column(Double)
