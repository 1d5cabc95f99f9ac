"""Who carries the load in a simulated run (sim/des/simulator.load_breakdown)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sim.des.metrics import gini
from sim.des.simulator import load_breakdown


def node(model: int, profile: str, region: str) -> SimpleNamespace:
    return SimpleNamespace(
        model_index=model, profile=SimpleNamespace(name=profile), endpoint=SimpleNamespace(region=region)
    )


def test_the_gini_without_nodes_of_models_nobody_asks_for() -> None:
    # Four nodes of model 0 share the load evenly; four nodes of model 1 (no demand) carry nothing.
    nodes = [node(0, "gpu", "eu")] * 4 + [node(1, "cpu", "us")] * 4
    util = [0.2, 0.2, 0.2, 0.2, 0.0, 0.0, 0.0, 0.0]
    out = load_breakdown(nodes, util, demanded={0})
    assert gini(util) == pytest.approx(0.5)  # over all nodes: looks piled up ...
    assert out["utilization_gini_demanded_models"] == 0.0  # ... but the demanded model's nodes are even
    assert out["nodes_of_demanded_models"] == 4 and out["nodes_that_carried_load"] == 4
    assert out["by_profile"] == {
        "cpu": {"nodes": 4, "carried_any": 0, "busy_share": 0.0},
        "gpu": {"nodes": 4, "carried_any": 4, "busy_share": 1.0},
    }
    assert out["by_region"]["eu"]["busy_share"] == 1.0
