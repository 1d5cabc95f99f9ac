"""Properties over many small random swarms, and the simulator's import boundary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simcases import small_scenario

from sim.des.session import DONE, FAILED
from sim.des.simulator import Simulation

REPO = Path(__file__).resolve().parents[2]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    initial=st.integers(1, 12),
    max_layers=st.integers(4, 30),
    uptime_s=st.sampled_from([0.0, 30.0, 120.0]),
    crash_fraction=st.floats(0.0, 1.0),
    rate=st.floats(0.1, 3.0),
    max_queue=st.integers(1, 50),
    placement=st.sampled_from(["tracker", "random"]),
    routing=st.sampled_from(["tracker", "nearest"]),
)
def test_any_swarm_conserves_requests(
    seed: int,
    initial: int,
    max_layers: int,
    uptime_s: float,
    crash_fraction: float,
    rate: float,
    max_queue: int,
    placement: str,
    routing: str,
) -> None:
    sc = small_scenario(
        run={"seed": seed, "duration_s": 90.0},
        nodes={
            "initial": initial,
            "max_layers": max_layers,
            "mean_uptime_s": uptime_s,
            "join_rate_per_s": initial / uptime_s if uptime_s else 0.0,
            "crash_fraction": crash_fraction,
            "drain_timeout_s": 10.0,
        },
        workload={"rate_per_s": rate, "output_tokens_median": 30.0},
        gateway={"max_queue": max_queue},
        policy={"placement": placement, "routing": routing},
    )
    sim = Simulation(sc)
    result = sim.run()
    req = result["requests"]
    assert req["arrived"] == req["completed"] + req["failed"] + req["in_flight"]
    live = list(sim.gateways.sessions.values())
    assert len(live) == req["in_flight"]
    assert not any(s.phase in (DONE, FAILED) for s in live)
    live_ids = {s.id for s in live}
    for node in sim.swarm.nodes.values():
        assert set(node.sessions) <= live_ids
    # Coverage never goes negative and matches the serving nodes.
    for rows in result["timeseries"]["coverage_by_model"].values():
        assert all(c >= 0 for row in rows for c in row)
    for s in live:  # every route of a live session tiles the model
        if s.route:
            assert s.route[0].start == 0 and s.route[-1].end == 30
            assert all(a.end == b.start for a, b in zip(s.route, s.route[1:], strict=False))


@pytest.mark.slow  # a fresh interpreter
def test_simulator_imports_no_service_runtime() -> None:
    """The simulator is a functional core: no event loop, RPC, database or engine."""
    # sim.cli also registers other tools' commands; check the simulator's own modules only.
    code = (
        "import sys, sim.des.simulator, sim.des.report\n"
        "bad = [m for m in ('trio', 'grpc', 'sqlalchemy', 'llama_cpp', 'zeroconf', 'quart', 'hypercorn')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout.strip()
    assert out == ""
