"""The spreading knobs of the simulated policy: recent busy shares reach routing, and spread the load."""

from __future__ import annotations

import pytest
from simcases import small_scenario

from sim.des.config import ScenarioError
from sim.des.simulator import Simulation


def _scenario(busy_ms: float):  # type: ignore[no-untyped-def]
    # Twelve one-thread nodes of 10 layers for a 30-layer model: four candidates per span.
    return small_scenario(
        run={"duration_s": 400.0},
        nodes={"initial": 12},
        workload={"rate_per_s": 0.2},
        policy={"recent_busy_ms": busy_ms, "recent_busy_halflife_s": 30.0},
    )


def test_recent_busy_shares_are_tracked_and_spread_the_load() -> None:
    plain = Simulation(_scenario(0.0))
    off = plain.run()
    assert plain.recent_busy == {}  # off: nothing tracked, routing as before
    sim = Simulation(_scenario(2000.0))
    on = sim.run()
    shares = sim.recent_busy
    assert shares and all(0.0 <= v <= 1.0 for v in shares.values())
    assert any(v > 0 for v in shares.values())
    balance_off = off["metrics"]["load_balance"]
    balance_on = on["metrics"]["load_balance"]
    # A heavy spreading term moves work on to nodes the latency-first policy leaves idle.
    assert balance_on["nodes_that_carried_load"] >= balance_off["nodes_that_carried_load"]
    assert balance_on["utilization_gini"] < balance_off["utilization_gini"]


def test_the_knobs_are_checked() -> None:
    with pytest.raises(ScenarioError):
        small_scenario(policy={"recent_busy_ms": -1.0})
    with pytest.raises(ScenarioError):
        small_scenario(policy={"recent_busy_halflife_s": 0.0})
    with pytest.raises(ScenarioError):
        small_scenario(policy={"gateway_leg_weight": -0.5})
