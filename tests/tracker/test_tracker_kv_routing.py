"""Routes by free KV: the tracker sends a long prompt to the route whose nodes announced room for it.

In process (quart test client), signed announcements and heartbeats as nodes send them; the
heartbeats' ``kv_free_tokens`` (a node's free KV pool positions) decide which route fits.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tracker_helpers import MODEL, FakeClock, announce_for, key, signed, test_config

from proto.announce import Heartbeat, PayloadError
from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.routing import largest_context, select_routes
from tracker.service import Registry
from tracker.snapshot import ShardView
from tracker.store import Store, make_engine


@pytest.fixture
async def swarm(tmp_path: Path, db_url: str) -> AsyncIterator[tuple[Any, FakeClock, Registry]]:
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


async def _node(
    client: Any, clock: FakeClock, seed: int, start: int, end: int, ms: float, kv_free: int
) -> None:
    k = key(seed)
    announce = announce_for(k, start, end, ms=ms, port=9000 + seed)
    assert (await _post(client, "/v1/announce", signed(k, "announce", announce.to_json(), clock())))[0] == 200
    beat = Heartbeat(
        public_key_hex(k), active_sessions=0, queue_depth=0, kv_free_tokens=kv_free, tokens_served=0
    )
    assert (await _post(client, "/v1/heartbeat", signed(k, "heartbeat", beat.to_json(), clock())))[0] == 200


async def test_a_long_prompt_goes_to_the_route_with_room_for_it(swarm) -> None:
    client, clock, registry = swarm
    # A fast 2-node route with little free KV, and a slow 1-node route with a large free pool.
    await _node(client, clock, 1, 0, 15, 5.0, kv_free=2048)
    await _node(client, clock, 2, 15, 30, 5.0, kv_free=4096)
    await _node(client, clock, 3, 0, 30, 50.0, kv_free=12288)
    fast = [public_key_hex(key(1)), public_key_hex(key(2))]
    slow = [public_key_hex(key(3))]

    def nodes(body: Any) -> list[list[str]]:
        return [[h["node_id"] for h in r["hops"]] for r in body["routes"]]

    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 1})
    assert status == 200 and nodes(body) == [fast]  # cheapest when KV does not matter
    assert [h["kv_free_tokens"] for h in body["routes"][0]["hops"]] == [2048, 4096]
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 1, "kv_tokens": 2000})
    assert status == 200 and nodes(body) == [fast]  # fits on every stage of the fast route
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 2, "kv_tokens": 6000})
    assert status == 200 and nodes(body) == [slow]  # the first stage of the fast one has 2048 free
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "kv_tokens": 20000})
    assert status == 503 and body["routes"] == []
    r = await client.get(f"/v1/routes?model={MODEL.fingerprint}&kv_tokens=3000")
    assert [[h["node_id"] for h in x["hops"]] for x in json.loads(await r.get_data())["routes"]] == [slow]
    for bad in (-1, "many", True):
        assert (await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "kv_tokens": bad}))[0] == 400
    # The search itself, on the registry's snapshot.
    snap = await registry.snapshot()
    found = select_routes(snap, MODEL.fingerprint, 1, rng=random.Random(0), kv_tokens=6000).routes
    assert [[h.node_id for h in r.hops] for r in found] == [slow]


async def _pool_node(
    client: Any,
    clock: FakeClock,
    seed: int,
    start: int,
    end: int,
    *,
    pool: int,
    session_max: int,
    free: int,
    preemptions: int | None = None,
    refusals: int | None = None,
) -> str:
    k = key(seed)
    announce = announce_for(k, start, end, ms=5.0, port=9000 + seed)
    assert (await _post(client, "/v1/announce", signed(k, "announce", announce.to_json(), clock())))[0] == 200
    beat = Heartbeat(
        public_key_hex(k),
        active_sessions=1,
        queue_depth=0,
        kv_free_tokens=free,
        tokens_served=0,
        kv_used_tokens=pool - free,
        kv_pool_tokens=pool,
        kv_session_max_tokens=session_max,
        kv_preemptions=preemptions,
        kv_refusals=refusals,
    )
    assert (await _post(client, "/v1/heartbeat", signed(k, "heartbeat", beat.to_json(), clock())))[0] == 200
    return public_key_hex(k)


async def test_pool_sizes_are_kept_shown_and_name_the_largest_context(swarm) -> None:
    client, clock, registry = swarm
    # Route A: [0,15) one session up to 4096 (1000 free now) + [15,30) up to 8192; route B: one node
    # [0,30) whose sessions may hold 2048 each, with 12000 free.
    a0 = await _pool_node(
        client, clock, 11, 0, 15, pool=8192, session_max=4096, free=1000, preemptions=3, refusals=12
    )
    a1 = await _pool_node(
        client, clock, 12, 15, 30, pool=16384, session_max=8192, free=8000, preemptions=0, refusals=0
    )
    b = await _pool_node(client, clock, 13, 0, 30, pool=16384, session_max=2048, free=12000)
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 2})
    assert status == 200
    # The widest route holds 4096 per session (A's tightest stage); what is free for one now: 2048 (B).
    assert body["kv"] == {"session_max_tokens": 4096, "free_max_tokens": 2048}
    hops = {h["node_id"]: h for r in body["routes"] for h in r["hops"]}
    assert (hops[a0]["kv_pool_tokens"], hops[a0]["kv_session_max_tokens"]) == (8192, 4096)
    assert (hops[b]["kv_pool_tokens"], hops[b]["kv_session_max_tokens"]) == (16384, 2048)
    # 1,500 positions: A's first stage has 1000 free, B holds it. 3,000: B may never hold that many
    # for one session and A has no room now -- no route, but the answer says the swarm could (4096).
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 2, "kv_tokens": 1500})
    assert status == 200 and [[h["node_id"] for h in r["hops"]] for r in body["routes"]] == [[b]]
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 2, "kv_tokens": 3000})
    assert status == 503 and body["routes"] == [] and body["kv"]["session_max_tokens"] == 4096
    # The node list and the dashboard show pool size, used and free per node.
    swarm_body = json.loads(await (await client.get("/v1/swarm")).get_data())
    shard = next(n["shard"] for n in swarm_body["nodes"] if n["node_id"] == a1)
    assert (shard["kv_pool_tokens"], shard["kv_session_max_tokens"], shard["kv_used_tokens"]) == (
        16384,
        8192,
        8384,
    )
    state = await registry.dashboard_state()  # what /v1/dashboard/state serves
    row = next(n for n in state["nodes"] if n["node_id"] == a0)
    assert (row["kv_pool_tokens"], row["kv_used_tokens"], row["kv_free_tokens"]) == (8192, 7192, 1000)
    # Preemptions and KV refusals since each node started: shown where reported, null where not (b).
    pressure = {n["node_id"]: (n["kv_preemptions"], n["kv_refusals"]) for n in state["nodes"]}
    assert (pressure[a0], pressure[a1], pressure[b]) == ((3, 12), (0, 0), (None, None))
    assert (shard["kv_preemptions"], shard["kv_refusals"]) == (0, 0)
    # /metrics: per node, and the largest context per model.
    text = (await (await client.get("/metrics")).get_data()).decode()
    assert f'swarm_tracker_node_kv_pool_tokens{{node="{b[:16]}"}} 16384' in text
    assert f'swarm_tracker_node_kv_free_tokens{{node="{a0[:16]}"}} 1000' in text
    assert f'swarm_tracker_node_kv_preemptions{{node="{a0[:16]}"}} 3' in text
    assert f'swarm_tracker_node_kv_refusals{{node="{a0[:16]}"}} 12' in text
    assert f'swarm_tracker_node_kv_refusals{{node="{a1[:16]}"}} 0' in text
    assert f'swarm_tracker_node_kv_preemptions{{node="{b[:16]}"}}' not in text  # not reported
    context = [line for line in text.splitlines() if line.startswith("swarm_tracker_kv_context_max_tokens")]
    by_kind = {
        kind: float(line.split()[-1])
        for line in context
        for kind in ("session", "free")
        if f'"{kind}"' in line
    }
    assert by_kind == {"session": 4096.0, "free": 2048.0}, context
    # A later heartbeat's counts replace the earlier ones; announcing again clears them.
    clock.advance(0.5)
    later = Heartbeat(a0, 1, 0, 1000, 0, kv_preemptions=4, kv_refusals=20)
    status, _ = await _post(client, "/v1/heartbeat", signed(key(11), "heartbeat", later.to_json(), clock()))
    assert status == 200
    text = (await (await client.get("/metrics")).get_data()).decode()
    assert f'swarm_tracker_node_kv_preemptions{{node="{a0[:16]}"}} 4' in text
    assert f'swarm_tracker_node_kv_refusals{{node="{a0[:16]}"}} 20' in text
    again = announce_for(key(11), 0, 15, ms=5.0, port=9011)
    status, _ = await _post(client, "/v1/announce", signed(key(11), "announce", again.to_json(), clock()))
    assert status == 200
    swarm_body = json.loads(await (await client.get("/v1/swarm")).get_data())
    shard = next(n["shard"] for n in swarm_body["nodes"] if n["node_id"] == a0)
    assert (shard["kv_preemptions"], shard["kv_refusals"]) == (None, None)


def test_heartbeat_kv_pressure_round_trips_and_is_validated() -> None:
    node = public_key_hex(key(1))
    beat = Heartbeat(node, 0, 0, 10, 0, kv_preemptions=3, kv_refusals=12)
    body = beat.to_json()
    assert (body["kv_preemptions"], body["kv_refusals"]) == (3, 12)
    assert Heartbeat.from_json(body) == beat
    zero = Heartbeat(node, 0, 0, 10, 0, kv_preemptions=0, kv_refusals=0)
    assert Heartbeat.from_json(zero.to_json()) == zero and zero.to_json()["kv_refusals"] == 0
    # Not reported: absent from the JSON; a heartbeat without them (an older node) still parses.
    old = Heartbeat(node, 0, 0, 10, 0)
    assert "kv_preemptions" not in old.to_json() and "kv_refusals" not in old.to_json()
    parsed = Heartbeat.from_json(old.to_json())
    assert (parsed.kv_preemptions, parsed.kv_refusals) == (None, None)
    assert Heartbeat.from_json({**old.to_json(), "kv_refusals": None}).kv_refusals is None
    for field in ("kv_preemptions", "kv_refusals"):
        for bad in (-1, 1.5, "3", True, 1 << 41):
            with pytest.raises(PayloadError, match=field):
                Heartbeat.from_json({**body, field: bad})


def _shard(node: str, start: int, end: int, **kv: int | None) -> ShardView:
    return ShardView(node, MODEL.fingerprint, start, end, 5.0, 500.0, **kv)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shards", "free", "expected"),
    [
        ([], False, None),  # no route at all
        ([_shard("a", 0, 15, kv_session_max_tokens=4096)], False, None),  # a gap: no complete route
        ([_shard("a", 0, 30)], False, None),  # nobody announced a bound
        ([_shard("a", 0, 15, kv_session_max_tokens=4096), _shard("b", 15, 30)], False, 4096),
        ([_shard("a", 0, 30, kv_pool_tokens=9000)], False, 9000),  # no per-session maximum: the pool
        ([_shard("a", 0, 30, kv_session_max_tokens=4096, kv_free_tokens=100)], True, 100),
        (
            [
                _shard("a", 0, 10, kv_session_max_tokens=8192),
                _shard("b", 10, 30, kv_session_max_tokens=1024),
                _shard("c", 0, 20, kv_session_max_tokens=2048),
                _shard("d", 20, 30, kv_session_max_tokens=16384),
                _shard("e", 10, 20, kv_session_max_tokens=32768),
            ],
            False,
            8192,  # a -> e -> d, not the cheaper-looking two-stage routes
        ),
    ],
)
def test_largest_context_is_the_widest_complete_route(
    shards: list[ShardView], free: bool, expected: int | None
) -> None:
    assert largest_context(shards, 30, free=free) == expected


def test_heartbeat_prefix_heads_round_trip_and_bad_ones_are_refused() -> None:
    node = public_key_hex(key(7))
    heads = tuple(f"{i:032x}" for i in range(3))
    beat = Heartbeat(node, 0, 0, 10, 0, prefix_heads=heads)
    assert beat.to_json()["prefix_heads"] == list(heads) and Heartbeat.from_json(beat.to_json()) == beat
    assert "prefix_heads" not in Heartbeat(node, 0, 0, 10, 0).to_json()  # none: not sent (older trackers)
    base = Heartbeat(node, 0, 0, 10, 0).to_json()
    for bad, why in (
        (["ab" * 15], "32 lowercase hex"),  # too short
        (["ab" * 17], "32 lowercase hex"),  # too long
        (["AB" * 16], "32 lowercase hex"),
        ([7], "32 lowercase hex"),
        ("ab" * 16, "list of at most 32"),
        ([f"{i:032x}" for i in range(33)], "list of at most 32"),  # too many
        (["ab" * 16, "ab" * 16], "each head once"),
    ):
        with pytest.raises(PayloadError, match=why):
            Heartbeat.from_json({**base, "prefix_heads": bad})


async def test_prefix_heads_reach_the_route_answer_and_a_heartbeat_without_them_clears_them(swarm) -> None:
    client, clock, registry = swarm
    k = key(21)
    node = public_key_hex(k)
    announce = announce_for(k, 0, 30, ms=5.0, port=9021)
    assert (await _post(client, "/v1/announce", signed(k, "announce", announce.to_json(), clock())))[0] == 200
    heads = ("0f" * 16, "1e" * 16)
    beat = Heartbeat(node, 0, 0, 1000, 0, prefix_heads=heads)
    assert (await _post(client, "/v1/heartbeat", signed(k, "heartbeat", beat.to_json(), clock())))[0] == 200
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 1})
    assert status == 200 and body["routes"][0]["hops"][0]["prefix_heads"] == list(heads)
    swarm_body = json.loads(await (await client.get("/v1/swarm")).get_data())
    shard = next(n["shard"] for n in swarm_body["nodes"] if n["node_id"] == node)
    assert shard["prefix_heads"] == list(heads)
    # A malformed list is refused with a reason.
    clock.advance(0.5)
    bad = {**beat.to_json(), "prefix_heads": ["zz" * 16]}
    status, err = await _post(client, "/v1/heartbeat", signed(k, "heartbeat", bad, clock()))
    assert status == 400 and "prefix_heads" in json.dumps(err)
    # A heartbeat without heads (nothing kept any more) clears them.
    clock.advance(0.5)
    empty = Heartbeat(node, 0, 0, 1000, 0)
    assert (await _post(client, "/v1/heartbeat", signed(k, "heartbeat", empty.to_json(), clock())))[0] == 200
    clock.advance(2.0)  # past the routing snapshot's age
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 1})
    assert body["routes"][0]["hops"][0]["prefix_heads"] == []


async def test_hops_carry_the_load_the_route_was_priced_with(swarm) -> None:
    """The figures a gateway re-prices its pooled routes with (common/route_cost.py): the second
    look-up's route is priced with the first's hand-outs (priced_sessions above the reported load)."""
    from gateway.routes import parse_routes

    client, clock, registry = swarm
    await _node(client, clock, 1, 0, 30, 5.0, kv_free=4096)
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 1})
    assert status == 200
    (hop,) = body["routes"][0]["hops"]
    assert (hop["decode_ms_per_token"], hop["active_sessions"], hop["queue_depth"]) == (5.0, 0, 0)
    assert hop["max_sessions"] >= 1 and hop["priced_sessions"] == 0
    status, body = await _post(client, "/v1/routes", {"model": MODEL.fingerprint, "k": 1})
    (hop,) = body["routes"][0]["hops"]
    assert hop["active_sessions"] == 0 and hop["priced_sessions"] == 1.0  # the first hand-out
    (route,) = parse_routes(body, 0.0).routes
    assert route.stage_loads is not None and route.stage_loads[0].priced_sessions == 1.0
