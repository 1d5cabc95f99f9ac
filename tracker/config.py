"""The tracker's one configuration object.

Precedence, lowest to highest: defaults < TOML file (``--config`` or
``SWARM_TRACKER_CONFIG``) < environment (``SWARM_TRACKER_<FIELD>``) < command
line flags. Unknown keys in the file and unknown ``SWARM_TRACKER_*`` variables
are errors, so a typo never silently falls back to a default. Every field says
what it is and carries its unit in its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import LOG_LEVELS, ConfigError, knobs, load_layered

ENV_PREFIX = "SWARM_TRACKER_"
TLS_CERT_FILE = "tracker-tls.crt"  # the self-signed certificate's files in data_dir (tls_self_signed)
TLS_KEY_FILE = "tracker-tls.key"
UNREGISTERED_NAME_POLICIES = ("trusted", "any")


_listen = knobs("Listening and TLS")
_storage = knobs("Storage and housekeeping")
_nodes = knobs("Node liveness")
_limits = knobs("Request limits")
_registry = knobs("Model registry")
_routing = knobs("Routing")
_rebalance = knobs("Rebalancing")
_dashboard = knobs("Dashboard")
_trust = knobs("Trust and challenges")
_process = knobs("Process")


@dataclass(frozen=True)
class TrackerConfig:
    host: str = _listen("0.0.0.0", "interface to listen on")
    port: int = _listen(7460, "TCP port to listen on; 0 picks a free one (see port_file)")
    data_dir: str = _storage(
        "~/.swarm/tracker", "directory for the tracker key and the default SQLite database"
    )
    key_file: str = _storage(
        "", "the tracker's signing key; empty = <data_dir>/tracker.key (replicas must share one key)"
    )
    public_url: str = _listen(
        "", "this replica's URL as others reach it (shown on the dashboard); empty = the bound address"
    )
    db_url: str = _storage("", "SQLAlchemy URL; empty = sqlite:///<data_dir>/tracker.sqlite3")
    port_file: str = _listen("", "if set, the bound port is written here once the server listens")
    tls_cert_file: str = _listen(
        "",
        "PEM certificate (chain) to serve HTTPS with (then HTTPS only); nodes and gateways pin its sha256 "
        "(tracker_tls_fingerprint) or verify it against a CA; empty = plain HTTP, or see tls_self_signed",
    )
    tls_key_file: str = _listen("", "PEM private key of tls_cert_file (mode 0600)")
    tls_self_signed: bool = _listen(
        False,
        "serve HTTPS with a self-signed certificate made on first start in data_dir (tracker-tls.crt, "
        "tracker-tls.key) and kept; its fingerprint is printed then and by `swarm-tracker tls-fingerprint`",
    )
    heartbeat_interval_s: float = _nodes(10.0, "how often nodes are told to heartbeat")
    heartbeat_timeout_s: float = _nodes(30.0, "a node silent this long expires and leaves routing")
    expiry_check_interval_s: float = _nodes(2.0, "how often the tracker looks for silent nodes")
    signature_skew_s: float = _limits(
        60.0, "accepted clock difference for signed messages; also the nonce memory"
    )
    nonce_cache_max_entries: int = _limits(
        200_000, "bound on nonces remembered in memory; when full, signed requests get 503"
    )
    nonces_per_key_max: int = _limits(
        1000,
        "bound on unexpired nonces per signing key, in memory and in the shared table; over it that key "
        "alone is refused (429 in memory, 503 from the shared table)",
    )
    address_reads_per_s: float = _limits(
        50.0, "unauthenticated requests (GET, route requests) per second per source address; 0 = no limit"
    )
    address_reads_burst: int = _limits(200, "unauthenticated requests a source address may send at once")
    address_writes_per_s: float = _limits(
        100.0, "signed messages (announces, heartbeats, reports) per second per source address; 0 = no limit"
    )
    address_writes_burst: int = _limits(500, "signed messages a source address may send at once")
    key_messages_per_s: float = _limits(
        20.0,
        "signed messages per second per signing key (registered gateways exempt); 0 = no limit",
    )
    key_messages_burst: int = _limits(200, "signed messages one key may send at once")
    rate_limit_max_identities: int = _limits(
        100_000, "addresses and keys each rate-limit table remembers (the least recently seen go first)"
    )
    db_timeout_s: float = _storage(
        15.0, "longest a request waits for one database call (queue included); then 503 storage_unavailable"
    )
    prune_after_s: float = _storage(
        3600.0, "expired, departed or failed nodes silent this long are deleted, with models left unused"
    )
    prune_batch_max: int = _storage(
        500, "most nodes deleted per pruning round (each round also prunes models)"
    )
    prune_interval_s: float = _storage(10.0, "how often long-dead nodes and unused models are pruned (once)")
    list_max_rows: int = _limits(1000, "largest page of GET /v1/models and of the nodes in GET /v1/swarm")
    max_body_bytes: int = _limits(64 * 1024, "largest accepted request body; larger gets 413")
    registry_max_body_bytes: int = _limits(
        16 * 1024 * 1024, "largest model registration (with its manifest) accepted; larger gets 413"
    )
    registry_keys: str = _registry(
        "",
        "public keys (64 hex, commas) besides the tracker's own that may register and remove models",
    )
    route_ticket_ttl_s: float = _routing(300.0, "lifetime of a route ticket")
    max_routes_k: int = _routing(16, "largest k a route request may ask for")
    snapshot_ttl_s: float = _routing(1.0, "how stale the cached routing snapshot may be (load figures only)")
    default_latency_ms: float = _routing(5.0, "assumed one-way latency between two nodes")
    relay_penalty_ms: float = _routing(10.0, "extra cost of a hop through a gateway relay")
    rtt_claim_ttl_s: float = _routing(600.0, "how long a reported round trip counts for network coordinates")
    rtt_probe_hints: int = _routing(2, "random peers each heartbeat answer asks a node to measure (0 = none)")
    rtt_probe_back_max: int = _routing(
        6, "peers that measured a node it is asked to measure back, per answer"
    )
    rebalance_min_gain: float = _rebalance(
        0.25,
        "rebalancing hysteresis: a node moves only if the layers it leaves stay this much richer "
        "(capacity per demand) than the layers it joins",
    )
    rebalance_min_holders: int = _rebalance(
        2, "rebalancing never moves a node off a layer that would then have fewer holders than this"
    )
    rebalance_pending_s: float = _rebalance(
        300.0, "how long an advised move counts as under way (the swarm is judged as if it were done)"
    )
    demand_half_life_s: float = _rebalance(
        300.0, "a model's demand (its route look-ups) halves after this long, for rebalancing"
    )
    db_threads: int = _storage(0, "worker threads for the database; 0 = 1 for SQLite, 4 otherwise")
    zeroconf: bool = _listen(True, "advertise _swarm-tracker._tcp.local. on the LAN")
    replica_heartbeat_interval_s: float = _storage(5.0, "how often this replica records itself as alive")
    purge_interval_s: float = _storage(60.0, "how often expired nonces and old reports are deleted (once)")
    reports_keep_s: float = _storage(86_400.0, "how long gateway statistics are kept for the dashboard")
    dashboard: bool = _dashboard(True, "serve the swarm dashboard at / and its event stream")
    dashboard_push_interval_s: float = _dashboard(
        1.0, "how often the dashboard's event stream sends the state"
    )
    dashboard_series_window_s: float = _dashboard(900.0, "how much history the dashboard's plots show")
    dashboard_max_clients: int = _dashboard(64, "most dashboard event streams open at once; more get 503")
    usage_query_max_rows: int = _limits(1000, "largest page of the accounting API")
    registered_gateways: str = _trust(
        "",
        "hex public keys of the gateways allowed to report usage, statistics, spot checks and "
        "evidence (comma or space separated); empty = any gateway (private swarms only)",
    )
    trusted_nodes: str = _trust(
        "",
        "hex public keys (node ids) of the operator's own nodes (comma or space separated): never on "
        "probation, reference answers for the join challenge and holders that move an unregistered "
        "name from their first announce; still banned by conclusive evidence",
    )
    probation_checks: int = _trust(3, "spot checks a node must pass before it is off probation")
    probation_penalty_ms: float = _trust(
        1000.0, "routing cost added to a node on probation (trusted nodes first, probation still used)"
    )
    ban_node_s: float = _trust(30 * 86_400.0, "how long a node caught lying stays banned (its key)")
    ban_host_s: float = _trust(
        86_400.0, "how long new keys from the hosts a liar announced from are refused; 0 = no host bans"
    )
    evidence_per_node_max: int = _trust(20, "evidence records kept per node (the oldest go first)")
    evidence_keep_s: float = _trust(90 * 86_400.0, "how long evidence and usage report receipts are kept")
    observed_speed_alpha: float = _routing(
        0.3, "weight of a gateway's new decode-time report in the observed speed (EWMA)"
    )
    observed_speed_keep_s: float = _routing(
        86_400.0, "a measured decode time older than this no longer counts for routing"
    )
    challenge_nodes: bool = _trust(
        True,
        "challenge every announced node (a known input through its span) before routing to it",
        off_aliases=("--no-challenges",),
    )
    challenge_concurrency: int = _trust(2, "challenges running at once")
    challenge_queue_max: int = _trust(1000, "challenges waiting at most; more wait for the periodic sweep")
    challenge_timeout_s: float = _trust(
        60.0, "longest one challenge attempt may take (connect, OPEN, PREFILL)"
    )
    challenge_info_timeout_s: float = _trust(
        10.0, "longest a challenged node may take to answer Info (a dead or tarpit address fails fast)"
    )
    challenge_attempts: int = _trust(3, "attempts before a node that does not answer counts as failed")
    challenge_tokens: int = _trust(8, "positions in the challenge input")
    allow_plaintext_nodes: bool = _trust(
        False,
        "challenge nodes that announce no TLS certificate over plaintext gRPC (else they fail the "
        "challenge); nodes that announce one are always dialled over TLS pinned to it",
    )
    unregistered_names: str = _registry(
        "trusted",
        "what an unregistered model name resolves to: trusted (the fingerprint most trusted nodes "
        "serve under it; fresh keys move nothing, and with no trusted holder the name resolves to "
        "nothing) | any (the most live shards, trusted or not: private swarms where every key is "
        "the operator's)",
        choices=UNREGISTERED_NAME_POLICIES,
    )
    log_level: str = _process("info", "debug, info, warning or error", choices=LOG_LEVELS)

    def resolved_data_dir(self) -> Path:
        return Path(self.data_dir).expanduser()

    @property
    def tls(self) -> bool:
        """Whether the tracker serves HTTPS (a certificate given, or its self-signed one)."""
        return bool(self.tls_cert_file) or self.tls_self_signed

    def resolved_tls_files(self) -> tuple[Path, Path]:
        """(certificate, key) it serves HTTPS with: the given pair, or the self-signed one in data_dir."""
        if self.tls_cert_file:
            return Path(self.tls_cert_file).expanduser(), Path(self.tls_key_file).expanduser()
        return self.resolved_data_dir() / TLS_CERT_FILE, self.resolved_data_dir() / TLS_KEY_FILE

    def registry_key_ids(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.registry_keys.split(",") if k.strip())

    def resolved_key_file(self) -> Path:
        return Path(self.key_file).expanduser() if self.key_file else self.resolved_data_dir() / "tracker.key"

    def resolved_db_url(self) -> str:
        return self.db_url or f"sqlite:///{self.resolved_data_dir() / 'tracker.sqlite3'}"

    def gateway_keys(self) -> frozenset[str]:
        """The registered gateways' public keys (empty: every gateway is accepted)."""
        keys = frozenset(k for k in self.registered_gateways.replace(",", " ").split() if k)
        for k in keys:
            if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
                raise ConfigError(f"registered_gateways: {k[:20]!r} is not a 64-character lowercase hex key")
        return keys

    def trusted_node_keys(self) -> frozenset[str]:
        """The operator's trusted nodes' public keys (their node ids; empty: none)."""
        keys = frozenset(k for k in self.trusted_nodes.replace(",", " ").split() if k)
        for k in keys:
            if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
                raise ConfigError(f"trusted_nodes: {k[:20]!r} is not a 64-character lowercase hex key")
        return keys

    def resolved_db_threads(self) -> int:
        if self.db_threads > 0:
            return self.db_threads
        return 1 if self.resolved_db_url().startswith("sqlite") else 4

    def validate(self) -> TrackerConfig:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
        if self.tls_cert_file and self.tls_self_signed:
            raise ConfigError("tls_self_signed makes a certificate: drop it or tls_cert_file/tls_key_file")
        for name in (
            "heartbeat_interval_s",
            "heartbeat_timeout_s",
            "expiry_check_interval_s",
            "signature_skew_s",
            "route_ticket_ttl_s",
            "replica_heartbeat_interval_s",
            "purge_interval_s",
            "reports_keep_s",
            "dashboard_push_interval_s",
            "dashboard_series_window_s",
            "rtt_claim_ttl_s",
            "ban_node_s",
            "evidence_keep_s",
            "observed_speed_keep_s",
            "challenge_timeout_s",
            "db_timeout_s",
            "challenge_info_timeout_s",
            "prune_after_s",
            "prune_interval_s",
            "rebalance_pending_s",
            "demand_half_life_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.heartbeat_timeout_s < self.heartbeat_interval_s:
            raise ConfigError("heartbeat_timeout_s must be at least heartbeat_interval_s")
        for name in (
            "nonce_cache_max_entries",
            "nonces_per_key_max",
            "max_body_bytes",
            "max_routes_k",
            "dashboard_max_clients",
            "usage_query_max_rows",
            "evidence_per_node_max",
            "challenge_concurrency",
            "challenge_queue_max",
            "challenge_attempts",
            "address_reads_burst",
            "address_writes_burst",
            "key_messages_burst",
            "rate_limit_max_identities",
            "prune_batch_max",
            "list_max_rows",
            "rebalance_min_holders",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if min(self.address_reads_per_s, self.address_writes_per_s, self.key_messages_per_s) < 0:
            raise ConfigError("address_reads_per_s, address_writes_per_s and key_messages_per_s must be >= 0")
        if not 0 <= self.rtt_probe_hints <= 16 or not 0 <= self.rtt_probe_back_max <= 32:
            raise ConfigError("rtt_probe_hints must be in 0..16 and rtt_probe_back_max in 0..32")
        if not 1 <= self.challenge_tokens <= 256:
            raise ConfigError("challenge_tokens must be in 1..256")
        if self.probation_checks < 0 or self.probation_penalty_ms < 0 or self.ban_host_s < 0:
            raise ConfigError("probation_checks, probation_penalty_ms and ban_host_s must be >= 0")
        if not 0.0 <= self.rebalance_min_gain <= 1000.0:
            raise ConfigError("rebalance_min_gain must be in 0..1000")
        if not 0.0 < self.observed_speed_alpha <= 1.0:
            raise ConfigError("observed_speed_alpha must be in (0, 1]")
        self.gateway_keys()  # raises on a malformed key
        self.trusted_node_keys()
        if self.registry_max_body_bytes < self.max_body_bytes:
            raise ConfigError("registry_max_body_bytes must be at least max_body_bytes")
        for k in self.registry_key_ids():
            if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
                raise ConfigError(f"registry_keys: {k!r} is not 64 lowercase hex characters")
        if self.snapshot_ttl_s < 0 or self.default_latency_ms < 0 or self.relay_penalty_ms < 0:
            raise ConfigError("snapshot_ttl_s, default_latency_ms and relay_penalty_ms must be >= 0")
        if self.unregistered_names not in UNREGISTERED_NAME_POLICIES:
            raise ConfigError(f"unregistered_names must be trusted or any, got {self.unregistered_names!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        return self


FIELDS = {f.name: f for f in dataclasses.fields(TrackerConfig)}


def load_config(
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> TrackerConfig:
    """Merge the layers; ``flags`` entries that are None mean "not given"."""
    return load_layered(
        TrackerConfig,
        section="tracker",
        env_prefix=ENV_PREFIX,
        file=file,
        env=env,
        flags=flags,
    )
