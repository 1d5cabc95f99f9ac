"""Sessions the tracker handed out count as load until the node's next heartbeat."""

from __future__ import annotations

import pytest
from test_tracker_api import Env, env  # noqa: F401 (the fixture)
from tracker_helpers import MODEL, key

from proto.signing import public_key_hex
from tracker.handouts import HandoutLedger


def test_ledger_counts_shares_forgets_on_report_and_with_age() -> None:
    ledger = HandoutLedger(max_age_s=10.0, max_nodes=3)
    ledger.record([("a", "b"), ("c",)], now_s=0.0)  # one look-up of two routes: half a session each
    assert ledger.extra(0.0) == {"a": 0.5, "b": 0.5, "c": 0.5}
    ledger.record([("a",)], now_s=1.0)
    assert ledger.extra(1.0)["a"] == 1.5
    ledger.reported("a")
    assert "a" not in ledger.extra(1.0)
    ledger.record([("d",), ("e",)], now_s=2.0)  # bounded: the oldest counts go first
    assert len(ledger) == 3 and set(ledger.extra(2.0)) == {"c", "d", "e"}
    assert ledger.extra(12.5) == {}  # older than max_age_s
    ledger.record([], now_s=13.0)
    assert len(ledger) == 0
    with pytest.raises(ValueError):
        HandoutLedger(max_age_s=0.0)


async def test_look_ups_between_heartbeats_spread_over_equal_nodes(env: Env) -> None:  # noqa: F811
    """Two whole-model nodes, the first a little faster: consecutive look-ups before any heartbeat
    do not all go to it; once its heartbeat reports zero sessions, it is first again."""
    for seed, ms in ((1, 10.0), (2, 12.0)):
        assert (await env.post("/v1/announce", env.announce_env(seed, 0, 30, ms=ms)))[0] == 200
    fast, slow = public_key_hex(key(1)), public_key_hex(key(2))
    firsts = []
    for _ in range(4):
        status, body = await env.post("/v1/routes", {"model": MODEL.fingerprint, "k": 1})
        assert status == 200
        firsts.append(body["routes"][0]["hops"][0]["node_id"])
    assert firsts[0] == fast and slow in firsts
    assert env.registry.handouts.extra(env.clock())[fast] >= 1.0
    assert (await env.post("/v1/heartbeat", env.heartbeat_env(1)))[0] == 200
    assert fast not in env.registry.handouts.extra(env.clock())
