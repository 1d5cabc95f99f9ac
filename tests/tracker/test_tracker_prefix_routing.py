"""The tracker prices a request's prompt prefix (tracker.routing.select_routes(prefix_heads=...),
common.route_cost.prefix_miss_ms): the route whose every stage holds the longest prefix wins while
its load allows; without heads every answer is what it was; the look-up's prefix_heads over HTTP."""

from __future__ import annotations

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

from common.prefix_chain import BLOCK_TOKENS, chain, head
from common.route_cost import DEFAULT_LOAD_COSTS, prefix_miss_ms
from node.prefix_blocks import PrefixBlocks
from proto.announce import Heartbeat
from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.routing import MAX_ROUTE_PREFIX_HEADS, select_routes
from tracker.service import Registry
from tracker.store import Store, make_engine

RECIPE = "3c" * 32
SYSTEM = [4 + i % 91 for i in range(60 * BLOCK_TOKENS)]  # a 960-token system prompt
LONG = [4 + i % 93 for i in range(130 * BLOCK_TOKENS)]  # 2,080 tokens


def reported(*kept: list[int]) -> tuple[str, ...]:
    """The heads a node keeping these token lists reports (its real index)."""
    index = PrefixBlocks(RECIPE)
    for i, toks in enumerate(kept):
        index.add(f"s{i}", toks)
    return tuple(index.heads())


def request_heads(prompt: list[int]) -> tuple[str, ...]:
    return tuple(head(h) for h in chain(RECIPE, prompt))


def two_routes(warm_load: int = 0, half: bool = False) -> Any:
    """Routes a (holding the system prompt on both stages, or only its first with ``half``) and b."""
    kept = reported(SYSTEM + [1] * 40)
    return snapshot(
        4,
        [
            shard("a0", 0, 2, prefix_heads=kept, active_sessions=warm_load, max_sessions=16),
            shard("a1", 2, 4, prefix_heads=() if half else kept, active_sessions=warm_load, max_sessions=16),
            shard("b0", 0, 2, max_sessions=16),
            shard("b1", 2, 4, max_sessions=16),
        ],
    )


def best(snap: Any, heads: tuple[str, ...] = ()) -> tuple[str, ...]:
    found = select_routes(snap, FP, 1, rng=random.Random(1), prefix_heads=heads).routes
    return found[0].node_ids


def test_the_route_holding_the_prompts_prefix_on_every_stage_is_preferred() -> None:
    prompt = request_heads(SYSTEM + [2] * 40)  # another client's question after the same system prompt
    assert best(two_routes(), prompt) == ("a0", "a1")
    # b pays, per stage, the positions a's heads show it holds (the ladder's 32 blocks of the 60 shared).
    miss = prefix_miss_ms(100.0, 32 * BLOCK_TOKENS)  # the shards prefill 100 tokens/s
    assert miss == pytest.approx(512 / 100.0 * 1000.0 / DEFAULT_LOAD_COSTS.prefix_answer_tokens)
    one_stage = snapshot(2, [shard("a", 0, 2, prefix_heads=reported(SYSTEM + [1] * 40)), shard("b", 0, 2)])
    plain = {
        r.node_ids: r.expected_ms_per_token
        for r in select_routes(one_stage, FP, 2, rng=random.Random(1)).routes
    }
    priced = select_routes(one_stage, FP, 2, rng=random.Random(1), prefix_heads=prompt).routes
    assert [r.node_ids for r in priced] == [("a",), ("b",)]
    assert priced[0].expected_ms_per_token == plain[("a",)]
    assert priced[1].expected_ms_per_token == pytest.approx(plain[("b",)] + miss)
    # A prompt sharing nothing with what is kept: priced as without heads.
    other = select_routes(
        one_stage, FP, 2, rng=random.Random(1), prefix_heads=request_heads([9] * 400)
    ).routes
    assert {r.node_ids: r.expected_ms_per_token for r in other} == plain


def test_a_route_holding_it_on_one_stage_only_is_not_the_holder() -> None:
    snap = two_routes(half=True)
    snap = type(snap)(
        models=snap.models,
        shards=(*snap.shards, shard("c0", 0, 2, prefix_heads=reported(SYSTEM + [1] * 40), max_sessions=16)),
    )
    # c0 and a0 hold it on [0, 2); only b1 and a1 (which holds nothing) serve [2, 4): the first stage is
    # a holder either way, and a1 without the prefix is no better than b1.
    prompt = request_heads(SYSTEM + [2] * 40)
    found = select_routes(snap, FP, 1, rng=random.Random(3), prefix_heads=prompt).routes[0]
    assert found.node_ids[0] in ("a0", "c0")


def test_load_outweighs_a_held_prefix_past_the_saving() -> None:
    prompt = request_heads(SYSTEM + [2] * 40)
    assert best(two_routes(warm_load=2), prompt) == ("a0", "a1")  # a little busier: still the holder
    assert best(two_routes(warm_load=12), prompt) == ("b0", "b1")  # three quarters full: the idle route
    assert best(two_routes(warm_load=2)) == ("b0", "b1")  # and without the prefix, load decides


def test_the_request_heads_are_bounded() -> None:
    long_prompt = [3 + i % 50 for i in range((MAX_ROUTE_PREFIX_HEADS + 40) * BLOCK_TOKENS)]
    kept = reported(long_prompt + [1] * 20)
    snap = snapshot(2, [shard("a", 0, 2, prefix_heads=kept), shard("b", 0, 2)])
    heads = request_heads(long_prompt + [2] * 20)
    routes = select_routes(snap, FP, 2, rng=random.Random(0), prefix_heads=heads).routes
    prices = {r.node_ids: r.expected_ms_per_token for r in routes}
    plain = {
        r.node_ids: r.expected_ms_per_token for r in select_routes(snap, FP, 2, rng=random.Random(0)).routes
    }
    # Only the first MAX_ROUTE_PREFIX_HEADS blocks count: the ladder's 256th block is the last of them.
    assert prices[("b",)] - plain[("b",)] == pytest.approx(prefix_miss_ms(100.0, 256 * BLOCK_TOKENS))


@settings(max_examples=40, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(swarms(), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_without_a_held_prefix_every_answer_is_what_it_was(snap: Any, k: int, seed: int) -> None:
    if snap.model(FP) is None:
        return
    plain = select_routes(snap, FP, k, rng=random.Random(seed))
    # Heads nobody reported (the shards of these swarms report none): the same routes at the same prices.
    named = select_routes(snap, FP, k, rng=random.Random(seed), prefix_heads=request_heads(SYSTEM))
    assert named == plain


@pytest.fixture
async def app_client(tmp_path: Path, db_url: str) -> AsyncIterator[tuple[Any, FakeClock]]:
    clock = FakeClock()
    store = Store(make_engine(db_url))
    registry = Registry(
        store, test_config(tmp_path, db_url=db_url), key(99), clock=clock, rng=random.Random(0)
    )
    await registry.start()
    try:
        yield create_app(registry).test_client(), clock
    finally:
        store.close()


async def _post(client: Any, body: Any, path: str = "/v1/routes") -> tuple[int, Any]:
    r = await client.post(path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return r.status_code, json.loads(await r.get_data())


async def test_a_route_look_up_naming_the_prompts_heads_gets_the_holder(app_client) -> None:
    client, clock = app_client
    nodes = {}
    for seed, holds in ((31, True), (32, False)):
        k = key(seed)
        announce = announce_for(k, 0, 30, ms=5.0, port=9000 + seed)
        assert (await _post(client, signed(k, "announce", announce.to_json(), clock()), "/v1/announce"))[
            0
        ] == 200
        # The holder is a little busier: without the prefix the idle node wins.
        beat = Heartbeat(
            public_key_hex(k),
            1 if holds else 0,
            0,
            100_000,
            0,
            prefix_heads=reported(LONG + [1] * 40) if holds else (),
        )
        assert (await _post(client, signed(k, "heartbeat", beat.to_json(), clock()), "/v1/heartbeat"))[
            0
        ] == 200
        nodes[holds] = public_key_hex(k)
    prompt_heads = list(request_heads(LONG + [2] * 40))
    status, body = await _post(client, {"model": MODEL.fingerprint, "k": 1, "prefix_heads": prompt_heads})
    assert status == 200 and body["routes"][0]["hops"][0]["node_id"] == nodes[True]
    status, body = await _post(client, {"model": MODEL.fingerprint, "k": 1})
    assert status == 200 and body["routes"][0]["hops"][0]["node_id"] == nodes[False]
    for bad in (["zz" * 16], "0f" * 16, ["0f" * 16] * (MAX_ROUTE_PREFIX_HEADS + 1), [3]):
        status, err = await _post(client, {"model": MODEL.fingerprint, "prefix_heads": bad})
        assert status == 400 and "prefix_heads" in json.dumps(err)
