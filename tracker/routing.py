"""Route selection: which chains of shards should serve a model right now, for which gateway.

Pure function over a :class:`~tracker.snapshot.SwarmSnapshot`; no I/O, no
clock, randomness only through the injected ``random.Random`` (used to break
exact ties, so identical nodes share traffic across calls while a given seed
always gives the same answer). numpy for the vectorised search.

The graph
    Vertices are layer boundaries ``0..L``; every eligible shard ``[a, b)`` is an
    edge ``a -> b``. A route is a path ``0 -> L``: shards that tile the layers
    contiguously. Because the hop latency depends on the *pair* of consecutive
    nodes, the dynamic programme runs over shards (the state is "the last shard
    taken"), visiting boundaries in increasing order -- a DAG shortest path.

Cost of a route (milliseconds per generated token), for the gateway at ``origin``
    ``entry + sum(compute(s)) + sum over inner hops (latency(s_i, s_i+1) + transfer(s_i))
    + ring + exit``:

    * ``compute(s)``, the expected time of one more session's token through the shard
      (its queueing included), with ``d = decode_ms_per_token``, ``c = max_sessions``,
      ``n = active + extra`` sessions (``extra``: ``extra_sessions``, what was handed
      out there since its last report) and occupancy ``u = min((n + queue) / c,
      max_occupancy)``::

          d * (1 + batch_growth_per_session * n + queue_wait_weight * u / (1 - u))

      -- a batch step grows with every session in it (memory-bound decode: a little
      per session), and the wait for a slot grows like an M/M/1 queue's as the shard
      fills -- plus ``saturated_penalty_ms`` when the shard is full (n >= c or no
      free KV) plus ``snapshot.relay_penalty_ms`` when it is reached through a relay
      plus ``snapshot.probation_penalty_ms`` when its node is on probation (trusted
      nodes first; probation nodes still serve, their requests checked). So a near,
      idle node wins over a far one, and keeps winning until its load costs more than
      the distance to the next best: near nodes are used until they are busy;
    * ``latency(a, b)`` is one-way: ``snapshot.latency_ms[(a, b)]`` if given, else
      half the RTT the two nodes' network coordinates predict
      (:mod:`tracker.coordinates`; a coordinate whose error exceeds
      ``UNTRUSTED_ERROR`` counts as none), else ``snapshot.default_latency_ms``;
    * ``transfer(s)`` = one token's hidden state (``n_embd * activation_bytes_per_value``)
      over the sender's uplink (``ShardView.uplink_mbit_s``, else ``default_uplink_mbit_s``),
      times ``1 + uplink_queue_share * n``: a step's frames leave one after another;
    * ``ring`` = ``latency(last, first)``: with direct push the last stage sends the
      sampled token straight to the first (0 for a one-stage route);
    * ``entry`` / ``exit`` = ``latency`` between the gateway (``origin``, its
      coordinate; None = unknown, the default latency) and the first / last stage,
      times ``gateway_leg_weight``.

    Exactness: the search is exact for every term but the ring, which depends on
    the first *and* last stage; it is added exactly for each candidate last stage
    with the first stage of that stage's best chain. So the chosen route costs at
    most the optimum plus one ring link (the dearest from a candidate last stage
    back to a candidate first stage; in the coordinate space, by the triangle
    inequality, at most an exit plus an entry leg); with no positions and no
    explicit pairs (constant hops) it is exact.

Complexity (measured by ``sim/bench_tracker.py``, docs/tracker.md)
    Per snapshot, once: each model's eligible shards as arrays (numpy columns, kept in
    ``SwarmSnapshot.memo``; the tracker reuses one snapshot for ``snapshot_ttl_s``, the
    simulator until the swarm changes). Per look-up: every shard's cost in one vectorised
    step, then *pruning*: within one span ``[a, b)``, shards are ranked by a lower bound of
    any route through them (their cost and transfer plus twice their leg to the gateway:
    by the triangle inequality a route through a node goes there and back; or, where the
    legs are weighted down (``gateway_leg_weight``), twice half its height: the hop into it
    and the hop out of it each pay its last mile) and only the
    best ``prune_floor + prune_per_route * k`` are searched. The search itself is exact
    over what is kept; pruning can lose the optimum only where a span has more shards
    than that and one ranked low is the best continuation of its neighbours (a swarm of
    a few hundred shards per span). The hop latencies between the shards ending and the
    shards starting at each boundary are one matrix, computed once per look-up and shared
    by its k searches; a search is one ``argmin`` per boundary. A look-up of 32 routes
    of an 80-layer model over 10 000 nodes takes ~20 ms (warm) on the 2-core machine.

k routes (data parallelism)
    Routes are chosen one after another; every shard already used counts as
    one more active session plus ``reuse_penalty_ms`` per use, so later routes
    avoid earlier nodes when they can. If that greedy pass still shares nodes
    but k node-disjoint routes exist (checked with a min-cost flow over the
    boundary graph, hops at the default latency), the disjoint set is returned
    instead. Routes are distinct; fewer than k come back when fewer distinct
    routes exist.

What a route carries for the gateway
    ``hop_rtt_ms[i]``: the estimated round trip of the link into hop i (hop 0:
    from the gateway); ``hop_bandwidth_mbit_s[i]``: the uplink of its sender
    (hop 0: None, the gateway's own); ``ring_rtt_ms`` (last -> first) and
    ``exit_rtt_ms`` (last -> gateway). None wherever nothing was measured.

Invariants of the result
    * every route tiles ``0..L`` contiguously with shards of the requested
      model, none from ``exclude_nodes``, each starting and ending at the
      model's split points (``ModelInfo.split_points``; a shard announced at
      another boundary cannot be served and is ignored);
    * ``expected_ms_per_token`` is the cost above of exactly that route;
    * ``uncovered`` is empty exactly when ``routes`` is non-empty.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from common.prefix_chain import BLOCK_TOKENS, held_blocks
from common.route_cost import LoadCosts, compute_ms, prefix_miss_ms
from common.route_cost import transfer_ms as common_transfer_ms
from tracker.coordinates import UNTRUSTED_ERROR, NetCoord
from tracker.errors import UnknownModel
from tracker.recipes import recipe_exclusions
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot

_INF = float("inf")
MAX_ROUTE_PREFIX_HEADS = 256  # heads of a request's prompt one look-up may name (4,096 positions)

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Route:
    hops: tuple[ShardView, ...]
    expected_ms_per_token: float
    # Estimates for the gateway, None where nothing was measured (see the module docstring).
    hop_rtt_ms: tuple[float | None, ...] = ()
    hop_bandwidth_mbit_s: tuple[float | None, ...] = ()
    ring_rtt_ms: float | None = None
    exit_rtt_ms: float | None = None

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(h.node_id for h in self.hops)


@dataclass(frozen=True)
class RouteSelection:
    routes: tuple[Route, ...]
    # Layer ranges [a, b) that block every route; empty exactly when a route exists.
    uncovered: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RoutingCosts(LoadCosts):
    """Tunable weights of the cost model (milliseconds per token unless the name says otherwise):
    the load terms of :class:`common.route_cost.LoadCosts` and the search's own."""

    reuse_penalty_ms: float = 10_000.0  # per earlier route that already uses the shard
    gateway_leg_weight: float = 1.0  # how much the gateway -> first and last -> gateway legs count
    ring_weight: float = 1.0  # how much the last -> first stage link counts (0: price open chains only)
    # Above this many shards of one span [a, b), only the most promising (cheapest lower bound)
    # ``prune_floor + prune_per_route * k`` are searched (see "Complexity").
    prune_floor: int = 4
    prune_per_route: int = 1
    # Spreading: a shard whose node was busy a share b (0..1) of the recent past (``recent_busy``)
    # costs b times this much more, so work moves on to equally good nodes before the load terms
    # alone would move it (0: off).
    recent_busy_ms: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prune_floor < 1 or self.prune_per_route < 0:
            raise ValueError("prune_floor must be >= 1 and prune_per_route >= 0")


DEFAULT_COSTS = RoutingCosts()


def shard_cost_ms(
    shard: ShardView,
    snapshot: SwarmSnapshot,
    costs: RoutingCosts = DEFAULT_COSTS,
    extra_sessions: float = 0.0,
) -> float:
    """Expected compute time (with the wait for a slot, + relay and probation penalties) of one
    token through this shard for one more session, under its reported load plus ``extra_sessions``
    (sessions handed out there since its last report)."""
    load = (shard.active_sessions if shard.active_sessions > 0 else 0) + max(extra_sessions, 0.0)
    cost = _loaded_compute_ms(shard, load, costs)
    if shard.relayed:
        cost += snapshot.relay_penalty_ms
    if shard.probation:
        cost += snapshot.probation_penalty_ms
    return cost


def _loaded_compute_ms(shard: ShardView, load: float, costs: RoutingCosts) -> float:
    """The load-dependent part of :func:`shard_cost_ms` with ``load`` sessions on the shard."""
    return compute_ms(
        shard.decode_ms_per_token, shard.max_sessions, load, shard.queue_depth, shard.kv_free_tokens, costs
    )


def transfer_ms(
    shard: ShardView, n_embd: int, costs: RoutingCosts = DEFAULT_COSTS, extra_sessions: float = 0.0
) -> float:
    """Time for ``shard`` to send one token's hidden state over its uplink, behind the frames of
    the sessions it already serves (reported plus ``extra_sessions``)."""
    load = (shard.active_sessions if shard.active_sessions > 0 else 0) + max(extra_sessions, 0.0)
    return _loaded_transfer_ms(shard, n_embd, load, costs)


def _loaded_transfer_ms(shard: ShardView, n_embd: int, load: float, costs: RoutingCosts) -> float:
    return common_transfer_ms(shard.uplink_mbit_s, n_embd, load, costs)


def repriced_ms(
    route: Route, sessions_now: Mapping[str, float], n_embd: int, costs: RoutingCosts = DEFAULT_COSTS
) -> float:
    """``route.expected_ms_per_token`` with its stages' load as it is now (node id -> sessions it
    serves, as the asking gateway knows it; stages not named keep the load they were priced with).
    A gateway choosing among its pooled routes between look-ups uses this: only the load terms
    (compute, wait for a slot, uplink queue) change, the latencies stay."""
    total = route.expected_ms_per_token
    last = len(route.hops) - 1
    for i, hop in enumerate(route.hops):
        now = sessions_now.get(hop.node_id)
        if now is None:
            continue
        then = float(hop.active_sessions if hop.active_sessions > 0 else 0)
        if now == then:
            continue
        total += _loaded_compute_ms(hop, now, costs) - _loaded_compute_ms(hop, then, costs)
        if i < last:  # the last stage sends only the sampled token
            total += _loaded_transfer_ms(hop, n_embd, now, costs) - _loaded_transfer_ms(
                hop, n_embd, then, costs
            )
    return total


def trusted(coord: NetCoord | None) -> NetCoord | None:
    """The coordinate if routing may use it (error at most ``UNTRUSTED_ERROR``), else None."""
    if coord is None or coord.error > UNTRUSTED_ERROR:
        return None
    return coord


def select_routes(
    snapshot: SwarmSnapshot,
    model_fingerprint: str,
    k: int = 1,
    *,
    exclude_nodes: frozenset[str] = frozenset(),
    rng: random.Random,
    costs: RoutingCosts = DEFAULT_COSTS,
    origin: NetCoord | None = None,
    extra_sessions: Mapping[str, float] | None = None,
    kv_tokens: int = 0,
    one_recipe: bool = True,
    recent_busy: Mapping[str, float] | None = None,
    prefix_heads: Sequence[str] = (),
) -> RouteSelection:
    """Up to ``k`` distinct minimum-cost routes for the model, for a gateway at ``origin`` (its
    network coordinate; None = unknown); see the module docstring. ``extra_sessions``: node id ->
    sessions expected there beyond its last report (the tracker's recent hand-outs, what the
    asking gateway has in flight); they count as load.

    ``kv_tokens`` > 0: the KV positions the request needs on every stage (prompt plus max_tokens);
    a shard whose last heartbeat announced fewer free KV positions is skipped (one that announced
    nothing yet is kept), so a long prompt goes to a route that can hold it.

    ``recent_busy``: node id -> the share of the recent past it spent computing (0..1); with
    ``costs.recent_busy_ms`` it makes recently busy nodes dearer (the price includes it).

    ``prefix_heads``: the heads of the request's prompt blocks in order (common.prefix_chain.head,
    at most :data:`MAX_ROUTE_PREFIX_HEADS`): a shard holding fewer of its first positions than the
    shard holding the most, as far as the heads its node reported tell, costs
    ``common.route_cost.prefix_miss_ms`` more (the price includes it), so the route whose every stage
    holds the longest prefix wins while its load allows. Empty: prices as before.

    ``one_recipe``: every route chains shards of one runtime recipe (tracker/recipes.py; shards
    whose recipe is not known join any); False searches all shards together.

    Raises :class:`tracker.errors.UnknownModel` if the snapshot has no such model,
    ``ValueError`` if ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    model = snapshot.model(model_fingerprint)
    if model is None:
        raise UnknownModel(f"unknown model fingerprint {model_fingerprint!r}")
    if one_recipe and (others := recipe_exclusions(snapshot, model_fingerprint)):
        # Several recipes: one search per recipe, the others' nodes excluded; the cheapest k of all.
        found = [
            select_routes(
                snapshot,
                model_fingerprint,
                k,
                exclude_nodes=exclude_nodes | other,
                rng=rng,
                costs=costs,
                origin=origin,
                extra_sessions=extra_sessions,
                kv_tokens=kv_tokens,
                one_recipe=False,
                recent_busy=recent_busy,
                prefix_heads=prefix_heads,
            )
            for other in others
        ]
        unique = {r.node_ids: r for sel in found for r in sel.routes}
        best = sorted(unique.values(), key=lambda r: (r.expected_ms_per_token, r.node_ids))[:k]
        if best:
            return RouteSelection(routes=tuple(best), uncovered=())
        return min(found, key=lambda sel: len(sel.uncovered))
    n_layers = model.n_layers
    cols = _columns(snapshot, model)
    n_all = len(cols.shards)
    # One draw from ``rng`` seeds the tie keys of all eligible shards: the same snapshot and seed
    # always give the same answer, and identical shards share traffic across calls.
    ties_all = np.random.default_rng(rng.getrandbits(64)).random(n_all)
    # Per-request eligibility is a mask over the (per-snapshot) columns; a filter that depends on
    # the request goes here, a preference as a term of _Columns.compute_ms.
    keep = np.ones(n_all, dtype=bool)
    for node in exclude_nodes:
        for i in cols.indices(node):
            keep[i] = False
    if kv_tokens > 0:  # a shard that announced too little free KV for the request (none said: kept)
        for i, shard in enumerate(cols.shards):
            if shard.kv_free_tokens is not None and shard.kv_free_tokens < kv_tokens:
                keep[i] = False
            if shard.kv_session_max_tokens is not None and shard.kv_session_max_tokens < kv_tokens:
                keep[i] = False  # it may never hold that many positions for one session
    extra = np.zeros(n_all)
    if extra_sessions:
        for node, count in extra_sessions.items():
            for i in cols.indices(node):
                extra[i] = max(float(count), 0.0)
    base_all = cols.compute_ms(extra, snapshot, costs)
    bias = np.zeros(n_all)
    if recent_busy and costs.recent_busy_ms:
        for node, share in recent_busy.items():
            for i in cols.indices(node):
                bias[i] = costs.recent_busy_ms * min(max(float(share), 0.0), 1.0)
        base_all = base_all + bias
    if prefix_heads:
        wanted = tuple(prefix_heads[:MAX_ROUTE_PREFIX_HEADS])
        held = np.zeros(n_all)
        for i, shard in enumerate(cols.shards):
            if keep[i] and shard.prefix_heads:
                held[i] = held_blocks(shard.prefix_heads, wanted) * BLOCK_TOKENS
        most = float(held.max()) if n_all else 0.0
        if most > 0:
            miss = np.array(
                [
                    prefix_miss_ms(s.prefill_tokens_per_s, int(most - held[i]), costs)
                    for i, s in enumerate(cols.shards)
                ]
            )
            bias = bias + miss
            base_all = base_all + miss
    tx_all = cols.transfer_ms(extra, model.n_embd, costs)
    entry_all = cols.entry_ms(origin, snapshot.default_latency_ms, costs.gateway_leg_weight)
    # Pruning: within one span, rank shards by a lower bound of any route through them (their own
    # cost and transfer, and the way there and back from the gateway -- or, where the gateway legs
    # weigh less than the node's own last mile, the hop into it and out of it, each at least half its
    # height); keep the best few per span. With the legs at full weight the first term always wins.
    per_span = costs.prune_floor + costs.prune_per_route * k
    lower = base_all + tx_all + 2.0 * np.maximum(entry_all, np.where(cols.has, cols.half_h, 0.0))
    idx = np.flatnonzero(keep)
    order = idx[np.lexsort((ties_all[idx], lower[idx], cols.span[idx]))]
    if order.size:
        spans = cols.span[order]
        first_of_span = np.flatnonzero(np.r_[True, spans[1:] != spans[:-1]])
        rank = np.arange(order.size) - np.repeat(first_of_span, np.diff(np.r_[first_of_span, order.size]))
        order = order[rank < per_span]
    sub = np.sort(order)  # back in start order (the columns are sorted by start)
    shards = [cols.shards[i] for i in sub.tolist()]
    if not shards:
        return RouteSelection(routes=(), uncovered=_uncovered(shards, n_layers))
    graph = _Graph(
        cols, sub, ties_all[sub], base_all[sub], tx_all[sub], entry_all[sub], extra[sub], snapshot, costs
    )
    graph.bias = bias[sub]
    graph.origin = trusted(origin)
    base = graph.base

    first = graph.shortest(base, graph.tx)
    if first is None:
        return RouteSelection(routes=(), uncovered=_uncovered(shards, n_layers))

    paths: list[tuple[int, ...]] = [first]
    uses = np.zeros(len(shards))
    last = first
    # A search that returns an existing route makes that route dearer again and retries, so a
    # distinct alternative wins once one exists; the bound keeps a tiny swarm from looping.
    for _ in range(3 * k):
        if len(paths) >= k:
            break
        for i in last:
            uses[i] += 1
        cost, tx = graph.penalised(uses)
        last = graph.shortest(cost, tx) or first
        if last not in paths:
            paths.append(last)
    if len(paths) < k:
        _fill_by_banning(graph, paths, k, uses, max_searches=4 * k)

    if k > 1 and not _node_disjoint(paths, shards):
        disjoint = _disjoint_by_flow(shards, base.tolist(), snapshot.default_latency_ms, n_layers, k)
        if disjoint is not None and _node_disjoint(disjoint, shards):
            paths = disjoint

    routes = [graph.route(p) for p in paths]
    ties = graph.ties
    order_r = sorted(range(len(routes)), key=lambda r: (routes[r].expected_ms_per_token, ties[paths[r][0]]))
    return RouteSelection(routes=tuple(routes[r] for r in order_r), uncovered=())


def _fill_by_banning(
    graph: _Graph, paths: list[tuple[int, ...]], k: int, uses: FloatArray, max_searches: int
) -> None:
    """Add distinct routes by banning one shard of an existing route at a time (appends to ``paths``).

    Any route not yet chosen omits at least one shard of every chosen route (two
    tilings of 0..L that share all of one's shards are equal), so banning single
    shards reaches most of them; bounded by ``max_searches``.
    """
    searches = 0
    while len(paths) < k and searches < max_searches:
        cost, tx = graph.penalised(uses)
        best: tuple[float, tuple[int, ...]] | None = None
        for banned in sorted({i for p in paths for i in p}):
            if searches >= max_searches:
                break
            searches += 1
            saved = cost[banned]
            cost[banned] = _INF
            cand = graph.shortest(cost, tx)
            cost[banned] = saved
            if cand is None or banned in cand or cand in paths:
                continue
            total = graph.path_cost(cand, cost, tx)
            if best is None or total < best[0]:
                best = (total, cand)
        if best is None:
            return
        paths.append(best[1])
        for i in best[1]:
            uses[i] += 1


# Hop matrices (predecessors x successors at one boundary) up to this many entries are computed
# once per look-up and reused by all its searches; larger ones are priced in slices per search.
MAX_CACHED_MATRIX = 1_000_000
_SLICE = 250_000


@dataclass(frozen=True)
class _Columns:
    """A model's eligible shards (right model, inside the model, at its split points) as arrays,
    sorted by start (stable: equal starts keep the snapshot's order). Built once per snapshot."""

    n_layers: int
    shards: list[ShardView]
    of_node: dict[str, int]  # node id -> its shard's index (one of them, if it serves several)
    more_of_node: dict[str, list[int]]  # node id -> all its shards' indices, where it serves several
    start: npt.NDArray[np.intp]
    end: npt.NDArray[np.intp]
    span: npt.NDArray[np.intp]  # an id per distinct (start, end)
    decode: FloatArray
    capacity: FloatArray
    active: FloatArray
    queued: FloatArray
    kv_full: npt.NDArray[np.bool_]
    relayed: npt.NDArray[np.bool_]
    probation: npt.NDArray[np.bool_]
    uplink: FloatArray  # 0 = not announced
    has: npt.NDArray[np.bool_]  # a trusted coordinate
    pos: FloatArray  # n x 3 (zeros where none)
    half_h: FloatArray  # half the height (zero where none)

    def indices(self, node: str) -> list[int]:
        """The indices of ``node``'s shards (none if it serves none of this model)."""
        many = self.more_of_node.get(node)
        if many is not None:
            return many
        one = self.of_node.get(node)
        return [] if one is None else [one]

    def compute_ms(self, extra: FloatArray, snapshot: SwarmSnapshot, costs: RoutingCosts) -> FloatArray:
        """:func:`shard_cost_ms` of every shard at once (the same formula)."""
        decode = np.maximum(self.decode, costs.min_decode_ms_per_token)
        load = self.active + extra
        occupancy = np.minimum((load + self.queued) / self.capacity, costs.max_occupancy)
        factor = 1.0 + costs.batch_growth_per_session * load + costs.occupancy_weight * occupancy
        if costs.queue_wait_weight:
            factor = factor + costs.queue_wait_weight * occupancy / (1.0 - occupancy)
        cost = decode * factor
        cost = cost + np.where((load >= self.capacity) | self.kv_full, costs.saturated_penalty_ms, 0.0)
        cost = cost + np.where(self.relayed, snapshot.relay_penalty_ms, 0.0)
        result: FloatArray = cost + np.where(self.probation, snapshot.probation_penalty_ms, 0.0)
        return result

    def transfer_ms(self, extra: FloatArray, n_embd: int, costs: RoutingCosts) -> FloatArray:
        """:func:`transfer_ms` of every shard at once."""
        rate = np.where(self.uplink > 0, self.uplink, costs.default_uplink_mbit_s)
        one = n_embd * costs.activation_bytes_per_value * 8.0 / (rate * 1000.0)
        result: FloatArray = one * (1.0 + costs.uplink_queue_share * (self.active + extra))
        return result

    def entry_ms(self, origin: NetCoord | None, default_ms: float, weight: float) -> FloatArray:
        """The weighted one-way latency between the gateway at ``origin`` and every shard."""
        legs = np.full(len(self.shards), default_ms)
        o = trusted(origin)
        if o is not None:
            diff = self.pos - np.asarray(o.vec)
            near = 0.5 * np.sqrt(np.einsum("ij,ij->i", diff, diff)) + self.half_h + 0.5 * o.height_ms
            legs = np.where(self.has, near, legs)
        result: FloatArray = weight * legs
        return result


def _columns(snapshot: SwarmSnapshot, model: ModelInfo) -> _Columns:
    key = ("routing.columns", model.fingerprint)
    found = snapshot.memo.get(key)
    if isinstance(found, _Columns):
        return found
    n_layers = model.n_layers
    fp = model.fingerprint
    shards = sorted(
        (
            s
            for s in snapshot.shards
            if s.model_fingerprint == fp and 0 <= s.start < s.end <= n_layers and model.allows(s.start, s.end)
        ),
        key=attrgetter("start"),
    )
    n = len(shards)
    ids = list(map(attrgetter("node_id"), shards))
    of_node = dict(zip(ids, range(n), strict=True))  # (no list per node: 10 000s of small objects cost)
    more: dict[str, list[int]] = {}
    if len(of_node) < n:  # some node serves several shards of this model
        seen: set[str] = set()
        several: set[str] = set()
        for node in ids:
            (several if node in seen else seen).add(node)
        for i, node in enumerate(ids):
            if node in several:
                more.setdefault(node, []).append(i)
    # Column by column with C-level attribute access: this runs once per snapshot over 10 000s of shards.
    numbers = attrgetter(
        "start",
        "end",
        "decode_ms_per_token",
        "max_sessions",
        "active_sessions",
        "queue_depth",
        "relayed",
        "probation",
    )
    table = np.array(list(map(numbers, shards)), dtype=float).reshape(n, 8)
    start = table[:, 0].astype(np.intp)
    end = table[:, 1].astype(np.intp)
    span = np.unique(start * (n_layers + 1) + end, return_inverse=True)[1].reshape(n).astype(np.intp)
    kv_full = np.fromiter((f == 0 for f in map(attrgetter("kv_free_tokens"), shards)), dtype=bool, count=n)
    uplink = np.fromiter(
        (u if u is not None and u > 0 else 0.0 for u in map(attrgetter("uplink_mbit_s"), shards)),
        dtype=float,
        count=n,
    )
    found_coords = list(map(attrgetter("coord"), shards))
    placed = [i for i, c in enumerate(found_coords) if c is not None and c.error <= UNTRUSTED_ERROR]
    pos = np.zeros((n, 3))
    half_h = np.zeros(n)
    has = np.zeros(n, dtype=bool)
    if placed:
        chosen = [found_coords[i] for i in placed]
        pos[placed] = np.array([c.vec for c in chosen if c is not None])
        half_h[placed] = 0.5 * np.array([c.height_ms for c in chosen if c is not None])
        has[placed] = True
    cols = _Columns(
        n_layers=n_layers,
        shards=shards,
        of_node=of_node,
        more_of_node=more,
        start=start,
        end=end,
        span=span,
        decode=table[:, 2].copy(),
        capacity=np.maximum(table[:, 3], 1.0),
        active=np.maximum(table[:, 4], 0.0),
        queued=np.maximum(table[:, 5], 0.0),
        kv_full=kv_full,
        relayed=table[:, 6] > 0,
        probation=table[:, 7] > 0,
        uplink=uplink,
        has=has,
        pos=pos,
        half_h=half_h,
    )
    snapshot.memo[key] = cols
    return cols


class _Graph:
    """The shards one look-up searches (a pruned subset of the columns, in start order), indexed
    by boundary, with the hop latencies between them, and the searches over them."""

    def __init__(
        self,
        cols: _Columns,
        sub: npt.NDArray[np.intp],
        ties: FloatArray,
        base: FloatArray,
        tx: FloatArray,
        entry: FloatArray,
        extra: FloatArray,
        snapshot: SwarmSnapshot,
        costs: RoutingCosts,
    ) -> None:
        self.shards = [cols.shards[i] for i in sub.tolist()]
        self.node_ids = [s.node_id for s in self.shards]
        self.ties = ties
        self.base = base
        self.tx = tx
        self.entry = entry
        self.exit = entry  # one-way latency is symmetric
        self.n_layers = cols.n_layers
        self.costs = costs
        self.default_ms = snapshot.default_latency_ms
        self.latency = snapshot.latency_ms
        self.ring_weight = costs.ring_weight
        self.has = cols.has[sub]
        self.pos = cols.pos[sub]
        self.half_h = cols.half_h[sub]
        self.coords = [trusted(s.coord) for s in self.shards]
        self.origin: NetCoord | None = None
        self._cols = cols
        self._sub = sub
        self._extra = extra
        self._snapshot = snapshot
        self.bias: FloatArray | None = None  # the spreading term already in ``base`` (recent_busy)
        starts = cols.start[sub]
        ends = cols.end[sub]
        self.start_of = starts
        self.end_of = ends
        self.starts = sorted(set(starts.tolist()))
        self.start_groups: dict[int, npt.NDArray[np.intp]] = {}
        self.end_groups: dict[int, npt.NDArray[np.intp]] = {}
        for x in self.starts:
            self.start_groups[x] = np.flatnonzero(starts == x)
        for x in sorted(set(ends.tolist())):
            group = np.flatnonzero(ends == x)
            # Ties among predecessors go to the lower tie key: argmin takes the first of equals.
            self.end_groups[x] = group[np.argsort(ties[group], kind="stable")]
        self.hops: dict[int, FloatArray | None] = {}
        for x in self.starts:
            preds = self.end_groups.get(x)
            if x == 0 or preds is None:
                continue
            succ = self.start_groups[x]
            self.hops[x] = (
                self.hop_matrix(preds, succ) if preds.size * succ.size <= MAX_CACHED_MATRIX else None
            )

    # -- costs of single links ---------------------------------------------------------------------------

    def hop_matrix(self, a: npt.NDArray[np.intp], b: npt.NDArray[np.intp]) -> FloatArray:
        """One-way latency from each shard in ``a`` (rows) to each in ``b`` (columns)."""
        diff = self.pos[a][:, None, :] - self.pos[b][None, :, :]
        near = (
            0.5 * np.sqrt(np.einsum("ijk,ijk->ij", diff, diff))
            + self.half_h[a][:, None]
            + self.half_h[b][None, :]
        )
        both = self.has[a][:, None] & self.has[b][None, :]
        m: FloatArray = np.where(both, near, self.default_ms)
        if self.latency:
            rows: dict[str, list[int]] = {}
            for r, i in enumerate(a.tolist()):
                rows.setdefault(self.node_ids[i], []).append(r)
            cols: dict[str, list[int]] = {}
            for c, j in enumerate(b.tolist()):
                cols.setdefault(self.node_ids[j], []).append(c)
            for (na, nb), ms in self.latency.items():
                if na in rows and nb in cols:
                    for r in rows[na]:
                        for c in cols[nb]:
                            m[r, c] = ms
        return m

    def one_way_ms(self, a: int, b: int) -> float:
        """One-way latency from shard a's node to shard b's node."""
        if self.latency:
            given = self.latency.get((self.node_ids[a], self.node_ids[b]))
            if given is not None:
                return given
        ca, cb = self.coords[a], self.coords[b]
        if ca is None or cb is None:
            return self.default_ms
        return ca.one_way_ms(cb)

    def known_rtt_ms(self, a: int | None, b: int) -> float | None:
        """The estimated round trip between shard a's node (None: the gateway) and shard b's, if measured."""
        cb = self.coords[b]
        if a is None:
            return None if cb is None or self.origin is None else self.origin.rtt_ms(cb)
        if self.latency:
            given = self.latency.get((self.node_ids[a], self.node_ids[b]))
            if given is not None:
                return 2.0 * given
        ca = self.coords[a]
        return None if ca is None or cb is None else ca.rtt_ms(cb)

    def ring_ms(self, last: int, first: int) -> float:
        return 0.0 if last == first else self.ring_weight * self.one_way_ms(last, first)

    def ring_vec(self, lasts: npt.NDArray[np.intp], heads: npt.NDArray[np.intp]) -> FloatArray:
        """:meth:`ring_ms` for many (last, first) pairs at once."""
        if self.latency:
            return np.array([self.ring_ms(int(j), int(h)) for j, h in zip(lasts, heads, strict=True)])
        diff = self.pos[lasts] - self.pos[heads]
        near = 0.5 * np.sqrt(np.einsum("ij,ij->i", diff, diff)) + self.half_h[lasts] + self.half_h[heads]
        ring = np.where(self.has[lasts] & self.has[heads], near, self.default_ms)
        result: FloatArray = np.where(lasts == heads, 0.0, self.ring_weight * ring)
        return result

    def penalised(self, uses: FloatArray) -> tuple[FloatArray, FloatArray]:
        """Shard and transfer costs when each shard carries ``uses`` earlier routes of this look-up:
        each use is one more session of load, plus ``reuse_penalty_ms`` so disjoint routes win."""
        if not uses.any():
            return self.base.copy(), self.tx
        cols, sub = self._cols, self._sub
        load = self._extra + uses
        full_extra = np.zeros(len(cols.shards))
        full_extra[sub] = load
        cost = (
            cols.compute_ms(full_extra, self._snapshot, self.costs)[sub] + self.costs.reuse_penalty_ms * uses
        )
        if self.bias is not None:
            cost = cost + self.bias
        one = self.tx / (1.0 + self.costs.uplink_queue_share * (cols.active[sub] + self._extra))
        tx = one * (1.0 + self.costs.uplink_queue_share * (cols.active[sub] + load))
        return cost, tx

    def path_cost(self, path: Iterable[int], cost: FloatArray, tx: FloatArray) -> float:
        total = 0.0
        prev = -1
        head = -1
        for i in path:
            if prev < 0:
                head = i
                total += float(self.entry[i])
            else:
                total += self.one_way_ms(prev, i) + float(tx[prev])
            total += float(cost[i])
            prev = i
        return total + self.ring_ms(prev, head) + float(self.exit[prev])

    def route(self, path: tuple[int, ...]) -> Route:
        hops = tuple(self.shards[i] for i in path)
        rtts = tuple(self.known_rtt_ms(path[j - 1] if j else None, i) for j, i in enumerate(path))
        rates = tuple(None if j == 0 else self.shards[path[j - 1]].uplink_mbit_s for j in range(len(path)))
        ring = self.known_rtt_ms(path[-1], path[0]) if len(path) > 1 else 0.0
        return Route(
            hops=hops,
            expected_ms_per_token=self.path_cost(path, self.base, self.tx),
            hop_rtt_ms=rtts,
            hop_bandwidth_mbit_s=rates,
            ring_rtt_ms=ring,
            exit_rtt_ms=self.known_rtt_ms(None, path[-1]),
        )

    # -- the search ----------------------------------------------------------------------------------------

    def shortest(self, cost: FloatArray, tx: FloatArray) -> tuple[int, ...] | None:
        """Least-cost 0 -> L path (shard indices) under ``cost`` (inf = banned) and ``tx``, exact
        for every term but the ring (priced for each candidate last stage with its chain's first);
        exact ties to the lower tie key."""
        n = cost.shape[0]
        dist = np.full(n, _INF)
        pred = np.full(n, -1, dtype=np.intp)
        first = np.full(n, -1, dtype=np.intp)
        for x in self.starts:
            here = self.start_groups[x]
            if x == 0:
                dist[here] = self.entry[here] + cost[here]
                first[here] = here
                continue
            preds = self.end_groups.get(x)
            if preds is None:
                continue
            before = dist[preds] + tx[preds]  # inf where no chain reaches the predecessor
            if not np.isfinite(before).any():
                continue
            matrix = self.hops.get(x)
            if matrix is not None:
                total = before[:, None] + matrix
                arg = total.argmin(axis=0)
                best = total[arg, np.arange(here.size)]
            else:
                best = np.empty(here.size)
                arg = np.empty(here.size, dtype=np.intp)
                step = max(1, _SLICE // preds.size)
                for lo in range(0, here.size, step):
                    part = before[:, None] + self.hop_matrix(preds, here[lo : lo + step])
                    a = part.argmin(axis=0)
                    arg[lo : lo + step] = a
                    best[lo : lo + step] = part[a, np.arange(part.shape[1])]
            choice = preds[arg]
            dist[here] = best + cost[here]
            pred[here] = choice
            first[here] = first[choice]
        lasts = self.end_groups.get(self.n_layers)
        if lasts is None:
            return None
        lasts = lasts[np.isfinite(dist[lasts])]
        if lasts.size == 0:
            return None
        ring = self.ring_vec(lasts, first[lasts])
        total = dist[lasts] + ring + self.exit[lasts]
        j = int(lasts[np.lexsort((self.ties[lasts], total))[0]])
        path = []
        while j >= 0:
            path.append(j)
            j = int(pred[j])
        return tuple(reversed(path))


def session_capacity(shard: ShardView, *, free: bool = False) -> float:
    """The most KV positions one session may hold on ``shard``: its announced per-session maximum,
    else its pool's size; with ``free`` also no more than its free KV now. ``inf`` where the node
    announced none of them (an older node: its own Info and OPEN grant decide)."""
    cap = math.inf
    for value in (
        shard.kv_session_max_tokens if shard.kv_session_max_tokens is not None else shard.kv_pool_tokens,
        shard.kv_free_tokens if free else None,
    ):
        if value is not None:
            cap = min(cap, float(value))
    return cap


def largest_context(shards: Iterable[ShardView], n_layers: int, *, free: bool = False) -> int | None:
    """The most KV positions one session can hold on any complete route of ``shards`` (one model's):
    the widest path over the layer boundaries 0..n_layers, a route as wide as its tightest stage
    (:func:`session_capacity`). None when no complete route exists or nobody on the widest one
    announced a bound. What a gateway names in a 413 prompt_too_long; with ``free``: what fits now."""
    best: dict[int, float] = {0: math.inf}
    for shard in sorted(shards, key=attrgetter("start", "end")):
        if shard.start in best and shard.end > shard.start:
            width = min(best[shard.start], session_capacity(shard, free=free))
            if width > best.get(shard.end, -1.0):
                best[shard.end] = width
    end = best.get(n_layers)
    if end is None or math.isinf(end):
        return None
    return int(end)


@dataclass(frozen=True)
class KvContexts:
    """One model's largest servable contexts (:func:`largest_context`), None where unknown."""

    session_max_tokens: int | None  # the most positions one session may ever hold on some route
    free_max_tokens: int | None  # ... and what some route has free for one now


def kv_contexts(snapshot: SwarmSnapshot, model: ModelInfo) -> KvContexts:
    """:func:`largest_context` of ``model``'s live shards, kept with the snapshot (one pass per snapshot)."""
    key = ("routing.kv_contexts", model.fingerprint)
    found = snapshot.memo.get(key)
    if isinstance(found, KvContexts):
        return found
    shards = [s for s in snapshot.shards if s.model_fingerprint == model.fingerprint]
    result = KvContexts(
        largest_context(shards, model.n_layers), largest_context(shards, model.n_layers, free=True)
    )
    snapshot.memo[key] = result
    return result


def _node_disjoint(paths: list[tuple[int, ...]], shards: list[ShardView]) -> bool:
    seen: set[str] = set()
    for p in paths:
        nodes = {shards[i].node_id for i in p}
        if seen & nodes:
            return False
        seen |= nodes
    return True


def _disjoint_by_flow(
    shards: list[ShardView], base: list[float], hop_ms: float, n_layers: int, k: int
) -> list[tuple[int, ...]] | None:
    """k shard-disjoint 0 -> L paths of least total cost (successive shortest paths), or None.

    Parallel shards between the same two boundaries are grouped: only the cheapest
    unused one (forward) and the dearest used one (backward) matter in the residual graph.
    """
    free: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(shards):
        free.setdefault((s.start, s.end), []).append(i)
    for members in free.values():
        members.sort(key=lambda i: (base[i], i))
    used: dict[tuple[int, int], list[int]] = {g: [] for g in free}
    incident: dict[int, list[tuple[int, int]]] = {}
    for a, b in free:
        incident.setdefault(a, []).append((a, b))
        incident.setdefault(b, []).append((a, b))

    for _ in range(k):
        # SPFA (Bellman-Ford with a queue): the residual graph has negative back edges.
        dist = {0: 0.0}
        via: dict[int, tuple[tuple[int, int], bool]] = {}
        queue = deque([0])
        queued = {0}
        while queue:
            u = queue.popleft()
            queued.discard(u)
            du = dist[u]
            for g in incident.get(u, ()):
                a, b = g
                if a == u and free[g]:
                    v, w, fwd = b, base[free[g][0]] + hop_ms, True
                elif b == u and used[g]:
                    v, w, fwd = a, -(max(base[i] for i in used[g]) + hop_ms), False
                else:
                    continue
                if du + w < dist.get(v, _INF) - 1e-9:
                    dist[v] = du + w
                    via[v] = (g, fwd)
                    if v not in queued:
                        queued.add(v)
                        queue.append(v)
        if n_layers not in dist:
            return None
        v = n_layers
        while v != 0:
            g, fwd = via[v]
            if fwd:
                used[g].append(free[g].pop(0))
                v = g[0]
            else:
                dearest = max(used[g], key=lambda i: (base[i], i))
                used[g].remove(dearest)
                bisect.insort(free[g], dearest, key=lambda i: (base[i], i))
                v = g[1]

    # Decompose the flow into k paths (the boundary DAG has no cycles).
    outgoing: dict[int, list[int]] = {}
    for members in used.values():
        for i in members:
            outgoing.setdefault(shards[i].start, []).append(i)
    for lst in outgoing.values():
        lst.sort(key=lambda i: base[i])
    paths: list[tuple[int, ...]] = []
    for _ in range(k):
        x, path = 0, []
        while x != n_layers:
            i = outgoing[x].pop(0)
            path.append(i)
            x = shards[i].end
        paths.append(tuple(path))
    return paths


def _uncovered(shards: list[ShardView], n_layers: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges nobody covers; if every layer is covered but boundaries do not chain,
    the gap between the furthest boundary reachable from 0 and the nearest boundary
    from which ``n_layers`` is reachable."""
    gaps: list[tuple[int, int]] = []
    x = 0
    for s in shards:  # sorted by start
        if s.start > x:
            gaps.append((x, s.start))
        x = max(x, s.end)
    if x < n_layers:
        gaps.append((x, n_layers))
    if gaps:
        return tuple(gaps)
    reach = {0}
    for s in shards:
        if s.start in reach:
            reach.add(s.end)
    co = {n_layers}
    for s in sorted(shards, key=lambda s: s.end, reverse=True):
        if s.end in co:
            co.add(s.start)
    far = max(reach)
    near = min(b for b in co if b > far)
    return ((far, near),)


__all__ = [
    "Route",
    "RouteSelection",
    "RoutingCosts",
    "DEFAULT_COSTS",
    "repriced_ms",
    "select_routes",
    "shard_cost_ms",
    "transfer_ms",
    "trusted",
]
