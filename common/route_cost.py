"""The load-dependent part of a route's cost, shared by the tracker and the gateway (pure).

The tracker prices a route once, at look-up (``tracker.routing``: latencies, compute,
transfer, penalties); a gateway choosing among its pooled routes between look-ups re-prices
only the terms that change with load, with the same formulas, from here:

* :func:`compute_ms`, the expected time of one more session's token through a shard with
  ``load`` sessions, with ``d = decode_ms_per_token``, ``c = max_sessions`` and occupancy
  ``u = min((load + queue_depth) / c, max_occupancy)``::

      d * (1 + batch_growth_per_session * load + occupancy_weight * u
             + queue_wait_weight * u / (1 - u))

  plus ``saturated_penalty_ms`` when the shard is full (``load >= c`` or no free KV);
* :func:`transfer_ms`, one token's hidden state over the shard's uplink, behind the frames of
  the sessions it serves: ``n_embd * activation_bytes_per_value * 8 / uplink * (1 +
  uplink_queue_share * load)``;
* :func:`repriced_ms`, a route's cost with its stages' load as it is now: the priced cost plus,
  per stage, the change of those two terms between the load it was priced with and now;
* :func:`prefix_miss_ms`, what a stage that does not hold a request's prompt prefix costs beyond
  one that does: the time it takes to prefill those positions again (``missing / prefill tokens
  per second``), spread over ``prefix_answer_tokens`` tokens of the answer, per token. A route whose
  every stage holds the longest prefix wins until its load terms grow past that saving, so one hot
  prefix does not pile all traffic on one route. Only a look-up that names the request's prefix
  (``tracker.routing.select_routes(prefix_heads=...)``) prices it.

No I/O, no clock: plain numbers in, milliseconds out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadCosts:
    """Weights of the load terms (milliseconds per token unless the name says otherwise);
    ``tracker.routing.RoutingCosts`` extends it with the search's own weights."""

    saturated_penalty_ms: float = 1000.0  # shard at max sessions or with no free KV
    min_decode_ms_per_token: float = 0.001  # floor for nonsensical measurements (<= 0)
    # One token's hidden state on the wire: n_embd values of this many bytes (4: f32, the exact mode).
    activation_bytes_per_value: float = 4.0
    default_uplink_mbit_s: float = 50.0  # a node that announced no uplink
    # A batch step grows by this share of the single-token time per session in it (memory-bound
    # GPUs ~0.15, CPUs ~0.6; nodes report only the single); 0.3 also covers what the model leaves
    # out (attention over each session's context, the step's scheduling) and is what met the tail
    # goals in the simulator (docs/simulation.md).
    batch_growth_per_session: float = 0.3
    # Expected wait for a slot, in single-token times, is this times u / (1 - u) at occupancy u.
    queue_wait_weight: float = 1.0
    # A term linear in the occupancy u, in single-token times (the cost model before queueing was
    # priced: occupancy_weight=1, batch growth, queue wait and uplink queue 0).
    occupancy_weight: float = 0.0
    # u is capped here (a full shard also pays saturated_penalty_ms); must be < 1 with a queue wait.
    max_occupancy: float = 0.95
    # The uplink sends a step's frames one after another: a session's frame waits on average
    # behind this share of the others'.
    uplink_queue_share: float = 0.5
    # A stage missing m positions of a request's prompt prefix that another candidate stage holds
    # costs its prefill time of them spread over this many answer tokens, per token (a chat answer's
    # order of magnitude: saving a 1,500-token prefill at 300 tokens/s is worth ~39 ms a token;
    # 0: prefixes are not priced).
    prefix_answer_tokens: float = 128.0
    min_prefill_tokens_per_s: float = 1.0  # floor for nonsensical measurements

    def __post_init__(self) -> None:
        if self.queue_wait_weight and not 0.0 <= self.max_occupancy < 1.0:
            raise ValueError("max_occupancy must be in [0, 1) when queue_wait_weight is set")
        if not self.prefix_answer_tokens >= 0.0 or not self.min_prefill_tokens_per_s > 0.0:
            raise ValueError("prefix_answer_tokens must be >= 0 and min_prefill_tokens_per_s > 0")


DEFAULT_LOAD_COSTS = LoadCosts()


def compute_ms(
    decode_ms_per_token: float,
    max_sessions: int,
    load: float,
    queue_depth: int = 0,
    kv_free_tokens: int | None = None,
    costs: LoadCosts = DEFAULT_LOAD_COSTS,
) -> float:
    """Expected time of one token through a shard for one more session with ``load`` sessions
    there (the module docstring's formula)."""
    decode = decode_ms_per_token
    if not decode >= costs.min_decode_ms_per_token:  # also NaN
        decode = costs.min_decode_ms_per_token
    capacity = max_sessions if max_sessions > 1 else 1
    load = load if load > 0 else 0.0
    queued = queue_depth if queue_depth > 0 else 0
    occupancy = min((load + queued) / capacity, costs.max_occupancy)
    factor = 1.0 + costs.batch_growth_per_session * load + costs.occupancy_weight * occupancy
    if costs.queue_wait_weight:
        factor += costs.queue_wait_weight * occupancy / (1.0 - occupancy)
    cost = decode * factor
    if load >= capacity or kv_free_tokens == 0:
        cost += costs.saturated_penalty_ms
    return cost


def transfer_ms(
    uplink_mbit_s: float | None, n_embd: int, load: float, costs: LoadCosts = DEFAULT_LOAD_COSTS
) -> float:
    """Time to send one token's hidden state over an uplink (None or <= 0: the default) behind the
    frames of ``load`` sessions."""
    mbit = uplink_mbit_s if uplink_mbit_s and uplink_mbit_s > 0 else costs.default_uplink_mbit_s
    one = n_embd * costs.activation_bytes_per_value * 8.0 / (mbit * 1000.0)
    return one * (1.0 + costs.uplink_queue_share * (load if load > 0 else 0.0))


def prefix_miss_ms(
    prefill_tokens_per_s: float, missing_positions: int, costs: LoadCosts = DEFAULT_LOAD_COSTS
) -> float:
    """What a stage prefilling ``prefill_tokens_per_s`` costs per token for not holding
    ``missing_positions`` of the request's prompt prefix that another candidate stage holds (the
    module docstring's formula; 0 when none is missing or prefixes are not priced)."""
    if missing_positions <= 0 or not costs.prefix_answer_tokens > 0.0:
        return 0.0
    rate = prefill_tokens_per_s
    if not rate >= costs.min_prefill_tokens_per_s:  # also NaN
        rate = costs.min_prefill_tokens_per_s
    return missing_positions * 1000.0 / rate / costs.prefix_answer_tokens


@dataclass(frozen=True)
class StageLoad:
    """What pricing one stage's load needs: its single-token time, its session limit, the load the
    route was priced with, its queue and free KV at that time, and its uplink (what it sends the
    next stage's input over; the last stage sends only the sampled token)."""

    decode_ms_per_token: float
    max_sessions: int
    priced_sessions: float
    queue_depth: int = 0
    kv_free_tokens: int | None = None
    uplink_mbit_s: float | None = None


def repriced_ms(
    expected_ms_per_token: float,
    stages: Sequence[StageLoad],
    sessions_now: Sequence[float | None],
    n_embd: int,
    costs: LoadCosts = DEFAULT_LOAD_COSTS,
) -> float:
    """A route's cost (``expected_ms_per_token``, priced with each stage's ``priced_sessions``) with
    its stages' load as it is now: ``sessions_now[i]`` for stage i (None: unchanged). Only the load
    terms (compute with the wait for a slot, the uplink's queue) change; latencies stay."""
    if len(sessions_now) != len(stages):
        raise ValueError("one load per stage")
    total = expected_ms_per_token
    last = len(stages) - 1
    for i, (stage, now) in enumerate(zip(stages, sessions_now, strict=True)):
        if now is None:
            continue
        then = stage.priced_sessions if stage.priced_sessions > 0 else 0.0
        if now == then:
            continue
        total += compute_ms(
            stage.decode_ms_per_token, stage.max_sessions, now, stage.queue_depth, stage.kv_free_tokens, costs
        ) - compute_ms(
            stage.decode_ms_per_token,
            stage.max_sessions,
            then,
            stage.queue_depth,
            stage.kv_free_tokens,
            costs,
        )
        if i < last:
            total += transfer_ms(stage.uplink_mbit_s, n_embd, now, costs) - transfer_ms(
                stage.uplink_mbit_s, n_embd, then, costs
            )
    return total
