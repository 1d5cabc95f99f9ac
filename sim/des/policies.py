"""The decisions under test: where a joining node sits, and which route a request takes.

"tracker" policies call the tracker's real pure functions
(:func:`tracker.placement.recommend_span`, :func:`tracker.routing.select_routes`);
nothing here re-implements them. Routing "tracker" passes the asking gateway's
network coordinate (``origin``) and a snapshot with the nodes' coordinates;
"blind" is the same function on a snapshot without them (the tracker before
network coordinates). The baselines exist only to compare against:

``random`` placement
    a node takes a span as long as its memory allows, at a uniformly random start.
``nearest`` routing
    walk the layer boundaries from 0; at each one take the shard nearest to the
    gateway (lowest one-way latency; longer span on ties) among those from which
    the last layer can still be reached; ignore load. k routes prefer nodes not
    yet used by earlier routes of the same selection.

A route replacement (a stage died) is asked as the gateway would ask the
tracker: "give me shards for the span ``[a, b)`` of my route, not these
nodes". With the tracker policy that is ``select_routes`` on a snapshot
restricted to the kept stages plus every live shard inside ``[a, b)``, which
forces the answer to keep the healthy stages; if no such route exists, a
whole new route from the full snapshot (stages that stay on it keep their KV).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tracker.coordinates import NetCoord
from tracker.placement import recommend_span
from tracker.routing import DEFAULT_COSTS, Route, RoutingCosts, select_routes
from tracker.snapshot import ShardView, SwarmSnapshot


@dataclass(frozen=True)
class PlannedRoute:
    node_ids: tuple[str, ...]
    expected_ms_per_token: float
    route: Route | None = None  # the tracker's route (its stages' views at look-up), for re-pricing


# one-way latency in ms from a node to a gateway (by index)
LatencyFn = Callable[[str, int], float]
# a gateway's network coordinate (by index), None when it has none yet
OriginFn = Callable[[int], NetCoord | None]


class Placement:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.calls = 0
        self.wall_s = 0.0  # time spent inside the placement function (machine-dependent)

    def choose(
        self, snapshot: SwarmSnapshot, fingerprint: str, n_layers: int, capacity: int, rng: random.Random
    ) -> tuple[int, int]:
        self.calls += 1
        if self.kind == "tracker":
            t0 = time.perf_counter()
            try:
                return recommend_span(snapshot, fingerprint, capacity, rng=rng)
            finally:
                self.wall_s += time.perf_counter() - t0
        cap = min(capacity, n_layers)
        start = rng.randint(0, n_layers - cap)
        return start, start + cap


class Routing:
    def __init__(
        self,
        kind: str,
        latency_ms: LatencyFn,
        origin: OriginFn = lambda _g: None,
        costs: RoutingCosts = DEFAULT_COSTS,
        recent_busy: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self.kind = kind
        self._recent_busy = recent_busy  # node id -> recent busy share, for the spreading term
        self._latency_ms = latency_ms
        self._origin = origin if kind == "tracker" else (lambda _g: None)
        self.costs = costs
        self.calls = 0  # how many times a route selector ran
        self.wall_s = 0.0  # time spent inside route selection (machine-dependent)

    def select(
        self,
        snapshot: SwarmSnapshot,
        fingerprint: str,
        k: int,
        gateway: int,
        rng: random.Random,
        exclude: frozenset[str] = frozenset(),
    ) -> list[PlannedRoute]:
        self.calls += 1
        if self.kind in ("tracker", "blind"):
            t0 = time.perf_counter()
            sel = select_routes(
                snapshot,
                fingerprint,
                k,
                exclude_nodes=exclude,
                rng=rng,
                costs=self.costs,
                origin=self._origin(gateway),
                recent_busy=self._recent_busy() if self._recent_busy is not None else None,
            )
            self.wall_s += time.perf_counter() - t0
            return [
                PlannedRoute(tuple(h.node_id for h in r.hops), r.expected_ms_per_token, r) for r in sel.routes
            ]
        shards = [
            s for s in snapshot.shards if s.model_fingerprint == fingerprint and s.node_id not in exclude
        ]
        model = snapshot.model(fingerprint)
        if model is None:
            return []
        return _nearest_routes(shards, 0, model.n_layers, k, lambda nid: self._latency_ms(nid, gateway))

    def replace(
        self,
        snapshot: SwarmSnapshot,
        fingerprint: str,
        route: list[ShardView],
        lost: list[int],
        gateway: int,
        rng: random.Random,
        exclude: frozenset[str],
    ) -> PlannedRoute | None:
        """A route equal to ``route`` outside the span of the ``lost`` stages, or a whole new one."""
        i0, i1 = min(lost), max(lost)
        a, b = route[i0].start, route[i1].end
        kept = route[:i0] + route[i1 + 1 :]
        inside = [
            s
            for s in snapshot.shards
            if s.model_fingerprint == fingerprint and a <= s.start and s.end <= b and s.node_id not in exclude
        ]
        self.calls += 1
        if self.kind in ("tracker", "blind"):
            restricted = SwarmSnapshot(
                models=snapshot.models,
                shards=tuple(kept) + tuple(inside),
                latency_ms=snapshot.latency_ms,
                default_latency_ms=snapshot.default_latency_ms,
                relay_penalty_ms=snapshot.relay_penalty_ms,
            )
            t0 = time.perf_counter()
            sel = select_routes(
                restricted,
                fingerprint,
                1,
                exclude_nodes=exclude,
                rng=rng,
                costs=self.costs,
                origin=self._origin(gateway),
            )
            self.wall_s += time.perf_counter() - t0
            if sel.routes:
                r = sel.routes[0]
                return PlannedRoute(tuple(h.node_id for h in r.hops), r.expected_ms_per_token, r)
        else:
            mid = _nearest_routes(inside, a, b, 1, lambda nid: self._latency_ms(nid, gateway))
            if mid:
                ids = (
                    tuple(s.node_id for s in route[:i0])
                    + mid[0].node_ids
                    + tuple(s.node_id for s in route[i1 + 1 :])
                )
                return PlannedRoute(ids, mid[0].expected_ms_per_token)
        whole = self.select(snapshot, fingerprint, 1, gateway, rng, exclude)
        return whole[0] if whole else None


def _nearest_routes(
    shards: list[ShardView], first: int, last: int, k: int, latency: Callable[[str], float]
) -> list[PlannedRoute]:
    """Greedy nearest-first routes tiling ``first..last`` (see module docstring)."""
    by_start: dict[int, list[ShardView]] = {}
    for s in shards:
        if first <= s.start < s.end <= last:
            by_start.setdefault(s.start, []).append(s)
    # Boundaries from which ``last`` is reachable, found backwards.
    reach = {last}
    for x in sorted(by_start, reverse=True):
        if any(s.end in reach for s in by_start[x]):
            reach.add(x)
    if first not in reach:
        return []
    lat = {s.node_id: latency(s.node_id) for s in shards}
    for lst in by_start.values():
        lst.sort(key=lambda s: (lat[s.node_id], -(s.end - s.start), s.node_id))
    used: set[str] = set()
    routes: list[PlannedRoute] = []
    seen: set[tuple[str, ...]] = set()
    for _ in range(k):
        x, hops, cost = first, [], 0.0
        while x != last:
            options = [s for s in by_start[x] if s.end in reach]
            fresh = [s for s in options if s.node_id not in used]
            s = (fresh or options)[0]
            hops.append(s.node_id)
            cost += 2 * lat[s.node_id] + s.decode_ms_per_token
            x = s.end
        ids = tuple(hops)
        if ids in seen:
            break
        seen.add(ids)
        used.update(ids)
        routes.append(PlannedRoute(ids, cost))
    return routes
