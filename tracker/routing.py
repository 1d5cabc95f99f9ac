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

    * ``compute(s) = decode_ms_per_token * (1 + (active + queue) / max_sessions)``
      plus ``saturated_penalty_ms`` when the shard is full (active >= max or no
      free KV) plus ``snapshot.relay_penalty_ms`` when it is reached through a relay
      plus ``snapshot.probation_penalty_ms`` when its node is on probation (trusted
      nodes first; probation nodes still serve, their requests checked);
    * ``latency(a, b)`` is one-way: ``snapshot.latency_ms[(a, b)]`` if given, else
      half the RTT the two nodes' network coordinates predict
      (:mod:`tracker.coordinates`; a coordinate whose error exceeds
      ``UNTRUSTED_ERROR`` counts as none), else ``snapshot.default_latency_ms``;
    * ``transfer(s)`` = one token's hidden state (``n_embd * activation_bytes_per_value``)
      over the sender's uplink (``ShardView.uplink_mbit_s``, else ``default_uplink_mbit_s``);
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

Complexity
    Without coordinates or explicit pairs every hop costs the same, so one pass in
    start order settles the best way into each boundary (O(n)). With coordinates,
    each boundary's predecessors are first reduced to those not *dominated* (q
    dominates p when reaching p's position through q is no dearer: then q is at
    least as good for every successor, by the triangle inequality), then every
    successor is priced against that frontier in one vectorised step. Explicit
    ``latency_ms`` pairs use a scan of predecessors cheapest first with an early stop.

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
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from tracker.coordinates import UNTRUSTED_ERROR, NetCoord
from tracker.errors import UnknownModel
from tracker.snapshot import ShardView, SwarmSnapshot

_INF = float("inf")
MAX_FRONTIER = 512  # beyond this many undominated predecessors, the rest are kept unpruned

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
class RoutingCosts:
    """Tunable weights of the cost model (milliseconds per token unless the name says otherwise)."""

    saturated_penalty_ms: float = 1000.0  # shard at max sessions or with no free KV
    reuse_penalty_ms: float = 10_000.0  # per earlier route that already uses the shard
    min_decode_ms_per_token: float = 0.001  # floor for nonsensical measurements (<= 0)
    # One token's hidden state on the wire: n_embd values of this many bytes (4: f32, the exact mode).
    activation_bytes_per_value: float = 4.0
    default_uplink_mbit_s: float = 50.0  # a node that announced no uplink
    gateway_leg_weight: float = 1.0  # how much the gateway -> first and last -> gateway legs count
    ring_weight: float = 1.0  # how much the last -> first stage link counts (0: price open chains only)


DEFAULT_COSTS = RoutingCosts()


def shard_cost_ms(shard: ShardView, snapshot: SwarmSnapshot, costs: RoutingCosts = DEFAULT_COSTS) -> float:
    """Expected compute (+ relay) time of one token through this shard under its current load."""
    # Written without max()/min() calls: this runs once per shard per request (10 000s of times).
    decode = shard.decode_ms_per_token
    if decode < costs.min_decode_ms_per_token:
        decode = costs.min_decode_ms_per_token
    capacity = shard.max_sessions if shard.max_sessions > 1 else 1
    active = shard.active_sessions if shard.active_sessions > 0 else 0
    queued = shard.queue_depth if shard.queue_depth > 0 else 0
    cost = decode * (1.0 + (active + queued) / capacity)
    if active >= capacity or shard.kv_free_tokens == 0:
        cost += costs.saturated_penalty_ms
    if shard.relayed:
        cost += snapshot.relay_penalty_ms
    if shard.probation:
        cost += snapshot.probation_penalty_ms
    return cost


def transfer_ms(shard: ShardView, n_embd: int, costs: RoutingCosts = DEFAULT_COSTS) -> float:
    """Time for ``shard`` to send one token's hidden state over its uplink."""
    mbit = (
        shard.uplink_mbit_s
        if shard.uplink_mbit_s and shard.uplink_mbit_s > 0
        else costs.default_uplink_mbit_s
    )
    return n_embd * costs.activation_bytes_per_value * 8.0 / (mbit * 1000.0)


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
    kv_tokens: int = 0,
) -> RouteSelection:
    """Up to ``k`` distinct minimum-cost routes for the model, for a gateway at ``origin`` (its
    network coordinate; None = unknown); see the module docstring.

    ``kv_tokens`` > 0: the KV positions the request needs on every stage (prompt plus max_tokens);
    a shard whose last heartbeat announced fewer free KV positions is skipped (one that announced
    nothing yet is kept), so a long prompt goes to a route that can hold it.

    Raises :class:`tracker.errors.UnknownModel` if the snapshot has no such model,
    ``ValueError`` if ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    model = snapshot.model(model_fingerprint)
    if model is None:
        raise UnknownModel(f"unknown model fingerprint {model_fingerprint!r}")
    n_layers = model.n_layers
    shards = sorted(
        (
            s
            for s in snapshot.shards
            if s.model_fingerprint == model_fingerprint
            and 0 <= s.start < s.end <= n_layers
            and model.allows(s.start, s.end)
            and s.node_id not in exclude_nodes
            and not (kv_tokens > 0 and s.kv_free_tokens is not None and s.kv_free_tokens < kv_tokens)
        ),
        key=attrgetter("start"),  # stable: equal starts keep the snapshot's order
    )
    # One draw per eligible shard, in start order (the snapshot's order among equal starts):
    # the same snapshot and seed always give the same answer.
    ties = [rng.random() for _ in shards]
    base = [shard_cost_ms(s, snapshot, costs) for s in shards]
    graph = _Graph(shards, base, ties, snapshot, n_layers, model.n_embd, costs, trusted(origin))

    first = graph.shortest(base)
    if first is None:
        return RouteSelection(routes=(), uncovered=_uncovered(shards, n_layers))

    paths: list[tuple[int, ...]] = [first]
    uses = [0] * len(shards)
    last = first
    # A search that returns an existing route makes that route dearer again and retries, so a
    # distinct alternative wins once one exists; the bound keeps a tiny swarm from looping.
    for _ in range(3 * k):
        if len(paths) >= k:
            break
        for i in last:
            uses[i] += 1
        penalised = [_penalised(base[i], shards[i], u, costs) if u else base[i] for i, u in enumerate(uses)]
        last = graph.shortest(penalised) or first
        if last not in paths:
            paths.append(last)
    if len(paths) < k:
        _fill_by_banning(graph, paths, k, uses, base, shards, costs, max_searches=4 * k)

    if k > 1 and not _node_disjoint(paths, shards):
        disjoint = _disjoint_by_flow(shards, base, snapshot.default_latency_ms, n_layers, k)
        if disjoint is not None and _node_disjoint(disjoint, shards):
            paths = disjoint

    routes = [graph.route(p, base) for p in paths]
    order = sorted(range(len(routes)), key=lambda r: (routes[r].expected_ms_per_token, ties[paths[r][0]]))
    return RouteSelection(routes=tuple(routes[r] for r in order), uncovered=())


def _penalised(base: float, shard: ShardView, uses: int, costs: RoutingCosts) -> float:
    """Cost of a shard that ``uses`` earlier routes already run through: each use is one
    more session of load, plus a flat penalty so disjoint alternatives win."""
    decode = max(shard.decode_ms_per_token, costs.min_decode_ms_per_token)
    return base + decode * uses / max(shard.max_sessions, 1) + costs.reuse_penalty_ms * uses


def _fill_by_banning(
    graph: _Graph,
    paths: list[tuple[int, ...]],
    k: int,
    uses: list[int],
    base: list[float],
    shards: list[ShardView],
    costs: RoutingCosts,
    max_searches: int,
) -> None:
    """Add distinct routes by banning one shard of an existing route at a time (appends to ``paths``).

    Any route not yet chosen omits at least one shard of every chosen route (two
    tilings of 0..L that share all of one's shards are equal), so banning single
    shards reaches most of them; bounded by ``max_searches``.
    """
    searches = 0
    while len(paths) < k and searches < max_searches:
        penalised = [_penalised(base[i], shards[i], u, costs) if u else base[i] for i, u in enumerate(uses)]
        best: tuple[float, tuple[int, ...]] | None = None
        for banned in sorted({i for p in paths for i in p}):
            if searches >= max_searches:
                break
            searches += 1
            saved, penalised[banned] = penalised[banned], _INF
            cand = graph.shortest(penalised)
            penalised[banned] = saved
            if cand is None or banned in cand or cand in paths:
                continue
            cost = graph.path_cost(cand, penalised)
            if best is None or cost < best[0]:
                best = (cost, cand)
        if best is None:
            return
        paths.append(best[1])
        for i in best[1]:
            uses[i] += 1


class _Graph:
    """Eligible shards indexed by boundary, their network positions, and the searches over them."""

    def __init__(
        self,
        shards: list[ShardView],
        base: list[float],
        ties: list[float],
        snapshot: SwarmSnapshot,
        n_layers: int,
        n_embd: int,
        costs: RoutingCosts,
        origin: NetCoord | None,
    ) -> None:
        self.shards = shards
        self.ties = ties
        self.n_layers = n_layers
        self.default_ms = snapshot.default_latency_ms
        self.latency = snapshot.latency_ms
        self.leg_weight = costs.gateway_leg_weight
        self.ring_weight = costs.ring_weight
        self.origin = origin
        n = len(shards)
        self.start_of = [0] * n
        self.end_of = [0] * n
        self.tx = [0.0] * n
        self.coords: list[NetCoord | None] = [None] * n
        vecs: list[tuple[float, float, float]] = []
        heights: list[float] = []
        placed: list[int] = []
        self.by_start: dict[int, list[int]] = {}
        # One pass over the shards (this runs per route request over up to 10 000s of them).
        per_bit_ms = n_embd * costs.activation_bytes_per_value * 8.0 / 1000.0
        fallback_rate = costs.default_uplink_mbit_s
        limit = UNTRUSTED_ERROR
        for i, sh in enumerate(shards):
            self.start_of[i] = sh.start
            self.end_of[i] = sh.end
            rate = sh.uplink_mbit_s
            self.tx[i] = per_bit_ms / (rate if rate is not None and rate > 0 else fallback_rate)
            c = sh.coord
            if c is not None and c.error <= limit:
                self.coords[i] = c
                placed.append(i)
                vecs.append(c.vec)
                heights.append(c.height_ms)
            group = self.by_start.get(sh.start)
            if group is None:
                self.by_start[sh.start] = [i]
            else:
                group.append(i)
        self.starts = sorted(self.by_start)
        self.positioned = bool(placed)
        gateway = self.leg_weight * self.default_ms
        if not self.positioned:
            self.entry = [gateway] * n
        else:
            where = np.asarray(placed, dtype=np.intp)
            self.has = np.zeros(n, dtype=bool)
            self.has[where] = True
            self.pos = np.zeros((n, 3))
            self.pos[where] = np.asarray(vecs, dtype=float)
            self.half_h = np.zeros(n)
            self.half_h[where] = 0.5 * np.asarray(heights, dtype=float)
            self.tx_arr = np.asarray(self.tx, dtype=float)
            self.tie_arr = np.asarray(ties, dtype=float)
            entry = np.full(n, gateway)
            if origin is not None:
                diff = self.pos - np.asarray(origin.vec)
                legs = 0.5 * np.sqrt(np.einsum("ij,ij->i", diff, diff)) + self.half_h + 0.5 * origin.height_ms
                entry = np.where(self.has, self.leg_weight * legs, entry)
            self.entry_arr = entry
            self.entry = entry.tolist()
            self.start_groups = {x: np.asarray(g, dtype=np.intp) for x, g in self.by_start.items()}
            ends: dict[int, list[int]] = {}
            for i, e in enumerate(self.end_of):
                ends.setdefault(e, []).append(i)
            self.end_groups = {x: np.asarray(g, dtype=np.intp) for x, g in ends.items()}
        self.exit = self.entry  # one-way latency is symmetric

    # -- costs of single links ---------------------------------------------------------------------------

    def one_way_ms(self, a: int, b: int) -> float:
        """One-way latency from shard a's node to shard b's node."""
        if self.latency:
            given = self.latency.get((self.shards[a].node_id, self.shards[b].node_id))
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
            given = self.latency.get((self.shards[a].node_id, self.shards[b].node_id))
            if given is not None:
                return 2.0 * given
        ca = self.coords[a]
        return None if ca is None or cb is None else ca.rtt_ms(cb)

    def ring_ms(self, last: int, first: int) -> float:
        return 0.0 if last == first else self.ring_weight * self.one_way_ms(last, first)

    def path_cost(self, path: Iterable[int], cost: list[float]) -> float:
        total = 0.0
        prev = -1
        head = -1
        for i in path:
            if prev < 0:
                head = i
                total += self.entry[i]
            else:
                total += self.one_way_ms(prev, i) + self.tx[prev]
            total += cost[i]
            prev = i
        return total + self.ring_ms(prev, head) + self.exit[prev]

    def route(self, path: tuple[int, ...], cost: list[float]) -> Route:
        hops = tuple(self.shards[i] for i in path)
        rtts = tuple(self.known_rtt_ms(path[j - 1] if j else None, i) for j, i in enumerate(path))
        rates = tuple(None if j == 0 else self.shards[path[j - 1]].uplink_mbit_s for j in range(len(path)))
        ring = self.known_rtt_ms(path[-1], path[0]) if len(path) > 1 else 0.0
        return Route(
            hops=hops,
            expected_ms_per_token=self.path_cost(path, cost),
            hop_rtt_ms=rtts,
            hop_bandwidth_mbit_s=rates,
            ring_rtt_ms=ring,
            exit_rtt_ms=self.known_rtt_ms(None, path[-1]),
        )

    # -- searches ------------------------------------------------------------------------------------

    def shortest(self, cost: list[float]) -> tuple[int, ...] | None:
        """Least-cost 0 -> L path (shard indices) under ``cost``, exact ties to the lower tie key."""
        if self.latency:
            return self._shortest_pairwise(cost)
        if self.positioned:
            return self._shortest_positioned(cost)
        return self._shortest_flat(cost)

    def _finish(
        self, last: list[int], dist: list[float], first_of: list[int], pred: list[int]
    ) -> tuple[int, ...] | None:
        """The best complete path among the shards ending at L, with the ring and exit priced exactly."""
        if not last:
            return None
        ties = self.ties
        j = min(last, key=lambda p: (dist[p] + self.ring_ms(p, first_of[p]) + self.exit[p], ties[p]))
        path = []
        while j >= 0:
            path.append(j)
            j = pred[j]
        return tuple(reversed(path))

    def _shortest_flat(self, cost: list[float]) -> tuple[int, ...] | None:
        """Every hop costs the default: the best way into boundary x does not depend on the next
        shard, so one pass in start order settles it (shards ending at x all start before x)."""
        hop = self.default_ms
        starts, ends, ties, tx = self.start_of, self.end_of, self.ties, self.tx
        n = len(cost)
        # boundary -> (dist + the sender's transfer, tie, last shard)
        reach: dict[int, tuple[float, float, int]] = {}
        dist = [_INF] * n
        pred = [-1] * n
        first_of = [-1] * n
        last: list[int] = []
        for j, x in enumerate(starts):
            if cost[j] == _INF:  # infinite cost = banned shard
                continue
            if x == 0:
                dist[j] = self.entry[j] + cost[j]
                first_of[j] = j
            else:
                r = reach.get(x)
                if r is None:
                    continue
                pred[j] = r[2]
                first_of[j] = first_of[r[2]]
                dist[j] = r[0] + hop + cost[j]
            e = ends[j]
            if e == self.n_layers:
                last.append(j)
                continue
            d = dist[j] + tx[j]
            cur = reach.get(e)
            if cur is None or d < cur[0] or (d == cur[0] and ties[j] < cur[1]):
                reach[e] = (d, ties[j], j)
        return self._finish(last, dist, first_of, pred)

    def _shortest_pairwise(self, cost: list[float]) -> tuple[int, ...] | None:
        """With explicit per-pair latencies: the state is the last shard; predecessors are scanned
        cheapest first with an early stop (a hop costs at least the smallest latency known)."""
        shards, ties, tx = self.shards, self.ties, self.tx
        n = len(cost)
        dist = [_INF] * n
        pred = [-1] * n
        first_of = [-1] * n
        ends_at: dict[int, list[int]] = {}
        min_hop = min([self.default_ms, *self.latency.values()])
        if self.positioned:
            min_hop = 0.0
        for x in self.starts:
            here = self.by_start[x]
            if x == 0:
                for j in here:
                    if cost[j] < _INF:  # infinite cost = banned shard
                        dist[j] = self.entry[j] + cost[j]
                        first_of[j] = j
                        ends_at.setdefault(shards[j].end, []).append(j)
                continue
            preds = ends_at.get(x)
            if not preds:
                continue
            preds.sort(key=lambda p: (dist[p] + tx[p], ties[p]))
            for j in here:
                if cost[j] == _INF:
                    continue
                best_p, best_d = -1, _INF
                for p in preds:
                    dp = dist[p] + tx[p]
                    if dp + min_hop > best_d:
                        break  # sorted by dist: nobody further down can win
                    d = dp + self.one_way_ms(p, j)
                    if d < best_d or (d == best_d and ties[p] < ties[best_p]):
                        best_p, best_d = p, d
                dist[j] = best_d + cost[j]
                pred[j] = best_p
                first_of[j] = first_of[best_p]
                ends_at.setdefault(shards[j].end, []).append(j)
        return self._finish(ends_at.get(self.n_layers, []), dist, first_of, pred)

    def _shortest_positioned(self, cost: list[float]) -> tuple[int, ...] | None:
        """With network coordinates: per boundary, the undominated predecessors price every
        successor in one vectorised step (see the module docstring)."""
        n = len(cost)
        cost_arr = np.asarray(cost, dtype=float)
        dist = np.full(n, _INF)
        pred = np.full(n, -1, dtype=np.intp)
        first = np.full(n, -1, dtype=np.intp)
        default = self.default_ms
        for x in self.starts:
            here = self.start_groups[x]
            here = here[cost_arr[here] < _INF]  # infinite cost = banned shard
            if here.size == 0:
                continue
            if x == 0:
                dist[here] = self.entry_arr[here] + cost_arr[here]
                first[here] = here
                continue
            preds = self.end_groups.get(x)
            if preds is None:
                continue
            preds = preds[dist[preds] < _INF]  # shards ending here that a chain reaches
            if preds.size == 0:
                continue
            before = dist[preds] + self.tx_arr[preds]  # each one's value before the hop's latency
            # A successor without a usable coordinate: the cheapest predecessor, plus the default.
            cheapest = int(np.lexsort((self.tie_arr[preds], before))[0])
            best = np.full(here.size, float(before[cheapest]) + default)
            choice = np.full(here.size, int(preds[cheapest]), dtype=np.intp)
            placed = self.has[here]
            if placed.any():
                succ = here[placed]
                # One with a coordinate: the cheapest predecessor without one, plus the default ...
                sub_best = np.full(succ.size, _INF)
                sub_choice = np.full(succ.size, -1, dtype=np.intp)
                unplaced = preds[~self.has[preds]]
                if unplaced.size:
                    u = int(np.lexsort((self.tie_arr[unplaced], dist[unplaced] + self.tx_arr[unplaced]))[0])
                    p0 = int(unplaced[u])
                    sub_best[:] = dist[p0] + self.tx[p0] + default
                    sub_choice[:] = p0
                # ... or the best of the undominated predecessors with one, at the predicted latency.
                with_pos = preds[self.has[preds]]
                if with_pos.size:
                    a = dist[with_pos] + self.tx_arr[with_pos] + self.half_h[with_pos]
                    keep = _frontier(a, self.pos[with_pos], self.tie_arr[with_pos])
                    front = with_pos[keep]
                    value, arg = _price(a[keep], self.pos[front], self.pos[succ])
                    value = value + self.half_h[succ]
                    better = value < sub_best
                    sub_best = np.where(better, value, sub_best)
                    sub_choice = np.where(better, front[arg], sub_choice)
                best[placed] = sub_best
                choice[placed] = sub_choice
            dist[here] = best + cost_arr[here]
            pred[here] = choice
            first[here] = first[choice]  # (a choice of -1 only where dist is infinite)
        lasts = self.end_groups.get(self.n_layers)
        if lasts is None:
            return None
        lasts = lasts[dist[lasts] < _INF]
        if lasts.size == 0:
            return None
        heads = first[lasts]
        diff = self.pos[lasts] - self.pos[heads]
        ring = 0.5 * np.sqrt(np.einsum("ij,ij->i", diff, diff)) + self.half_h[lasts] + self.half_h[heads]
        ring = np.where(self.has[lasts] & self.has[heads], ring, default)
        ring = np.where(lasts == heads, 0.0, self.ring_weight * ring)
        total = dist[lasts] + ring + self.entry_arr[lasts]  # exit = entry: latency is symmetric
        j = int(lasts[np.lexsort((self.tie_arr[lasts], total))[0]])
        path = []
        while j >= 0:
            path.append(j)
            j = int(pred[j])
        return tuple(reversed(path))


def _pairwise_distances(a: FloatArray, b: FloatArray) -> FloatArray:
    """Euclidean distances between the rows of ``a`` (m x 3) and ``b`` (n x 3): an m x n array."""
    diff = a[:, None, :] - b[None, :, :]
    result: FloatArray = np.sqrt(np.einsum("ijk,ijk->ij", diff, diff))
    return result


def _frontier(a: FloatArray, pos: FloatArray, ties: FloatArray) -> npt.NDArray[np.intp]:
    """Indices (into ``a``) of the predecessors no other one dominates, cheapest first.

    q dominates p when ``a[q] + |pos[q] - pos[p]| / 2 <= a[p]``: reaching any successor
    through q then costs no more than through p. The cheapest candidate left is never
    dominated (whatever could dominate it is cheaper, so kept, or dominated by a kept one:
    dominance is transitive); it is kept, and everything it dominates is dropped, until
    nothing is left -- one vectorised test per kept predecessor. Past ``MAX_FRONTIER`` kept
    ones, the rest is kept unpruned (still exact, only slower)."""
    order = np.lexsort((ties, a))
    a_s, pos_s = a[order], pos[order]
    left = np.arange(order.size, dtype=np.intp)
    kept: list[int] = []
    while left.size:
        if len(kept) >= MAX_FRONTIER:
            kept.extend(left.tolist())
            break
        q = int(left[0])
        kept.append(q)
        rest = left[1:]
        diff = pos_s[rest] - pos_s[q]
        reach = a_s[q] + 0.5 * np.sqrt(np.einsum("ij,ij->i", diff, diff))
        left = rest[reach > a_s[rest]]
    result: npt.NDArray[np.intp] = order[np.asarray(kept, dtype=np.intp)]
    return result


def _price(a: FloatArray, front: FloatArray, succ: FloatArray) -> tuple[FloatArray, npt.NDArray[np.intp]]:
    """For each successor position: min over the frontier of ``a + |front - succ| / 2``, and which.
    Done in slices so the temporary stays bounded (about 1M distances)."""
    best = np.empty(succ.shape[0])
    arg = np.empty(succ.shape[0], dtype=np.intp)
    step = max(1, 1_000_000 // max(1, front.shape[0]))
    for lo in range(0, succ.shape[0], step):
        m = a[:, None] + 0.5 * _pairwise_distances(front, succ[lo : lo + step])
        idx = m.argmin(axis=0)
        arg[lo : lo + step] = idx
        best[lo : lo + step] = m[idx, np.arange(m.shape[1])]
    return best, arg


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
    "select_routes",
    "shard_cost_ms",
    "transfer_ms",
    "trusted",
]
