"""Bounds against hostile clients (issue 17): quotas as pure logic with an injected clock, the per-key
share of the nonce cache, pruning of junk, paginated reads, and bad input refused with 400."""

from __future__ import annotations

import base64
import functools
import json
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import trio
from quart.typing import TestClientProtocol as QuartClient
from tracker_helpers import MODEL, FakeClock, announce_for, heartbeat_for, key, signed, test_config

from common.tracker_client import TrackerClient
from proto.announce import ModelSpec
from proto.signing import make_payload, public_key_hex
from tracker.app import address_identity, create_app
from tracker.errors import BadRequest
from tracker.json_input import check_json, parse_json
from tracker.ratelimit import NonceShare, TokenBuckets
from tracker.server import RunningTracker, serve_tracker
from tracker.service import Registry
from tracker.store import Store, make_engine

# --- token buckets: pure, the clock is a number ------------------------------------------------------


def test_a_bucket_passes_its_burst_then_refuses_with_the_wait_until_the_next_token() -> None:
    b = TokenBuckets(rate_per_s=2.0, burst=5, max_keys=10)
    assert all(b.take("a", 100.0).allowed for _ in range(5))
    refused = b.take("a", 100.0)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(0.5)
    assert refused.retry_after_header == "1"
    assert b.take("b", 100.0).allowed  # another identity has its own bucket
    assert not b.take("a", 100.4).allowed  # 0.8 tokens: not yet
    assert b.take("a", 100.5).allowed  # one token refilled
    assert not b.take("a", 100.5).allowed


def test_refused_requests_take_nothing_and_the_bucket_refills_to_its_burst_only() -> None:
    b = TokenBuckets(rate_per_s=1.0, burst=3, max_keys=10)
    for _ in range(3):
        b.take("a", 0.0)
    for _ in range(100):  # hammering while empty does not push the next success further away
        assert not b.take("a", 0.5).allowed
    assert b.take("a", 1.0).allowed
    # a long silence refills to the burst, not beyond it
    assert [b.take("a", 1000.0).allowed for _ in range(4)] == [True, True, True, False]
    stats = b.statistics()
    assert stats.keys == 1 and stats.refused == 101 and stats.allowed == 7


def test_the_table_is_bounded_and_forgets_the_least_recently_seen_identity() -> None:
    b = TokenBuckets(rate_per_s=1.0, burst=1, max_keys=3)
    for k in "abc":
        assert b.take(k, 0.0).allowed
    assert not b.take("a", 0.0).allowed  # "a" is now the most recent
    assert b.take("d", 0.0).allowed  # evicts "b", the least recently seen
    assert len(b) == 3 and b.statistics().evicted == 1
    assert b.take("b", 0.0).allowed  # forgotten: a fresh bucket (evicts "c")
    assert not b.take("a", 0.0).allowed  # still remembered, still empty


def test_a_rate_of_zero_turns_the_limit_off() -> None:
    b = TokenBuckets(rate_per_s=0.0, burst=0, max_keys=1)
    assert all(b.take(str(i), 0.0).allowed for i in range(1000))
    assert len(b) == 0


def test_nonce_share_counts_per_key_until_each_nonce_expires() -> None:
    share = NonceShare(max_per_key=3)
    for i in range(3):
        assert not share.full("flood", 0.0)
        share.add("flood", 10.0 + i)
    assert share.full("flood", 0.0) and not share.full("honest", 0.0)
    assert share.full("flood", 10.0)  # expiry 10.0 is still live at 10.0
    assert not share.full("flood", 10.5)  # the first nonce expired
    assert not share.full("flood", 100.0) and share.keys() == 0 and len(share) == 0


def test_per_address_identity_groups_ipv6_by_64() -> None:
    assert address_identity("203.0.113.7") == "203.0.113.7"
    assert address_identity("2001:db8:1:2:aaaa::1") == address_identity("2001:db8:1:2:bbbb::9")
    assert address_identity("2001:db8:1:2::1") != address_identity("2001:db8:1:3::1")
    assert address_identity("::ffff:198.51.100.1") == "198.51.100.1"
    assert address_identity(None) == ""


# --- JSON input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
        (b'{"a":' * 40 + b"1" + b"}" * 40, "nested deeper than 32"),
        (b'{"model":"\\ud800"}', "model holds a lone UTF-16 surrogate"),
        (b'{"\\udfff":1}', "lone UTF-16 surrogate"),
        (b'{"a":[{"b":"x\\ud800y"}]}', "a[].b holds a lone"),
        (b"{not json", "not valid JSON"),
    ],
)
def test_bad_json_is_a_clear_bad_request(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(message)):
        parse_json(raw)


def test_good_json_passes_untouched() -> None:
    value = parse_json('{"a":[1,{"b":"été \\ud83d\\ude00"}]}'.encode())
    assert value == {"a": [1, {"b": "été 😀"}]}
    check_json(value)


# --- the registry in process ------------------------------------------------------------------------


@dataclass
class Env:
    registry: Registry
    client: QuartClient
    clock: FakeClock
    store: Store

    async def post(self, path: str, body: Any = None, *, data: bytes | None = None) -> tuple[int, Any, Any]:
        if data is None:
            data = json.dumps(body).encode()
        r = await self.client.post(path, data=data, headers={"content-type": "application/json"})
        return r.status_code, json.loads(await r.get_data()), r.headers

    async def get(self, path: str) -> tuple[int, Any]:
        r = await self.client.get(path)
        return r.status_code, json.loads(await r.get_data())


async def _env(tmp_path: Path, **overrides: Any) -> tuple[Env, Store]:
    clock = FakeClock(time.time())
    store = Store(make_engine(f"sqlite:///{tmp_path / 'tracker.sqlite3'}"))
    registry = Registry(store, test_config(tmp_path, **overrides), key(99), clock=clock, rng=random.Random(0))
    await registry.start()
    return Env(registry, create_app(registry).test_client(), clock, store), store


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    e, store = await _env(tmp_path)
    try:
        yield e
    finally:
        store.close()


async def test_one_key_flooding_gets_429_and_honest_heartbeats_all_pass(tmp_path: Path) -> None:
    # The per-key rate off, a small per-key nonce share and a small cache in all: the flood is stopped
    # by its own share, so the cache every node uses never fills.
    e, store = await _env(
        tmp_path,
        key_messages_per_s=0.0,
        nonces_per_key_max=20,
        nonce_cache_max_entries=100,
        address_writes_per_s=0.0,
    )
    try:
        flood, honest = key(1), [key(s) for s in range(2, 6)]
        for k in (flood, *honest):
            envelope = signed(k, "announce", announce_for(k).to_json(), e.clock())
            assert (await e.post("/v1/announce", envelope))[0] == 200
        statuses: dict[int, int] = {}
        for i in range(200):
            e.clock.advance(0.5)  # honest nodes beat every 5 s, the flood 2 per second
            status, body, headers = await e.post(
                "/v1/heartbeat", signed(flood, "heartbeat", heartbeat_for(flood).to_json(), e.clock())
            )
            statuses[status] = statuses.get(status, 0) + 1
            if status == 429:
                assert body["error"]["code"] == "rate_limited" and int(headers["Retry-After"]) >= 1
            if i % 10 == 0:
                for k in honest:
                    h = signed(k, "heartbeat", heartbeat_for(k).to_json(), e.clock())
                    assert (await e.post("/v1/heartbeat", h))[0] == 200
        # The flood key holds at most 20 nonces (60 s each) at a time: 19 pass in the first window
        # (its announce holds one), a few more as its oldest expire; everything else is refused for
        # it alone, and the cache every node shares never fills.
        assert statuses[429] >= 140 and statuses[200] + statuses[429] == 200
        assert len(e.registry.gate.nonces) <= 4 * 13 + 20
    finally:
        store.close()


async def test_the_per_key_rate_refuses_a_fast_key_and_exempts_registered_gateways(tmp_path: Path) -> None:
    gw = key(50)
    e, store = await _env(
        tmp_path, key_messages_per_s=1.0, key_messages_burst=3, registered_gateways=public_key_hex(gw)
    )
    try:
        k = key(1)
        await e.post("/v1/announce", signed(k, "announce", announce_for(k).to_json(), e.clock()))
        got = [
            (await e.post("/v1/heartbeat", signed(k, "heartbeat", heartbeat_for(k).to_json(), e.clock())))[0]
            for _ in range(4)
        ]
        assert got == [200, 200, 429, 429]
        e.clock.advance(1.0)
        envelope = signed(k, "heartbeat", heartbeat_for(k).to_json(), e.clock())
        assert (await e.post("/v1/heartbeat", envelope))[0] == 200
        for _ in range(10):  # the operator's gateway reports as often as its traffic needs
            body = signed(gw, "gateway_stats", _gateway_stats(), e.clock(), signer="gateway_id")
            status, answer, _ = await e.post("/v1/gateway-stats", body)
            assert status == 200, answer
    finally:
        store.close()


def _gateway_stats() -> dict[str, Any]:
    from proto.announce import GatewayStats

    return GatewayStats(
        gateway_id="",
        interval_s=1.0,
        sessions_active=0,
        requests_queued=0,
        requests=0,
        errors=0,
        prompt_tokens=0,
        completion_tokens=0,
        ttft_p50_s=None,
        ttft_p95_s=None,
        routes=(),
    ).to_json()


async def test_per_address_reads_get_429_with_retry_after_and_healthz_stays_free(tmp_path: Path) -> None:
    e, store = await _env(tmp_path, address_reads_per_s=1.0, address_reads_burst=5)
    try:
        got = [(await e.client.get("/v1/models")).status_code for _ in range(7)]
        assert got == [200] * 5 + [429] * 2
        r = await e.client.get("/v1/swarm")
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert json.loads(await r.get_data())["error"]["code"] == "rate_limited"
        assert [(await e.client.get("/healthz")).status_code for _ in range(20)] == [200] * 20
    finally:
        store.close()


async def test_a_lone_surrogate_in_a_signed_payload_is_400_and_writes_nothing(env: Env) -> None:
    k = key(3)
    body = announce_for(k).to_json()
    body["software_version"] = "\ud800"
    payload = make_payload("announce", "node_id", k, env.clock(), body)
    raw = json.dumps(payload, ensure_ascii=True, sort_keys=True, separators=(",", ":")).encode()
    envelope = {
        "payload": base64.b64encode(raw).decode(),
        "signature": base64.b64encode(k.sign(raw).signature).decode(),
        "public_key": public_key_hex(k),
    }
    status, answer, _ = await env.post("/v1/announce", envelope)
    assert status == 400 and "software_version holds a lone UTF-16 surrogate" in answer["error"]["message"]
    status, answer, _ = await env.post("/v1/routes", data=b'{"model":"\\ud800"}')
    assert status == 400 and "lone UTF-16 surrogate" in answer["error"]["message"]
    status, answer, _ = await env.post("/v1/heartbeat", data=b"[" * 30_000 + b"]" * 30_000)
    assert status == 400 and "nested deeper than" in answer["error"]["message"]
    assert env.store.table_counts() == {"models": 0, "gateways": 0, "nodes": 0, "shards": 0, "usage": 0}


def _junk_model(i: int) -> ModelSpec:
    return replace(MODEL, fingerprint=f"{i:064x}", name=f"junk-{i}")


async def test_junk_is_pruned_in_bounded_batches_and_the_honest_swarm_is_kept(tmp_path: Path) -> None:
    e, store = await _env(
        tmp_path, prune_after_s=100.0, prune_batch_max=40, key_messages_per_s=0.0, address_writes_per_s=0.0
    )
    try:
        honest = key(200)
        await e.post("/v1/announce", signed(honest, "announce", announce_for(honest).to_json(), e.clock()))
        for i in range(100):
            k = key(i)
            a = announce_for(k, model=_junk_model(i), port=9000 + i)
            assert (await e.post("/v1/announce", signed(k, "announce", a.to_json(), e.clock())))[0] == 200
        gw = key(150)  # a gateway (any key may report while registered_gateways is empty)
        report = signed(gw, "gateway_stats", _gateway_stats(), e.clock(), signer="gateway_id")
        assert (await e.post("/v1/gateway-stats", report))[0] == 200
        assert store.table_counts()["models"] == 101 and store.table_counts()["gateways"] == 1
        status, page = await e.get("/v1/models?limit=30&offset=90")
        assert status == 200 and len(page["models"]) == 11 and page["total"] == 101
        assert page["next_offset"] is None
        status, page = await e.get("/v1/swarm?limit=10")
        assert len(page["nodes"]) == 10 and page["next_offset"] == 10
        assert (await e.get("/v1/models?limit=0"))[0] == 400
        e.clock.advance(50.0)
        await e.post("/v1/heartbeat", signed(honest, "heartbeat", heartbeat_for(honest).to_json(), e.clock()))
        await e.registry.expire_once()  # the junk never heartbeats: expired
        assert await e.registry.prune_once() == {
            "nodes": 0,
            "shards": 0,
            "rtt_claims": 0,
            "challenge_results": 0,
            "models": 0,
            "gateways": 0,
        }  # not silent long enough yet
        e.clock.advance(60.0)
        await e.post("/v1/heartbeat", signed(honest, "heartbeat", heartbeat_for(honest).to_json(), e.clock()))
        rounds = []
        while (pruned := await e.registry.prune_once())["nodes"] or pruned["models"]:
            rounds.append((pruned["nodes"], pruned["models"]))
        assert rounds == [(40, 40), (40, 40), (20, 20)]
        assert store.table_counts() == {"models": 1, "gateways": 0, "nodes": 1, "shards": 1, "usage": 0}
        status, models = await e.get("/v1/models")
        assert [m["name"] for m in models["models"]] == [MODEL.name] and models["models"][0]["routable"]
    finally:
        store.close()


async def test_the_client_reads_every_page_of_the_model_list(tmp_path: Path) -> None:
    config = test_config(tmp_path, list_max_rows=10)
    shutdown = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            ready: list[RunningTracker] = []
            await nursery.start(
                functools.partial(serve_tracker, config, shutdown=shutdown, on_ready=ready.append)
            )
            async with TrackerClient(ready[0].url, key(1)) as client:
                for i in range(25):
                    k = key(i + 1)
                    async with TrackerClient(ready[0].url, k) as node:
                        await node.announce(announce_for(k, model=_junk_model(i), port=9000 + i))
                models = await client.models()
                assert sorted(m["name"] for m in models) == sorted(f"junk-{i}" for i in range(25))
                assert len(await client.models(max_pages=2)) == 20
            shutdown.set()
