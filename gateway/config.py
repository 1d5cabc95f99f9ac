"""The gateway's one configuration object.

Precedence, lowest to highest: defaults < TOML file (``--config`` or
``SWARM_GATEWAY_CONFIG``; top-level keys or one ``[gateway]`` table) <
environment (``SWARM_GATEWAY_<FIELD>``) < command-line flags. Unknown keys in
the file and unknown ``SWARM_GATEWAY_*`` variables are errors. Every field
says what it is and carries its unit in its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import LOG_LEVELS, ConfigError, knobs, load_layered
from common.tls import HttpTls, pin_settings_problem
from gateway.checks import CROSS_RECIPE_MARGIN_NATS

ENV_PREFIX = "SWARM_GATEWAY_"


BATCH_ISOLATION_MODES = ("auto", "off", "checked", "all")
UNCONFIRMED_ROUTES = ("serve", "refuse")
KV_ADMISSION_ORDERS = ("fifo", "fit", "shortest")  # gateway.admission.KV_ADMISSION_ORDERS
DATA_PLANES = ("push", "relay")
ACTIVATION_ENCODINGS = ("f32", "f16", "int8", "auto")
COMPACTION_POLICIES = ("drop_oldest", "summary")
SPECULATION_MODES = ("greedy", "all", "off")
# Architectures whose numbers for a row depend on what else shares its batch on llama.cpp's CPU
# kernels (tests/node/test_gemma3_real.py): with batch_isolation = auto every session of such a
# model is isolated, so the same request gives the same text under load.
BATCH_VARIANT_ARCHITECTURES = frozenset({"gemma3"})


_tracker = knobs("Tracker")
_http = knobs("HTTP API")
_admission = knobs("Admission and limits")
_keys = knobs("API keys")
_routing = knobs("Routes and nodes")
_plane = knobs("Data plane")
_checks = knobs("Spot checks")
_reuse = knobs("KV reuse and prefixes")
_history = knobs("Conversations and stored responses")
_process = knobs("Process")


@dataclass(frozen=True)
class GatewayConfig:
    tracker_url: str = _tracker(
        "",
        "tracker base URL, e.g. http://10.0.0.2:7460, or several replicas separated by commas (the gateway"
        " fails over between them); empty = discover on the LAN",
        aliases=("--tracker",),
    )
    tracker_id: str = _tracker(
        "",
        "the tracker's public key (64 hex: `swarm-tracker id`, or tracker_id in its /healthz); every route"
        " ticket must be signed with it and the gateway dials only the hops and certificate pins a valid"
        " ticket lists; empty = the key learned on a first use before (<data_dir>/tracker.id), else see"
        " trust_tracker_on_first_use, else the gateway does not start",
    )
    tracker_tls_fingerprint: str = _tracker(
        "",
        "with an https:// tracker: sha256 (64 hex; several: commas) of its TLS certificate to pin, "
        "checked on every connection before anything is sent (`swarm-tracker tls-fingerprint`); "
        "empty = verify it against tracker_ca_file or the system CAs",
    )
    tracker_ca_file: str = _tracker("", "with an https:// tracker: CA bundle (PEM) to verify it with")
    trust_tracker_on_first_use: bool = _tracker(
        False,
        "with no tracker_id and none learned before: take the key the tracker's /healthz names at the first"
        " route look-up and keep it in <data_dir>/tracker.id (whoever is between gateway and tracker at that"
        " moment could name their own)",
    )
    host: str = _http("127.0.0.1", "interface the OpenAI API listens on")
    port: int = _http(8000, "TCP port of the OpenAI API; 0 picks a free one (see port_file)")
    port_file: str = _http("", "if set, the bound port is written here once the server listens")
    max_sessions: int = _admission(16, "Route Sessions running at once; more requests wait in the queue")
    max_queue: int = _admission(32, "requests waiting for a session slot; more get 503")
    max_sessions_per_client: int = _admission(
        0, "running plus queued requests per client (API key, else address); 0 = no limit; more get 429"
    )
    queue_timeout_s: float = _admission(30.0, "longest wait for a session slot before 503")
    kv_wait_s: float = _admission(
        60.0,
        "longest wait for KV room: a request that fits the swarm's contexts but not its free KV now, or a"
        " preempted session waiting to resume; then 503 kv_exhausted",
    )
    max_kv_waiters: int = _admission(
        32, "requests and preempted sessions waiting for KV room at once; more get 503"
    )
    kv_retry_s: float = _admission(
        1.0,
        "while waiting for KV room, the first in line tries again this often (at once when a session of"
        " this gateway ends)",
    )
    kv_admission: str = _admission(
        "shortest",
        "in which order requests waiting for KV room go: fifo (first come; nobody passes the first in "
        "line) | fit (the first in line that fits the room this gateway believes free) | shortest (of "
        "those that fit, the one needing the fewest positions: prompt plus max_tokens); fit and "
        "shortest are bounded by kv_admission_max_bypass and kv_admission_max_wait_s "
        "(docs/concurrency.md, the KV wait)",
        choices=KV_ADMISSION_ORDERS,
    )
    kv_admission_max_bypass: int = _admission(
        8,
        "a request waiting for KV room that later ones went before this many times goes first, and "
        "nobody after it goes until it has (0 = no bound by count)",
    )
    kv_admission_max_wait_s: float = _admission(
        0.0,
        "a request that waited this long for KV room goes first, and nobody after it goes until it has "
        "(0 = no bound by time: the default, since under a slow burst every waiter passes any such bound "
        "and the order becomes fifo; kv_admission_max_bypass bounds bypasses whatever the speed)",
    )
    kv_heartbeat_lag_s: float = _admission(
        15.0,
        "how much older than the tracker's answer a node's announced free KV may be (its heartbeat "
        "interval and some): KV this gateway committed since then is taken off the figure",
    )
    exact_resume: bool = _plane(
        True,
        "a session resumed after a preemption or moved to another route re-prefills its generated tokens one"
        " position per step, as their decode steps computed them, so the text stays bit-exact (llama.cpp's"
        " results may depend on how positions are batched); false: in prefill chunks (faster, may differ at"
        " a near-tie)",
    )
    max_preemptions: int = _admission(
        4, "times one request may be preempted by a node (its KV freed for an older session) and resumed"
    )
    api_keys_file: str = _keys(
        "",
        "API keys (SHA-256 of each, one JSON object per line; swarm-gateway keys add/list/revoke); "
        "empty = <data_dir>/api-keys.jsonl; no file or no key = every request is anonymous",
    )
    allow_anonymous: bool = _keys(
        True,
        "with keys in the key file: whether requests without a key are served (as anonymous)",
        off_aliases=("--no-anonymous",),
    )
    anonymous_max_tokens: int = _keys(
        1024, "completion tokens per anonymous request (also its default max_tokens); 0 = no cap"
    )
    anonymous_tokens_per_minute: int = _keys(
        0, "prompt + completion tokens per minute per anonymous client address; 0 = no limit"
    )
    client_stall_s: float = _admission(
        30.0,
        "a streaming client that takes nothing of its response for this long loses its session (every "
        "stage frees its KV); also each connection's TCP_USER_TIMEOUT (Linux: unacknowledged data that "
        "long closes it)",
    )
    client_send_buffer_bytes: int = _admission(
        64 * 1024,
        "kernel send buffer per client connection (SO_SNDBUF), so a client that stops reading is noticed "
        "after a bounded amount of output; 0 = the system's autotuning",
    )
    routes_k: int = _routing(2, "data-parallel routes asked of the tracker per model")
    route_ttl_s: float = _routing(10.0, "how long cached routes are used before asking the tracker again")
    node_info_ttl_s: float = _routing(30.0, "how long a node's Info (recipe, limits) is cached")
    prefill_step_tokens: int = _plane(
        256, "prompt positions per prefill step (capped by each node's max_step_tokens)"
    )
    max_request_bytes: int = _http(1024 * 1024, "largest request body; larger gets 413")
    max_frame_bytes: int = _plane(4 * 1024 * 1024, "largest frame accepted from a node")
    data_plane: str = _plane(
        "push",
        "push: stages send hidden states to the next stage directly and the last one sends the next "
        "decode step to the first; relay: every hop goes through this gateway",
        choices=DATA_PLANES,
    )
    allow_plaintext_nodes: bool = _routing(
        False,
        "dial nodes that announce no TLS certificate in plaintext (loopback tests, nodes older than TLS); "
        "off: such nodes are refused and routed around. Nodes that announce one are always pinned to it",
    )
    tls_cert_file: str = _http(
        "",
        "PEM certificate (chain) to serve HTTPS with: the OpenAI API and the relay (wss://) for nodes "
        "behind NAT; empty = plain HTTP (put a TLS proxy in front on a network)",
    )
    tls_key_file: str = _http("", "PEM private key of tls_cert_file")
    tls_port: int = _http(
        -1,
        "with tls_cert_file: -1 = port serves HTTPS only; else HTTPS on this port (0 picks a free one, "
        "see tls_port_file) while port stays plain HTTP (loopback clients beside nodes dialling wss://)",
    )
    tls_port_file: str = _http("", "if set, the bound HTTPS port (tls_port) is written here once listening")
    activation_encoding: str = _plane(
        "f32",
        "hidden states between stages: f32 (bit-exact), f16, int8 (int8 blocks), or auto (per hop, by the"
        " sending node's announced uplink; f16 and int8 are not bit-exact with the whole model)",
        choices=ACTIVATION_ENCODINGS,
    )
    auto_f32_min_mbit_s: float = _plane(
        400.0,
        "with activation_encoding=auto: hops at least this fast (or of unknown speed) use f32, slower ones"
        " f16 (or int8, below auto_int8_below_mbit_s)",
    )
    auto_int8_below_mbit_s: float = _plane(
        0.0, "with activation_encoding=auto: hops slower than this use int8 blocks instead of f16; 0 = never"
    )
    prefill_pipeline_steps: int = _plane(
        4, "prefill steps in flight at once, so stages work on different chunks (1: one after the other)"
    )
    recovery_history_bytes: int = _plane(
        64 * 1024 * 1024, "outputs each stage keeps per session so a replacement of the next can be replayed"
    )
    check_fraction: float = _checks(
        0.05,
        "share of requests also run on a second route and compared step by step (spot checks; "
        "requests touching a node on probation are always checked)",
    )
    check_judge_timeout_s: float = _checks(120.0, "longest wait for a third route to judge a disagreement")
    probation_checks: int = _checks(
        3,
        "spot checks a node must pass (seen by this gateway or the tracker) before its requests are "
        "sampled; 0: no probation here (the tracker's probation flag is ignored too)",
    )
    exclude_liars_s: float = _checks(86400.0, "how long this gateway avoids a node caught lying")
    cross_recipe_margin_nats: float = _checks(
        CROSS_RECIPE_MARGIN_NATS,
        "how far (natural log) two honest nodes of other recipes may put a token's logprob, and a "
        "differing greedy token from the top, before a check calls it a lie (calibrated: "
        "docs/security.md, Heterogeneity)",
    )
    unconfirmed_routes: str = _checks(
        "serve",
        "what a request gets where every route holds a node on probation that no other route can "
        "check: serve (run it unchecked, as in a swarm where nobody can check anybody yet) | refuse "
        "(503 unconfirmable with Retry-After: no output that was not confirmed)",
        choices=UNCONFIRMED_ROUTES,
    )
    batch_isolation: str = _checks(
        "auto",
        "which sessions every stage computes in batches of their own, so the same request gives the "
        "same numbers under any load and spot checks compare batch-invariant numbers: auto (every "
        "session of a model whose numbers depend on the batch, e.g. Gemma 3; none of the others) | "
        "off | checked (the runs of a check; nodes can then tell a check from other traffic) | all "
        "(every session; no batching across sessions)",
        choices=BATCH_ISOLATION_MODES,
    )
    speculation: str = _plane(
        "greedy",
        "speculative decoding (the last stage drafts by n-gram lookup and one pass through the route "
        "verifies a window of drafts; the text is unchanged): greedy (requests at temperature 0) | all "
        "(sampled requests too: each draw is seeded per position, so the text equals a plain run's "
        "with the same seed) | off. A request's extra_body 'speculation': true/false overrides it; "
        "grammar-constrained requests, spot-checked sessions and single-stage routes never speculate",
        choices=SPECULATION_MODES,
    )
    speculation_max_drafts: int = _plane(
        8, "most drafted tokens per window (1..15); each node caps it where its model stays exact"
    )
    open_timeout_s: float = _routing(
        2.0,
        "longest wait for every stage to acknowledge OPEN (a node answers it in milliseconds: a stopped "
        "or silent node costs a request no more than this before the route is replaced)",
    )
    dial_timeout_s: float = _routing(
        1.5,
        "longest wait for a node's first answer (Info) before its route is replaced: a dead address or "
        "one that accepts connections and never answers costs a request no more than this",
    )
    avoid_unreachable_s: float = _routing(
        60.0,
        "how long this gateway routes around a node that did not answer Info or OPEN in time (it also "
        "tells the tracker, which challenges the node again before routing to it)",
    )
    prefill_step_timeout_s: float = _plane(
        120.0,
        "ceiling of the deadline of one prefill step through every stage (it adapts to the measured "
        "prefill steps or the tracker's estimate, at least 15 s)",
    )
    decode_step_timeout_s: float = _plane(
        30.0,
        "ceiling of the decode deadline (it adapts to the measured step time, or before the first step "
        "to the tracker's estimate for the route; at least 3 s)",
    )
    tracker_timeout_s: float = _tracker(10.0, "longest wait for one tracker call")
    close_timeout_s: float = _plane(5.0, "longest wait for RELEASE/CANCEL replies when a session ends")
    report_usage: bool = _tracker(
        True,
        "report per-node token counts of each request to the tracker",
        off_aliases=("--no-usage-reports",),
    )
    usage_queue_max: int = _tracker(
        1024, "usage reports waiting to be sent; more are dropped (counted in metrics)"
    )
    discovery_timeout_s: float = _tracker(
        5.0, "how long to look for a tracker on the LAN when tracker_url is empty"
    )
    stats_interval_s: float = _tracker(
        5.0, "how often statistics (sessions, tokens, TTFT) go to the tracker's dashboard; 0 = never"
    )
    public_url: str = _tracker("", "this gateway's URL as clients reach it, shown on the swarm dashboard")
    rtt_probe_interval_s: float = _tracker(
        15.0, "how often the nodes of cached routes are pinged (reported with the statistics); 0 = never"
    )
    kv_keep_s: float = _reuse(
        30.0,
        "after a request its KV stays on the route this long, so the next turn of the conversation (or a "
        "request sharing its prefix, from the same client) prefills only what is new; 0 = off",
    )
    responses_store_max: int = _history(
        1000,
        "responses the Responses API keeps for previous_response_id and GET /v1/responses/{id} (all API"
        " keys together; the least recently used go first); 0 = keep none",
    )
    responses_store_ttl_s: float = _history(3600.0, "how long a kept response can be continued or read")
    responses_store_max_chars: int = _history(
        64_000_000, "the kept responses' conversations together, in JSON characters (least recent go first)"
    )
    conversation_ttl_s: float = _history(
        3600.0,
        "a conversation (conversation_id) idle this long is forgotten; its next turn must resend the history",
    )
    conversations_per_key: int = _history(
        64,
        "conversations one client (API key, else address) keeps; a new one evicts its least recently used",
    )
    conversations_max: int = _history(10_000, "conversations this gateway keeps in all")
    conversation_max_chars: int = _history(
        4_000_000, "characters of messages one conversation's history may hold (then conversation_full)"
    )
    conversation_compaction: str = _history(
        "drop_oldest",
        "when a conversation outgrows the context: drop_oldest (leave out the oldest exchanges after the "
        "system messages) or summary (the model summarizes them first; costs one extra generation)",
        choices=COMPACTION_POLICIES,
    )
    conversation_summary_tokens: int = _history(256, "most tokens of a compaction summary (policy summary)")
    prefix_min_tokens: int = _reuse(32, "shortest kept prefix worth reusing (tokens)")
    prefix_share_min_tokens: int = _reuse(
        256,
        "a request may start from another client's kept KV when their prompts agree on at least this many "
        "tokens (a chat app's system prompt); the nodes copy it. Another client can tell from timing that "
        "such a prefix was sent recently; 0 = never share across clients",
    )
    prefix_exact: bool = _reuse(
        False,
        "reuse only kept positions computed in whole prefill steps, so a warm request's output is "
        "bit-identical to a cold one's; false reuses every matching position (faster; low-order bits may "
        "differ, as with llama.cpp's cache_prompt)",
        off_aliases=("--prefix-inexact",),
    )
    prefix_route_slack: int = _reuse(
        2,
        "a request goes to the route that keeps its prefix unless that route carries this many more of "
        "this gateway's sessions than the least loaded one",
    )
    model_alias: str = _http(
        "",
        "extra model ids: ALIAS=MODEL[,ALIAS=MODEL...] (MODEL: a model's name, id or fingerprint); every "
        "model is also served under an id made from its name (lowercase, dashes)",
    )
    cors_origins: str = _http(
        "", "browser origins allowed to call the API (comma-separated, or *); empty = no CORS headers"
    )
    access_log: bool = _http(
        True, "one log line per request: status, tokens, time to first token, total time"
    )
    data_dir: str = _process("~/.swarm/gateway", "directory for the gateway key and the vocabulary cache")
    log_level: str = _process("info", "debug, info, warning or error", choices=LOG_LEVELS)

    def aliases(self) -> dict[str, str]:
        """``model_alias`` as {alias: model}."""
        out: dict[str, str] = {}
        for item in filter(None, (x.strip() for x in self.model_alias.split(","))):
            alias, sep, target = item.partition("=")
            if not sep or not alias.strip() or not target.strip():
                raise ValueError(f"expected ALIAS=MODEL, got {item!r}")
            out[alias.strip()] = target.strip()
        return out

    def isolates(self, checked: bool, architecture: str = "") -> bool:
        """Whether a session's stages compute it in batches of its own (``batch_isolation``): the
        primary, shadow and judge of a check always agree on it, so their digests compare bit for bit
        even for models whose numbers depend on the batch (docs/security.md, Limits). ``auto``:
        every session of a batch-variant ``architecture`` (:data:`BATCH_VARIANT_ARCHITECTURES`)."""
        if self.batch_isolation == "auto":
            return architecture in BATCH_VARIANT_ARCHITECTURES
        return self.batch_isolation == "all" or (self.batch_isolation == "checked" and checked)

    def speculation_drafts(
        self, temperature: float, override: bool | None, *, grammar: bool, checked: bool
    ) -> int:
        """Drafts per window for one session (0: no speculation); see ``speculation``."""
        if grammar or checked or self.speculation_max_drafts == 0:
            return 0
        wanted = self.speculation == "all" or (self.speculation == "greedy" and temperature <= 0.0)
        return self.speculation_max_drafts if (wanted if override is None else override) else 0

    def cors(self) -> tuple[str, ...]:
        return tuple(filter(None, (x.strip() for x in self.cors_origins.split(","))))

    def resolved_data_dir(self) -> Path:
        return Path(self.data_dir).expanduser()

    def tls_files(self) -> tuple[str, str]:
        """(certificate, key) paths for HTTPS, ``~`` expanded."""
        return str(Path(self.tls_cert_file).expanduser()), str(Path(self.tls_key_file).expanduser())

    def resolved_api_keys_file(self) -> Path:
        if self.api_keys_file:
            return Path(self.api_keys_file).expanduser()
        return self.resolved_data_dir() / "api-keys.jsonl"

    def tracker_tls(self) -> HttpTls:
        """How an https:// tracker is trusted (tracker_tls_fingerprint, tracker_ca_file)."""
        return HttpTls.from_settings(self.tracker_tls_fingerprint, self.tracker_ca_file)

    def validate(self) -> GatewayConfig:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
        if not -1 <= self.tls_port <= 65535 or (self.tls_port >= 0 and not self.tls_cert_file):
            raise ConfigError("tls_port must be -1..65535 and needs tls_cert_file")
        for name in (
            "max_sessions",
            "routes_k",
            "prefill_step_tokens",
            "max_request_bytes",
            "max_frame_bytes",
            "usage_queue_max",
            "prefill_pipeline_steps",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.max_frame_bytes < 128 * 1024:
            raise ConfigError("max_frame_bytes must be >= 131072 (frames of at least one hidden-state row)")
        for name in (
            "max_queue",
            "max_sessions_per_client",
            "max_kv_waiters",
            "kv_admission_max_bypass",
            "kv_admission_max_wait_s",
            "kv_heartbeat_lag_s",
            "max_preemptions",
            "anonymous_max_tokens",
            "anonymous_tokens_per_minute",
            "client_send_buffer_bytes",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        for name in (
            "queue_timeout_s",
            "kv_wait_s",
            "kv_retry_s",
            "route_ttl_s",
            "node_info_ttl_s",
            "open_timeout_s",
            "dial_timeout_s",
            "prefill_step_timeout_s",
            "decode_step_timeout_s",
            "tracker_timeout_s",
            "close_timeout_s",
            "discovery_timeout_s",
            "client_stall_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.tracker_id and (
            len(self.tracker_id) != 64 or any(c not in "0123456789abcdef" for c in self.tracker_id)
        ):
            raise ConfigError("tracker_id must be 64 lowercase hex characters")
        if self.tracker_url:
            from common.config import parse_urls

            try:
                parse_urls(self.tracker_url, "tracker URL")
            except ValueError as err:
                raise ConfigError(f"tracker_url: {err} (got {self.tracker_url!r})") from err
        problem = pin_settings_problem(
            "tracker", self.tracker_url, self.tracker_tls_fingerprint, self.tracker_ca_file
        )
        if problem:
            raise ConfigError(problem)
        if self.kv_keep_s < 0 or self.kv_keep_s > 600:
            raise ConfigError("kv_keep_s must be in [0, 600]")
        if (
            self.responses_store_max < 0
            or self.responses_store_ttl_s < 0
            or self.responses_store_max_chars < 0
        ):
            raise ConfigError(
                "responses_store_max, responses_store_ttl_s and responses_store_max_chars must be >= 0"
            )
        if self.conversation_ttl_s <= 0 or self.conversations_per_key < 1 or self.conversations_max < 1:
            raise ConfigError(
                "conversation_ttl_s must be > 0, conversations_per_key and conversations_max >= 1"
            )
        if self.conversation_max_chars < 1 or not 16 <= self.conversation_summary_tokens <= 4096:
            raise ConfigError(
                "conversation_max_chars must be >= 1, conversation_summary_tokens in [16, 4096]"
            )
        if self.conversation_compaction not in COMPACTION_POLICIES:
            raise ConfigError(
                "conversation_compaction must be drop_oldest or summary, "
                f"got {self.conversation_compaction!r}"
            )
        if self.prefix_share_min_tokens < 0:
            raise ConfigError("prefix_share_min_tokens must be >= 0")
        if self.prefix_min_tokens < 1 or self.prefix_route_slack < 0:
            raise ConfigError("prefix_min_tokens must be >= 1 and prefix_route_slack >= 0")
        try:
            self.aliases()
        except ValueError as err:
            raise ConfigError(f"model_alias: {err}") from err
        if self.stats_interval_s < 0:
            raise ConfigError("stats_interval_s must be >= 0")
        if self.rtt_probe_interval_s < 0:
            raise ConfigError("rtt_probe_interval_s must be >= 0")
        if self.data_plane not in DATA_PLANES:
            raise ConfigError(f"data_plane must be push or relay, got {self.data_plane!r}")
        if self.activation_encoding not in ACTIVATION_ENCODINGS:
            raise ConfigError(
                f"activation_encoding must be f32, f16, int8 or auto, got {self.activation_encoding!r}"
            )
        if not 0.0 <= self.auto_int8_below_mbit_s <= self.auto_f32_min_mbit_s:
            raise ConfigError("auto_int8_below_mbit_s must be in [0, auto_f32_min_mbit_s]")
        if not 0.0 <= self.check_fraction <= 1.0:
            raise ConfigError(f"check_fraction must be in [0, 1], got {self.check_fraction}")
        if self.probation_checks < 0:
            raise ConfigError("probation_checks must be >= 0")
        if self.batch_isolation not in BATCH_ISOLATION_MODES:
            raise ConfigError(
                f"batch_isolation must be one of {', '.join(BATCH_ISOLATION_MODES)}, "
                f"got {self.batch_isolation!r}"
            )
        if self.speculation not in SPECULATION_MODES:
            raise ConfigError(
                f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}"
            )
        if not 0 <= self.speculation_max_drafts <= 15:
            raise ConfigError(f"speculation_max_drafts must be in [0, 15], got {self.speculation_max_drafts}")
        if self.avoid_unreachable_s < 0:
            raise ConfigError("avoid_unreachable_s must be >= 0")
        if not 0.0 <= self.cross_recipe_margin_nats <= 20.0:
            raise ConfigError(
                f"cross_recipe_margin_nats must be in [0, 20], got {self.cross_recipe_margin_nats}"
            )
        if self.check_judge_timeout_s <= 0 or self.exclude_liars_s < 0:
            raise ConfigError("check_judge_timeout_s must be > 0 and exclude_liars_s >= 0")
        if self.recovery_history_bytes < 0:
            raise ConfigError("recovery_history_bytes must be >= 0")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        return self


FIELDS = {f.name: f for f in dataclasses.fields(GatewayConfig)}


def load_config(
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Merge the layers; ``flags`` entries that are None mean "not given"."""
    return load_layered(
        GatewayConfig,
        section="gateway",
        env_prefix=ENV_PREFIX,
        file=file,
        env=env,
        flags=flags,
    )
