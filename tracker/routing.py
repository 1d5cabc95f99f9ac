"""Route selection: which chains of shards should serve a model right now.

Pure function over a :class:`~tracker.snapshot.SwarmSnapshot`; no I/O, no
clock, randomness only through the injected ``random.Random`` (used to break
exact ties, so identical nodes share traffic across calls while a given seed
always gives the same answer).

The graph
    Vertices are layer boundaries ``0..L``; every eligible shard ``[a, b)`` is an
    edge ``a -> b``. A route is a path ``0 -> L``: shards that tile the layers
    contiguously. Because the hop latency depends on the *pair* of consecutive
    nodes, the dynamic programme runs over shards (the state is "the last shard
    taken"), visiting boundaries in increasing order -- a DAG shortest path.

Cost of a route (milliseconds per generated token)
    ``entry + sum(compute(s)) + sum(hop(s_i, s_i+1)) + exit`` where
    ``compute(s) = decode_ms_per_token * (1 + (active + queue) / max_sessions)``
    plus ``saturated_penalty_ms`` when the shard is full (active >= max or no
    free KV) plus ``snapshot.relay_penalty_ms`` when it is reached through a
    relay; ``hop`` is ``snapshot.latency_ms[(a, b)]`` or
    ``snapshot.default_latency_ms``; entry (gateway to first stage) and exit
    (last stage back to the gateway) use the default latency.

k routes (data parallelism)
    Routes are chosen one after another; every shard already used counts as
    one more active session plus ``reuse_penalty_ms`` per use, so later routes
    avoid earlier nodes when they can. If that greedy pass still shares nodes
    but k node-disjoint routes exist (checked with a min-cost flow over the
    boundary graph), the disjoint set is returned instead. Routes are distinct;
    fewer than k come back when fewer distinct routes exist.

Invariants of the result
    * every route tiles ``0..L`` contiguously with shards of the requested
      model, none from ``exclude_nodes``, each starting and ending at the
      model's split points (``ModelInfo.split_points``; a shard announced at
      another boundary cannot be served and is ignored);
    * ``uncovered`` is empty exactly when ``routes`` is non-empty.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter

from tracker.errors import UnknownModel
from tracker.snapshot import ShardView, SwarmSnapshot

_INF = float("inf")


@dataclass(frozen=True)
class Route:
    hops: tuple[ShardView, ...]
    expected_ms_per_token: float

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
    """Tunable weights of the cost model (all in milliseconds per token)."""

    saturated_penalty_ms: float = 1000.0  # shard at max sessions or with no free KV
    reuse_penalty_ms: float = 10_000.0  # per earlier route that already uses the shard
    min_decode_ms_per_token: float = 0.001  # floor for nonsensical measurements (<= 0)


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
    return cost


def select_routes(
    snapshot: SwarmSnapshot,
    model_fingerprint: str,
    k: int = 1,
    *,
    exclude_nodes: frozenset[str] = frozenset(),
    rng: random.Random,
    costs: RoutingCosts = DEFAULT_COSTS,
) -> RouteSelection:
    """Up to ``k`` distinct minimum-latency routes for the model; see the module docstring.

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
        ),
        key=attrgetter("start"),  # stable: equal starts keep the snapshot's order
    )
    # One draw per eligible shard, in start order (the snapshot's order among equal starts):
    # the same snapshot and seed always give the same answer.
    ties = [rng.random() for _ in shards]
    base = [shard_cost_ms(s, snapshot, costs) for s in shards]
    graph = _Graph(shards, base, ties, snapshot, n_layers)

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

    routes = [
        Route(hops=tuple(shards[i] for i in p), expected_ms_per_token=graph.path_cost(p, base)) for p in paths
    ]
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
    """Eligible shards indexed by boundary, with the DAG shortest path over them."""

    def __init__(
        self,
        shards: list[ShardView],
        base: list[float],
        ties: list[float],
        snapshot: SwarmSnapshot,
        n_layers: int,
    ) -> None:
        self.shards = shards
        self.ties = ties
        self.n_layers = n_layers
        self.default_ms = snapshot.default_latency_ms
        self.latency = snapshot.latency_ms
        self.min_hop_ms = min([self.default_ms, *self.latency.values()]) if self.latency else self.default_ms
        self.start_of = [s.start for s in shards]
        self.end_of = [s.end for s in shards]
        # Only the pairwise-latency search needs shards grouped by start boundary.
        self.by_start: dict[int, list[int]] = {}
        if self.latency:
            for i, x in enumerate(self.start_of):
                self.by_start.setdefault(x, []).append(i)
        self.starts = sorted(self.by_start)

    def hop_ms(self, a: int, b: int) -> float:
        if not self.latency:
            return self.default_ms
        return self.latency.get((self.shards[a].node_id, self.shards[b].node_id), self.default_ms)

    def path_cost(self, path: Iterable[int], cost: list[float]) -> float:
        total = self.default_ms  # gateway -> first stage
        prev = -1
        for i in path:
            if prev >= 0:
                total += self.hop_ms(prev, i)
            total += cost[i]
            prev = i
        return total + self.default_ms  # last stage -> gateway

    def shortest(self, cost: list[float]) -> tuple[int, ...] | None:
        """Least-cost 0 -> L path (shard indices) under ``cost``, exact ties to the lower tie key."""
        if self.latency:
            return self._shortest_pairwise(cost)
        # Every hop costs the default: the best way into boundary x does not depend on the next
        # shard, so one pass in start order settles it (shards ending at x all start before x).
        hop = self.default_ms
        starts, ends, ties = self.start_of, self.end_of, self.ties
        reach: dict[int, tuple[float, float, int]] = {
            0: (0.0, -1.0, -1)
        }  # boundary -> (dist, tie, last shard)
        pred = [-1] * len(cost)
        for j, x in enumerate(starts):
            r = reach.get(x)
            if r is None or cost[j] == _INF:  # infinite cost = banned shard
                continue
            pred[j] = r[2]
            d = r[0] + hop + cost[j]  # the hop into j: from the gateway when x == 0
            e = ends[j]
            cur = reach.get(e)
            if cur is None or d < cur[0] or (d == cur[0] and ties[j] < cur[1]):
                reach[e] = (d, ties[j], j)
        last = reach.get(self.n_layers)
        if last is None:
            return None
        path = []
        j = last[2]
        while j >= 0:
            path.append(j)
            j = pred[j]
        return tuple(reversed(path))

    def _shortest_pairwise(self, cost: list[float]) -> tuple[int, ...] | None:
        """As :meth:`shortest` when some node pairs have their own latency: the state is the last shard."""
        shards, ties = self.shards, self.ties
        n = len(cost)
        dist = [_INF] * n
        pred = [-1] * n
        ends_at: dict[int, list[int]] = {}
        min_hop = self.min_hop_ms
        for x in self.starts:
            here = self.by_start[x]
            if x == 0:
                for j in here:
                    if cost[j] < _INF:  # infinite cost = banned shard
                        dist[j] = self.default_ms + cost[j]
                        ends_at.setdefault(shards[j].end, []).append(j)
                continue
            preds = ends_at.get(x)
            if not preds:
                continue
            preds.sort(key=lambda p: (dist[p], ties[p]))
            for j in here:
                if cost[j] == _INF:
                    continue
                best_p, best_d = -1, _INF
                for p in preds:
                    dp = dist[p]
                    if dp + min_hop > best_d:
                        break  # sorted by dist: nobody further down can win
                    d = dp + self.hop_ms(p, j)
                    if d < best_d or (d == best_d and ties[p] < ties[best_p]):
                        best_p, best_d = p, d
                dist[j] = best_d + cost[j]
                pred[j] = best_p
                ends_at.setdefault(shards[j].end, []).append(j)
        last = ends_at.get(self.n_layers)
        if not last:
            return None
        j = min(last, key=lambda p: (dist[p], ties[p]))
        path = []
        while j >= 0:
            path.append(j)
            j = pred[j]
        return tuple(reversed(path))


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


__all__ = ["Route", "RouteSelection", "RoutingCosts", "DEFAULT_COSTS", "select_routes", "shard_cost_ms"]
