"""Speculative decoding over the route, property-tested on the real session machines (session_sim).

The last stage drafts by n-gram lookup, a window of token + drafts goes through every stage, the
last stage keeps the agreeing prefix and every stage drops the rest of the window from its KV when
the next window arrives. The sim's "model" repeats itself (period 5) but not always, so windows are
accepted wholly, partly or not at all in random patterns. Whatever the interleaving and the faults
(stages killed or hung mid-window, replies duplicated or late), the client's tokens equal plain
decoding's, and at the end every live stage's KV holds exactly the accepted history.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from session_sim import Fault, SimSwarm, make_nodes, run_request
from test_route_session_properties import all_freed

from node.session_machine import StepJob

SPANS = [(0, 4), (4, 8), (8, 12)]
PROMPT = [5, 17, 33, 2, 8, 61, 4, 4, 9, 12, 40, 3, 7]
MAX_NEW = 30


def plain_reference() -> list[int]:
    nodes, by_span = make_nodes(SPANS, spares=0, repetitive=True)
    result = run_request(SimSwarm(nodes, random.Random(0)), by_span, PROMPT, MAX_NEW)
    assert result.failed is None and len(result.tokens) == MAX_NEW
    return result.tokens


REFERENCE = plain_reference()


class WindowCounter:
    """Wraps each last stage's compute to count windows and their accepted positions."""

    def __init__(self, swarm: SimSwarm) -> None:
        self.windows = 0
        self.drafts = 0
        for node in swarm.nodes.values():
            if node.is_last:
                inner = node.compute

                def compute(job: object, inner: object = inner) -> object:
                    assert isinstance(job, StepJob)
                    if job.drafts:
                        self.windows += 1
                        self.drafts += job.drafts
                    return inner(job)  # type: ignore[operator]

                node.compute = compute  # type: ignore[method-assign]


@pytest.mark.parametrize("max_drafts", [1, 3, 8])
@pytest.mark.parametrize("seed", range(3))
def test_windows_give_the_plain_text_with_fewer_passes(max_drafts: int, seed: int) -> None:
    nodes, by_span = make_nodes(SPANS, spares=0, repetitive=True)
    swarm = SimSwarm(nodes, random.Random(seed))
    counter = WindowCounter(swarm)
    result = run_request(
        swarm, by_span, PROMPT, MAX_NEW, max_drafts=max_drafts, prefill_pipeline_steps=1 + seed
    )
    assert result.failed is None and result.recoveries == 0
    assert result.tokens == REFERENCE
    assert counter.windows > 0 and counter.drafts <= counter.windows * max_drafts
    assert all(not n.kv and n.machine.statistics().sessions == 0 for n in nodes.values())


def test_kv_of_every_stage_equals_the_accepted_history_between_windows() -> None:
    """Stop the request early and look at every stage: the last stage holds exactly the accepted
    positions; a stage before it holds at most the last window's rejected drafts more, and drops
    them before it computes anything else (the next window's start)."""
    nodes, by_span = make_nodes(SPANS, spares=0, repetitive=True)
    swarm = SimSwarm(nodes, random.Random(7))
    seen: list[tuple[int, int, int]] = []  # (stage start, kv before the step, the step's start)
    for node in nodes.values():
        inner = node.compute

        def compute(job: object, node: object = node, inner: object = inner) -> object:
            assert isinstance(job, StepJob)
            kv = node.kv.get(job.session_id, 0)  # type: ignore[attr-defined]
            seen.append((node.start, kv, job.start))  # type: ignore[attr-defined]
            return inner(job)  # type: ignore[operator]

        node.compute = compute  # type: ignore[method-assign]
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, max_drafts=4)
    assert result.tokens == REFERENCE
    # Every step computed on a KV of exactly its start: rejected positions were always dropped first.
    assert seen and all(kv == start for _stage, kv, start in seen)


faults = st.lists(
    st.builds(
        Fault,
        kind=st.sampled_from(["kill", "hang", "resume", "dup"]),
        at=st.integers(min_value=0, max_value=200),
        node=st.sampled_from([f"n{a}-{b}-{i}" for a, b in SPANS for i in range(3)]),
    ),
    max_size=4,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=faults, seed=st.integers(0, 2**16), push=st.booleans(), max_drafts=st.integers(1, 8))
def test_failures_mid_window_keep_the_text_exact_and_free_every_stage(
    plan: list[Fault], seed: int, push: bool, max_drafts: int
) -> None:
    nodes, by_span = make_nodes(SPANS, spares=2, repetitive=True)
    swarm = SimSwarm(nodes, random.Random(seed))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=plan, push=push, max_drafts=max_drafts)
    if result.failed is None:
        assert result.tokens == REFERENCE
    else:
        assert result.tokens == REFERENCE[: len(result.tokens)]
    assert all_freed(swarm) == []
