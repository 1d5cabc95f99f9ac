"""The load terms of the route cost (queueing), re-pricing, and the pruned search at scale."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from swarm_strategies import FP, shard, snapshot, swarms

from tracker.coordinates import NetCoord
from tracker.routing import (
    DEFAULT_COSTS,
    RoutingCosts,
    repriced_ms,
    select_routes,
    shard_cost_ms,
    transfer_ms,
)
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot


@settings(max_examples=100, deadline=None, derandomize=True)
@given(swarms(positioned=True), st.integers(0, 2**32), st.floats(0.0, 6.0))
def test_extra_sessions_price_like_reported_ones(snap: SwarmSnapshot, seed: int, extra: float) -> None:
    """Sessions handed out since the last report (``extra_sessions``) cost what the same number of
    reported sessions would: the route found and its price agree with a snapshot that reports them."""
    eligible = [s for s in snap.shards if s.model_fingerprint == FP]
    if not eligible:
        return
    whole = {s.node_id: float(int(extra)) for s in eligible}
    reported = dataclasses.replace(
        snap,
        shards=tuple(
            dataclasses.replace(s, active_sessions=s.active_sessions + int(extra))
            if s.node_id in whole
            else s
            for s in snap.shards
        ),
    )
    a = select_routes(snap, FP, 1, rng=random.Random(seed), extra_sessions=whole)
    b = select_routes(reported, FP, 1, rng=random.Random(seed))
    assert [r.node_ids for r in a.routes] == [r.node_ids for r in b.routes]
    for ra, rb in zip(a.routes, b.routes, strict=True):
        assert ra.expected_ms_per_token == pytest.approx(rb.expected_ms_per_token)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.floats(0.5, 50.0),
    st.integers(1, 32),
    st.integers(0, 40),
    st.integers(0, 4),
    st.floats(1.0, 1000.0),
)
def test_costs_grow_with_load(ms: float, cap: int, active: int, queued: int, uplink: float) -> None:
    s = shard(
        "n", 0, 10, ms=ms, max_sessions=cap, active_sessions=active, queue_depth=queued, uplink_mbit_s=uplink
    )
    snap = snapshot(10, [s])
    costs = [shard_cost_ms(s, snap, DEFAULT_COSTS, extra) for extra in (0.0, 1.0, 2.0, 5.0)]
    sends = [transfer_ms(s, 4096, DEFAULT_COSTS, extra) for extra in (0.0, 1.0, 2.0, 5.0)]
    assert costs == sorted(costs) and sends == sorted(sends)
    assert costs[0] >= ms  # never cheaper than one token alone
    if active + 1 < cap:
        assert costs[1] < DEFAULT_COSTS.saturated_penalty_ms + 100 * ms  # not full: no penalty yet


def test_near_nodes_are_used_until_busy_then_a_farther_one_wins() -> None:
    """Two one-stage routes: a near one and one 40 ms away. Idle, the near one wins; loaded with
    enough sessions (the wait for a slot), the far one does."""
    gw = NetCoord((0.0, 0.0, 0.0), 1.0, 0.05)
    near_c = NetCoord((2.0, 0.0, 0.0), 1.0, 0.05)
    far_c = NetCoord((80.0, 0.0, 0.0), 1.0, 0.05)

    def swarm(near_load: int) -> SwarmSnapshot:
        return snapshot(
            10,
            [
                shard("near", 0, 10, ms=20.0, max_sessions=16, active_sessions=near_load, coord=near_c),
                shard("far", 0, 10, ms=20.0, max_sessions=16, coord=far_c),
            ],
        )

    picks = [
        select_routes(swarm(n), FP, 1, rng=random.Random(0), origin=gw).routes[0].node_ids for n in range(16)
    ]
    assert picks[0] == ("near",)
    switch = picks.index(("far",))
    assert 2 <= switch <= 14  # used while lightly loaded, not until full
    assert all(p == ("far",) for p in picks[switch:])


@settings(max_examples=80, deadline=None, derandomize=True)
@given(swarms(positioned=True), st.integers(0, 2**32), st.data())
def test_repriced_matches_a_fresh_look_up(snap: SwarmSnapshot, seed: int, data: st.DataObject) -> None:
    """A pooled route re-priced at new loads costs what a look-up on a snapshot with those loads
    reports for that same route; at the loads it was priced with, it is unchanged."""
    sel = select_routes(snap, FP, 1, rng=random.Random(seed))
    if not sel.routes:
        return
    (route,) = sel.routes
    n_embd = snap.model(FP).n_embd  # type: ignore[union-attr]
    assert repriced_ms(route, {}, n_embd) == route.expected_ms_per_token
    now = {h.node_id: float(data.draw(st.integers(0, 6))) for h in route.hops}
    loaded = dataclasses.replace(
        snap,
        shards=tuple(
            dataclasses.replace(s, active_sessions=int(now[s.node_id])) if s.node_id in now else s
            for s in snap.shards
        ),
    )
    only = dataclasses.replace(loaded, shards=tuple(s for s in loaded.shards if s.node_id in now))
    again = select_routes(only, FP, 1, rng=random.Random(seed))
    assert again.routes
    same = [r for r in again.routes if r.node_ids == route.node_ids]
    if same:
        assert repriced_ms(route, now, n_embd) == pytest.approx(same[0].expected_ms_per_token)


def _big_swarm(n: int, seed: int) -> tuple[SwarmSnapshot, NetCoord]:
    rng = random.Random(seed)
    centres = [(rng.uniform(-100, 100), rng.uniform(-100, 100), rng.uniform(-30, 30)) for _ in range(6)]
    shards = []
    for i in range(n):
        start = rng.randrange(0, 8) * 10
        end = min(80, start + rng.choice([1, 2, 3]) * 10)
        c = rng.choice(centres)
        shards.append(
            ShardView(
                node_id=f"{i:064x}",
                model_fingerprint=FP,
                start=start,
                end=end,
                decode_ms_per_token=rng.uniform(2.0, 40.0),
                prefill_tokens_per_s=500.0,
                active_sessions=rng.randrange(0, 5),
                max_sessions=8,
                coord=NetCoord(tuple(x + rng.gauss(0.0, 8.0) for x in c), rng.uniform(1.0, 25.0), 0.1),  # type: ignore[arg-type]
                uplink_mbit_s=100.0,
            )
        )
    models = (ModelInfo(FP, "m", 80, 576),)
    return SwarmSnapshot(models=models, shards=tuple(shards)), NetCoord(centres[0], 1.0, 0.05)


def test_pruned_search_at_scale_is_deterministic_and_spreads_k_routes() -> None:
    """1 500 shards, 150+ per span (pruning active): 32 routes over distinct nodes, in the same
    order for the same seed, the first no dearer than the best of the routes found."""
    snap, origin = _big_swarm(1500, 3)
    a = select_routes(snap, FP, 32, rng=random.Random(5), origin=origin)
    b = select_routes(dataclasses.replace(snap), FP, 32, rng=random.Random(5), origin=origin)  # cold memo
    assert [r.node_ids for r in a.routes] == [r.node_ids for r in b.routes]
    assert len(a.routes) == 32
    nodes = [n for r in a.routes for n in r.node_ids]
    assert len(nodes) == len(set(nodes))
    assert a.routes[0].expected_ms_per_token == min(r.expected_ms_per_token for r in a.routes)


def test_bad_cost_weights_are_refused() -> None:
    with pytest.raises(ValueError):
        RoutingCosts(max_occupancy=1.0)
    with pytest.raises(ValueError):
        RoutingCosts(prune_floor=0)
    RoutingCosts(queue_wait_weight=0.0, max_occupancy=1000.0)  # the model before: no wait term


def test_recently_busy_nodes_cost_more_only_when_spreading_is_on() -> None:
    """``recent_busy`` with ``recent_busy_ms``: of two equal nodes, the one busy lately loses, by
    exactly its share times the weight; with the weight 0 (the default) the share changes nothing."""
    snap = snapshot(10, [shard("a", 0, 10, 10.0), shard("b", 0, 10, 10.5)])
    busy = {"a": 0.4}
    plain = select_routes(snap, FP, 1, rng=random.Random(1), recent_busy=busy)
    assert plain.routes[0].node_ids == ("a",)  # off: the faster node
    spread = RoutingCosts(recent_busy_ms=100.0)
    got = select_routes(snap, FP, 2, rng=random.Random(1), costs=spread, recent_busy=busy)
    assert [r.node_ids for r in got.routes] == [("b",), ("a",)]
    assert got.routes[1].expected_ms_per_token == pytest.approx(
        select_routes(snap, FP, 1, rng=random.Random(1)).routes[0].expected_ms_per_token + 40.0
    )
    # Shares outside 0..1 are clipped; nodes not named are not charged.
    over = select_routes(snap, FP, 1, rng=random.Random(1), costs=spread, recent_busy={"a": 7.0})
    assert over.routes[0].node_ids == ("b",)
    b_alone = select_routes(snap, FP, 1, rng=random.Random(1), exclude_nodes=frozenset({"a"}))
    assert over.routes[0].expected_ms_per_token == pytest.approx(b_alone.routes[0].expected_ms_per_token)


def test_pruning_with_light_gateway_legs_keeps_the_nodes_with_short_last_miles() -> None:
    """With the gateway legs weighted down, a span's pruned candidates are still ranked by what
    every hop into and out of a node costs at least (half its height each way), not by compute
    alone: the node with the short last mile is kept and chosen."""
    far = NetCoord((0.0, 0.0, 0.0), 40.0, 0.1)
    near = NetCoord((0.0, 0.0, 0.0), 2.0, 0.1)
    shards = [shard(f"slow{i}", 0, 5, 9.0, coord=far) for i in range(8)]
    shards.append(shard("quick", 0, 5, 10.0, coord=near))
    shards += [shard("tail", 5, 10, 1.0, coord=near)]
    snap = snapshot(10, shards)
    costs = RoutingCosts(gateway_leg_weight=0.0, prune_floor=1, prune_per_route=0)
    got = select_routes(snap, FP, 1, rng=random.Random(3), costs=costs, origin=near)
    assert got.routes[0].node_ids == ("quick", "tail")
