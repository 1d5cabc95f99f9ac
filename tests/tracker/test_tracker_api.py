"""The HTTP API in process (quart test client): refusals write nothing, routes, placement, usage."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from quart.typing import TestClientProtocol as QuartClient
from tracker_helpers import MODEL, FakeClock, announce_for, heartbeat_for, key, signed, test_config

from proto.announce import UsageEntry, UsageReport
from proto.signing import make_payload, public_key_hex, sign_envelope, verify_route_ticket
from tracker.app import create_app
from tracker.errors import StorageUnavailable
from tracker.service import Registry
from tracker.store import Store, make_engine


@dataclass
class Env:
    registry: Registry
    client: QuartClient
    clock: FakeClock
    store: Store

    async def post(self, path: str, body: Any = None, *, data: bytes | None = None) -> tuple[int, Any]:
        if data is None:
            data = json.dumps(body).encode()
        r = await self.client.post(path, data=data, headers={"content-type": "application/json"})
        return r.status_code, json.loads(await r.get_data())

    async def get(self, path: str) -> tuple[int, Any]:
        r = await self.client.get(path)
        raw = await r.get_data()
        return r.status_code, (json.loads(raw) if r.mimetype == "application/json" else raw.decode())

    def counts(self) -> dict[str, int]:
        return self.store.table_counts()

    def announce_env(self, seed: int, *args: Any, **kw: Any) -> dict[str, str]:
        k = key(seed)
        return signed(k, "announce", announce_for(k, *args, **kw).to_json(), self.clock())

    def heartbeat_env(self, seed: int, **kw: Any) -> dict[str, str]:
        k = key(seed)
        return signed(k, "heartbeat", heartbeat_for(k, **kw).to_json(), self.clock())


@pytest.fixture
async def env(tmp_path: Path, db_url: str) -> AsyncIterator[Env]:
    clock = FakeClock()
    store = Store(make_engine(db_url))
    registry = Registry(
        store,
        test_config(tmp_path, db_url=db_url, max_body_bytes=8192),
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


async def test_announce_heartbeat_and_state(env: Env) -> None:
    status, body = await env.post("/v1/announce", env.announce_env(1, 0, 15))
    assert status == 200 and body["created"] is True and body["state"] == "live"
    assert env.counts() == {"models": 1, "gateways": 0, "nodes": 1, "shards": 1, "usage": 0}
    status, body = await env.post("/v1/heartbeat", env.heartbeat_env(1, active=2, tokens=50))
    assert status == 200 and body["restored"] is False
    status, state = await env.get("/v1/swarm")
    assert status == 200
    (node,) = state["nodes"]
    assert node["shard"]["active_sessions"] == 2 and node["shard"]["tokens_served_total"] == 50
    assert node["hardware"]["backends"] == ["cpu"]
    status, models = await env.get("/v1/models")
    assert models["models"][0]["routable"] is False and models["models"][0]["live_nodes"] == 1


async def test_refusals_write_nothing(env: Env) -> None:
    await env.post("/v1/announce", env.announce_env(1, 0, 15))
    before = env.counts()
    state_before = (await env.get("/v1/swarm"))[1]["nodes"]
    k1, k2 = key(1), key(2)
    now = env.clock()
    good_hb = env.heartbeat_env(1)
    cases: dict[str, tuple[str, dict[str, Any] | bytes, int, str]] = {
        "forged signature": (
            "/v1/announce",
            dict(env.announce_env(2, 15, 30), signature=env.announce_env(3)["signature"]),
            401,
            "bad_signature",
        ),
        "stale timestamp": (
            "/v1/announce",
            signed(k2, "announce", announce_for(k2, 15, 30).to_json(), now - 3600),
            401,
            "stale_timestamp",
        ),
        "future timestamp": (
            "/v1/heartbeat",
            signed(k1, "heartbeat", heartbeat_for(k1, active=3).to_json(), now + 3600),
            401,
            "stale_timestamp",
        ),
        "wrong key for node id": (
            "/v1/announce",
            sign_envelope(
                k2,
                {
                    **make_payload("announce", "node_id", k2, now, announce_for(k1, 15, 30).to_json()),
                    "node_id": public_key_hex(k1),
                },
            ),
            401,
            "key_mismatch",
        ),
        "heartbeat signed as announce": ("/v1/announce", good_hb, 401, "wrong_kind"),
        "oversized body": ("/v1/announce", b"{" + b" " * 9000 + b"}", 413, ""),
        "not json": ("/v1/announce", b"{nope", 400, ""),
        "absurdly nested json": ("/v1/announce", b"[" * 4000 + b"]" * 4000, 400, ""),
        "not an envelope": ("/v1/announce", {"node_id": public_key_hex(k2)}, 400, "malformed_envelope"),
        "shard past the model": (
            "/v1/announce",
            signed(k2, "announce", {**announce_for(k2, 15, 30).to_json(), "shard_end": 31}, now),
            400,
            "",
        ),
        "unknown field": (
            "/v1/announce",
            signed(k2, "announce", {**announce_for(k2, 15, 30).to_json(), "colour": "red"}, now),
            400,
            "",
        ),
        "negative load": (
            "/v1/heartbeat",
            signed(k1, "heartbeat", {**heartbeat_for(k1).to_json(), "active_sessions": -1}, now),
            400,
            "",
        ),
        "layer count conflict": (
            "/v1/announce",
            signed(k2, "announce", announce_for(k2, 0, 10, model=replace(MODEL, n_layers=10)).to_json(), now),
            409,
            "",
        ),
    }
    for name, (path, payload, status, reason) in cases.items():
        if isinstance(payload, bytes):
            got, body = await env.post(path, data=payload)
        else:
            got, body = await env.post(path, payload)
        assert got == status, (name, body)
        assert "error" in body and body["error"]["message"], name
        if reason:
            assert body["error"]["reason"] == reason, name
        assert env.counts() == before, name
    assert (await env.get("/v1/swarm"))[1]["nodes"] == state_before  # e.g. the future heartbeat never landed
    # A replay of an accepted heartbeat is refused and changes nothing.
    assert (await env.post("/v1/heartbeat", good_hb))[0] == 200
    state_mid = (await env.get("/v1/swarm"))[1]["nodes"]
    status, body = await env.post("/v1/heartbeat", good_hb)
    assert status == 401 and body["error"]["reason"] == "replayed_nonce"
    assert (await env.get("/v1/swarm"))[1]["nodes"] == state_mid
    # Every refusal was counted by reason.
    metrics = (await env.get("/metrics"))[1]
    assert 'swarm_tracker_refusals_total{reason="replayed_nonce"} 1' in metrics


async def test_unknown_node_heartbeat_is_404(env: Env) -> None:
    status, body = await env.post("/v1/heartbeat", env.heartbeat_env(5))
    assert status == 404 and "announce first" in body["error"]["message"]
    assert env.counts()["nodes"] == 0


async def test_routes_tickets_and_exclusions(env: Env) -> None:
    pins = {1: "1a" * 32, 2: "", 3: "3c" * 32}  # node 2 serves plaintext
    for seed, (a, b) in {1: (0, 15), 2: (15, 30), 3: (0, 30)}.items():
        announce = env.announce_env(seed, a, b, ms=10.0 if seed < 3 else 100.0, tls_fingerprint=pins[seed])
        assert (await env.post("/v1/announce", announce))[0] == 200
    status, body = await env.post("/v1/routes", {"model": MODEL.fingerprint, "k": 2})
    assert status == 200 and body["uncovered"] == []
    assert [len(r["hops"]) for r in body["routes"]] == [2, 1]
    for route in body["routes"]:
        for hop in route["hops"]:
            t = verify_route_ticket(
                route["ticket"],
                tracker_public_key=env.registry.tracker_id,
                now_s=env.clock(),
                node_id=hop["node_id"],
                model_fingerprint=MODEL.fingerprint,
            )
            assert t.session_id == route["session_id"]
            assert [h.node_id for h in t.hops] == [h["node_id"] for h in route["hops"]]
            # The pins are signed: the ticket's hops carry what the answer's hops say.
            assert [(h.address, h.tls_fingerprint) for h in t.hops] == [
                (h["address"], h["tls_fingerprint"]) for h in route["hops"]
            ]
        signed_hops = json.loads(base64.b64decode(route["ticket"]["payload"]))["hops"]
        for signed_hop, hop in zip(signed_hops, route["hops"], strict=True):
            # absent for a plaintext node: such tickets keep the bytes they had before the field
            assert signed_hop.get("tls_fingerprint") == (hop["tls_fingerprint"] or None)
    # By name, GET form, excluding the single-shard node and one half: no route, uncovered named.
    excl = f"{public_key_hex(key(3))},{public_key_hex(key(2))}"
    status, body = await env.get(f"/v1/routes?model={MODEL.name}&k=1&exclude={excl}")
    assert status == 503 and body["routes"] == [] and body["uncovered"] == [[15, 30]]
    assert (await env.post("/v1/routes", {"model": "nope"}))[0] == 404
    assert (await env.post("/v1/routes", {"model": MODEL.fingerprint, "k": 0}))[0] == 400
    assert (await env.post("/v1/routes", {"model": MODEL.fingerprint, "k": "2"}))[0] == 400
    assert (await env.post("/v1/routes", {"model": MODEL.fingerprint, "x": 1}))[0] == 400


async def test_expiry_and_restore(env: Env) -> None:
    await env.post("/v1/announce", env.announce_env(1, 0, 30))
    assert (await env.post("/v1/routes", {"model": MODEL.fingerprint}))[0] == 200
    env.clock.advance(env.registry.config.heartbeat_timeout_s + 0.5)
    assert await env.registry.expire_once() == [public_key_hex(key(1))]
    status, body = await env.post("/v1/routes", {"model": MODEL.fingerprint})
    assert status == 503 and body["uncovered"] == [[0, 30]]
    assert (await env.get("/v1/swarm"))[1]["nodes"][0]["state"] == "expired"
    status, body = await env.post("/v1/heartbeat", env.heartbeat_env(1))
    assert status == 200 and body["restored"] is True
    assert (await env.post("/v1/routes", {"model": MODEL.fingerprint}))[0] == 200


async def test_recommend(env: Env) -> None:
    await env.post("/v1/announce", env.announce_env(1, 0, 12))
    status, body = await env.get(f"/v1/recommend?model={MODEL.fingerprint}&capacity_layers=10")
    assert status == 200 and (body["start"], body["end"]) == (12, 22)
    assert (await env.get(f"/v1/recommend?model={MODEL.fingerprint}&capacity_layers=0"))[0] == 400
    assert (await env.get(f"/v1/recommend?model={MODEL.fingerprint}"))[0] == 400
    assert (await env.get("/v1/recommend?model=zzz&capacity_layers=3"))[0] == 404


async def test_usage_ledger(env: Env) -> None:
    gw = key(50)
    report = UsageReport(
        gateway_id=public_key_hex(gw),
        request_id="req-1",
        model_fingerprint=MODEL.fingerprint,
        entries=(UsageEntry(public_key_hex(key(1)), 120, 100), UsageEntry(public_key_hex(key(2)), 120, 100)),
    )
    status, body = await env.post(
        "/v1/usage", signed(gw, "usage", report.to_json(), env.clock(), "gateway_id")
    )
    assert status == 200 and body == {"recorded": 2, "duplicates": 0}
    status, body = await env.post(
        "/v1/usage", signed(gw, "usage", report.to_json(), env.clock(), "gateway_id")
    )
    assert body == {"recorded": 0, "duplicates": 2}
    assert env.store.usage_totals()[public_key_hex(key(1))] == (120, 100)
    before = env.counts()
    # A node key cannot report as a gateway it is not.
    impostor = sign_envelope(
        key(1),
        {
            **make_payload("usage", "gateway_id", key(1), env.clock(), report.to_json()),
            "gateway_id": public_key_hex(gw),
        },
    )
    status, body = await env.post("/v1/usage", impostor)
    assert status == 401 and body["error"]["reason"] == "key_mismatch"
    assert env.counts() == before


async def test_health_metrics_and_unknown_path(env: Env) -> None:
    status, body = await env.get("/healthz")
    assert status == 200 and body["tracker_id"] == env.registry.tracker_id
    await env.post("/v1/announce", env.announce_env(1, 0, 30))
    status, text = await env.get("/metrics")
    assert status == 200
    assert "# TYPE swarm_tracker_announces_total counter" in text
    assert 'swarm_tracker_nodes{state="live"} 1' in text
    status, body = await env.get("/v2/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"


async def test_database_outage_is_503_and_routes_ride_it_out(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy.exc import OperationalError

    await env.post("/v1/announce", env.announce_env(1, 0, 30))
    assert (await env.post("/v1/routes", {"model": MODEL.fingerprint}))[0] == 200

    def down(*_args: object, **_kw: object) -> None:
        raise OperationalError("SELECT 1", {}, ConnectionError("connection refused"))

    for name in ("heartbeat", "snapshot", "expire"):
        monkeypatch.setattr(env.store, name, down)
    env.registry.invalidate_snapshot()  # force a refresh attempt
    status, body = await env.post("/v1/heartbeat", env.heartbeat_env(1))
    assert status == 503 and body["error"]["code"] == "storage_unavailable"
    # Routes keep coming from the last snapshot while it is younger than the heartbeat timeout ...
    assert (await env.post("/v1/routes", {"model": MODEL.fingerprint}))[0] == 200
    with pytest.raises(StorageUnavailable):
        await env.registry.expire_once()
    # ... and stop once it is older.
    env.clock.advance(env.registry.config.heartbeat_timeout_s + 1)
    status, body = await env.post("/v1/routes", {"model": MODEL.fingerprint})
    assert status == 503 and body["error"]["code"] == "storage_unavailable"


async def test_relayed_node_is_reached_through_its_gateway(env: Env) -> None:
    k = key(7)
    relayed = replace(announce_for(k, 0, 30), relay=True, relay_via="gw-1", addresses=("10.9.9.9:1",))
    assert (await env.post("/v1/announce", signed(k, "announce", relayed.to_json(), env.clock())))[0] == 200
    status, body = await env.post("/v1/routes", {"model": MODEL.fingerprint})
    assert status == 200
    (hop,) = body["routes"][0]["hops"]
    assert hop["address"] == "relay:gw-1" and hop["relay"] is True
    # The relay penalty is part of the expected cost (default latency 5 ms in and out, penalty 10 ms).
    assert body["routes"][0]["expected_ms_per_token"] == pytest.approx(5 + 10.0 + 10 + 5)
