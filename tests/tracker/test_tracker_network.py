"""Round-trip samples in, network coordinates and latency-aware routes out: payloads, storage
(SQLite and PostgreSQL), the HTTP API, and coordinates surviving a tracker restart."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from test_tracker_api import Env
from tracker_helpers import FakeClock, announce_for, heartbeat_for, key, signed, test_config

from proto.announce import (
    MAX_RTT_SAMPLES,
    Announce,
    GatewayStats,
    Heartbeat,
    PayloadError,
    RttSample,
)
from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.coordinates import MAX_CLAIMS_PER_REPORTER
from tracker.errors import UnknownNode
from tracker.models import RttClaim
from tracker.service import Registry
from tracker.store import Store, make_engine

# --- payloads ----------------------------------------------------------------------------------------


def test_rtt_samples_and_uplink_round_trip_and_refusals() -> None:
    k, peer = key(1), key(2)
    hb = Heartbeat(public_key_hex(k), 0, 0, 10, 0, rtt_samples=(RttSample(public_key_hex(peer), 12.5),))
    assert Heartbeat.from_json(hb.to_json()) == hb
    assert "rtt_samples" not in Heartbeat(public_key_hex(k), 0, 0, 10, 0).to_json()  # older trackers
    pooled = Heartbeat(public_key_hex(k), 0, 0, 10, 0, kv_pool_tokens=4096, kv_session_max_tokens=2048)
    assert Heartbeat.from_json(pooled.to_json()) == pooled
    assert "kv_pool_tokens" not in Heartbeat(public_key_hex(k), 0, 0, 10, 0).to_json()
    with pytest.raises(PayloadError, match="kv_pool_tokens"):
        Heartbeat.from_json({**pooled.to_json(), "kv_pool_tokens": -1})
    a = announce_for(k)
    with_uplink = Announce(**{**a.__dict__, "uplink_mbit_s": 40.0})
    assert Announce.from_json(with_uplink.to_json()).uplink_mbit_s == 40.0
    assert Announce.from_json(a.to_json()).uplink_mbit_s is None

    def refused(samples: list[Any], match: str) -> None:
        body = {**hb.to_json(), "rtt_samples": samples}
        with pytest.raises(PayloadError, match=match):
            Heartbeat.from_json(body)

    one = {"peer_id": public_key_hex(peer), "rtt_ms": 5.0}
    refused([one, one], "each peer once")
    refused([{"peer_id": public_key_hex(k), "rtt_ms": 5.0}], "sender itself")
    refused([{**one, "rtt_ms": 0.0}], "rtt_ms")
    refused([{**one, "rtt_ms": 5e-324}], "rtt_ms")
    refused([{**one, "rtt_ms": 60_001.0}], "rtt_ms")
    refused([{**one, "rtt_ms": float("nan")}], "rtt_ms")
    refused([{**one, "extra": 1}], "unknown field")
    refused([{"peer_id": f"{i:064x}", "rtt_ms": 1.0} for i in range(MAX_RTT_SAMPLES + 1)], "at most")
    with pytest.raises(PayloadError, match="uplink_mbit_s"):
        Announce.from_json({**a.to_json(), "uplink_mbit_s": -1})
    gw = GatewayStats(public_key_hex(key(9)), 5.0, 0, 0, 0, 0, 0, 0, None, None, rtt_samples=hb.rtt_samples)
    assert GatewayStats.from_json(gw.to_json()) == gw


# --- storage --------------------------------------------------------------------------------------------


@pytest.fixture
def store(db_url: str) -> Any:
    s = Store(make_engine(db_url))
    s.upgrade()
    yield s
    s.close()


def claims(store: Store) -> list[tuple[str, str]]:
    with store.engine.connect() as conn:
        return [(r, p) for r, p in conn.execute(select(RttClaim.reporter_id, RttClaim.peer_id))]


def test_claims_are_bounded_refit_and_probed_back(store: Store) -> None:
    now = 1_800_000_000.0
    nodes = [key(i) for i in range(1, 43)]
    for i, k in enumerate(nodes):
        store.announce(announce_for(k, port=9000 + i), now)
    ids = [public_key_hex(k) for k in nodes]
    with pytest.raises(UnknownNode):
        store.record_rtt("0" * 64, (RttSample(ids[0], 5.0),), now, claim_ttl_s=600.0)
    # Node 0 reports 32 peers, then 8 more: the table keeps the newest 32.
    first = tuple(RttSample(p, 10.0 + i) for i, p in enumerate(ids[1:33]))
    r = store.record_rtt(ids[0], first, now, claim_ttl_s=600.0)
    assert r.coordinate is not None  # peers without a coordinate count as the origin: a new swarm starts
    store.record_rtt(ids[0], tuple(RttSample(p, 30.0) for p in ids[33:41]), now + 1, claim_ttl_s=600.0)
    mine = {p for rep, p in claims(store) if rep == ids[0]}
    assert len(mine) == MAX_CLAIMS_PER_REPORTER and set(ids[33:41]) <= mine
    # Node 41 measured node 0, which never measured 41: node 0 is asked to measure it back
    # (with the address to dial); a peer it already measured is not asked for.
    store.record_rtt(ids[41], (RttSample(ids[0], 30.0),), now + 2, claim_ttl_s=600.0)
    store.record_rtt(ids[33], (RttSample(ids[0], 30.0),), now + 2, claim_ttl_s=600.0)
    again = store.record_rtt(ids[0], (RttSample(ids[1], 10.0),), now + 3, claim_ttl_s=600.0)
    assert again.probe == ((ids[41], "127.0.0.1:9041"),)
    # Old claims no longer count and are purged.
    purged = store.purge(now + 4000.0, reports_keep_s=1.0, replicas_keep_s=1.0, claims_keep_s=600.0)
    assert purged["rtt_claims"] == MAX_CLAIMS_PER_REPORTER + 2
    assert claims(store) == []


def test_coordinates_survive_a_restart(db_url: str) -> None:
    now = 1_800_000_000.0
    a, b = key(1), key(2)
    s1 = Store(make_engine(db_url))
    s1.upgrade()
    s1.announce(announce_for(a, 0, 15, port=9001), now)
    s1.announce(announce_for(b, 15, 30, port=9002), now)
    for t in range(5):
        s1.record_rtt(public_key_hex(a), (RttSample(public_key_hex(b), 40.0),), now + t, claim_ttl_s=600.0)
        s1.record_rtt(public_key_hex(b), (RttSample(public_key_hex(a), 41.0),), now + t, claim_ttl_s=600.0)
    before = {sh.node_id: sh.coord for sh in s1.snapshot(now + 5, 60.0).shards}
    s1.close()
    s2 = Store(make_engine(db_url))
    try:
        after = {sh.node_id: sh.coord for sh in s2.snapshot(now + 5, 60.0).shards}
    finally:
        s2.close()
    assert after == before and all(c is not None for c in after.values())
    ca, cb = after[public_key_hex(a)], after[public_key_hex(b)]
    assert ca is not None and cb is not None
    assert ca.rtt_ms(cb) == pytest.approx(41.0, rel=0.3)


# --- the HTTP API: a three-region swarm measured, then routed --------------------------------------------

REGION_RTT = {("A", "A"): 10.0, ("B", "B"): 10.0, ("C", "C"): 10.0, ("A", "B"): 80.0, ("B", "C"): 120.0}
REGION_RTT[("A", "C")] = 150.0


def true_rtt(ra: str, rb: str) -> float:
    return REGION_RTT.get((ra, rb)) or REGION_RTT[(rb, ra)]


@pytest.fixture
async def env(tmp_path: Path, db_url: str) -> AsyncIterator[Env]:
    clock = FakeClock()
    store = Store(make_engine(db_url))
    registry = Registry(
        store,
        test_config(tmp_path, db_url=db_url, heartbeat_timeout_s=1e6),
        key(99),
        clock=clock,
        rng=random.Random(0),
    )
    await registry.start()
    app = create_app(registry)
    try:
        yield Env(registry, app.test_client(), clock, store)
    finally:
        store.close()


async def measure_rounds(env: Env, nodes: dict[int, str], gateway: int, rounds: int) -> None:
    """Nodes measure what the tracker asks (probe hints) plus what they measured before; the
    gateway measures every node it may use. True RTTs by region, +5 % noise."""
    rng = random.Random(1)
    targets: dict[int, set[str]] = {seed: set() for seed in nodes}
    by_id = {public_key_hex(key(seed)): seed for seed in nodes}
    for _ in range(rounds):
        for seed, region in nodes.items():
            samples = [
                {"peer_id": p, "rtt_ms": true_rtt(region, nodes[by_id[p]]) * rng.uniform(1.0, 1.05)}
                for p in sorted(targets[seed])[:MAX_RTT_SAMPLES]
            ]
            body = {**heartbeat_for(key(seed)).to_json(), "rtt_samples": samples}
            status, answer = await env.post(
                "/v1/heartbeat", signed(key(seed), "heartbeat", body, env.clock())
            )
            assert status == 200, answer
            targets[seed] |= {h["node_id"] for h in answer["probe"]}
        gw = key(gateway)
        stats = GatewayStats(public_key_hex(gw), 5.0, 0, 0, 0, 0, 0, 0, None, None)
        samples = [{"peer_id": p, "rtt_ms": true_rtt("A", nodes[s])} for p, s in sorted(by_id.items())]
        status, answer = await env.post(
            "/v1/gateway-stats",
            signed(
                gw, "gateway_stats", {**stats.to_json(), "rtt_samples": samples}, env.clock(), "gateway_id"
            ),
        )
        assert status == 200, answer
        env.clock.advance(1.0)


async def test_routes_for_a_gateway_stay_in_its_region_and_carry_hop_estimates(env: Env) -> None:
    """Nine nodes, three per region and stage; region C computes fastest (8 ms a stage against 20
    in A). Once measured, a gateway in A is given the A route, with per-hop RTTs and uplinks;
    the same request without the gateway's id (today's routing) takes the fastest compute."""
    nodes = {}
    for r, region in enumerate("ABC"):
        for stage in range(3):
            seed = 10 * (r + 1) + stage
            nodes[seed] = region
            a = announce_for(
                key(seed), 10 * stage, 10 * stage + 10, port=9000 + seed, ms=(20.0, 12.0, 8.0)[r]
            )
            a = Announce(**{**a.__dict__, "uplink_mbit_s": 100.0})
            status, _ = await env.post(
                "/v1/announce", signed(key(seed), "announce", a.to_json(), env.clock())
            )
            assert status == 200
    gateway = 50
    await measure_rounds(env, nodes, gateway, rounds=25)
    gw_id = public_key_hex(key(gateway))
    status, body = await env.post("/v1/routes", {"model": "ab" * 32, "k": 1, "gateway_id": gw_id})
    assert status == 200, body
    (route,) = body["routes"]
    assert [nodes[_seed(h["node_id"])] for h in route["hops"]] == ["A", "A", "A"]
    assert all(h["rtt_ms"] is not None and h["rtt_ms"] < 30.0 for h in route["hops"])
    assert [h["bandwidth_mbit_s"] for h in route["hops"]] == [None, 100.0, 100.0]
    assert route["ring_rtt_ms"] < 30.0 and route["exit_rtt_ms"] < 30.0
    status, blind = await env.post("/v1/routes", {"model": "ab" * 32, "k": 1})
    assert [nodes[_seed(h["node_id"])] for h in blind["routes"][0]["hops"]] == ["C", "C", "C"]
    # The swarm view shows every node placed.
    status, swarm = await env.get("/v1/swarm")
    assert all(n["coordinate"] is not None for n in swarm["nodes"])

    # A restarted tracker (same database) routes the same way at once.
    restarted = Registry(env.store, env.registry.config, key(99), clock=env.clock, rng=random.Random(0))
    await restarted.start()
    again = await restarted.routes("ab" * 32, 1, frozenset(), gw_id)
    assert [nodes[_seed(h["node_id"])] for h in again["routes"][0]["hops"]] == ["A", "A", "A"]


def _seed(node_id: str) -> int:
    for seed in range(1, 100):
        if public_key_hex(key(seed)) == node_id:
            return seed
    raise AssertionError(node_id)


async def test_heartbeat_answers_probe_hints_and_refuses_bad_samples(env: Env) -> None:
    for seed in (1, 2, 3):
        await env.post("/v1/announce", env.announce_env(seed, port=9000 + seed))
    status, answer = await env.post("/v1/heartbeat", env.heartbeat_env(1))
    assert status == 200
    assert answer["probe"] and all(h["node_id"] != public_key_hex(key(1)) for h in answer["probe"])
    assert {h["address"] for h in answer["probe"]} <= {"127.0.0.1:9002", "127.0.0.1:9003"}
    before = env.counts()
    body = {
        **heartbeat_for(key(1)).to_json(),
        "rtt_samples": [{"peer_id": public_key_hex(key(1)), "rtt_ms": 3.0}],
    }
    status, err = await env.post("/v1/heartbeat", signed(key(1), "heartbeat", body, env.clock()))
    assert status == 400 and "sender itself" in json.dumps(err)
    assert env.counts() == before
