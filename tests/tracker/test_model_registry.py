"""The model registry (issue 14): signed registrations with manifests, name binding, lookups with peers,
and placement that knows each layer's bytes. In process through the HTTP API (quart test client) on SQLite
(and PostgreSQL when ``SWARM_TEST_POSTGRES_URL`` is set)."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from quart.typing import TestClientProtocol as QuartClient
from tracker_helpers import MODEL, FakeClock, announce_for, key, signed, test_config

from proto.announce import PayloadError
from proto.manifest import Manifest, TensorEntry
from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.errors import NoFittingSpan
from tracker.placement import SpanMemory, recommend_span
from tracker.registry import KIND, ModelRegistration, profile
from tracker.service import Registry
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot
from tracker.store import Store, make_engine

TRACKER_SEED = 99


def manifest(n_layers: int = 30, layer: int = 1000, embd: int = 5000, head: int | None = None) -> Manifest:
    entries, off = [], 4096
    names = [("token_embd.weight", embd)]
    names += [(f"blk.{i}.{part}", layer // 2) for i in range(n_layers) for part in ("attn", "ffn")]
    names += [("output_norm.weight", 64)]
    if head is not None:
        names.append(("output.weight", head))
    for name, size in names:
        entries.append(TensorEntry(name, off, size, f"{len(entries):064x}"))
        off += size + 32
    return Manifest(off, 4096, "e" * 64, tuple(entries))


M = manifest()
FP = M.fingerprint()


def registration(**kw: Any) -> dict[str, Any]:
    body = {
        "fingerprint": FP,
        "name": "smollm2-135m",
        "architecture": MODEL.architecture,
        "n_layers": 30,
        "n_embd": MODEL.n_embd,
        "sources": ["https://models.example/smollm2.gguf"],
    }
    body.update(kw)
    return body


@dataclass
class Env:
    registry: Registry
    client: QuartClient
    clock: FakeClock

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        r = await self.client.post(path, data=json.dumps(body), headers={"content-type": "application/json"})
        return r.status_code, json.loads(await r.get_data())

    async def get(self, path: str) -> tuple[int, Any]:
        r = await self.client.get(path)
        return r.status_code, json.loads(await r.get_data())

    def register(self, seed: int = TRACKER_SEED, mani: Manifest = M, **kw: Any) -> dict[str, Any]:
        env = signed(key(seed), KIND, registration(**kw), self.clock(), signer="signer_id")
        return {"registration": env, "manifest": mani.to_json()}


@pytest.fixture
async def env(tmp_path: Path, db_url: str) -> AsyncIterator[Env]:
    clock = FakeClock()
    store = Store(make_engine(db_url))
    config = test_config(tmp_path, db_url=db_url, registry_keys=public_key_hex(key(7)))
    registry = Registry(store, config, key(TRACKER_SEED), clock=clock, rng=random.Random(0))
    await registry.start()
    try:
        yield Env(registry, create_app(registry).test_client(), clock)
    finally:
        store.close()


async def test_register_look_up_and_join_placement(env: Env) -> None:
    status, body = await env.post("/v1/registry/models", env.register())
    assert status == 200 and body == {"fingerprint": FP, "name": "smollm2-135m", "created": True}
    for model in ("smollm2-135m", FP):
        status, entry = await env.get(f"/v1/registry/models/{model}")
        assert status == 200
        assert Manifest.from_json(entry["manifest"]).fingerprint() == FP
        assert entry["sources"] == ["https://models.example/smollm2.gguf"] and entry["peers"] == []
        assert entry["registration"]["public_key"] == public_key_hex(key(TRACKER_SEED))
    status, listed = await env.get("/v1/registry/models?source=https://models.example/smollm2.gguf")
    assert [m["fingerprint"] for m in listed["models"]] == [FP]
    # A node serving a span of it shows up as a peer.
    k = key(1)
    spec = replace(MODEL, fingerprint=FP)
    status, _ = await env.post(
        "/v1/announce", signed(k, "announce", announce_for(k, 0, 10, model=spec).to_json(), env.clock())
    )
    assert status == 200
    status, entry = await env.get("/v1/registry/models/smollm2-135m")
    assert entry["peers"] == [
        {"node_id": public_key_hex(k), "address": "127.0.0.1:9000", "start": 0, "end": 10}
    ]
    # Placement knows the bytes: a node with room for 5 layers' weights and KV gets 5 (not the 10 it may
    # hold by count), and no first span, whose token table it cannot hold.
    status, rec = await env.get(
        f"/v1/recommend?model=smollm2-135m&capacity_layers=10&memory_bytes={5 * 1100}&kv_bytes_per_layer=100"
    )
    assert status == 200 and rec["end"] - rec["start"] == 5 and rec["start"] == 10
    status, err = await env.get(
        f"/v1/recommend?model={FP}&capacity_layers=10&memory_bytes=500&kv_bytes_per_layer=100"
    )
    assert status == 409 and err["error"]["code"] == "no_fitting_span"


async def test_refusals(env: Env) -> None:
    # Only the tracker's key or a registry key may register.
    status, body = await env.post("/v1/registry/models", env.register(seed=3))
    assert status == 401 and body["error"]["reason"] == "untrusted_key"
    assert (await env.post("/v1/registry/models", env.register(seed=7)))[0] == 200
    # A manifest that does not hash to the fingerprint.
    other = manifest(layer=999)
    status, body = await env.post("/v1/registry/models", env.register(mani=other))
    assert status == 400 and "hashes to" in body["error"]["message"]
    # Blocks that do not match the layer count.
    status, body = await env.post("/v1/registry/models", env.register(n_layers=31))
    assert status == 400
    # A name is bound to one fingerprint unless the registration says replace.
    m2 = manifest(layer=998)
    req = env.register(mani=m2, fingerprint=m2.fingerprint())
    status, body = await env.post("/v1/registry/models", req)
    assert status == 409 and "--replace" in body["error"]["message"]
    status, body = await env.post(
        "/v1/registry/models", env.register(mani=m2, fingerprint=m2.fingerprint(), replace=True)
    )
    assert status == 200
    assert (await env.get(f"/v1/registry/models/{FP}"))[0] == 404
    # Replays are refused.
    req = env.register(seed=7, mani=m2, fingerprint=m2.fingerprint())
    assert (await env.post("/v1/registry/models", req))[0] == 200
    assert (await env.post("/v1/registry/models", req))[0] == 401
    # Removal, signed.
    removal = signed(
        key(TRACKER_SEED), "model_removal", {"model": "smollm2-135m"}, env.clock(), signer="signer_id"
    )
    assert (await env.post("/v1/registry/remove", removal))[1] == {
        "fingerprint": m2.fingerprint(),
        "removed": True,
    }
    assert (await env.get("/v1/registry/models/smollm2-135m"))[0] == 404
    # Announcing a registered fingerprint with another shape is a conflict.
    assert (await env.post("/v1/registry/models", env.register(seed=7)))[0] == 200
    k = key(2)
    wrong = replace(MODEL, fingerprint=FP, n_layers=29)
    status, _ = await env.post(
        "/v1/announce", signed(k, "announce", announce_for(k, 0, 10, model=wrong).to_json(), env.clock())
    )
    assert status == 409


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "a" * 64}, "must not look like a fingerprint"),
        ({"name": " x"}, "surrounding spaces"),
        ({"sources": ["ftp://x/y"]}, "not an http"),
        ({"split_points": [0, 5, 3, 30]}, "increasing"),
        ({"n_layers": 0}, "n_layers"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_registration_payload_is_strict(change: dict[str, Any], message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        ModelRegistration.from_json(registration(**change))


def test_profile_and_span_memory() -> None:
    p = profile(manifest(n_layers=4, layer=1000, embd=5000, head=7000), 4)
    assert p.layer_bytes == (1000,) * 4 and p.first_extra_bytes == 5000 and p.last_extra_bytes == 7000 + 64
    tied = profile(manifest(n_layers=4, embd=5000), 4)
    assert tied.last_extra_bytes == 5000 + 64
    info = ModelInfo(
        "f" * 64, "m", 4, 64, layer_bytes=p.layer_bytes, first_extra_bytes=5000, last_extra_bytes=7064
    )
    mem = SpanMemory(memory_bytes=6000, kv_bytes_per_layer=0)
    assert (
        mem.fits(info, 0, 1)
        and not mem.fits(info, 0, 2)
        and mem.fits(info, 1, 3)
        and not mem.fits(info, 3, 4)
    )
    snap = SwarmSnapshot(models=(info,), shards=())
    # Empty swarm, a node with room for 1 first layer: it takes [0, 1).
    assert recommend_span(snap, info.fingerprint, 4, rng=random.Random(0), memory=mem) == (0, 1)
    shard = ShardView("n", info.fingerprint, 0, 1, decode_ms_per_token=10.0, prefill_tokens_per_s=100.0)
    snap = SwarmSnapshot(models=(info,), shards=(shard,))
    # From 1: the last layer would bring the LM head (7064 bytes), so the span stops at 3.
    assert recommend_span(snap, info.fingerprint, 4, rng=random.Random(0), memory=mem) == (1, 3)
    with pytest.raises(NoFittingSpan):
        recommend_span(snap, info.fingerprint, 4, rng=random.Random(0), memory=SpanMemory(900))
