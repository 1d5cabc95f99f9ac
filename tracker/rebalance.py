"""Rebalancing: should a serving node move to another span (of its model, or of another model)?

Pure function over a :class:`~tracker.snapshot.SwarmSnapshot`; no I/O, no clock, ties
broken with the injected ``random.Random``. A node asks periodically (the caller's
cadence); the answer is "stay" or a :class:`Move` that the node carries out by draining
its sessions, fetching the new span's bytes and announcing it again.

The model
    A model's *throughput* is the tokens per second its weakest layer can serve: the
    minimum over layers of the summed ``1000 / decode_ms_per_token`` of the shards that
    hold it (:func:`tracker.placement.layer_coverage`), and 0 while some layer has no
    shard. Its *service level* is the throughput over its demand (``demand``: e.g.
    sessions or requests per second the tracker handed out for it recently; a model
    without demand is not short of anything). A node's speed per layer is its shard's
    ``decode_ms_per_token`` over the shard's length; at another span it is assumed to
    keep that speed per layer.

The decision, in order
    1. A pinned node (an operator fixed its span) stays.
    2. A node stays if leaving would leave a layer of its span with fewer than
       ``min_holders`` holders (2: never cut a model, nor make a single point of failure;
       others should join next to it) -- counted on the swarm as it is (``present``) as well
       as on the view with the pending moves applied: a node advised to come takes minutes
       to drain, fetch and load (or fails), and until it serves it holds nothing.
    Demand: a model's counts as at least ``demand_floor_share`` of the mean over the
    models where it protects: for the model the node would leave (an idle model keeps
    some capacity for when its demand comes back), for another span of the node's own
    model, and for a model with a layer nobody holds (it is drawn one node and stays
    servable). It does not draw: towards another model that is served (every layer
    held) only that model's own demand counts, so a node never leaves a model with live
    demand for one without any that is already served -- that would take capacity from
    the users asking now for users who may come (when they do, their look-ups are
    demand, and nodes follow within a few of the meter's half-lives).
    3. For every model the node may serve (``capacity_layers``), the span it would take
       on the swarm without it (:func:`tracker.placement.recommend_span`: the weakest
       layers, aligned with the existing boundaries).
    4. It moves where the layers it would join are poorest -- their weakest coverage per
       unit of their model's demand -- if the layers it leaves would, without it, still
       be at least ``1 + min_gain`` times richer (hysteresis: a move that gains less is
       not worth a drain and a download, and after a move the two sides are within that
       factor, so nodes do not trade places back and forth); or, within its model, if
       afterwards fewer layers are held by a single node (a single point of failure
       removed) and the model's throughput drops by at most ``max_spof_cost``.

    Comparing spans rather than whole models lets one node at a time fix a model whose
    halves are equally weak (moving one node does not raise the minimum of both).

Bounds: the caller runs this once per node per interval (O(shards) per model each).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tracker.placement import layer_coverage, recommend_span
from tracker.snapshot import ShardView, SwarmSnapshot


@dataclass(frozen=True)
class RebalanceParams:
    min_gain: float = 0.25  # the layers left must stay this much richer than those joined
    min_holders: int = 2  # a node does not leave layers that would then have fewer holders than this
    # A model's demand counts as at least this share of the models' mean where it protects (the model
    # a node would leave; a model with a layer nobody holds), never to draw a node to a served model.
    demand_floor_share: float = 0.5
    max_spof_cost: float = 0.1  # a move that removes a single point of failure may cost this share
    min_decode_ms_per_token: float = 0.001


DEFAULT_PARAMS = RebalanceParams()


@dataclass(frozen=True)
class Move:
    model_fingerprint: str
    start: int
    end: int
    reason: str  # "throughput" or "single_point_of_failure"
    gain: float  # how much richer (relative) the layers it leaves are than those it joins


def throughput(snapshot: SwarmSnapshot, model_fingerprint: str) -> float:
    """Tokens per second through the model's weakest layer (0 while a layer is uncovered)."""
    model = snapshot.model(model_fingerprint)
    if model is None or model.n_layers < 1:
        return 0.0
    return min(layer_coverage(snapshot, model_fingerprint, model.n_layers))


def _fewest_holders(snapshot: SwarmSnapshot, fp: str, start: int, end: int) -> int:
    """The fewest distinct nodes holding any layer of ``[start, end)`` of model ``fp``."""
    holders: list[set[str]] = [set() for _ in range(start, end)]
    for s in snapshot.shards:
        if s.model_fingerprint == fp:
            for layer in range(max(s.start, start), min(s.end, end)):
                holders[layer - start].add(s.node_id)
    return min((len(h) for h in holders), default=0)


def single_holders(snapshot: SwarmSnapshot, model_fingerprint: str) -> list[int]:
    """Layers of the model held by exactly one node."""
    model = snapshot.model(model_fingerprint)
    if model is None:
        return []
    holders: list[set[str]] = [set() for _ in range(model.n_layers)]
    for s in snapshot.shards:
        if s.model_fingerprint == model_fingerprint and 0 <= s.start < s.end <= model.n_layers:
            for layer in range(s.start, s.end):
                holders[layer].add(s.node_id)
    return [i for i, h in enumerate(holders) if len(h) == 1]


def removable(snapshot: SwarmSnapshot, node_ids: Sequence[str]) -> tuple[list[str], list[str]]:
    """Of ``node_ids`` (in order): those that can leave routing one after another without leaving a
    layer of their model with no holder, and those spared because they then hold some layer alone.

    The tracker sends the nodes a gateway could not reach back to their challenge (out of routing
    until they answer); a node that is the last live holder of a layer is spared that: out of
    routing it would turn a slow or suspect model into one nobody can use (503 "not covered" for
    every gateway), while the gateway that named it routes around it anyway. A node not in the
    snapshot holds nothing in it and can leave. O(named nodes' shards x their models' layers)."""
    named = set(node_ids)
    fps = {s.model_fingerprint for s in snapshot.shards if s.node_id in named}
    holders: dict[tuple[str, int], set[str]] = {}
    for s in snapshot.shards:
        if s.model_fingerprint in fps:
            for layer in range(s.start, s.end):
                holders.setdefault((s.model_fingerprint, layer), set()).add(s.node_id)
    out: list[str] = []
    spared: list[str] = []
    for node in node_ids:
        cells = [(s.model_fingerprint, layer) for s in snapshot.shards if s.node_id == node
                 for layer in range(s.start, s.end)]  # fmt: skip
        if any(holders.get(c, set()) <= {node} for c in cells):
            spared.append(node)
            continue
        for c in cells:
            holders[c].discard(node)
        out.append(node)
    return out, spared


def advise(
    snapshot: SwarmSnapshot,
    node_id: str,
    capacity_layers: Mapping[str, int],
    demand: Mapping[str, float],
    *,
    rng: random.Random,
    pinned: bool = False,
    params: RebalanceParams = DEFAULT_PARAMS,
    present: SwarmSnapshot | None = None,
) -> Move | None:
    """Where ``node_id`` should move, or None to stay (see the module docstring).

    ``capacity_layers``: model fingerprint -> how many layers of it the node can hold (the
    models it may serve); ``demand``: model fingerprint -> recent demand (any unit, the same
    for all models). A node that serves no shard, or several, is not moved (None). ``present``: the
    swarm as it is when ``snapshot`` has pending moves applied (:func:`apply_moves`); rule 2 holds
    on both.
    """
    mine = [s for s in snapshot.shards if s.node_id == node_id]
    if pinned or len(mine) != 1:
        return None
    here = mine[0]
    fp = here.model_fingerprint
    for swarm in (snapshot, present or snapshot):
        if _fewest_holders(swarm, fp, here.start, here.end) - 1 < max(1, params.min_holders):
            return None  # leaving would cut the model, or leave one of its layers with too few holders
    per_layer_ms = max(here.decode_ms_per_token, params.min_decode_ms_per_token) / (here.end - here.start)
    without = replace(snapshot, shards=tuple(s for s in snapshot.shards if s.node_id != node_id))
    floor = params.demand_floor_share * sum(demand.values()) / max(1, len(demand))
    floored = {m: max(demand.get(m, 0.0), floor) for m in {fp, *capacity_layers, *demand}}
    # Towards another served model, its own demand only: the floor protects, it does not draw.
    drawn = {m: floored[m] if m == fp or throughput(without, m) <= 0 else demand.get(m, 0.0) for m in floored}
    # What the layers it serves would have without it, per unit of their model's demand.
    source = _span_level(without, fp, here.start, here.end, floored)

    best: tuple[float, Move] | None = None
    for target in sorted(capacity_layers):
        cap = capacity_layers[target]
        if cap < 1 or without.model(target) is None:
            continue
        a, b = recommend_span(without, target, cap, rng=rng)
        if target == fp and (a, b) == (here.start, here.end):
            continue
        goal = _span_level(without, target, a, b, drawn)
        gain = _relative(source, goal)  # how much richer the layers it leaves are than those it joins
        reason = ""
        if gain >= params.min_gain:
            reason = "throughput"
        elif target == fp:
            moved = _with_shard(without, here, target, a, b, per_layer_ms)
            if len(single_holders(moved, fp)) < len(single_holders(snapshot, fp)):
                cost = _relative(throughput(moved, fp), throughput(snapshot, fp))
                if cost >= -params.max_spof_cost:
                    reason = "single_point_of_failure"
        if reason and (best is None or gain > best[0]):
            best = (gain, Move(target, a, b, reason, gain))
    return best[1] if best is not None else None


def apply_moves(snapshot: SwarmSnapshot, moves: Mapping[str, Move]) -> SwarmSnapshot:
    """The swarm as it will be once the advised ``moves`` (node id -> move) are carried out: each
    mover's shard taken away and put back at its target, at the same speed per layer.

    The tracker answers every node from this view, so while one node drains and fetches, the
    next one asking sees the gap that node will fill and does not rush to fill it too."""
    if not moves:
        return snapshot
    kept: list[ShardView] = []
    added: list[ShardView] = []
    for s in snapshot.shards:
        move = moves.get(s.node_id)
        if move is None:
            kept.append(s)
            continue
        if (s.model_fingerprint, s.start, s.end) == (move.model_fingerprint, move.start, move.end):
            kept.append(s)  # already there (announced at its new span)
            continue
        per_layer = s.decode_ms_per_token / max(1, s.end - s.start)
        if move.model_fingerprint != s.model_fingerprint:
            # Layers of another model weigh differently: take that model's typical speed per layer.
            per_layer = _median_layer_ms(snapshot, move.model_fingerprint, per_layer)
        added.append(
            replace(
                s,
                model_fingerprint=move.model_fingerprint,
                start=move.start,
                end=move.end,
                decode_ms_per_token=per_layer * (move.end - move.start),
                active_sessions=0,
                queue_depth=0,
            )
        )
    return replace(snapshot, shards=(*kept, *added))


def _median_layer_ms(snapshot: SwarmSnapshot, fp: str, default: float) -> float:
    """The median ``decode_ms_per_token`` per layer of model ``fp``'s shards (``default`` without any)."""
    per_layer = sorted(s.decode_ms_per_token / (s.end - s.start) for s in snapshot.shards
                       if s.model_fingerprint == fp and s.end > s.start)  # fmt: skip
    return per_layer[len(per_layer) // 2] if per_layer else default


class PendingMoves:
    """Moves the tracker advised and the nodes have not finished yet (node id -> move).

    Pure, bounded: a move is forgotten ``keep_s`` after it was advised (a node that took
    longer, or never moved, is seen where it really is again), and at most ``max_moves`` are
    kept, the oldest going first."""

    def __init__(self, keep_s: float, max_moves: int = 100_000) -> None:
        if keep_s <= 0 or max_moves < 1:
            raise ValueError("keep_s must be > 0 and max_moves >= 1")
        self.keep_s = keep_s
        self.max_moves = max_moves
        self._moves: dict[str, tuple[Move, float, str]] = {}  # node -> (move, when, model left); oldest first

    def record(self, node_id: str, move: Move, now_s: float, origin: str = "") -> None:
        """``node_id`` was told to move from model ``origin`` ("" = not said) at ``now_s``."""
        self._moves.pop(node_id, None)
        self._moves[node_id] = (move, now_s, origin)
        while len(self._moves) > self.max_moves:
            del self._moves[next(iter(self._moves))]

    def active(self, now_s: float, *, besides: str = "") -> dict[str, Move]:
        """The moves advised within ``keep_s`` (older ones are dropped), without ``besides``'s."""
        for node in [n for n, (_m, at, _o) in self._moves.items() if now_s - at > self.keep_s]:
            del self._moves[node]
        return {n: m for n, (m, _at, _o) in self._moves.items() if n != besides}

    def reverses(self, origin: str, target: str, now_s: float) -> bool:
        """Whether a pending move goes the other way (from ``target``'s model to ``origin``'s): two
        nodes trading models cost two drains and two downloads for nothing, so the second stays."""
        self.active(now_s)
        return origin != target and any(
            o == target and m.model_fingerprint == origin for m, _at, o in self._moves.values()
        )

    def __len__(self) -> int:
        return len(self._moves)


def _span_level(snapshot: SwarmSnapshot, fp: str, start: int, end: int, demand: Mapping[str, float]) -> float:
    """The weakest coverage of ``[start, end)`` per unit of the model's demand (inf without demand)."""
    want = demand.get(fp, 0.0)
    model = snapshot.model(fp)
    if want <= 0 or model is None:
        return float("inf")
    cover = layer_coverage(snapshot, fp, model.n_layers)
    return min(cover[start:end]) / want


def _with_shard(
    snapshot: SwarmSnapshot, here: ShardView, fp: str, start: int, end: int, per_layer_ms: float
) -> SwarmSnapshot:
    shard = replace(
        here,
        model_fingerprint=fp,
        start=start,
        end=end,
        decode_ms_per_token=per_layer_ms * (end - start),
        active_sessions=0,
        queue_depth=0,
    )
    return replace(snapshot, shards=(*snapshot.shards, shard))


def _relative(after: float, before: float) -> float:
    """(after - before) / before, with the infinities of models without demand handled."""
    if before == after:
        return 0.0
    if before <= 0:
        return float("inf") if after > 0 else 0.0
    if before == float("inf"):
        return -1.0
    return (after - before) / before


__all__ = [
    "DEFAULT_PARAMS",
    "Move",
    "PendingMoves",
    "RebalanceParams",
    "advise",
    "apply_moves",
    "removable",
    "single_holders",
    "throughput",
]
