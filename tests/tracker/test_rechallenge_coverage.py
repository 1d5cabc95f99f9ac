"""A gateway names nodes it could not reach; the tracker sends them back to their challenge (out of
routing until they answer) -- but not the last live holder of a layer (issue 26).

Seen on the emulated WAN under load (docs/wan.md): one slow ``Info`` answer made the gateway name
Gemma 3's only node, which left routing for the seconds its challenge took, and every request for
Gemma 3 got 503 "layers not covered" meanwhile; three SmolLM2 nodes named in one report left
SmolLM2 with no node at all. In process, on a real SQLite database; the challenge runner is never
started, so a node sent back to its challenge stays ``challenging`` and the test sees who was sent."""

from __future__ import annotations

import random
from pathlib import Path

import trio
from swarm_strategies import FP, OTHER_FP, shard, snapshot
from tracker_helpers import MODEL, FakeClock, announce_for, key, signed, test_config

from proto.announce import GatewayStats
from proto.signing import public_key_hex
from tracker.challenger import Challenger
from tracker.rebalance import removable
from tracker.service import Registry
from tracker.store import Store, make_engine

GW = key(90)
SPANS = {1: (0, 15), 2: (0, 15), 3: (15, 30), 4: (15, 30)}


def test_removable_spares_the_last_holder_of_a_layer_in_report_order() -> None:
    snap = snapshot(
        10, [shard("a", 0, 5), shard("b", 0, 10), shard("c", 5, 10), shard("o", 0, 10, fp=OTHER_FP)]
    )
    assert snap.model(FP) is not None
    # a goes (b holds 0..5); b then holds 0..5 alone: spared; c goes (b, staying, holds 5..10).
    assert removable(snap, ["a", "b", "c"]) == (["a", "c"], ["b"])
    assert removable(snap, ["b", "a"]) == (["b"], ["a"])  # the order decides who is the last
    assert removable(snap, ["o", "gone"]) == (["gone"], ["o"])  # alone on its model; not in the view
    assert removable(snap, []) == ([], [])


async def gateway_names(registry: Registry, clock: FakeClock, nodes: tuple[str, ...]) -> dict[str, str]:
    """A statistics report of the gateway naming ``nodes`` unreachable; the nodes' states after it."""
    stats = GatewayStats(public_key_hex(GW), 5.0, 0, 0, 0, 0, 0, 0, None, None, unreachable=nodes)
    clock.advance(0.01)
    await registry.report_gateway_stats(
        signed(GW, "gateway_stats", stats.to_json(), registry.clock(), "gateway_id")
    )
    return {n["node_id"]: n["state"] for n in (await registry.swarm_state())["nodes"]}


async def test_a_report_never_takes_the_last_holder_of_a_layer_out_of_routing(tmp_path: Path) -> None:
    config = test_config(tmp_path, challenge_nodes=True, heartbeat_timeout_s=600.0)
    store = Store(make_engine(config.resolved_db_url()))
    clock = FakeClock()
    registry = Registry(store, config, key(99), clock=clock, rng=random.Random(0))
    await registry.start()
    try:
        with trio.fail_after(30):
            for seed, (start, end) in SPANS.items():  # no challenger set yet: live at once
                a = announce_for(key(seed), start, end, port=9000 + seed)
                answer = await registry.announce(signed(key(seed), "announce", a.to_json(), registry.clock()))
                assert answer["state"] == "live"
            registry.challenger = Challenger(registry, grpc_rt=None)  # type: ignore[arg-type]  # never run
            ids = {seed: public_key_hex(key(seed)) for seed in SPANS}
            # Named 1, 2 and 3 (a report lists them sorted): of 1 and 2 the first goes and the second,
            # then alone on 0..15, is spared; 3 goes (4 holds 15..30).
            first, second = sorted((ids[1], ids[2]))
            states = await gateway_names(registry, clock, tuple(sorted((ids[1], ids[2], ids[3]))))
            assert states == {first: "challenging", second: "live", ids[3]: "challenging", ids[4]: "live"}
            assert (await registry.routes(MODEL.fingerprint, 2, frozenset()))["routes"]
            # Named again, the two left: both spared (each holds its half alone); still routable.
            states = await gateway_names(registry, clock, tuple(sorted((second, ids[4]))))
            assert states[second] == states[ids[4]] == "live"
            assert (await registry.routes(MODEL.fingerprint, 2, frozenset()))["routes"]
    finally:
        store.close()
