"""The node daemon's one configuration object.

Layers, lowest to highest: defaults < TOML file (``--config FILE`` or
``SWARM_NODE_CONFIG``; top-level keys or a single ``[node]`` table) <
environment ``SWARM_NODE_<FIELD>`` < command-line flags. An unknown key in the
file or an unknown ``SWARM_NODE_*`` variable is an error, so a typo never falls
back to a default silently. Each field documents itself (``NodeConfig.describe``)
and carries its unit in its name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import LOG_LEVELS, ConfigError, help_of, knobs, load_layered
from common.tls import (
    HttpTls,
    ServerCert,
    TlsError,
    is_fingerprint,
    load_or_create_server_cert,
    load_server_cert,
    pin_settings_problem,
)
from proto.codec import ISOLATED_SLICE_TOKENS

ENV_PREFIX = "SWARM_NODE_"


# How the shard's weights are loaded (common.llama.LOAD_MODES maps each to llama.cpp's load_mode).
LOAD_MODE_NAMES = ("read", "mmap", "direct")
KV_POOL_LAYOUTS = ("auto", "sparse", "resident", "unified")


_model = knobs("Model and shard")
_memory = knobs("Memory and KV")
_engine = knobs("Engine and batching")
_sessions = knobs("Sessions and streams")
_tracker = knobs("Tracker")
_listen = knobs("Listening and security")
_relay = knobs("Relay (behind NAT)")
_rebalance = knobs("Rebalancing")
_process = knobs("Process")


def _xdg(var: str, fallback: str, leaf: str) -> str:
    return str(Path(os.environ.get(var) or Path.home() / fallback) / leaf)


@dataclass(frozen=True)
class NodeConfig:
    model: str = _model(
        "",
        "the model (required for start): a whole-model GGUF path, an http(s) URL of one (only the shard's "
        "bytes are fetched), or a model name or fingerprint the tracker's registry knows",
    )
    manifest: str = _model(
        "", "with a URL model: its manifest (FILE or URL); empty = the registry or <url>.manifest.json"
    )
    peers: str = _model(
        "",
        "nodes (HOST:PORT, commas) to fetch the span's bytes from, besides the registry's peers",
        aliases=("--peer",),
        repeatable=True,
    )
    layers: str = _model(
        "auto", "layer range START:END to serve, or 'auto' (ask the tracker's recommend endpoint)"
    )
    capacity_layers: int = _model(
        0, "with layers=auto: most layers this node takes; 0 = as many as its memory holds (memory_limit_mb)"
    )
    memory_limit_mb: int = _memory(
        0,
        "most memory (MiB) this node uses in all; 0 = what the machine allows (available RAM, the cgroup's "
        "limit, RLIMIT_AS)",
    )
    memory_overhead_mb: int = _memory(
        200, "fixed memory (MiB) counted for the process itself besides weights, KV and compute buffers"
    )
    gpu_layers: str = _memory(
        "0",
        "layers of the shard to offload to the GPU: a number, 'all', or 'auto' (as many as fit in free "
        "device memory); 0 = none",
    )
    load_mode: str = _model(
        "read",
        "how the shard's weights are loaded: 'read' (into llama.cpp's buffers), 'mmap' (mapped: pages "
        "shared with other processes mapping the same file, but left resident beside the copy a CPU build "
        "repacks Q4_0/IQ4_NL weights into) or 'direct' (read past the page cache)",
        choices=LOAD_MODE_NAMES,
    )
    serve_span_bytes_per_s: int = _model(
        32 * 1024 * 1024,
        "most bytes per second this node sends to joining nodes fetching its span (0 = no limit, -1 = do not "
        "serve them)",
    )
    serve_span_streams: int = _model(4, "most span fetches served at once")
    fetch_stall_timeout_s: float = _model(60.0, "a model source that sends nothing this long is retried")
    fetch_slow_bytes_per_s: int = _model(
        1_000_000, "a source measured slower than this gives way to the others (peers); 0 = keep the order"
    )
    tracker_url: str = _tracker(
        "",
        "tracker base URL, or several replicas separated by commas (calls fail over between them);"
        " empty = discover it on the LAN with zeroconf",
        aliases=("--tracker",),
    )
    region: str = _tracker("", "free-form locality shown on the swarm dashboard, e.g. eu-west or home-lab")
    uplink_mbit_s: float = _tracker(
        0.0, "this machine's upload rate, announced so routes can price sending activations; 0 = unsaid"
    )
    rtt_probe_interval_s: float = _tracker(
        15.0, "how often peers are pinged for the tracker's network coordinates; 0 = never"
    )
    tracker_id: str = _tracker(
        "", "pinned tracker public key (64 hex); empty = learn it from the announce answer"
    )
    tracker_tls_fingerprint: str = _tracker(
        "",
        "with an https:// tracker: sha256 (64 hex; several: commas) of its TLS certificate to pin, "
        "checked on every connection (`swarm-tracker tls-fingerprint`); empty = verify it against "
        "tracker_ca_file or the system CAs",
    )
    tracker_ca_file: str = _tracker("", "with an https:// tracker: CA bundle (PEM) to verify it with")
    no_tracker: bool = _tracker(
        False, "serve without a tracker (tests, benchmarks); needs a pinned tracker_id or insecure_no_tickets"
    )
    insecure_no_tickets: bool = _listen(
        False, "accept OPEN without verifying the route ticket (local tests only)"
    )
    relay_url: str = _relay(
        "",
        "gateway to serve through when this node cannot accept connections (NAT): its http://host:port "
        "or ws://host:port/v1/relay; empty = direct gRPC only",
        aliases=("--relay",),
    )
    relay_tls_fingerprint: str = _relay(
        "",
        "with an https:// or wss:// relay_url: sha256 (64 hex) of the gateway's certificate to pin (the "
        "gateway logs it as gateway_tls); empty = verify the gateway against relay_ca_file or the system CAs",
    )
    relay_ca_file: str = _relay(
        "", "with an https:// or wss:// relay_url: CA bundle (PEM) to verify the gateway with"
    )
    relay_auto: bool = _relay(
        False, "with relay_url: use the relay only if the tracker cannot reach this node's gRPC port"
    )
    insecure_plaintext: bool = _listen(
        False,
        "serve gRPC without TLS and announce no certificate; also push to peers that announce none "
        "(loopback tests and benchmarks only: activations and tickets travel readable)",
    )
    tls_cert_file: str = _listen(
        "",
        "PEM certificate gRPC is served with (its sha256 is announced and pinned by every dialler); "
        "empty = node-tls.crt in data_dir, made on first start",
    )
    tls_key_file: str = _listen(
        "", "PEM private key of tls_cert_file (mode 0600); empty = node-tls.key in data_dir"
    )
    host: str = _listen("0.0.0.0", "interface the gRPC ShardService listens on")
    port: int = _listen(7470, "gRPC port; 0 picks a free one (see port_file)")
    advertise_host: str = _listen(
        "", "host name/IP announced to the tracker; empty = a local non-loopback IP"
    )
    port_file: str = _listen("", "write the bound gRPC port here once serving (for launchers)")
    admin_host: str = _listen("127.0.0.1", "interface of the admin HTTP server (/healthz, /metrics, /status)")
    admin_port: int = _listen(7471, "admin HTTP port; 0 picks a free one; -1 disables the admin server")
    admin_port_file: str = _listen("", "write the bound admin port here once serving")
    threads: int = _engine(0, "llama.cpp compute threads; 0 = the machine's physical cores")
    max_sessions: int = _memory(8, "most Route Sessions held at once (KV sequences)")
    session_kv_tokens: int = _memory(
        2048, "per-sequence layout (kv_pool_tokens = 0): KV positions one session may hold, reserved"
    )
    kv_pool_tokens: int = _memory(
        -1,
        "KV positions of one pool shared by every session (16-position blocks taken as sessions grow, "
        "nothing reserved at OPEN); -1 = sized from the memory left after the shard's weights; "
        "0 = the per-sequence layout (max_sessions x session_kv_tokens)",
    )
    max_session_kv_tokens: int = _memory(
        0, "with a pool: the most positions one session may grow to; 0 = the model's trained context"
    )
    kv_pool_layout: str = _memory(
        "auto",
        "with a pool: auto (sparse per-sequence streams where they apply, else resident streams of "
        "pool / max_sessions positions), sparse, resident, or unified (one shared stream: slower)",
        choices=KV_POOL_LAYOUTS,
    )
    max_preemptions: int = _memory(
        3, "with a pool: a session preempted this many times on this node is never preempted again"
    )
    batch_tokens: int = _engine(512, "most positions one engine batch takes (llama.cpp n_batch)")
    prefill_chunk_tokens: int = _engine(
        256, "most positions of one prefill step per batch, so decodes keep moving"
    )
    draft_model: str = _engine(
        "",
        "a GGUF path: as the last stage of a speculating session, draft with this model (its vocabulary "
        "must be the target's, checked at start; e.g. a lower-bit quantization of the target) instead "
        "of n-gram lookup; one llama.cpp thread, at most speculate_max_sessions sessions, 2048 positions "
        "each (longer histories draft by n-gram); empty = n-gram lookup only",
    )
    draft_model_choice: str = _engine(
        "always",
        "with draft_model: 'always' = the draft model drafts every window; 'auto' (experimental) = the "
        "node measures the tokens per second the draft model and n-gram lookup yield over its sessions' "
        "passes (8 each, then the faster for 64, then both again) and drafts with the faster",
        choices=("auto", "always"),
    )
    no_draft_lookahead: bool = _engine(
        False,
        "with draft_model: draft each window only when it is due; by default the drafting thread drafts "
        "the window after it while it travels (used when every draft is accepted)",
    )
    speculate_windows_in_flight: int = _engine(
        1,
        "as the last stage of a speculating session: most verify windows round the ring at once (1..4); "
        "above 1 the next window, drafted as if the ones before it are accepted, leaves before they "
        "come back, and a rejection discards it on every stage (docs/protocol.md, Windows in flight)",
    )
    max_queued_steps: int = _engine(64, "most steps waiting for the engine; more get RESOURCE_EXHAUSTED")
    max_frame_bytes: int = _engine(4 * 1024 * 1024, "largest frame accepted and sent (gRPC message limit)")
    idle_lease_s: float = _sessions(
        300.0, "a session without any frame this long is evicted and its KV freed"
    )
    reattach_window_s: float = _sessions(
        30.0, "a session whose stream ended without RELEASE waits this long for re-OPEN"
    )
    max_kept_sessions: int = _memory(
        4, "released sessions kept warm for a conversation's next turn (Release.keep_ms); 0: never"
    )
    max_kept_kv_tokens: int = _memory(
        8192,
        "per-sequence layout (kv_pool_tokens = 0): KV positions all kept sessions may hold together; "
        "with a pool, kept sessions are its evictable cache (evicted before any live session waits)",
    )
    max_keep_s: float = _memory(120.0, "longest a released session is kept warm, whatever the gateway asks")
    lease_check_interval_s: float = _sessions(1.0, "how often expired leases are looked for")
    stream_idle_timeout_s: float = _sessions(
        10.0, "a Session stream that opened no session and pushed no step is closed after this long"
    )
    max_idle_streams_per_address: int = _sessions(
        0,
        "most such unproven Session streams from one source address; one more closes the oldest "
        "(0 = twice max_sessions, at least 16: one gateway may open a stream per session at once)",
    )
    reply_buffer_bytes: int = _sessions(
        32 * 1024 * 1024, "most bytes of replies a stream's peer may leave unread before it loses the stream"
    )
    heartbeat_interval_s: float = _tracker(
        0.0, "0 = the interval the tracker asks for in its announce answer"
    )
    tracker_retry_s: float = _tracker(5.0, "wait between attempts when the tracker cannot be reached")
    rebalance_interval_s: float = _rebalance(
        0.0,
        "how often the node asks the tracker whether another span would serve the swarm better, and "
        "moves (drain, fetch, rejoin) when told to; 0 = never (the span chosen at start stays)",
    )
    pin_span: bool = _rebalance(
        False, "never move this node's span (it still answers the tracker's question)"
    )
    rebalance_models: str = _rebalance(
        "", "models (names or fingerprints, commas) besides its own this node may move to; empty = none"
    )
    rebalance_confirmations: int = _rebalance(
        2, "a move is made after the same advice this many times in a row"
    )
    rebalance_cooldown_s: float = _rebalance(
        600.0, "no move within this long of the node's start or its last move (hysteresis)"
    )
    rebalance_drain_s: float = _rebalance(
        60.0,
        "before a move, how long sessions may finish; the rest are handed back (the gateway replays "
        "them on another node)",
    )
    discovery_timeout_s: float = _tracker(3.0, "how long zeroconf discovery of the tracker may take")
    benchmark: bool = _engine(True, "measure prefill and decode speed of the shard at start-up")
    unmeasured_decode_ms: float = _engine(
        10.0, "with benchmark off: the per-token time announced instead of a measurement (tests)"
    )
    shutdown_grace_s: float = _process(5.0, "how long streams may drain on SIGINT/SIGTERM")
    data_dir: str = _process(
        "~/.swarm/node",
        "directory of the node key (node.key, mode 0600) and its TLS certificate (node-tls.*)",
    )
    cache_dir: str = _model(
        "", "shard files, fingerprints, compiled capture; empty = $XDG_CACHE_HOME/swarm-node"
    )
    log_level: str = _process("info", "debug, info, warning or error", choices=LOG_LEVELS)

    def resolved_model_path(self) -> Path:
        return Path(self.model).expanduser()

    def rebalance_model_list(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.rebalance_models.split(",") if m.strip())

    def peer_addresses(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.peers.split(",") if p.strip())

    def resolved_data_dir(self) -> Path:
        return Path(self.data_dir).expanduser()

    def server_cert(self) -> tuple[ServerCert | None, bool]:
        """The TLS certificate gRPC is served with (None: insecure_plaintext), and whether it was made now."""
        if self.insecure_plaintext:
            return None, False
        try:
            if self.tls_cert_file:
                cert = Path(self.tls_cert_file).expanduser()
                return load_server_cert(cert, Path(self.tls_key_file).expanduser()), False
            return load_or_create_server_cert(self.resolved_data_dir())
        except TlsError as err:
            raise ConfigError(str(err)) from err

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return Path(_xdg("XDG_CACHE_HOME", ".cache", "swarm-node"))

    def resolved_idle_streams_per_address(self) -> int:
        """The bound on one address's unproven Session streams: as configured, or (0) twice
        ``max_sessions``, at least 16 -- a gateway bursting a request per session opens that many
        streams within milliseconds, before the node has read their OPENs."""
        if self.max_idle_streams_per_address > 0:
            return self.max_idle_streams_per_address
        return max(16, 2 * self.max_sessions)

    def resolved_threads(self) -> int:
        if self.threads > 0:
            return self.threads
        try:
            import psutil

            return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)
        except ImportError:  # pragma: no cover - psutil is a declared dependency
            return max(1, os.cpu_count() or 1)

    def tracker_tls(self) -> HttpTls:
        """How an https:// tracker is trusted (tracker_tls_fingerprint, tracker_ca_file)."""
        return HttpTls.from_settings(self.tracker_tls_fingerprint, self.tracker_ca_file)

    def validate(self) -> NodeConfig:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not 1 <= self.speculate_windows_in_flight <= 4:
            raise ConfigError(
                f"speculate_windows_in_flight must be in 1..4, got {self.speculate_windows_in_flight}"
            )
        if self.draft_model and not Path(self.draft_model).expanduser().is_file():
            raise ConfigError(f"draft_model: no such file {self.draft_model}")
        if self.tracker_url:
            from common.config import parse_urls

            try:
                parse_urls(self.tracker_url, "tracker URL")
            except ValueError as err:
                raise ConfigError(f"tracker_url: {err}") from err
        if len(self.region) > 64:
            raise ConfigError("region must be at most 64 characters")
        if not -1 <= self.admin_port <= 65535:
            raise ConfigError(f"admin_port must be in -1..65535, got {self.admin_port}")
        for name in (
            "max_sessions",
            "session_kv_tokens",
            "batch_tokens",
            "prefill_chunk_tokens",
            "max_queued_steps",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.max_idle_streams_per_address < 0:
            raise ConfigError(
                "max_idle_streams_per_address must be >= 0 (0 = twice max_sessions, at least 16)"
            )
        if self.max_kept_sessions < 0 or self.max_kept_kv_tokens < 0 or self.max_keep_s < 0:
            raise ConfigError("max_kept_sessions, max_kept_kv_tokens and max_keep_s must be >= 0")
        if self.session_kv_tokens < 16:
            raise ConfigError("session_kv_tokens must be >= 16")
        if self.kv_pool_tokens not in (0, -1) and self.kv_pool_tokens < 256:
            raise ConfigError(
                f"kv_pool_tokens must be 0 (no pool), -1 (auto) or >= 256, got {self.kv_pool_tokens}"
            )
        if self.max_session_kv_tokens and self.max_session_kv_tokens < 16:
            raise ConfigError("max_session_kv_tokens must be 0 (the model's context) or >= 16")
        if self.kv_pool_layout not in KV_POOL_LAYOUTS:
            raise ConfigError(
                f"kv_pool_layout must be auto, sparse, resident or unified, got {self.kv_pool_layout!r}"
            )
        if self.max_preemptions < 0:
            raise ConfigError("max_preemptions must be >= 0")
        if self.batch_tokens < ISOLATED_SLICE_TOKENS:
            # An isolated step's slice must run as one llama.cpp ubatch on every node (node.batching).
            raise ConfigError(f"batch_tokens must be >= {ISOLATED_SLICE_TOKENS}")
        if self.max_frame_bytes < 64 * 1024:
            raise ConfigError("max_frame_bytes must be >= 65536")
        if self.reply_buffer_bytes < self.max_frame_bytes:
            raise ConfigError("reply_buffer_bytes must be >= max_frame_bytes")
        for name in (
            "idle_lease_s",
            "reattach_window_s",
            "lease_check_interval_s",
            "stream_idle_timeout_s",
            "tracker_retry_s",
            "discovery_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if not 0 < self.unmeasured_decode_ms <= 1e6:
            raise ConfigError("unmeasured_decode_ms must be in (0, 1000000]")
        if not 0 <= self.uplink_mbit_s <= 1_000_000 or self.rtt_probe_interval_s < 0:
            raise ConfigError("uplink_mbit_s must be in 0..1000000 and rtt_probe_interval_s >= 0")
        if self.heartbeat_interval_s < 0 or self.shutdown_grace_s < 0 or self.threads < 0:
            raise ConfigError("heartbeat_interval_s, shutdown_grace_s and threads must be >= 0")
        if self.capacity_layers < 0:
            raise ConfigError("capacity_layers must be >= 0")
        if min(self.rebalance_interval_s, self.rebalance_cooldown_s, self.rebalance_drain_s) < 0:
            raise ConfigError("rebalance_interval_s, rebalance_cooldown_s and rebalance_drain_s must be >= 0")
        if not 1 <= self.rebalance_confirmations <= 100:
            raise ConfigError("rebalance_confirmations must be in 1..100")
        if len(self.rebalance_model_list()) > 16:
            raise ConfigError("rebalance_models: at most 16 models")
        if self.rebalance_interval_s > 0 and self.no_tracker:
            raise ConfigError("rebalance_interval_s asks the tracker: set it to 0 with no_tracker")
        if self.memory_limit_mb < 0 or self.memory_overhead_mb < 0:
            raise ConfigError("memory_limit_mb and memory_overhead_mb must be >= 0")
        if self.gpu_layers not in ("all", "auto") and not (
            self.gpu_layers.isdigit() and int(self.gpu_layers) >= 0
        ):
            raise ConfigError(f"gpu_layers must be a number >= 0, 'all' or 'auto', got {self.gpu_layers!r}")
        if self.load_mode not in LOAD_MODE_NAMES:
            names = ", ".join(LOAD_MODE_NAMES)
            raise ConfigError(f"load_mode must be one of {names}, got {self.load_mode!r}")
        if self.serve_span_bytes_per_s < -1 or self.serve_span_streams < 1:
            raise ConfigError("serve_span_bytes_per_s must be >= -1 and serve_span_streams >= 1")
        if self.fetch_stall_timeout_s <= 0 or self.fetch_slow_bytes_per_s < 0:
            raise ConfigError("fetch_stall_timeout_s must be > 0 and fetch_slow_bytes_per_s >= 0")
        for peer in self.peer_addresses():
            if ":" not in peer:
                raise ConfigError(f"peers: {peer!r} is not HOST:PORT")
        if self.tracker_id and (
            len(self.tracker_id) != 64 or any(c not in "0123456789abcdef" for c in self.tracker_id)
        ):
            raise ConfigError("tracker_id must be 64 lowercase hex characters")
        if self.no_tracker and not self.insecure_no_tickets and not self.tracker_id:
            raise ConfigError(
                "no_tracker needs a pinned tracker_id or insecure_no_tickets: tickets are verified"
            )
        if self.no_tracker and self.layers == "auto":
            raise ConfigError("layers=auto asks the tracker; give START:END with no_tracker")
        problem = pin_settings_problem(
            "tracker", self.tracker_url, self.tracker_tls_fingerprint, self.tracker_ca_file
        )
        if problem:
            raise ConfigError(problem)
        if self.relay_tls_fingerprint and not is_fingerprint(self.relay_tls_fingerprint):
            raise ConfigError("relay_tls_fingerprint must be 64 lowercase hex characters")
        if (self.relay_tls_fingerprint or self.relay_ca_file) and not self.relay_url.startswith(
            ("https://", "wss://")
        ):
            raise ConfigError("relay_tls_fingerprint and relay_ca_file need an https:// or wss:// relay_url")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
        if self.insecure_plaintext and self.tls_cert_file:
            raise ConfigError("insecure_plaintext serves no TLS: drop tls_cert_file/tls_key_file or it")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        return self

    @staticmethod
    def describe() -> dict[str, str]:
        return {f.name: help_of(f) for f in dataclasses.fields(NodeConfig)}


FIELDS = {f.name: f for f in dataclasses.fields(NodeConfig)}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def load_config(
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Merge the layers; a flag whose value is None was not given."""
    return load_layered(NodeConfig, section="node", env_prefix=ENV_PREFIX, file=file, env=env, flags=flags)
