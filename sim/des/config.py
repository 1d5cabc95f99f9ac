"""Scenario files: the frozen configuration of one simulated run.

A scenario is a TOML file (parsed with the standard library's ``tomllib``)
whose tables map one-to-one onto the frozen dataclasses below. Every field
has a default, so a scenario names only what it changes; a key the schema
does not know is an error (:class:`ScenarioError`), never silently ignored,
so a typo cannot quietly fall back to a default.

Units are in the field names (``_s`` seconds, ``_ms`` milliseconds,
``_mbps`` megabits per second, ``_gb`` gigabytes, ``_mb`` megabytes).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ScenarioError(ValueError):
    """The scenario file is malformed: unknown key, wrong type or impossible value."""


@dataclass(frozen=True)
class RunConfig:
    name: str = "unnamed"
    description: str = ""
    seed: int = 1  # master seed; every random stream is derived from it
    duration_s: float = 300.0  # simulated time; requests still running then count as in flight
    sample_interval_s: float = 5.0  # time-series resolution (coverage, throughput, queue)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m"
    n_layers: int = 30
    n_embd: int = 576  # width of the residual stream: activation frames are n_tokens * n_embd * 2 bytes
    n_embd_kv: int = 192  # K/V width per token and layer (grouped-query attention); scales attention cost
    # Weights per layer (millions). 0 = estimate as 12 * n_embd^2 (a dense llama block).
    params_per_layer_m: float = 3.54
    # Memory one layer occupies on a node (weights, quantized). 0 = params * 4.5 bits (Q4_1).
    layer_mb: float = 0.0
    request_share: float = 1.0  # relative share of client requests for this model
    node_share: float = 1.0  # relative share of volunteers that serve this model

    @property
    def params_m(self) -> float:
        return self.params_per_layer_m or 12.0 * self.n_embd**2 / 1e6

    @property
    def layer_bytes(self) -> float:
        if self.layer_mb:
            return self.layer_mb * 1e6
        return self.params_m * 1e6 * 4.5 / 8


@dataclass(frozen=True)
class NetworkConfig:
    preset: str = "lan"  # region model: "lan", "continent" or "world" (see geography.py)
    # One-way last-mile latency added per node, drawn uniformly from [min, max].
    access_latency_ms_min: float = 0.05
    access_latency_ms_max: float = 0.3
    gateway_regions: tuple[str, ...] = ()  # one gateway per entry; empty = one in the first region
    gateway_bandwidth_mbps: float = 10_000.0  # gateways sit in data centres; not a bottleneck by default
    # Network coordinates (routing "tracker"): random peers a tracker asks each node to measure per
    # heartbeat, and the queueing noise of a measured round trip (true RTT times uniform [1, 1 + this]).
    rtt_probes_per_heartbeat: int = 2
    rtt_noise: float = 0.1


@dataclass(frozen=True)
class ProfileShare:
    profile: str = "cpu-1t"  # a name from hardware.PROFILES
    share: float = 1.0


@dataclass(frozen=True)
class NodesConfig:
    initial: int = 6  # volunteers present at the start
    bootstrap_s: float = 5.0  # initial volunteers join spread uniformly over [0, bootstrap_s)
    join_rate_per_s: float = 0.0  # later arrivals (Poisson)
    mean_uptime_s: float = 0.0  # 0 = nobody leaves; else exponential online time
    crash_fraction: float = 0.5  # leavers that crash; the rest leave gracefully (drain)
    failure_detect_s: float = 1.0  # time for the gateway to notice a crashed stage
    drain_timeout_s: float = 30.0  # a gracefully leaving node serves its sessions this long at most
    heartbeat_interval_s: float = 5.0  # how often load reaches the tracker's snapshot
    download_mbps: float = 0.0  # 0 = shards load instantly; else shard bytes / this before serving
    max_layers: int = 0  # cap on a node's shard length (0 = memory decides)
    profiles: tuple[ProfileShare, ...] = (ProfileShare(),)
    # Rebalancing (tracker.rebalance.advise): every this many seconds (0 = never) this many serving
    # nodes, drawn at random, ask whether to move; a node told to move drains, downloads its new span
    # (download_mbps) and serves it. Demand per model: the sessions its gateways hold or queue.
    rebalance_interval_s: float = 0.0
    rebalance_nodes_per_round: int = 8


@dataclass(frozen=True)
class Burst:
    start_s: float = 0.0
    duration_s: float = 0.0
    rate_per_s: float = 0.0  # added to the base rate during the burst
    model: str = ""  # the burst's requests all go to this model ("": split like the base rate)


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "poisson"  # "poisson" or "trace"
    start_s: float = 0.0  # no requests before this (lets a swarm form first); traces are shifted by it
    rate_per_s: float = 1.0
    trace_file: str = ""  # JSON lines {"t": s, "prompt_tokens": n, "output_tokens": n[, "model": name]}
    # Lengths are log-normal around the median, clipped to [1, max].
    prompt_tokens_median: float = 200.0
    prompt_tokens_sigma: float = 0.8
    prompt_tokens_max: int = 2048
    output_tokens_median: float = 100.0
    output_tokens_sigma: float = 0.7
    output_tokens_max: int = 1024
    bursts: tuple[Burst, ...] = ()


@dataclass(frozen=True)
class GatewayConfig:
    routes_k: int = 4  # data-parallel routes asked from the route selector per refresh
    max_queue: int = 1000  # requests waiting for a free route; beyond this they are refused
    admission_timeout_s: float = 60.0  # a waiting request gives up after this
    recovery_timeout_s: float = 60.0  # a session whose route cannot be repaired in this time fails
    recovery_retry_s: float = 2.0  # wait between attempts when no replacement exists
    route_refresh_min_s: float = 1.0  # least time between two route-pool refreshes of one gateway and model
    # New sessions avoid pooled routes the selector expects to be slower than this per token
    # (they wait instead). 0 = no bound. Recovery ignores it: a slow stage beats a failed session.
    max_route_ms_per_token: float = 0.0
    # A new session goes to the pooled route cheapest at its stages' current load, re-priced with the
    # tracker's cost model (tracker.routing.repriced_ms); false: the route's expected time per token
    # times (1 + its busiest stage's occupancy), as before.
    reprice_routes: bool = True
    prefill_chunk_tokens: int = 256
    step_token_budget: int = 512  # tokens one batch step of a node may hold (decode first)
    # "relay": every hop is gateway -> stage -> gateway; "push": stages send hidden states to the next
    # stage and the last one the sampled token to the gateway and, for the next step, to the first.
    data_plane: str = "relay"


@dataclass(frozen=True)
class PolicyConfig:
    placement: str = "tracker"  # "tracker" (tracker.placement.recommend_span) or "random"
    # "tracker": tracker.routing.select_routes with network coordinates (measured in the simulation)
    # and the asking gateway's position; "blind": the same function without coordinates (the
    # tracker before coordinates: every hop the same default latency); "nearest": the baseline.
    routing: str = "tracker"
    # The route cost's load terms (tracker.routing.RoutingCosts, docs/tracker.md "Route selection").
    batch_growth_per_session: float = 0.3  # a batch step's growth per session, in single-token times
    queue_wait_weight: float = 1.0  # the wait for a slot: this times u / (1 - u), in single-token times
    uplink_queue_share: float = 0.5  # a frame waits behind this share of the other sessions' frames
    occupancy_weight: float = 0.0  # a term linear in the occupancy (1 with the others 0: the model before)
    max_occupancy: float = 0.95  # the occupancy is capped here (< 1 with a queue wait)
    # How much the gateway -> first stage and last stage -> gateway legs count in a route's cost per
    # token (tracker.routing.RoutingCosts.gateway_leg_weight; 1: every token pays them).
    gateway_leg_weight: float = 1.0
    # Spreading (tracker.routing.RoutingCosts.recent_busy_ms): a node busy a share b of the recent
    # past costs b times this many ms more; "recent" is an exponential average of its busy share per
    # heartbeat interval with this half-life.
    recent_busy_ms: float = 0.0
    recent_busy_halflife_s: float = 60.0


@dataclass(frozen=True)
class Scenario:
    run: RunConfig = field(default_factory=RunConfig)
    models: tuple[ModelConfig, ...] = (ModelConfig(),)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    source_dir: str = ""  # directory of the scenario file (relative trace paths resolve here)


def load_scenario(path: str | Path, overrides: tuple[str, ...] = ()) -> Scenario:
    """Parse and validate a scenario file.

    ``overrides`` are ``table.key=VALUE`` strings (VALUE in TOML syntax, e.g.
    ``gateway.routes_k=8`` or ``network.gateway_regions=["europe"]``) applied
    to the file's tables before validation; arrays of tables cannot be addressed.
    """
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise ScenarioError(f"{p}: {err}") from err
    data = dict(data)
    for text in overrides:
        _apply_override(data, text)
    data["source_dir"] = str(p.resolve().parent)
    return parse_scenario(data)


def _apply_override(data: dict[str, Any], text: str) -> None:
    path, sep, raw = text.partition("=")
    keys = path.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise ScenarioError(f"override {text!r}: expected table.key=VALUE")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError as err:
        raise ScenarioError(f"override {text!r}: VALUE is not TOML: {err}") from err
    table = data
    for k in keys[:-1]:
        nxt = table.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ScenarioError(f"override {text!r}: {k!r} is not a table")
        table = nxt
    table[keys[-1]] = value


def parse_scenario(data: dict[str, Any]) -> Scenario:
    scenario: Scenario = _build(Scenario, data, "")
    _validate(scenario)
    return scenario


def with_policy(scenario: Scenario, placement: str | None = None, routing: str | None = None) -> Scenario:
    policy = dataclasses.replace(
        scenario.policy,
        placement=placement or scenario.policy.placement,
        routing=routing or scenario.policy.routing,
    )
    _validate_policy(policy)
    return dataclasses.replace(scenario, policy=policy)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ScenarioError(f"{where or 'scenario'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ScenarioError(
            f"{where or 'scenario'}: unknown key(s) {', '.join(unknown)}; known: {sorted(known)}"
        )
    kwargs = {
        name: _convert(hints[name], value, f"{where}.{name}" if where else name)
        for name, value in data.items()
    }
    return cls(**kwargs)


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ScenarioError(f"{where}: expected an array")
        return tuple(_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        raise ScenarioError(f"{where}: unsupported union type")  # pragma: no cover - schema has none
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ScenarioError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScenarioError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ScenarioError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ScenarioError(f"{where}: expected true/false, got {value!r}")
        return value
    raise ScenarioError(f"{where}: unsupported type {tp}")  # pragma: no cover


def _validate_policy(policy: PolicyConfig) -> None:
    if policy.placement not in ("tracker", "random"):
        raise ScenarioError(f"policy.placement must be 'tracker' or 'random', got {policy.placement!r}")
    if policy.routing not in ("tracker", "blind", "nearest"):
        raise ScenarioError(f"policy.routing must be 'tracker', 'blind' or 'nearest', got {policy.routing!r}")
    for name in (
        "batch_growth_per_session",
        "queue_wait_weight",
        "uplink_queue_share",
        "occupancy_weight",
        "gateway_leg_weight",
        "recent_busy_ms",
    ):
        if not getattr(policy, name) >= 0:
            raise ScenarioError(f"policy.{name} must be >= 0")
    if policy.queue_wait_weight and not 0 <= policy.max_occupancy < 1:
        raise ScenarioError("policy.max_occupancy must be in [0, 1) when policy.queue_wait_weight > 0")
    if not policy.recent_busy_halflife_s > 0:
        raise ScenarioError("policy.recent_busy_halflife_s must be > 0")


def _validate(s: Scenario) -> None:
    from sim.des.geography import PRESETS
    from sim.des.hardware import PROFILES

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ScenarioError(msg)

    need(s.run.duration_s > 0, "run.duration_s must be > 0")
    need(s.run.sample_interval_s > 0, "run.sample_interval_s must be > 0")
    need(len(s.models) >= 1, "at least one [[models]] entry is needed")
    names = [m.name for m in s.models]
    need(len(set(names)) == len(names), f"model names must be unique: {names}")
    for m in s.models:
        need(m.n_layers >= 1 and m.n_embd >= 1 and m.n_embd_kv >= 1, f"model {m.name}: sizes must be >= 1")
        need(m.request_share >= 0 and m.node_share >= 0, f"model {m.name}: shares must be >= 0")
    need(sum(m.node_share for m in s.models) > 0, "some model needs node_share > 0")
    need(s.network.preset in PRESETS, f"network.preset must be one of {sorted(PRESETS)}")
    regions = PRESETS[s.network.preset].regions
    for g in s.network.gateway_regions:
        need(g in regions, f"network.gateway_regions: {g!r} is not a region of preset {s.network.preset!r}")
    need(
        0 <= s.network.access_latency_ms_min <= s.network.access_latency_ms_max,
        "network: need 0 <= access_latency_ms_min <= access_latency_ms_max",
    )
    need(s.nodes.initial >= 0, "nodes.initial must be >= 0")
    need(0.0 <= s.nodes.crash_fraction <= 1.0, "nodes.crash_fraction must be in [0, 1]")
    need(s.nodes.heartbeat_interval_s > 0, "nodes.heartbeat_interval_s must be > 0")
    need(s.nodes.rebalance_interval_s >= 0, "nodes.rebalance_interval_s must be >= 0")
    need(s.nodes.rebalance_nodes_per_round >= 1, "nodes.rebalance_nodes_per_round must be >= 1")
    for b in s.workload.bursts:
        need(
            not b.model or b.model in {m.name for m in s.models}, f"workload burst model {b.model!r} unknown"
        )
    need(len(s.nodes.profiles) >= 1, "nodes.profiles must not be empty")
    for ps in s.nodes.profiles:
        need(ps.profile in PROFILES, f"unknown hardware profile {ps.profile!r}; known: {sorted(PROFILES)}")
        need(ps.share >= 0, "profile share must be >= 0")
    need(s.workload.kind in ("poisson", "trace"), "workload.kind must be 'poisson' or 'trace'")
    need(
        s.workload.kind != "trace" or bool(s.workload.trace_file),
        "workload.trace_file is needed for kind='trace'",
    )
    need(0 <= s.workload.start_s < s.run.duration_s, "workload.start_s must be in [0, run.duration_s)")
    need(s.gateway.max_route_ms_per_token >= 0, "gateway.max_route_ms_per_token must be >= 0")
    need(s.gateway.routes_k >= 1, "gateway.routes_k must be >= 1")
    need(s.gateway.data_plane in ("relay", "push"), "gateway.data_plane must be 'relay' or 'push'")
    need(s.network.rtt_probes_per_heartbeat >= 0, "network.rtt_probes_per_heartbeat must be >= 0")
    need(0 <= s.network.rtt_noise <= 10, "network.rtt_noise must be in [0, 10]")
    need(s.gateway.prefill_chunk_tokens >= 1, "gateway.prefill_chunk_tokens must be >= 1")
    need(
        s.gateway.step_token_budget >= s.gateway.prefill_chunk_tokens,
        "gateway.step_token_budget must be >= prefill_chunk_tokens",
    )
    _validate_policy(s.policy)
