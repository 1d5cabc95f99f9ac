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

from proto.announce import Heartbeat
from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.routing import select_routes
from tracker.service import Registry
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
