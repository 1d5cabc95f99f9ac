"""``POST /v1/rebalance`` in process (quart test client, real SQLite): the advice follows the
demand (route look-ups), is signed by the tracker and bound to the question, counts the moves
it already advised, and refuses what it should."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from quart.typing import TestClientProtocol as QuartClient
from tracker_helpers import MODEL, FakeClock, announce_for, key, signed, test_config

from proto.announce import ModelSpec
from proto.rebalance import ADVICE_KIND, REQUEST_KIND, RebalanceAdvice, RebalanceRequest
from proto.signing import (
    NonceCache,
    SignatureError,
    make_payload,
    open_envelope,
    public_key_hex,
    sign_envelope,
)
from tracker.app import create_app
from tracker.demand import DemandMeter
from tracker.service import Registry
from tracker.store import Store, make_engine

OTHER = ModelSpec(fingerprint="cd" * 32, name="other-model", architecture="gemma3", n_layers=18, n_embd=640)


@dataclass
class Env:
    registry: Registry
    client: QuartClient
    clock: FakeClock

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        r = await self.client.post(
            path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        return r.status_code, json.loads(await r.get_data())

    async def ask(self, seed: int, **kw: Any) -> tuple[int, Any, str]:
        k = key(seed)
        req = RebalanceRequest(public_key_hex(k), kw.pop("share", 1.0), **kw)
        envelope = signed(k, REQUEST_KIND, req.to_json(), self.clock())
        nonce = json.loads(base64.b64decode(envelope["payload"]))["nonce"]
        status, body = await self.post("/v1/rebalance", envelope)
        return status, body, nonce

    def advice(self, body: Any) -> RebalanceAdvice:
        payload = open_envelope(
            body["advice"], kind=ADVICE_KIND, now_s=self.clock(), skew_s=60.0, nonces=NonceCache(),
            signer_field="tracker_id",
        )  # fmt: skip
        assert payload["tracker_id"] == self.registry.tracker_id
        return RebalanceAdvice.from_json(payload)


@pytest.fixture
async def env(tmp_path: Path, db_url: str) -> AsyncIterator[Env]:
    clock = FakeClock()
    store = Store(make_engine(db_url))
    # Nodes stay live while the fake clock runs ahead (no heartbeats in this test).
    cfg = test_config(tmp_path, db_url=db_url, demand_half_life_s=60.0, heartbeat_timeout_s=1000.0)
    registry = Registry(store, cfg, key(99), clock=clock, rng=random.Random(0))
    await registry.start()
    try:
        yield Env(registry, create_app(registry).test_client(), clock)
    finally:
        store.close()


async def _swarm(env: Env) -> None:
    # Three whole copies of MODEL (nodes 1-3), one of OTHER (node 4).
    for seed in (1, 2, 3):
        k = key(seed)
        status, _ = await env.post(
            "/v1/announce", signed(k, "announce", announce_for(k, 0, 30).to_json(), env.clock())
        )
        assert status == 200
    k = key(4)
    a = announce_for(k, 0, 18, model=OTHER, port=9004)
    assert (await env.post("/v1/announce", signed(k, "announce", a.to_json(), env.clock())))[0] == 200


async def test_a_node_moves_where_the_demand_went_and_the_next_one_stays(env: Env) -> None:
    await _swarm(env)
    # Demand on MODEL only: nobody moves (OTHER's single holder may not leave; MODEL's are needed).
    for _ in range(20):
        assert (await env.post("/v1/routes", {"model": MODEL.fingerprint}))[0] == 200
    status, body, nonce = await env.ask(1, models=(OTHER.fingerprint,))
    assert status == 200
    advice = env.advice(body)
    assert advice.move is None and advice.node_id == public_key_hex(key(1)) and advice.request_nonce == nonce
    # The demand shifts to OTHER; MODEL's look-ups decay (half-life 60 s).
    env.clock.advance(300.0)
    for _ in range(20):
        assert (await env.post("/v1/routes", {"model": OTHER.fingerprint}))[0] == 200
    status, body, nonce = await env.ask(1, models=(OTHER.fingerprint,))
    advice = env.advice(body)
    assert advice.move is not None and advice.request_nonce == nonce
    assert (advice.move.model_fingerprint, advice.move.start, advice.move.end) == (OTHER.fingerprint, 0, 18)
    assert advice.move.model_name == OTHER.name and advice.move.reason == "throughput"
    # Node 2 asks next: the tracker counts node 1 as already on OTHER, so MODEL keeps two holders.
    status, body, _ = await env.ask(2, models=(OTHER.fingerprint,))
    assert env.advice(body).move is None
    # A node that offers no other model stays; so does a pinned one, and it is told why.
    assert env.advice((await env.ask(3))[1]).move is None
    pinned = env.advice((await env.ask(3, models=(OTHER.fingerprint,), pinned=True))[1])
    assert pinned.move is None and pinned.why == "pinned"
    metrics = (await (await env.client.get("/metrics")).get_data()).decode()
    assert 'swarm_tracker_rebalance_advice_total{advice="move_throughput"} 1' in metrics


async def test_refusals(env: Env) -> None:
    await _swarm(env)
    status, body, _ = await env.ask(7)  # never announced
    assert status == 404
    k = key(1)
    bad = signed(k, REQUEST_KIND, {"node_id": public_key_hex(k), "capacity_share": 0.0}, env.clock())
    assert (await env.post("/v1/rebalance", bad))[0] == 400
    # Signed by node 2 in node 1's name.
    payload = make_payload(REQUEST_KIND, "node_id", key(2), env.clock(), {"capacity_share": 1.0})
    forged = sign_envelope(key(2), {**payload, "node_id": public_key_hex(k)})
    assert (await env.post("/v1/rebalance", forged))[0] == 401
    replay = signed(k, REQUEST_KIND, {"node_id": public_key_hex(k), "capacity_share": 1.0}, env.clock())
    assert (await env.post("/v1/rebalance", replay))[0] == 200
    assert (await env.post("/v1/rebalance", replay))[0] == 401
    # The advice cannot be passed off as another kind of message.
    status, body, _ = await env.ask(1)
    with pytest.raises(SignatureError):
        open_envelope(
            body["advice"], kind="route_ticket", now_s=env.clock(), skew_s=60.0, nonces=NonceCache(),
            signer_field="tracker_id",
        )  # fmt: skip


def test_demand_decays_by_half_lives_and_stays_bounded() -> None:
    meter = DemandMeter(half_life_s=10.0, max_models=2)
    meter.record("a", 0.0)
    meter.record("a", 0.0)
    meter.record("b", 0.0)
    r0 = meter.rates(0.0)
    assert r0["a"] == pytest.approx(2 * r0["b"])
    assert meter.rates(10.0)["a"] == pytest.approx(r0["a"] / 2)
    assert meter.rates(30.0)["b"] == pytest.approx(r0["b"] / 8)
    meter.record("c", 30.0)  # a third model: the least demanded one goes
    assert set(meter.rates(30.0)) == {"a", "c"} and len(meter) == 2
    with pytest.raises(ValueError):
        DemandMeter(half_life_s=0.0)
