"""Decode timings from the Route Session machine (``StepTimed``, ``HopTimed``), with real node session
machines in memory (``session_sim``): one step time per decode step, one share per stage and step, and
the shares of a step add up to its time (when its reports reach the gateway in stage order)."""

from __future__ import annotations

import math
import random

import pytest
from session_sim import Fault, SimSwarm, make_nodes, run_request

from gateway.session_machine import HopTimed, StepTimed

PROMPT = [5, 17, 33, 2, 8, 61, 4, 4, 9, 12, 40, 3, 7]
MAX_NEW = 9


@pytest.mark.parametrize(
    ("spans", "push", "seed"),
    [
        ([(0, 4), (4, 8), (8, 12)], True, 1),
        ([(0, 4), (4, 8), (8, 12)], False, 2),  # every hop through the gateway
        ([(0, 6), (6, 12)], True, 3),
        ([(0, 12)], True, 4),  # one stage: the gateway sends every decode step itself
    ],
)
def test_every_decode_step_is_timed_once_and_its_shares_add_up(
    spans: list[tuple[int, int]], push: bool, seed: int
) -> None:
    nodes, by_span = make_nodes(spans, spares=0)
    swarm = SimSwarm(nodes, random.Random(seed))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, push=push)
    assert result.failed is None and len(result.tokens) == MAX_NEW
    steps = [t for t in swarm.timings if isinstance(t, StepTimed)]
    hops = [t for t in swarm.timings if isinstance(t, HopTimed)]
    # The first token comes from the prefill; each of the others from one decode step.
    assert len(steps) == MAX_NEW - 1
    assert len(hops) == len(spans) * (MAX_NEW - 1)
    route = [t.node_id for t in hops[: len(spans)]]
    assert route == [by_span[s][0] for s in spans]
    assert all(t.seconds > 0 for t in steps)
    assert all(t.seconds >= 0 for t in hops)
    # Shares are emitted with (or after) their step's time, in stage order. They add up to the time
    # from the step's start to its latest report: the step's time, unless an earlier stage's report
    # reached the gateway after the last stage's (this scheduler reorders streams at random).
    shares = [h.seconds for h in hops]
    n = len(spans)
    exact = 0
    for i, step in enumerate(steps):
        total = sum(shares[i * n : (i + 1) * n])
        assert total >= step.seconds - 1e-9
        exact += math.isclose(total, step.seconds, abs_tol=1e-9)
    assert exact >= len(steps) // 2
    assert [h.stage for h in hops] == list(range(n)) * (MAX_NEW - 1)


def test_a_step_cut_by_a_replacement_is_timed_once_from_its_resend() -> None:
    """The middle stage dies while decoding; it is replaced in place and the step it cut runs again in
    the next epoch: every token still has exactly one step time and one share per stage."""
    nodes, by_span = make_nodes([(0, 4), (4, 8), (8, 12)], spares=1)
    swarm = SimSwarm(nodes, random.Random(7))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=[Fault("kill", 80, "n4-8-0")])
    assert result.failed is None and len(result.tokens) == MAX_NEW
    assert result.recoveries == 1 and result.route_runs == 1
    steps = [t for t in swarm.timings if isinstance(t, StepTimed)]
    hops = [t for t in swarm.timings if isinstance(t, HopTimed)]
    assert len(steps) == MAX_NEW - 1 and len(hops) == 3 * (MAX_NEW - 1)
    assert {h.node_id for h in hops if h.stage == 1} == {"n4-8-0", "n4-8-1"}
