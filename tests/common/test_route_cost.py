"""The load terms of a route's cost, shared by the tracker and the gateway (common/route_cost.py),
and the live gateway's choice among its pooled routes by that cost (gateway/routes.py acquire)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.route_cost import DEFAULT_LOAD_COSTS, LoadCosts, StageLoad, compute_ms, repriced_ms, transfer_ms
from gateway.admission import cheapest_now
from gateway.metrics import Metrics
from gateway.routes import RouteCache, parse_routes
from tracker import routing
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot

FP = "ab" * 32


def _shard(i: int, start: int, end: int, rng: random.Random) -> ShardView:
    return ShardView(
        node_id=f"{i:064x}",
        model_fingerprint=FP,
        start=start,
        end=end,
        decode_ms_per_token=rng.uniform(1.0, 40.0),
        prefill_tokens_per_s=500.0,
        active_sessions=rng.randrange(0, 6),
        max_sessions=rng.choice([1, 4, 8, 16]),
        queue_depth=rng.randrange(0, 3),
        uplink_mbit_s=rng.choice([None, 20.0, 100.0]),
        kv_free_tokens=rng.choice([None, 0, 5000]),
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(0, 2**32), st.lists(st.integers(0, 9), min_size=3, max_size=3))
def test_the_shared_function_reprices_like_the_tracker(seed: int, loads: list[int]) -> None:
    """common.route_cost.repriced_ms, from the figures the tracker sends a gateway, equals
    tracker.routing.repriced_ms on the tracker's own route."""
    rng = random.Random(seed)
    shards = tuple(_shard(i, 10 * (i % 3), 10 * (i % 3) + 10, rng) for i in range(9))
    snap = SwarmSnapshot(models=(ModelInfo(FP, "m", 30, 2048),), shards=shards)
    (route,) = routing.select_routes(snap, FP, 1, rng=random.Random(seed)).routes
    now = {h.node_id: float(n) for h, n in zip(route.hops, loads, strict=False)}
    stages = [
        StageLoad(
            h.decode_ms_per_token,
            h.max_sessions,
            h.active_sessions,
            h.queue_depth,
            h.kv_free_tokens,
            h.uplink_mbit_s,
        )
        for h in route.hops
    ]
    ours = repriced_ms(route.expected_ms_per_token, stages, [now[h.node_id] for h in route.hops], 2048)
    assert ours == pytest.approx(routing.repriced_ms(route, now, 2048))
    assert repriced_ms(route.expected_ms_per_token, stages, [None] * len(stages), 2048) == (
        route.expected_ms_per_token
    )


def test_the_load_terms() -> None:
    c = LoadCosts(batch_growth_per_session=0.5, queue_wait_weight=1.0, max_occupancy=0.9)
    assert compute_ms(10.0, 4, 0, costs=c) == 10.0
    # one session: the step grows by half, occupancy 1/4 waits 1/3 of a token
    assert compute_ms(10.0, 4, 1, costs=c) == pytest.approx(10.0 * (1 + 0.5 + (0.25 / 0.75)))
    # full: occupancy capped at 0.9, plus the saturation penalty; no free KV is full too
    assert compute_ms(10.0, 4, 4, costs=c) == pytest.approx(10.0 * (1 + 2.0 + 9.0) + 1000.0)
    assert compute_ms(10.0, 4, 0, kv_free_tokens=0, costs=c) == pytest.approx(1010.0)
    assert compute_ms(-1.0, 4, 0, costs=c) == c.min_decode_ms_per_token  # nonsense measurement
    assert transfer_ms(100.0, 1000, 0) == pytest.approx(1000 * 4 * 8 / 100_000)
    assert transfer_ms(None, 1000, 2) == pytest.approx(1000 * 4 * 8 / 50_000 * 2.0)
    with pytest.raises(ValueError):
        repriced_ms(1.0, [StageLoad(1.0, 1, 0)], [], 10)
    with pytest.raises(ValueError):
        LoadCosts(max_occupancy=1.0)


def _hop(node: str, start: int, end: int, **load: object) -> dict:
    return {"node_id": node, "start": start, "end": end, "address": f"{node}:1", **load}


def _answer(*routes: tuple[float, list[dict]]) -> dict:
    return {
        "model": {"fingerprint": FP, "name": "m", "n_layers": 30, "n_embd": 2048},
        "routes": [
            {"hops": hops, "ticket": {"payload": "x"}, "expires_at": 1e10, "expected_ms_per_token": ms}
            for ms, hops in routes
        ],
    }


def _load(decode: float, limit: int, active: int, priced: float | None = None) -> dict:
    return {
        "decode_ms_per_token": decode,
        "max_sessions": limit,
        "active_sessions": active,
        "queue_depth": 0,
        "priced_sessions": active if priced is None else priced,
    }


def _cache() -> RouteCache:
    return RouteCache(
        None,  # type: ignore[arg-type]  # acquire never asks the tracker
        k=2,
        ttl_s=10,
        tracker_timeout_s=5,
        metrics=Metrics(),
        tracker_key=None,  # type: ignore[arg-type]
    )


def test_hops_carry_the_load_figures_and_each_stage_its_uplink() -> None:
    body = _answer(
        (
            50.0,
            [
                _hop("a", 0, 15, **_load(20.0, 8, 2, 2.5)),
                _hop("b", 15, 30, bandwidth_mbit_s=40.0, **_load(10.0, 4, 1)),
            ],
        )
    )
    answer = parse_routes(body, 0.0)
    route = answer.routes[0]
    assert route.n_embd == 2048
    assert route.stage_loads == (
        StageLoad(20.0, 8, 2.5, 0, None, 40.0),
        StageLoad(10.0, 4, 1.0, 0, None, None),
    )
    assert answer.reported_sessions == {"a": 2, "b": 1}
    # A tracker from before the figures, or nonsense in one of them: the route cannot be re-priced.
    assert parse_routes(_answer((5.0, [_hop("a", 0, 30)])), 0.0).routes[0].stage_loads is None
    bad = _answer((5.0, [_hop("a", 0, 15, **_load(1.0, 2, 0)), _hop("b", 15, 30, **_load(-1.0, 2, 0))]))
    assert parse_routes(bad, 0.0).routes[0].stage_loads is None


def test_the_gateway_uses_the_near_route_until_its_load_costs_more_than_the_far_one() -> None:
    answer = parse_routes(
        _answer(
            (50.0, [_hop("near", 0, 30, **_load(20.0, 8, 0))]),
            (80.0, [_hop("far", 0, 30, **_load(20.0, 8, 0))]),
        ),
        0.0,
    )
    near, far = answer.routes
    cache = _cache()
    cache.note_reported(answer)
    chosen = []
    for _ in range(6):
        costs = {r.route_id: cache.route_cost(r) for r in (near, far)}
        route = cache.acquire([near, far])
        assert costs[route.route_id] == min(costs.values())  # the cheapest now, by the shared function
        chosen.append(route.hops[0].node_id)
    # 50, then +8.9, +18.7, +30 ms on the near node (batch growth, the wait for a slot): three
    # sessions go near before the far one is cheaper; least-loaded would have alternated.
    assert chosen[:4] == ["near", "near", "near", "far"]
    assert chosen.count("near") > chosen.count("far") >= 1
    # Sessions that end free the near route again.
    for _ in range(3):
        cache.release(near)
    assert cache.acquire([near, far]) is near


def test_the_load_the_tracker_reported_counts() -> None:
    answer = parse_routes(
        _answer(
            (50.0, [_hop("near", 0, 30, **_load(20.0, 8, 5))]),
            (80.0, [_hop("far", 0, 30, **_load(20.0, 8, 0))]),
        ),
        0.0,
    )
    near, far = answer.routes
    cache = _cache()
    cache.note_reported(answer)
    assert cache.sessions_now(near) == [5.0]
    # Priced at 5 sessions already (50 ms): unchanged until this gateway adds its own.
    assert cache.route_cost(near) == pytest.approx(50.0)
    busy = parse_routes(
        _answer(
            (50.0, [_hop("near", 0, 30, **_load(20.0, 8, 5, priced=0))]),
            (80.0, [_hop("far", 0, 30, **_load(20.0, 8, 0))]),
        ),
        0.0,
    )
    cache = _cache()
    cache.note_reported(busy)
    # Priced idle, reported busy with 5 of 8: dearer than the far route now.
    assert cache.acquire(list(busy.routes)).hops[0].node_id == "far"


def test_without_load_figures_the_least_loaded_route() -> None:
    answer = parse_routes(_answer((50.0, [_hop("a", 0, 30)]), (80.0, [_hop("b", 0, 30)])), 0.0)
    cache = _cache()
    cache.note_reported(answer)
    got = [cache.acquire(list(answer.routes)).hops[0].node_id for _ in range(4)]
    assert got == ["a", "b", "a", "b"]
    assert cheapest_now(["x", "y"], {"x": 2.0, "y": 1.0}.get, lambda r: 0, lambda r: 0.0) == "y"
    assert cheapest_now(["x", "y"], {"x": 2.0, "y": None}.get, {"x": 0, "y": 1}.get, lambda r: 0.0) == "x"
    with pytest.raises(ValueError):
        cheapest_now([], lambda r: 0.0, lambda r: 0, lambda r: 0.0)
    assert DEFAULT_LOAD_COSTS == LoadCosts()
