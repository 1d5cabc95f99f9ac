"""Property tests of the Route Session: any failure, anywhere, at any step; the text stays exact.

The gateway's ``RouteMachine`` drives real node session machines in memory
(``session_sim``): every interleaving of deliveries is chosen by a seeded
scheduler, and hypothesis picks the faults -- a stage killed or hung (and
maybe resumed, with its stale replies arriving late) at any event, replies
duplicated, the session preempted by a node (its KV freed for an older session,
STATUS_PREEMPTED). Whatever happens, the client's tokens equal the undisturbed
run's (or the request fails cleanly when no node is left for a span, or it was
preempted more often than allowed), and every node that is still up has freed
every session once the request is over.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from session_sim import Fault, SimSwarm, make_nodes, run_request

SPANS = [(0, 4), (4, 8), (8, 12)]
PROMPT = [5, 17, 33, 2, 8, 61, 4, 4, 9, 12, 40, 3, 7]  # 13 positions: three prefill steps of 5
MAX_NEW = 12


def reference(push: bool) -> list[int]:
    nodes, by_span = make_nodes(SPANS, spares=0)
    swarm = SimSwarm(nodes, random.Random(0))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, push=push)
    assert result.failed is None and len(result.tokens) == MAX_NEW
    return result.tokens


REFERENCE = reference(push=True)


def all_freed(swarm: SimSwarm) -> list[str]:
    """Live nodes that still hold a session (after the leases of unreachable owners ran out)."""
    for node in swarm.nodes.values():
        if not node.dead:
            node.hung = False
    # Deliver what is still in flight (a resumed node's queue), then let every lease expire.
    for _ in range(10_000):
        ready = swarm.ready()
        if not ready:
            break
        kind, key = ready[0]
        if kind == "to_node":
            data = swarm.to_node[key].popleft()  # type: ignore[index]
            name, conn = swarm.slots[key]  # type: ignore[index]
            node = swarm.nodes[name]
            if data == b"":
                del swarm.slots[key]  # type: ignore[arg-type]
                swarm.node_actions(node, node.machine.disconnect(conn, swarm.now))
            else:
                swarm.node_actions(node, node.machine.handle(conn, data, swarm.now))
        elif kind == "push":
            conn, q = swarm.pushes[key]  # type: ignore[index]
            node = swarm.nodes[key[2]]  # type: ignore[index]
            swarm.node_actions(node, node.machine.handle(conn, q.popleft(), swarm.now))
        elif kind == "job":
            name, job = swarm.jobs.pop(key)  # type: ignore[call-overload]
            node = swarm.nodes[name]
            swarm.node_actions(node, node.machine.complete(node.compute(job), swarm.now))
        else:
            swarm.to_gw.clear()
            swarm.failed_slots.clear()
            swarm.lookups.clear()
    later = swarm.now + 10_000
    for node in swarm.nodes.values():
        if not node.dead:
            for _name, conn in [v for v in swarm.slots.values() if v[0] == node.name]:
                node.machine.disconnect(conn, swarm.now)
            swarm.node_actions(node, node.machine.tick(later))
    return [n.name for n in swarm.nodes.values() if not n.dead and (n.kv or n.machine.statistics().sessions)]


def test_undisturbed_push_and_relay_give_the_same_tokens() -> None:
    assert reference(push=False) == REFERENCE


@pytest.mark.parametrize("seed", range(6))
def test_interleavings_alone_change_nothing(seed: int) -> None:
    nodes, by_span = make_nodes(SPANS, spares=1)
    swarm = SimSwarm(nodes, random.Random(seed))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, prefill_pipeline_steps=1 + seed % 3)
    assert result.tokens == REFERENCE and result.failed is None and result.recoveries == 0
    # A finished request frees every stage at once (RELEASE), with no lease needed.
    assert all(not n.kv and n.machine.statistics().sessions == 0 for n in nodes.values())


faults = st.lists(
    st.builds(
        Fault,
        kind=st.sampled_from(["kill", "hang", "resume", "dup"]),
        at=st.integers(min_value=0, max_value=160),  # a request takes ~140 scheduler events
        node=st.sampled_from([f"n{a}-{b}-{i}" for a, b in SPANS for i in range(3)]),
    ),
    max_size=4,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=faults, seed=st.integers(0, 2**16), push=st.booleans())
def test_any_failure_keeps_the_text_exact_and_frees_every_stage(
    plan: list[Fault], seed: int, push: bool
) -> None:
    nodes, by_span = make_nodes(SPANS, spares=2)
    swarm = SimSwarm(nodes, random.Random(seed))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=plan, push=push)
    if result.failed is None:
        assert result.tokens == REFERENCE
    else:
        # A clean failure (no node left for a span): what was streamed before it is still exact.
        assert result.tokens == REFERENCE[: len(result.tokens)]
    assert all_freed(swarm) == []


def test_a_killed_middle_stage_is_replaced_in_place() -> None:
    nodes, by_span = make_nodes(SPANS, spares=1)
    swarm = SimSwarm(nodes, random.Random(3))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=[Fault("kill", 120, "n4-8-0")])
    assert result.tokens == REFERENCE and result.failed is None
    assert result.recoveries == 1 and result.route_runs == 1  # the span was replaced, the route kept
    assert all_freed(swarm) == []


def test_a_hung_stage_is_replaced_after_its_deadline_and_its_late_replies_are_ignored() -> None:
    nodes, by_span = make_nodes(SPANS, spares=1)
    swarm = SimSwarm(nodes, random.Random(5))
    plan = [Fault("hang", 60, "n8-12-0"), Fault("resume", 400, "n8-12-0")]
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=plan)
    assert result.tokens == REFERENCE and result.failed is None and result.recoveries >= 1
    assert all_freed(swarm) == []


def test_no_spare_left_fails_cleanly_with_an_exact_prefix() -> None:
    nodes, by_span = make_nodes(SPANS, spares=0)
    swarm = SimSwarm(nodes, random.Random(1))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=[Fault("kill", 60, "n0-4-0")])
    assert result.failed is not None
    assert result.tokens == REFERENCE[: len(result.tokens)]
    assert all_freed(swarm) == []


def test_a_preempted_session_resumes_by_re_prefill_with_the_same_tokens() -> None:
    nodes, by_span = make_nodes(SPANS, spares=0)  # no spare: it resumes on the very same nodes
    swarm = SimSwarm(nodes, random.Random(2))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=[Fault("preempt", 90, "n4-8-0")])
    assert swarm.preemptions == 1, "the fault did not hit a live session"
    assert result.tokens == REFERENCE and result.failed is None
    assert result.preempted == 1 and result.route_runs == 2 and result.recoveries == 0
    assert all_freed(swarm) == []


def test_preempted_more_than_the_bound_fails_cleanly_with_an_exact_prefix() -> None:
    nodes, by_span = make_nodes(SPANS, spares=0)
    swarm = SimSwarm(nodes, random.Random(4))
    plan = [Fault("preempt", at, "n8-12-0") for at in range(60, 2000, 25)]
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=plan, max_preemptions=2)
    assert result.failed is not None and "preempted" in result.failed
    assert result.preempted == 3
    assert result.tokens == REFERENCE[: len(result.tokens)]
    assert all_freed(swarm) == []


preemptions_and_faults = st.lists(
    st.builds(
        Fault,
        kind=st.sampled_from(["preempt", "preempt", "preempt", "kill", "hang", "resume", "dup"]),
        at=st.integers(min_value=0, max_value=400),
        node=st.sampled_from([f"n{a}-{b}-{i}" for a, b in SPANS for i in range(2)]),
    ),
    max_size=5,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=preemptions_and_faults, seed=st.integers(0, 2**16), push=st.booleans())
def test_preemptions_among_failures_keep_the_text_exact_and_free_every_stage(
    plan: list[Fault], seed: int, push: bool
) -> None:
    nodes, by_span = make_nodes(SPANS, spares=1)
    swarm = SimSwarm(nodes, random.Random(seed))
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=plan, push=push)
    assert result.preempted <= swarm.preemptions
    if result.failed is None:
        assert result.tokens == REFERENCE
    else:
        assert result.tokens == REFERENCE[: len(result.tokens)]
    assert all_freed(swarm) == []


def test_a_resume_prefills_the_prompt_in_chunks_and_each_generated_token_alone() -> None:
    """``single_from``: the prompt goes in step_tokens chunks as it did first; the generated tokens one
    position per step, as their decode steps computed them (so the resumed KV is bit-exact)."""
    from gateway.session_machine import RouteConfig, RouteMachine, SendFrame, StageSpec
    from proto import codec

    prompt_len, generated = 13, 4
    config = RouteConfig(
        session_id="s",
        request_id="r",
        model_fingerprint="a" * 64,
        sampling=codec.SamplingSettings(temperature=0.0),
        kv_budget=40,
        step_tokens=5,
        node_frame_bytes=1 << 20,
        prefill_pipeline_steps=16,
        single_from=prompt_len,
    )
    machine = RouteMachine(config, [StageSpec("n", "n", 0, 12, "b" * 64, b"t")], new_token=lambda: b"x" * 8)
    machine.open(0.0)
    machine.phase, machine._stages[0].acked = "ready", True  # the OPEN was acknowledged
    sent = [
        c.frame for c in machine.begin(list(range(prompt_len + generated)), 0.0) if isinstance(c, SendFrame)
    ]
    spans = [(f.positions.start, f.positions.end) for f in sent]
    assert spans == [(0, 5), (5, 10), (10, 13), (13, 14), (14, 15), (15, 16), (16, 17)]
    assert [f.activation.sample for f in sent] == [False] * 6 + [True]  # the next token comes from the last
    assert machine.aligned_prefix == 10  # what a cold request of this prompt computed alike: whole chunks
