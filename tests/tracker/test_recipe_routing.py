"""Routes chain only shards of one runtime recipe (tracker/recipes.py, routing.select_routes).

A route whose stages differ in recipe (another llama.cpp build, a GPU backend) is refused by its
nodes at OPEN; the tracker must never hand one out. The pure part: worked examples and a
hypothesis property over random swarms with random recipes; the tracker part: nodes whose join
challenge recorded two recipes, through ``/v1/routes`` of a real Registry (in process, real
SQLite)."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from swarm_strategies import FP, shard, snapshot, swarms
from tracker_helpers import MODEL, FakeClock, announce_for, key, signed, test_config

from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.recipes import recipe_exclusions
from tracker.routing import select_routes
from tracker.service import Registry
from tracker.snapshot import ShardView, SwarmSnapshot
from tracker.store import Store, make_engine
from tracker.trust_store import ChallengeTarget

CPU, GPU = "c" * 64, "9" * 64


def recipes(route_hops: tuple[ShardView, ...]) -> set[str]:
    return {h.recipe_fingerprint for h in route_hops if h.recipe_fingerprint}


def test_the_cheapest_mix_is_never_handed_out() -> None:
    """A fast GPU first half and a fast CPU second half would be the cheapest route, but they run
    other recipes: the routes offered are all-CPU and all-GPU, never the mix."""
    snap = snapshot(
        30,
        [
            shard("gpu-a", 0, 15, 1.0, recipe_fingerprint=GPU),
            shard("cpu-a", 0, 15, 20.0, recipe_fingerprint=CPU),
            shard("cpu-b", 15, 30, 1.0, recipe_fingerprint=CPU),
            shard("gpu-b", 15, 30, 20.0, recipe_fingerprint=GPU),
        ],
    )
    mixed = select_routes(snap, FP, 4, rng=random.Random(0), one_recipe=False).routes
    assert ("gpu-a", "cpu-b") in [r.node_ids for r in mixed]  # what the old search offered first
    routes = select_routes(snap, FP, 4, rng=random.Random(0)).routes
    assert sorted(r.node_ids for r in routes) == [("cpu-a", "cpu-b"), ("gpu-a", "gpu-b")]
    assert all(len(recipes(r.hops)) == 1 for r in routes)


def test_shards_of_unknown_recipe_join_either_and_a_lone_recipe_changes_nothing() -> None:
    unknown = shard("relayed", 15, 30, 1.0)  # relayed: never dialled by the challenge, recipe unknown
    snap = snapshot(
        30,
        [
            shard("gpu-a", 0, 15, 1.0, recipe_fingerprint=GPU),
            shard("cpu-a", 0, 15, 5.0, recipe_fingerprint=CPU),
            unknown,
        ],
    )
    routes = select_routes(snap, FP, 2, rng=random.Random(0)).routes
    assert [r.node_ids for r in routes] == [("gpu-a", "relayed"), ("cpu-a", "relayed")]
    one = snapshot(
        30, [shard("a", 0, 15, recipe_fingerprint=CPU), shard("b", 15, 30, recipe_fingerprint=CPU), unknown]
    )
    assert recipe_exclusions(one, FP) == ()
    plain = select_routes(one, FP, 3, rng=random.Random(7), one_recipe=False)
    assert select_routes(one, FP, 3, rng=random.Random(7)) == plain


def test_no_route_of_one_recipe_reports_what_is_uncovered() -> None:
    snap = snapshot(
        30, [shard("gpu-a", 0, 15, recipe_fingerprint=GPU), shard("cpu-b", 15, 30, recipe_fingerprint=CPU)]
    )
    sel = select_routes(snap, FP, 2, rng=random.Random(0))
    assert sel.routes == () and sel.uncovered


@settings(max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(swarms(), st.lists(st.sampled_from(["", CPU, GPU]), min_size=64, max_size=64), st.integers(1, 4))
def test_every_route_offered_runs_one_recipe_and_tiles_the_model(
    swarm: SwarmSnapshot, picks: list[str], k: int
) -> None:
    shards = tuple(
        dataclasses.replace(s, recipe_fingerprint=picks[i % len(picks)]) for i, s in enumerate(swarm.shards)
    )
    snap = dataclasses.replace(swarm, shards=shards)
    fp = snap.models[0].fingerprint
    n_layers = snap.models[0].n_layers
    # A node serves one recipe per model: give every shard of a node its first shard's recipe.
    first: dict[str, str] = {}
    for s in snap.shards:
        first.setdefault(s.node_id, s.recipe_fingerprint)
    snap = dataclasses.replace(
        snap, shards=tuple(dataclasses.replace(s, recipe_fingerprint=first[s.node_id]) for s in snap.shards)
    )
    sel = select_routes(snap, fp, k, rng=random.Random(1))
    assert len(sel.routes) <= k
    for route in sel.routes:
        assert len(recipes(route.hops)) <= 1
        assert route.hops[0].start == 0 and route.hops[-1].end == n_layers
        assert all(a.end == b.start for a, b in zip(route.hops, route.hops[1:], strict=False))
    assert len({r.node_ids for r in sel.routes}) == len(sel.routes)


# -- the tracker: recipes recorded by the join challenge, routes through /v1/routes ------------------


@pytest.fixture
async def tracker(tmp_path: Path, db_url: str) -> AsyncIterator[tuple[Any, FakeClock, Registry]]:
    clock = FakeClock()
    store = Store(make_engine(db_url))
    registry = Registry(
        store, test_config(tmp_path, db_url=db_url), key(99), clock=clock, rng=random.Random(0)
    )
    await registry.start()
    try:
        yield create_app(registry).test_client(), clock, registry
    finally:
        store.close()


async def _post(client: Any, path: str, body: Any) -> tuple[int, Any]:
    r = await client.post(path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return r.status_code, json.loads(await r.get_data())


async def test_the_tracker_never_hands_out_a_route_mixing_recipes(tracker: Any) -> None:
    client, clock, registry = tracker
    nodes = {1: (0, 15, 1.0, GPU), 2: (15, 30, 20.0, GPU), 3: (0, 15, 20.0, CPU), 4: (15, 30, 1.0, CPU)}
    for seed, (start, end, ms, _recipe) in nodes.items():
        announce = announce_for(key(seed), start, end, ms=ms, port=9000 + seed)
        status, _ = await _post(
            client, "/v1/announce", signed(key(seed), "announce", announce.to_json(), clock())
        )
        assert status == 200
    ids = {seed: public_key_hex(key(seed)) for seed in nodes}

    def hops(body: Any) -> list[tuple[str, ...]]:
        return sorted(tuple(h["node_id"] for h in r["hops"]) for r in body["routes"])

    # Before any challenge recorded a recipe the cheapest route mixes the two fast halves.
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 1})
    assert status == 200 and hops(body) == [(ids[1], ids[4])]
    # What the join challenge records (the node's Info: check fingerprint and recipe fingerprint).
    for seed, (start, end, _ms, recipe) in nodes.items():
        target = ChallengeTarget(
            ids[seed], MODEL.fingerprint, f"127.0.0.1:{9000 + seed}", start, end, 30, 576
        )
        registry.store.trust.finish_challenge(
            target,
            recipe=recipe,
            route_recipe=recipe,
            input_id="x",
            digest="",
            outcome="no_reference",
            detail="",
            routable=True,
            now_s=clock(),
        )
    registry.invalidate_snapshot()
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 4})
    assert status == 200 and hops(body) == sorted([(ids[1], ids[2]), (ids[3], ids[4])])
    snap = await registry.snapshot()
    assert {s.node_id: s.recipe_fingerprint for s in snap.shards} == {ids[s]: nodes[s][3] for s in nodes}
