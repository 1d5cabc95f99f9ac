"""Operating a swarm, in process on a real database (SQLite, and PostgreSQL when configured):
graceful leave, replay protection shared by replicas, periodic work claimed once, the replica
registry, the accounting API, gateway statistics and the dashboard state, metrics that parse."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from quart.typing import TestClientProtocol as QuartClient
from tracker_helpers import MODEL, FakeClock, announce_for, heartbeat_for, key, signed, test_config

from proto.announce import GatewayStats, Leave, RouteStat, UsageEntry, UsageReport
from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.config import TrackerConfig
from tracker.dashboard import DashboardFeed
from tracker.errors import Conflict
from tracker.service import Registry
from tracker.store import Store, make_engine

GW = key(90)


@dataclass
class Replica:
    registry: Registry
    client: QuartClient
    store: Store

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        r = await self.client.post(
            path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        return r.status_code, json.loads(await r.get_data())

    async def get(self, path: str) -> tuple[int, Any]:
        r = await self.client.get(path)
        raw = await r.get_data()
        return r.status_code, (json.loads(raw) if r.mimetype == "application/json" else raw.decode())


@dataclass
class Cluster:
    a: Replica
    b: Replica
    clock: FakeClock
    config: TrackerConfig

    def envelope(self, seed: int, kind: str, body: dict, signer: str = "node_id") -> dict[str, str]:
        return signed(key(seed), kind, body, self.clock(), signer)

    def announce(self, seed: int, start: int, end: int, region: str = "") -> dict[str, str]:
        a = replace(announce_for(key(seed), start, end, port=9000 + seed), region=region)
        return self.envelope(seed, "announce", a.to_json())

    def heartbeat(self, seed: int, **kw: Any) -> dict[str, str]:
        return self.envelope(seed, "heartbeat", heartbeat_for(key(seed), **kw).to_json())

    def leave(self, seed: int) -> dict[str, str]:
        return self.envelope(seed, "leave", Leave(public_key_hex(key(seed)), "test").to_json())

    def usage(self, request: str, tokens: dict[int, int]) -> dict[str, str]:
        report = UsageReport(
            public_key_hex(GW),
            request,
            MODEL.fingerprint,
            tuple(UsageEntry(public_key_hex(key(s)), t, t // 2) for s, t in tokens.items()),
        )
        return signed(GW, "usage", report.to_json(), self.clock(), "gateway_id")


async def _replica(
    store: Store, config: TrackerConfig, clock: FakeClock, tracker_key_seed: int = 99
) -> Replica:
    registry = Registry(store, config, key(tracker_key_seed), clock=clock, rng=random.Random(0))
    await registry.start()
    feed = DashboardFeed(registry, push_interval_s=1.0, max_clients=2)
    return Replica(registry, create_app(registry, feed).test_client(), store)


@pytest.fixture
async def cluster(tmp_path: Path, db_url: str) -> AsyncIterator[Cluster]:
    """Two replicas (each with its own memory and connection pool) on one database."""
    clock = FakeClock()
    config = test_config(tmp_path, db_url=db_url, nonces_per_key_max=50)
    a, b = Store(make_engine(db_url)), Store(make_engine(db_url))
    try:
        yield Cluster(await _replica(a, config, clock), await _replica(b, config, clock), clock, config)
    finally:
        a.close()
        b.close()


def _route_nodes(body: dict) -> list[list[str]]:
    return [[h["node_id"] for h in r["hops"]] for r in body["routes"]]


async def test_leave_takes_the_node_out_of_routing_at_once(cluster: Cluster) -> None:
    a = cluster.a
    for seed, span in ((1, (0, 30)), (2, (0, 30))):
        assert (await a.post("/v1/announce", cluster.announce(seed, *span)))[0] == 200
    _, body = await a.post("/v1/routes", {"model": MODEL.fingerprint, "k": 2})
    assert sorted(n for r in _route_nodes(body) for n in r) == sorted(public_key_hex(key(s)) for s in (1, 2))
    status, answer = await cluster.b.post("/v1/leave", cluster.leave(1))  # the other replica hears it
    assert status == 200 and answer["state"] == "left"
    cluster.clock.advance(0.01)  # replica a's routing snapshot is cached for snapshot_ttl_s (0 here)
    for replica in (a, cluster.b):
        _, body = await replica.post("/v1/routes", {"model": MODEL.fingerprint, "k": 2})
        assert _route_nodes(body) == [[public_key_hex(key(2))]]
    # a heartbeat still in flight cannot bring it back; announcing again does
    status, err = await a.post("/v1/heartbeat", cluster.heartbeat(1))
    assert status == 404 and "left the swarm" in err["error"]["message"]
    _, swarm = await a.get("/v1/swarm")
    assert {n["node_id"]: n["state"] for n in swarm["nodes"]}[public_key_hex(key(1))] == "left"
    assert (await a.post("/v1/announce", cluster.announce(1, 0, 30)))[1]["restored"] is True
    _, body = await a.post("/v1/routes", {"model": MODEL.fingerprint, "k": 2})
    assert len(body["routes"]) == 2
    # leaving twice, or a node nobody knows
    assert (await a.post("/v1/leave", cluster.leave(7)))[0] == 404
    assert a.registry.metrics.counter("swarm_tracker_leaves_total") == 0  # b counted the one leave
    assert cluster.b.registry.metrics.counter("swarm_tracker_leaves_total") == 1


async def test_a_replay_is_refused_by_the_replica_that_did_not_see_the_original(cluster: Cluster) -> None:
    env = cluster.announce(1, 0, 30)
    assert (await cluster.a.post("/v1/announce", env))[0] == 200
    counts = cluster.a.store.table_counts(operations=True)
    status, err = await cluster.b.post("/v1/announce", env)
    assert status == 401 and err["error"]["reason"] == "replayed_nonce"
    assert cluster.b.registry.metrics.counter("swarm_tracker_refusals_total", reason="replayed_nonce") == 1
    assert cluster.a.store.table_counts(operations=True) == counts  # nothing written by the refusal
    # the same for heartbeats, usage reports and leaves
    for path, envelope in (
        ("/v1/heartbeat", cluster.heartbeat(1, tokens=5)),
        ("/v1/usage", cluster.usage("req-1", {1: 10})),
        ("/v1/leave", cluster.leave(1)),
    ):
        assert (await cluster.b.post(path, envelope))[0] == 200, path
        status, err = await cluster.a.post(path, envelope)
        assert (status, err["error"]["reason"]) == (401, "replayed_nonce"), path
    _, swarm = await cluster.a.get("/v1/swarm")
    assert swarm["nodes"][0]["shard"]["tokens_served_total"] == 5


async def test_nonces_are_bounded_per_key_and_purged_once_expired(cluster: Cluster) -> None:
    assert (await cluster.a.post("/v1/announce", cluster.announce(1, 0, 30)))[0] == 200
    limit = cluster.config.nonces_per_key_max
    for i in range(limit - 1):
        replica = cluster.a if i % 2 else cluster.b
        assert (await replica.post("/v1/heartbeat", cluster.heartbeat(1)))[0] == 200
    status, err = await cluster.b.post("/v1/heartbeat", cluster.heartbeat(1))
    assert status == 503 and err["error"]["reason"] == "nonce_cache_full"
    # another key is not affected
    assert (await cluster.b.post("/v1/announce", cluster.announce(2, 0, 30)))[0] == 200
    assert cluster.a.store.table_counts(operations=True)["nonces"] == limit + 1
    cluster.clock.advance(2 * cluster.config.signature_skew_s + 1)
    done = await cluster.a.registry.periodic_once()
    assert done["purged"]["nonces"] == limit + 1
    assert (await cluster.b.post("/v1/heartbeat", cluster.heartbeat(1)))[0] == 200


async def test_periodic_work_runs_once_per_period_across_replicas(cluster: Cluster) -> None:
    await cluster.a.post("/v1/announce", cluster.announce(1, 0, 30))
    cluster.clock.advance(cluster.config.heartbeat_timeout_s + 1)
    first = await cluster.a.registry.periodic_once()
    second = await cluster.b.registry.periodic_once()
    assert first["expired"] == [public_key_hex(key(1))] and "expired" not in second
    assert "purge" not in second and "purged" in first
    cluster.clock.advance(cluster.config.expiry_check_interval_s)
    assert "expired" in await cluster.b.registry.periodic_once()  # the next period: whoever comes first
    runs = cluster.b.registry.metrics
    assert runs.counter("swarm_tracker_periodic_runs_total", outcome="skipped") >= 2


async def test_replicas_register_and_must_share_one_key(cluster: Cluster, db_url: str) -> None:
    await cluster.a.registry.join("http://a:7460")
    await cluster.b.registry.join("http://b:7460")
    _, body = await cluster.a.get("/v1/replicas")
    assert sorted(r["url"] for r in body["replicas"]) == ["http://a:7460", "http://b:7460"]
    rogue_store = Store(make_engine(db_url))
    try:
        rogue = await _replica(rogue_store, cluster.config, cluster.clock, tracker_key_seed=42)
        with pytest.raises(Conflict, match="replicas must share one key"):
            await rogue.registry.join("http://c:7460")
    finally:
        rogue_store.close()
    await cluster.b.registry.leave_cluster()
    assert [r["url"] for r in (await cluster.a.get("/v1/replicas"))[1]["replicas"]] == ["http://a:7460"]


async def test_accounting_per_node_model_and_gateway_with_pages_and_ranges(cluster: Cluster) -> None:
    a = cluster.a
    for seed, span in ((1, (0, 10)), (2, (10, 20)), (3, (20, 30))):
        await a.post("/v1/announce", cluster.announce(seed, *span))
    t0 = cluster.clock()
    for i in range(5):
        assert (await a.post("/v1/usage", cluster.usage(f"r{i}", {1: 100, 2: 100, 3: 90 + i})))[0] == 200
        cluster.clock.advance(10)
    # a retried report (another replica, fresh signature) is not counted twice
    _, dup = await cluster.b.post("/v1/usage", cluster.usage("r0", {1: 100, 2: 100, 3: 90}))
    assert dup == {"recorded": 0, "duplicates": 3}
    status, body = await a.get(f"/v1/usage?by=node&since={t0}&until={cluster.clock() + 1}&limit=2")
    assert status == 200 and body["total_rows"] == 3 and len(body["rows"]) == 2 and body["next_offset"] == 2
    assert [r["tokens"] for r in body["rows"]] == [500, 500]
    assert body["totals"] == {"tokens": 1000 + 460, "steps": 250 + 250 + 229, "requests": 5}
    _, page2 = await a.get(f"/v1/usage?by=node&since={t0}&until={cluster.clock() + 1}&limit=2&offset=2")
    assert [r["key"] for r in page2["rows"]] == [public_key_hex(key(3))] and page2["next_offset"] is None
    assert page2["rows"][0]["tokens"] == 460 and page2["rows"][0]["requests"] == 5
    # a time range: the last two reports only
    _, recent = await a.get(f"/v1/usage?by=model&since={t0 + 25}&until={cluster.clock()}")
    assert recent["rows"] == [
        {
            "key": MODEL.fingerprint,
            "tokens": 2 * 200 + 93 + 94,
            "steps": 2 * 100 + 46 + 47,
            "requests": 2,
            "first_s": t0 + 30,
            "last_s": t0 + 40,
        }
    ]
    _, by_gw = await a.get("/v1/usage?by=gateway")
    assert [(r["key"], r["requests"]) for r in by_gw["rows"]] == [(public_key_hex(GW), 5)]
    _, one = await a.get(f"/v1/usage?by=model&node={public_key_hex(key(2))}")
    assert one["totals"]["tokens"] == 500
    # a volunteer's own view
    _, mine = await cluster.b.get(f"/v1/usage/nodes/{public_key_hex(key(3))}")
    assert mine["all_time"] == {"tokens": 460, "steps": 229, "requests": 5} and mine["state"] == "live"
    assert mine["by_model"][0]["key"] == MODEL.fingerprint
    # bad input is a clear 400
    for query, needle in (
        ("by=planet", "by must be"),
        ("limit=0", "limit must be in 1..1000"),
        ("limit=5000", "limit must be"),
        ("offset=-1", "offset"),
        ("since=yesterday", "since must be a number"),
        ("since=10&until=5", "since must not be after until"),
        ("colour=red", "unknown parameter"),
    ):
        status, err = await a.get(f"/v1/usage?{query}")
        assert status == 400 and needle in err["error"]["message"], query
    assert (await a.get("/v1/usage/nodes/xyz"))[0] == 400


async def test_gateway_statistics_feed_the_dashboard_state(cluster: Cluster) -> None:
    a = cluster.a
    ids = {s: public_key_hex(key(s)) for s in (1, 2, 3, 4)}
    for seed, span in ((1, (0, 10)), (2, (10, 30)), (3, (0, 30)), (4, (5, 12))):
        await a.post("/v1/announce", cluster.announce(seed, *span, region="eu-west"))
    for seed in (1, 2, 3):
        await a.post("/v1/heartbeat", cluster.heartbeat(seed, active=1, tokens=0))
    route = f"{ids[1][:8]}[0:10)>{ids[2][:8]}[10:30)"
    for ttft in (0.2, 0.4):
        stats = GatewayStats(
            public_key_hex(GW),
            5.0,
            3,
            1,
            4,
            1,
            400,
            120,
            ttft,
            2 * ttft,
            (RouteStat(route, 3),),
            "http://gw:8000",
        )
        assert (
            await a.post(
                "/v1/gateway-stats",
                signed(GW, "gateway_stats", stats.to_json(), cluster.clock(), "gateway_id"),
            )
        )[0] == 200
        cluster.clock.advance(5)
    await a.post("/v1/usage", cluster.usage("r1", {1: 60, 2: 60}))
    cluster.clock.advance(1.0)
    await a.post("/v1/heartbeat", cluster.heartbeat(1, active=1, tokens=30))
    await a.post("/v1/heartbeat", cluster.heartbeat(2, active=1, tokens=30))
    await a.post("/v1/heartbeat", cluster.heartbeat(3, active=1, tokens=30))
    _, state = await cluster.b.get("/v1/dashboard/state")
    (model,) = state["models"]
    # node 4 never heartbeated within 1.5 intervals: late, so not counted in the coverage map
    rows = {r["node_id"]: r for r in state["nodes"]}
    assert rows[ids[4]]["state"] == "late" and state["node_counts"]["late"] == 1
    assert model["coverage"] == [2] * 30 and model["gaps"] == []
    assert sorted(tuple(s[:2]) for s in model["spans"]) == [(0, 10), (0, 30), (10, 30)]
    assert rows[ids[1]]["region"] == "eu-west" and rows[ids[1]]["tokens_per_s"] == pytest.approx(30 / 11.0)
    assert rows[ids[1]]["start"] == 0 and rows[ids[1]]["end"] == 10 and rows[ids[1]]["reputation"] is None
    (used,) = [r for r in state["routes"] if r["route_id"] == route]
    assert used["sessions"] == 3 and used["requests"] == 1 and used["tokens_per_s"] == pytest.approx(1.0)
    assert [h["start"] for h in used["hops"]] == [0, 10]
    series = state["series"]
    assert (
        sum(v for v in series["tokens_per_s"] if v) > 0 and max(v for v in series["ttft_p95_s"] if v) == 0.8
    )
    assert max(v for v in series["sessions"] if v is not None) == 3
    assert state["gateways"][0]["url"] == "http://gw:8000"
    assert state["top_contributors_24h"][0]["tokens"] == 60
    # the whole state is strict JSON (no NaN) and bounded
    json.loads(json.dumps(state, allow_nan=False))
    assert len(series["t"]) <= 180
    # leave: the coverage loses the node at once
    await a.post("/v1/leave", cluster.leave(3))
    _, state = await a.get("/v1/dashboard/state")
    assert state["models"][0]["coverage"] == [1] * 30


async def test_gateway_stats_refusals(cluster: Cluster) -> None:
    bad = GatewayStats(public_key_hex(GW), 5.0, 1, 0, 1, 0, 1, 1, None, None).to_json()
    bad["routes"] = [{"route_id": "x", "sessions": 1}] * 33
    status, err = await cluster.a.post(
        "/v1/gateway-stats", signed(GW, "gateway_stats", bad, cluster.clock(), "gateway_id")
    )
    assert status == 400 and "routes" in err["error"]["message"]
    good = GatewayStats(public_key_hex(GW), 5.0, 1, 0, 1, 0, 1, 1, None, None).to_json()
    envelope = signed(GW, "gateway_stats", good, cluster.clock(), "gateway_id")
    other = signed(key(91), "gateway_stats", good, cluster.clock(), "gateway_id")
    status, err = await cluster.a.post("/v1/gateway-stats", envelope | {"signature": other["signature"]})
    assert status == 401 and err["error"]["reason"] == "bad_signature"
    assert cluster.a.store.table_counts(operations=True)["gateway_reports"] == 0


async def test_metrics_parse_with_prometheus_client_and_histograms_have_buckets(cluster: Cluster) -> None:
    a = cluster.a
    await a.post("/v1/announce", cluster.announce(1, 0, 30))
    await a.post("/v1/routes", {"model": MODEL.fingerprint})
    await a.post("/v1/announce", cluster.announce(1, 0, 30) | {"signature": "x"})
    status, text = await a.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    selection = families["swarm_tracker_route_selection_seconds"]
    assert selection.type == "histogram"
    buckets = [s for s in selection.samples if s.name.endswith("_bucket")]
    assert len(buckets) >= 10 and buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1
    assert families["swarm_tracker_nodes"].type == "gauge"
    live = [s for s in families["swarm_tracker_nodes"].samples if s.labels == {"state": "live"}]
    assert live[0].value == 1
    assert families["swarm_tracker_layer_coverage_min"].samples[0].value == 1
    assert families["swarm_tracker_http_request_seconds"].type == "histogram"
    assert families["swarm_build_info"].samples[0].labels["service"] == "tracker"
    assert "process_resident_memory_bytes" in families and "python_info" in families
    assert families["swarm_tracker_announces"].samples[0].value == 1  # counters: the family drops _total


async def test_dashboard_page_and_assets_are_served_by_the_tracker(cluster: Cluster) -> None:
    status, page = await cluster.a.get("/")
    assert status == 200 and "/static/dashboard.js" in page and '<script src="http' not in page
    for name in ("dashboard.js", "dashboard.css"):
        r = await cluster.a.client.get(f"/static/{name}")
        assert r.status_code == 200
        body = (await r.get_data()).decode()
        assert "http://" not in body.replace("http://www.w3.org/2000/svg", "")  # nothing from elsewhere
    assert (await cluster.a.get("/static/nope.js"))[0] == 404


async def test_announce_payload_keeps_old_fields_optional() -> None:
    a = announce_for(key(1), 0, 30)
    assert "region" not in a.to_json()
    assert replace(a, region="home").to_json()["region"] == "home"
    hb = heartbeat_for(key(1))
    assert "kv_used_tokens" not in hb.to_json()
