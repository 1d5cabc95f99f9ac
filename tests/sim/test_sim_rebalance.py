"""Rebalancing in the simulator: nodes move to the model whose demand grew, and nothing is lost."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sim.des.config import Burst, load_scenario
from sim.des.simulator import run

SCENARIO = Path(__file__).resolve().parents[2] / "sim" / "scenarios" / "demand_shift.toml"


def small(rebalance_s: float) -> dict:  # type: ignore[type-arg]
    """demand_shift.toml cut down: 12 volunteers, 1.5 requests/s for A until t = 240 s, then for B."""
    sc = load_scenario(SCENARIO)
    sc = dataclasses.replace(
        sc,
        run=dataclasses.replace(sc.run, duration_s=600.0),
        nodes=dataclasses.replace(sc.nodes, initial=12, rebalance_interval_s=rebalance_s),
        workload=dataclasses.replace(
            sc.workload,
            bursts=(Burst(60.0, 180.0, 1.5, "model-a"), Burst(240.0, 360.0, 1.5, "model-b")),
        ),
    )
    return run(sc)


def _min_cover(result: dict, model: str, t_s: float) -> int:  # type: ignore[type-arg]
    ts = result["timeseries"]
    i = max(j for j, t in enumerate(ts["t_s"]) if t <= t_s)
    return min(ts["coverage_by_model"][model][i])


@pytest.mark.slow  # a long simulation
def test_nodes_follow_the_demand_without_losing_requests() -> None:
    on = small(20.0)
    off = small(0.0)
    assert off["metrics"]["swarm"]["moves"] == 0
    assert on["metrics"]["swarm"]["moves"] > 0
    assert on["requests"]["conserved"] and off["requests"]["conserved"]
    # Model B starts with one node per layer: without moves its queue overflows the admission
    # timeout; with them every request is served (a moving node drains: nothing is lost).
    assert on["requests"]["failed"] == 0
    assert off["requests"]["failed"] > 0
    assert on["requests"]["completed"] > off["requests"]["completed"]
    # After the shift, model B holds more than it did at the shift, and more than without moves.
    assert _min_cover(on, "model-b", 590.0) > _min_cover(on, "model-b", 240.0)
    assert _min_cover(on, "model-b", 590.0) > _min_cover(off, "model-b", 590.0)
    # Nobody is moved below two holders of a layer (min_holders).
    assert _min_cover(on, "model-a", 590.0) >= 2
    # Deterministic for a seed.
    assert small(20.0)["metrics"] == on["metrics"]
