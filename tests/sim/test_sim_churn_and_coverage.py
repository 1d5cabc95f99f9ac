"""Churn without spare coverage degrades success; spare coverage restores it."""

from __future__ import annotations

import pytest
from simcases import churn, small_scenario

from sim.des.simulator import Simulation, run


@pytest.mark.slow  # a long simulation
def test_spare_coverage_restores_success() -> None:
    # 3 nodes of 10 layers tile 30 layers exactly once: every leave opens a gap.
    no_spare = run(churn(3))
    # 12 nodes: four shards per layer, so a lost stage has replacements.
    spare = run(churn(12))
    assert no_spare["metrics"]["swarm"]["crashes"] > 0 and spare["metrics"]["swarm"]["crashes"] > 0
    assert no_spare["requests"]["success_rate"] < 0.8
    assert spare["requests"]["success_rate"] > 0.95
    assert spare["requests"]["success_rate"] - no_spare["requests"]["success_rate"] > 0.2
    assert (
        no_spare["metrics"]["coverage"][0]["share_of_samples_fully_covered"]
        < spare["metrics"]["coverage"][0]["share_of_samples_fully_covered"]
    )


def _first_busy_node(sim: Simulation):  # type: ignore[no-untyped-def]
    for s in sim.gateways.sessions.values():
        if s.route and s.tokens_out > 5:
            return s, s.route[1]
    return None, None


def test_crash_mid_session_recovers_and_completes() -> None:
    sc = small_scenario(
        workload={"rate_per_s": 0.2, "output_tokens_median": 200.0, "output_tokens_sigma": 0.0},
        run={"duration_s": 120.0},
    )
    sim = Simulation(sc)
    victim: dict = {}

    def crash_one() -> None:
        s, node = _first_busy_node(sim)
        if node is None:
            sim.loop.schedule_in(0.5, crash_one)
            return
        victim["session"] = s
        victim["node"] = node
        sim.swarm.crash(node)

    sim.loop.schedule_at(10.0, crash_one)
    result = sim.run()
    s = victim["session"]
    assert s.phase == "done"
    assert s.recoveries == 1
    assert s.tokens_out == s.output_tokens
    assert victim["node"] not in s.route
    rec = result["metrics"]["recovery"]
    assert rec["recoveries"] >= 1
    # detection (1 s) plus replaying the committed context on the new stage
    assert rec["time_lost_s"] >= sc.nodes.failure_detect_s
    assert rec["replayed_token_layers_stages"] > 0


def test_graceful_leave_drains_without_recovery() -> None:
    sc = small_scenario(
        workload={"rate_per_s": 0.2, "output_tokens_median": 100.0, "output_tokens_sigma": 0.0},
        run={"duration_s": 120.0},
        nodes={"drain_timeout_s": 600.0},
    )
    sim = Simulation(sc)

    def leave_one() -> None:
        s, node = _first_busy_node(sim)
        if node is None:
            sim.loop.schedule_in(0.5, leave_one)
            return
        sim.swarm.leave_gracefully(node)

    sim.loop.schedule_at(10.0, leave_one)
    result = sim.run()
    assert result["metrics"]["swarm"]["graceful_leaves"] == 1
    assert result["metrics"]["recovery"]["recoveries"] == 0
    assert result["requests"]["failed"] == 0
