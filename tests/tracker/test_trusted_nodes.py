"""The operator's own nodes (``trusted_nodes``), in process on a real database: off probation and
trusted from their first announce (route answers, the trust API, the snapshot that name resolution
reads), the reference for newcomers' join challenges, and still banned by conclusive evidence."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tracker_helpers import MODEL, FakeClock, announce_for, key, signed, test_config

from proto.signing import public_key_hex
from tracker.app import create_app
from tracker.cli import main
from tracker.config import ConfigError, TrackerConfig, load_config
from tracker.service import Registry
from tracker.store import Store, make_engine
from tracker.trust_store import ChallengeTarget

GW = key(90)
OURS, FRESH, THIRD = 1, 2, 3  # node seeds: OURS is the operator's


def hexkey(seed: int) -> str:
    return public_key_hex(key(seed))


def test_trusted_nodes_parse_like_registered_gateways_and_bad_keys_are_refused() -> None:
    cfg = load_config(env={}, flags={"trusted_nodes": f"{hexkey(1)}, {hexkey(2)}  {hexkey(1)}"})
    assert cfg.trusted_node_keys() == frozenset({hexkey(1), hexkey(2)})
    assert TrackerConfig().trusted_node_keys() == frozenset()
    for bad in ("nothex", hexkey(1).upper(), hexkey(1)[:-1], hexkey(1) + "0"):
        with pytest.raises(ConfigError, match="trusted_nodes"):
            load_config(env={}, flags={"trusted_nodes": bad})
    refused = CliRunner().invoke(main, ["serve", "--trusted-nodes", "abc"], env={})
    assert refused.exit_code == 2 and "trusted_nodes" in refused.output


@dataclass
class Tracker:
    registry: Registry
    client: Any
    store: Store
    clock: FakeClock

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        r = await self.client.post(
            path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        return r.status_code, json.loads(await r.get_data())

    async def get(self, path: str) -> tuple[int, Any]:
        r = await self.client.get(path)
        return r.status_code, json.loads(await r.get_data())

    async def announce(self, seed: int, ms: float) -> None:
        a = replace(announce_for(key(seed), 0, 30, ms=ms), addresses=(f"127.0.0.1:{9000 + seed}",))
        status, body = await self.post(
            "/v1/announce", signed(key(seed), "announce", a.to_json(), self.clock())
        )
        assert status == 200 and body["state"] == "live", body

    async def hops(self) -> list[tuple[str, bool, bool]]:
        self.clock.advance(0.01)
        request = signed(
            GW, "route_request", {"model": MODEL.fingerprint, "k": 3}, self.clock(), "gateway_id"
        )
        status, body = await self.post("/v1/routes", request)
        assert status == 200, body
        return [
            (h["node_id"], h["probation"], h["operator_trusted"]) for r in body["routes"] for h in r["hops"]
        ]


@pytest.fixture
async def tracker(tmp_path: Path, db_url: str) -> AsyncIterator[Tracker]:
    clock = FakeClock()
    config = test_config(
        tmp_path,
        db_url=db_url,
        registered_gateways=public_key_hex(GW),
        trusted_nodes=hexkey(OURS),
        probation_checks=2,
        probation_penalty_ms=1000.0,
    )
    store = Store(make_engine(db_url))
    try:
        registry = Registry(store, config, key(99), clock=clock, rng=random.Random(0))
        await registry.start()
        yield Tracker(registry, create_app(registry).test_client(), store, clock)
    finally:
        store.close()


async def test_the_operators_node_is_trusted_from_its_first_announce_a_fresh_one_is_not(
    tracker: Tracker,
) -> None:
    await tracker.announce(OURS, ms=50.0)
    await tracker.announce(FRESH, ms=10.0)
    # The operator's node leads though slower (no probation penalty) and is flagged for gateways.
    assert await tracker.hops() == [(hexkey(OURS), False, True), (hexkey(FRESH), True, False)]
    _, ours = await tracker.get(f"/v1/trust/nodes/{hexkey(OURS)}")
    _, fresh = await tracker.get(f"/v1/trust/nodes/{hexkey(FRESH)}")
    assert (ours["probation"], ours["operator_trusted"], ours["checks_passed"]) == (False, True, 0)
    assert (fresh["probation"], fresh["operator_trusted"]) == (True, False)
    # Trusted holders are what an unregistered name resolves by (tracker/names.py).
    snap = await tracker.registry.snapshot()
    assert {s.node_id: (s.trusted, s.probation) for s in snap.shards} == {
        hexkey(OURS): (True, False),
        hexkey(FRESH): (False, True),
    }
    _, models = await tracker.get("/v1/models")
    (row,) = models["models"]
    assert row["trusted_nodes"] == 1 and row["fingerprint"] == MODEL.fingerprint


async def test_the_operators_answer_is_a_reference_for_a_newcomers_challenge(tracker: Tracker) -> None:
    await tracker.announce(OURS, ms=10.0)
    await tracker.announce(FRESH, ms=10.0)
    await tracker.announce(THIRD, ms=10.0)
    trust = tracker.store.trust

    def target(seed: int) -> ChallengeTarget:
        return ChallengeTarget(hexkey(seed), MODEL.fingerprint, "127.0.0.1:1", 0, 30, 30, 64)

    # The operator's node and a fresh one answered with no trusted reference yet (no_reference).
    for seed, digest in ((OURS, "aa" * 32), (FRESH, "bb" * 32)):
        trust.finish_challenge(
            target(seed), recipe="r", input_id="i", digest=digest, outcome="no_reference",
            detail="", routable=True, now_s=tracker.clock(),
        )  # fmt: skip
    now = tracker.clock()
    refs = trust.challenge_references(
        target(THIRD), "r", "i", now, probation_checks=2, trusted_nodes=frozenset({hexkey(OURS)})
    )
    assert refs == {"aa" * 32}  # the fresh node's answer is no reference
    assert trust.challenge_references(target(THIRD), "r", "i", now, probation_checks=2) == set()


async def test_conclusive_evidence_still_bans_an_operator_trusted_node(tracker: Tracker) -> None:
    for seed in (OURS, FRESH, THIRD):
        await tracker.announce(seed, ms=10.0)
    tracker.clock.advance(1)
    good = {"digest": "aa" * 16}
    body = {
        "gateway_id": public_key_hex(GW),
        "request_id": "req-1",
        "liar": hexkey(OURS),
        "conclusive": True,
        "stage": 0,
        "positions": [0, 12],
        "reports": {
            "primary": {"node_id": hexkey(OURS), "epoch": 1, "step_id": 2, "digest": "bb" * 16},
            "shadow": {"node_id": hexkey(FRESH), "epoch": 1, "step_id": 2, **good},
        },
        "judge": {"node_id": hexkey(THIRD), "epoch": 1, "step_id": 2, **good},
        "detail": "outvoted by the judge",
        "time": tracker.clock(),
    }
    status, verdict = await tracker.post(
        "/v1/evidence", signed(GW, "evidence", body, tracker.clock(), "gateway_id")
    )
    assert status == 200 and verdict["banned"] is True
    assert hexkey(OURS) not in {n for n, _, _ in await tracker.hops()}
    _, trust = await tracker.get(f"/v1/trust/nodes/{hexkey(OURS)}")
    assert trust["state"] == "banned" and trust["banned_until"] is not None
