"""Small scenarios for the simulator tests: seconds of wall time each (imported by the tests)."""

from __future__ import annotations

from typing import Any

from sim.des.config import Scenario, parse_scenario


def small_scenario(**overrides: Any) -> Scenario:
    """A 30-layer model on one-thread CPU nodes of 10 layers each; ``overrides`` per table."""
    data: dict[str, Any] = {
        "run": {"name": "test", "seed": 1, "duration_s": 300.0, "sample_interval_s": 10.0},
        "models": [{"name": "m", "n_layers": 30}],
        "nodes": {"initial": 6, "bootstrap_s": 1.0, "max_layers": 10, "heartbeat_interval_s": 2.0},
        "workload": {"rate_per_s": 0.3, "prompt_tokens_median": 100.0, "output_tokens_median": 40.0},
        "gateway": {"routes_k": 2, "recovery_timeout_s": 20.0, "admission_timeout_s": 20.0},
    }
    for table, values in overrides.items():
        if isinstance(values, dict):
            data.setdefault(table, {}).update(values)
        else:
            data[table] = values
    return parse_scenario(data)


def churn(initial: int, seed: int = 1, policy: dict[str, str] | None = None, **extra: Any) -> Scenario:
    """Volunteers stay two minutes on average; arrivals replace leavers."""
    nodes = {
        "initial": initial,
        "mean_uptime_s": 120.0,
        "join_rate_per_s": initial / 120.0,
        "crash_fraction": 0.5,
    }
    nodes.update(extra)
    return small_scenario(run={"seed": seed, "duration_s": 600.0}, nodes=nodes, policy=policy or {})
