"""Trust, in process on a real database (SQLite, and PostgreSQL when configured): registered gateways,
spot-check credit and probation, evidence and bans (keys and hosts), measured speed over claimed
speed, and the usage ledger a node can check signature by signature."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from tracker_helpers import MODEL, FakeClock, announce_for, heartbeat_for, key, signed, test_config

from proto.announce import (
    CheckPass,
    CheckResults,
    GatewayStats,
    ModelSpec,
    NodeSpeed,
    UsageEntry,
    UsageReport,
)
from proto.ledger import LedgerError, verify_ledger_entry
from proto.manifest import Manifest, TensorEntry
from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.config import TrackerConfig
from tracker.routing import select_routes
from tracker.service import Registry
from tracker.store import Store, make_engine

GW = key(90)  # registered
ROGUE = key(91)  # not registered


def hexkey(seed: int) -> str:
    return public_key_hex(key(seed))


@dataclass
class Tracker:
    registry: Registry
    client: Any
    store: Store
    clock: FakeClock
    config: TrackerConfig

    async def post(self, path: str, body: Any, remote: str = "127.0.0.1") -> tuple[int, Any]:
        r = await self.client.post(
            path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
            scope_base={"client": (remote, 40000)},
        )
        return r.status_code, json.loads(await r.get_data())

    async def get(self, path: str) -> tuple[int, Any]:
        r = await self.client.get(path)
        return r.status_code, json.loads(await r.get_data())

    def announce(
        self, seed: int, start: int = 0, end: int = 30, *, host: str = "127.0.0.1", ms: float = 10.0
    ) -> dict:
        a = replace(announce_for(key(seed), start, end, ms=ms), addresses=(f"{host}:{9000 + seed}",))
        return signed(key(seed), "announce", a.to_json(), self.clock())

    def heartbeat(self, seed: int) -> dict:
        return signed(key(seed), "heartbeat", heartbeat_for(key(seed)).to_json(), self.clock())

    def checks(self, counts: dict[int, int], gateway: Any = GW) -> dict:
        body = CheckResults(
            public_key_hex(gateway), tuple(CheckPass(hexkey(s), n) for s, n in counts.items())
        ).to_json()
        return signed(gateway, "check_results", body, self.clock(), "gateway_id")

    def evidence(self, liar: int, honest: int, judge_node: int, /, *, gateway: Any = GW, **over: Any) -> dict:
        good = {"digest": "aa" * 16}
        body = {
            "gateway_id": public_key_hex(gateway),
            "request_id": "req-1",
            "liar": hexkey(liar),
            "conclusive": True,
            "stage": 0,
            "positions": [0, 12],
            "reports": {
                "primary": {"node_id": hexkey(liar), "epoch": 1, "step_id": 2, "digest": "bb" * 16},
                "shadow": {"node_id": hexkey(honest), "epoch": 1, "step_id": 2, **good},
            },
            "judge": {"node_id": hexkey(judge_node), "epoch": 1, "step_id": 2, **good},
            "detail": "outvoted by the judge",
            "time": self.clock(),
        }
        body.update(over)
        return signed(gateway, "evidence", body, self.clock(), "gateway_id")

    async def routes(self, k: int = 1, model: str = MODEL.fingerprint) -> dict:
        self.clock.advance(0.01)
        # Signed by the registered gateway: a tracker with registered gateways answers nothing else.
        request = signed(GW, "route_request", {"model": model, "k": k}, self.clock(), "gateway_id")
        status, body = await self.post("/v1/routes", request)
        assert status in (200, 503)
        return body


@pytest.fixture
async def tracker(tmp_path: Path, db_url: str) -> AsyncIterator[Tracker]:
    clock = FakeClock()
    config = test_config(
        tmp_path,
        db_url=db_url,
        registered_gateways=public_key_hex(GW),
        probation_checks=2,
        probation_penalty_ms=1000.0,
    )
    store = Store(make_engine(db_url))
    try:
        registry = Registry(store, config, key(99), clock=clock, rng=random.Random(0))
        await registry.start()
        yield Tracker(registry, create_app(registry).test_client(), store, clock, config)
    finally:
        store.close()


def _hops(body: dict) -> list[list[tuple[str, bool]]]:
    return [[(h["node_id"], h["probation"]) for h in r["hops"]] for r in body["routes"]]


async def test_probation_flags_until_enough_checks_and_trusted_nodes_first(tracker: Tracker) -> None:
    for seed in (1, 2):
        status, body = await tracker.post(
            "/v1/announce", tracker.announce(seed, ms=10.0 if seed == 1 else 50.0)
        )
        assert status == 200 and body["state"] == "live"
    # both on probation: the faster one leads, and every hop says it is on probation
    assert _hops(await tracker.routes(k=2)) == [[(hexkey(1), True)], [(hexkey(2), True)]]
    # node 2 passes two checks (the threshold): it is trusted and, though slower, preferred now
    status, body = await tracker.post("/v1/checks", tracker.checks({2: 1}))
    assert status == 200 and body == {"credited": 1, "unknown": 0, "graduated": []}
    status, body = await tracker.post("/v1/checks", tracker.checks({2: 1, 7: 3}))
    assert status == 200 and body == {"credited": 1, "unknown": 1, "graduated": [hexkey(2)]}
    assert _hops(await tracker.routes(k=2)) == [[(hexkey(2), False)], [(hexkey(1), True)]]
    _, trust = await tracker.get(f"/v1/trust/nodes/{hexkey(2)}")
    assert (trust["checks_passed"], trust["probation"], trust["banned_until"]) == (2, False, None)
    assert tracker.registry.metrics.counter("swarm_tracker_checks_credited_total") == 5


async def test_reports_from_an_unregistered_gateway_are_refused_and_write_nothing(tracker: Tracker) -> None:
    await tracker.post("/v1/announce", tracker.announce(1))
    await tracker.post("/v1/announce", tracker.announce(2))
    before = tracker.store.table_counts(operations=True)
    usage = UsageReport(
        public_key_hex(ROGUE), "req-9", MODEL.fingerprint, (UsageEntry(hexkey(1), 1 << 40, 1),)
    )
    stats = GatewayStats(public_key_hex(ROGUE), 5.0, 0, 0, 1, 0, 1, 1, None, None)
    for path, envelope in (
        ("/v1/checks", tracker.checks({1: 50}, gateway=ROGUE)),
        ("/v1/evidence", tracker.evidence(1, 2, 3, gateway=ROGUE)),
        ("/v1/usage", signed(ROGUE, "usage", usage.to_json(), tracker.clock(), "gateway_id")),
        ("/v1/gateway-stats", signed(ROGUE, "gateway_stats", stats.to_json(), tracker.clock(), "gateway_id")),
    ):
        status, err = await tracker.post(path, envelope)
        assert (status, err["error"]["code"]) == (403, "unregistered_gateway"), path
        assert "not registered" in err["error"]["message"]
    assert tracker.store.table_counts(operations=True) == before
    assert (
        tracker.registry.metrics.counter("swarm_tracker_refusals_total", reason="unregistered_gateway") == 4
    )
    # a forged signature (the registered gateway's id, another key's signature) is refused before that
    forged = tracker.checks({1: 50}, gateway=ROGUE)
    forged["public_key"] = public_key_hex(GW)
    status, err = await tracker.post("/v1/checks", forged)
    assert (status, err["error"]["reason"]) == (401, "bad_signature")


async def test_conclusive_evidence_bans_the_key_and_new_keys_from_its_hosts(tracker: Tracker) -> None:
    await tracker.post("/v1/announce", tracker.announce(1, host="10.0.0.1"), remote="192.0.2.1")
    await tracker.post("/v1/announce", tracker.announce(2, host="10.0.0.1"), remote="192.0.2.2")
    await tracker.post("/v1/announce", tracker.announce(3, host="10.0.0.3"), remote="192.0.2.3")
    tracker.clock.advance(1)
    status, body = await tracker.post("/v1/evidence", tracker.evidence(1, 2, 3))
    assert status == 200 and body["banned"] is True
    assert body["hosts_banned"] == ["10.0.0.1", "192.0.2.1"]
    # out of routing at once
    assert hexkey(1) not in {n for r in _hops(await tracker.routes(k=3)) for n, _ in r}
    # its heartbeats and announces are refused with a one-line reason
    status, err = await tracker.post("/v1/heartbeat", tracker.heartbeat(1))
    assert (status, err["error"]["code"]) == (403, "banned")
    status, err = await tracker.post(
        "/v1/announce", tracker.announce(1, host="10.9.9.9"), remote="198.51.100.1"
    )
    assert (status, err["error"]["code"]) == (403, "banned") and "\n" not in err["error"]["message"]
    assert "caught lying" in err["error"]["message"]
    # a new key from the same host (announced address or where it calls from) is refused too...
    for host, remote in (("10.0.0.1", "198.51.100.2"), ("10.5.5.5", "192.0.2.1")):
        status, err = await tracker.post("/v1/announce", tracker.announce(4, host=host), remote=remote)
        assert (status, err["error"]["code"]) == (403, "banned") and "host" in err["error"]["message"]
    # ... but a node that was there before the ban keeps announcing
    tracker.clock.advance(1)
    status, _ = await tracker.post("/v1/announce", tracker.announce(2, host="10.0.0.1"), remote="192.0.2.2")
    assert status == 200
    _, bans = await tracker.get("/v1/trust/bans")
    assert [n["node_id"] for n in bans["nodes"]] == [hexkey(1)]
    assert sorted(h["host"] for h in bans["hosts"]) == ["10.0.0.1", "192.0.2.1"]
    _, trust = await tracker.get(f"/v1/trust/nodes/{hexkey(1)}")
    assert trust["state"] == "banned" and trust["checks_failed"] == 1 and len(trust["evidence"]) == 1
    # the signed envelope is kept as received
    assert trust["evidence"][0]["envelope"]["public_key"] == public_key_hex(GW)
    state = await tracker.registry.dashboard_state()  # the dashboard lists the banned node too
    assert {n["node_id"]: n["state"] for n in state["nodes"]}[hexkey(1)] == "banned"
    # host bans run out first, then the key's
    tracker.clock.advance(tracker.config.ban_host_s + 1)
    assert (await tracker.post("/v1/announce", tracker.announce(4, host="10.0.0.1")))[0] == 200
    assert (await tracker.post("/v1/announce", tracker.announce(1)))[0] == 403
    tracker.clock.advance(tracker.config.ban_node_s)
    status, body = await tracker.post("/v1/announce", tracker.announce(1))
    assert status == 200 and body["state"] == "live"


async def test_evidence_that_does_not_convict_is_refused_or_only_kept(tracker: Tracker) -> None:
    for seed in (1, 2, 3):
        await tracker.post("/v1/announce", tracker.announce(seed))
    before = tracker.store.table_counts(operations=True)
    judge_agrees_with_accused = {"node_id": hexkey(3), "epoch": 1, "step_id": 2, "digest": "bb" * 16}
    for over, why in (
        ({"judge": judge_agrees_with_accused}, "agrees with the judge"),
        ({"liar": hexkey(3)}, "judge is the accused"),
        ({"liar": hexkey(5)}, "no report of the accused"),
        ({"liar": ""}, "must name the liar"),
        ({"positions": [4, 2]}, "positions"),
        ({"surprise": 1}, "unknown field"),
    ):
        status, err = await tracker.post("/v1/evidence", tracker.evidence(1, 2, 3, **over))
        assert status == 400 and why in err["error"]["message"], over
    assert tracker.store.table_counts(operations=True) == before
    # an inconclusive verdict is kept as evidence but bans nobody
    status, body = await tracker.post("/v1/evidence", tracker.evidence(1, 2, 3, liar="", conclusive=False))
    assert status == 200 and body["banned"] is False
    # ... even one that names a node (a check compared with the cross-recipe tolerance, or whose
    # judge agreed with neither run): kept, and nobody is banned or loses routing
    tracker.clock.advance(0.01)
    status, body = await tracker.post("/v1/evidence", tracker.evidence(1, 2, 3, conclusive=False))
    assert status == 200 and body["banned"] is False and body["node_id"] == hexkey(1)
    _, trust = await tracker.get(f"/v1/trust/nodes/{hexkey(1)}")
    assert trust["banned_until"] is None and trust["checks_failed"] == 0 and trust["state"] == "live"
    assert trust["evidence"] and not any(e["conclusive"] for e in trust["evidence"])
    assert len(_hops(await tracker.routes(k=3))) == 3


async def test_the_evidence_log_is_bounded_per_node(tracker: Tracker) -> None:
    for seed in (1, 2, 3):
        await tracker.post("/v1/announce", tracker.announce(seed))
    limit = tracker.config.evidence_per_node_max
    for i in range(limit + 5):
        status, _ = await tracker.post(
            "/v1/evidence", tracker.evidence(1, 2, 3, liar="", conclusive=False, request_id=f"r{i}")
        )
        assert status == 200
        tracker.clock.advance(0.001)
    assert tracker.store.table_counts(operations=True)["trust_evidence"] == limit
    _, trust = await tracker.get(f"/v1/trust/nodes/{hexkey(1)}")
    assert trust["evidence"][0]["request_id"] == f"r{limit + 4}"  # newest kept, oldest gone


async def test_routing_uses_the_measured_decode_time_not_the_claim(tracker: Tracker) -> None:
    honest, liar = 1, 2
    await tracker.post("/v1/announce", tracker.announce(honest, ms=20.0))
    await tracker.post("/v1/announce", tracker.announce(liar, ms=0.01))  # claims 2000x faster
    assert _hops(await tracker.routes())[0][0][0] == hexkey(liar)
    stats = GatewayStats(
        public_key_hex(GW),
        5.0,
        0,
        0,
        4,
        0,
        40,
        40,
        None,
        None,
        nodes=(
            NodeSpeed(hexkey(liar), MODEL.fingerprint, 35.0, 4),
            NodeSpeed(hexkey(honest), MODEL.fingerprint, 18.0, 3),
        ),
    )
    status, body = await tracker.post(
        "/v1/gateway-stats", signed(GW, "gateway_stats", stats.to_json(), tracker.clock(), "gateway_id")
    )
    assert status == 200 and body["node_speeds"] == 2
    assert _hops(await tracker.routes())[0][0][0] == hexkey(honest)
    snap = await tracker.registry.snapshot()
    speeds = {s.node_id: s.decode_ms_per_token for s in snap.shards}
    assert speeds == {hexkey(liar): 35.0, hexkey(honest): 20.0}  # max(claim, measured)
    # a stale measurement stops counting
    tracker.clock.advance(tracker.config.observed_speed_keep_s + 1)
    for seed in (honest, liar):
        status, body = await tracker.post("/v1/heartbeat", tracker.heartbeat(seed))
        assert status == 200, body
    tracker.clock.advance(0.01)  # the cached snapshot is at most snapshot_ttl_s (0) old
    snap = await tracker.registry.snapshot()
    assert {s.node_id: s.decode_ms_per_token for s in snap.shards}[hexkey(liar)] == 0.01
    assert select_routes(snap, MODEL.fingerprint, 1, rng=random.Random(0)).routes


async def test_a_node_checks_its_ledger_entries_signature_by_signature(tracker: Tracker) -> None:
    for seed in (1, 2):
        await tracker.post("/v1/announce", tracker.announce(seed, *((0, 15) if seed == 1 else (15, 30))))
    report = UsageReport(
        public_key_hex(GW),
        "req-7",
        MODEL.fingerprint,
        (UsageEntry(hexkey(1), 30, 3), UsageEntry(hexkey(2), 20, 2)),
    )
    status, body = await tracker.post(
        "/v1/usage", signed(GW, "usage", report.to_json(), tracker.clock(), "gateway_id")
    )
    assert status == 200 and body == {"recorded": 2, "duplicates": 0}
    status, ledger = await tracker.get(f"/v1/usage/nodes/{hexkey(1)}/ledger")
    assert status == 200 and ledger["tracker_id"] == tracker.registry.tracker_id
    [entry] = ledger["entries"]
    assert (entry["request_id"], entry["tokens"], entry["steps"]) == ("req-7", 30, 3)
    checked = verify_ledger_entry(entry, node_id=hexkey(1), tracker_public_key=tracker.registry.tracker_id)
    assert checked.request_id == "req-7"
    # what a node catches: a row inflated by the tracker, a receipt from another key, a swapped report
    with pytest.raises(LedgerError, match="tokens and steps"):
        verify_ledger_entry(
            {**entry, "tokens": 31}, node_id=hexkey(1), tracker_public_key=tracker.registry.tracker_id
        )
    with pytest.raises(LedgerError, match="pinned tracker key"):
        verify_ledger_entry(entry, node_id=hexkey(1), tracker_public_key=hexkey(5))
    with pytest.raises(LedgerError, match="tokens and steps"):
        verify_ledger_entry(entry, node_id=hexkey(2), tracker_public_key=tracker.registry.tracker_id)
    tampered = dict(entry["report"], signature=entry["receipt"]["signature"])
    with pytest.raises(LedgerError, match="report"):
        verify_ledger_entry(
            {**entry, "report": tampered}, node_id=hexkey(1), tracker_public_key=tracker.registry.tracker_id
        )
    # a retried report records nothing new and keeps no second envelope
    again = signed(GW, "usage", report.to_json(), tracker.clock(), "gateway_id")
    assert (await tracker.post("/v1/usage", again))[1] == {"recorded": 0, "duplicates": 2}
    assert tracker.store.table_counts(operations=True)["usage_reports"] == 1
    # node-reported counters are shown apart and never credited
    await tracker.post(
        "/v1/heartbeat",
        signed(
            key(1),
            "heartbeat",
            replace(heartbeat_for(key(1)), tokens_served=1 << 30).to_json(),
            tracker.clock(),
        ),
    )
    _, usage = await tracker.get(f"/v1/usage/nodes/{hexkey(1)}")
    assert usage["all_time"]["tokens"] == 30 and usage["heartbeat_tokens_served_total"] == 1 << 30


def _manifest(n_layers: int = 30) -> Manifest:
    entries, off = [], 4096
    for name in ["token_embd.weight", *(f"blk.{i}.ffn" for i in range(n_layers)), "output_norm.weight"]:
        entries.append(TensorEntry(name, off, 1000, f"{len(entries):064x}"))
        off += 1032
    return Manifest(off, 4096, "e" * 64, tuple(entries))


async def test_a_registered_name_resolves_only_to_its_fingerprint(tracker: Tracker) -> None:
    manifest = _manifest()
    real = replace(MODEL, fingerprint=manifest.fingerprint(), name="smollm2-135m")
    fake = replace(MODEL, fingerprint="fe" * 32, name="smollm2-135m")

    def announce(seed: int, spec: ModelSpec) -> dict:
        a = replace(announce_for(key(seed), 0, 30, model=spec), addresses=(f"127.0.0.{seed}:9000",))
        return signed(key(seed), "announce", a.to_json(), tracker.clock())

    # before the name is registered, the first comer takes it (what issue 16 found)
    assert (await tracker.post("/v1/announce", announce(1, fake)))[0] == 200
    body = signed(
        key(99),
        "model_registration",
        {
            "fingerprint": real.fingerprint,
            "name": real.name,
            "architecture": real.architecture,
            "n_layers": real.n_layers,
            "n_embd": real.n_embd,
            "sources": [],
        },
        tracker.clock(),
        signer="signer_id",
    )
    status, _ = await tracker.post(
        "/v1/registry/models", {"registration": body, "manifest": manifest.to_json()}
    )
    assert status == 200
    # announcing the registered name with another fingerprint is refused, and writes nothing
    before = tracker.store.table_counts(operations=True)
    status, err = await tracker.post("/v1/announce", announce(2, fake))
    assert (status, err["error"]["code"]) == (403, "model_name_bound")
    assert "registered to fingerprint" in err["error"]["message"]
    assert tracker.store.table_counts(operations=True) == before
    # the real model's nodes are welcome; the name resolves to it alone
    assert (await tracker.post("/v1/announce", announce(3, real)))[0] == 200
    routes = await tracker.routes(k=2, model="smollm2-135m")
    assert routes["model"]["fingerprint"] == real.fingerprint
    assert [h["node_id"] for r in routes["routes"] for h in r["hops"]] == [hexkey(3)]
    _, models = await tracker.get("/v1/models")
    assert [m["fingerprint"] for m in models["models"] if m["name"] == "smollm2-135m"] == [real.fingerprint]
    # the early hijacker is still reachable by its own fingerprint, never by the name
    routes = await tracker.routes(k=1, model=fake.fingerprint)
    assert [h["node_id"] for r in routes["routes"] for h in r["hops"]] == [hexkey(1)]
