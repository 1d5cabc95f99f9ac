"""Every request completes, fails with a reason, or is in flight at the end -- exactly."""

from __future__ import annotations

import pytest
from simcases import churn, small_scenario

from sim.des.session import DONE, FAILED
from sim.des.simulator import Simulation, run

CASES = {
    "steady": small_scenario(),
    "churn-no-spare": churn(3),
    "churn-spare": churn(12, seed=4),
    "all-crash": churn(9, seed=5, crash_fraction=1.0),
    "overload-small-queue": small_scenario(
        workload={"rate_per_s": 5.0},
        gateway={"max_queue": 5, "admission_timeout_s": 5.0},
        run={"duration_s": 60.0},
    ),
    "cut-short": small_scenario(run={"duration_s": 20.0}, workload={"rate_per_s": 2.0}),
    "random-nearest": churn(9, seed=6, policy={"placement": "random", "routing": "nearest"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_requests_are_conserved(name: str) -> None:
    sim = Simulation(CASES[name])
    result = sim.run()
    req = result["requests"]
    assert req["conserved"], req
    assert req["arrived"] == req["completed"] + req["failed"] + req["in_flight"]
    assert req["failed"] == sum(req["failed_by_reason"].values())
    assert all(reason for reason in req["failed_by_reason"])
    # The sessions still tracked are exactly the ones in flight, none of them ended.
    live = sim.gateways.sessions.values()
    assert len(live) == req["in_flight"]
    assert not any(s.phase in (DONE, FAILED) for s in live)
    # Nodes hold only live sessions.
    live_ids = {s.id for s in live}
    for node in sim.swarm.nodes.values():
        assert set(node.sessions) <= live_ids


def test_cut_short_run_has_requests_in_flight() -> None:
    req = run(CASES["cut-short"])["requests"]
    assert req["in_flight"] > 0


def test_overload_refuses_with_reasons() -> None:
    req = run(CASES["overload-small-queue"])["requests"]
    assert (
        req["failed_by_reason"].get("queue_full", 0) + req["failed_by_reason"].get("admission_timeout", 0) > 0
    )
