"""Windows in flight, property-tested on the real session machines (session_sim).

The last stage keeps up to ``windows_in_flight`` verify windows round the ring: the next one, drafted
as if the ones before it were accepted, leaves before they come back; a rejection discards it on
every stage (a new head with a higher window number; stale windows dropped on arrival). Whatever the
acceptance pattern (the sim's model repeats itself, but not always), the interleaving and the faults
(stages killed or hung mid-window, replies duplicated or late): the client's tokens equal plain
decoding's, every stage computes every step on a KV that holds exactly the accepted tokens below the
step's start, and once the ring is quiet the last stage holds exactly the accepted tokens and every
stage before it the accepted tokens first.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from session_sim import MODEL_FP, RECIPE_FP, Fault, SimNode, SimSwarm, make_nodes, run_request
from test_route_session_properties import all_freed

from gateway.session_machine import RouteConfig, RouteMachine, StageSpec
from node.session_machine import FrameServer, StepJob
from proto import codec

SPANS = [(0, 4), (4, 8), (8, 12)]
PROMPT = [5, 17, 33, 2, 8, 61, 4, 4, 9, 12, 40, 3, 7]
MAX_NEW = 30


def nodes_in_flight(
    windows: int, spares: int = 0
) -> tuple[dict[str, SimNode], dict[tuple[int, int], list[str]]]:
    nodes, by_span = make_nodes(SPANS, spares=spares, repetitive=True)
    for node in nodes.values():
        spec = dataclasses.replace(node.machine.spec, windows_in_flight=windows)
        node.machine = FrameServer(spec, lambda *_: None)
    return nodes, by_span


def plain_reference() -> list[int]:
    nodes, by_span = make_nodes(SPANS, spares=0, repetitive=True)
    result = run_request(SimSwarm(nodes, random.Random(0)), by_span, PROMPT, MAX_NEW)
    assert result.failed is None and len(result.tokens) == MAX_NEW
    return result.tokens


REFERENCE = plain_reference()
TRUTH = PROMPT + REFERENCE  # the token at every position of the accepted history


class KvWatch:
    """Wraps every node's engine: the tokens its KV holds per session, checked at every step.

    The last stage -- whose draws are the output -- computes every step on exactly the accepted
    tokens. A stage before it may compute a window on top of the drafts of the windows in flight
    before it (that is what in flight means), but below the start + 1 of the head of that window's
    chain (the step that opened its window number: its first token is one the target drew) its KV
    is always the accepted tokens, and every step starts at its KV length."""

    def __init__(self, swarm: SimSwarm) -> None:
        self.kv: dict[tuple[str, str], list[int]] = {}
        self.heads: dict[tuple[str, str, int], dict[int, int]] = {}  # (node, session, epoch) -> gen -> start
        self.wrong: list[str] = []
        self.steps = 0
        self.in_flight = 0  # most windows of one session seen round the ring at once (last stage)
        for node in swarm.nodes.values():
            inner = node.compute

            def compute(job: object, node: SimNode = node, inner: object = inner) -> object:
                assert isinstance(job, StepJob)
                self.check(node, job)
                return inner(job)  # type: ignore[operator]

            node.compute = compute  # type: ignore[method-assign]

    def check(self, node: SimNode, job: StepJob) -> None:
        sid = job.session_id
        held = self.kv.setdefault((node.name, sid), [])
        engine_kv = node.kv.get(sid, 0)
        del held[engine_kv:]  # the engine's KV moved back without a step here: a truncation
        sess = node.machine._sessions.get(sid)
        gen = 0 if sess is None or sess.busy_step is None else sess.busy_step.window_gen
        heads = self.heads.setdefault((node.name, sid, 0 if sess is None else sess.epoch), {})
        heads.setdefault(gen, job.start)
        floor = job.start if node.is_last or not gen else min(job.start, heads[gen] + 1)
        if len(held) != job.start or held[:floor] != TRUTH[:floor]:
            self.wrong.append(
                f"{node.name} computed [{job.start}, +{job.n_tokens}) on {held} (floor {floor})"
            )
        self.steps += 1
        if job.token_ids is not None and len(job.token_ids):
            held.extend(int(t) for t in job.token_ids)
        if node.is_last and sess is not None:
            self.in_flight = max(self.in_flight, len(sess.flight))


@pytest.mark.parametrize("windows", [2, 4])
@pytest.mark.parametrize("max_drafts", [1, 3, 8])
@pytest.mark.parametrize("seed", range(2))
def test_windows_in_flight_give_the_plain_text(windows: int, max_drafts: int, seed: int) -> None:
    nodes, by_span = nodes_in_flight(windows)
    swarm = SimSwarm(nodes, random.Random(seed))
    watch = KvWatch(swarm)
    result = run_request(
        swarm, by_span, PROMPT, MAX_NEW, max_drafts=max_drafts, prefill_pipeline_steps=1 + seed
    )
    assert result.failed is None and result.recoveries == 0
    assert result.tokens == REFERENCE
    assert watch.wrong == [] and watch.steps > 0
    assert watch.in_flight >= 2  # windows did leave before the one before them came back
    assert all(not n.kv and n.machine.statistics().sessions == 0 for n in nodes.values())


def test_rejections_discard_the_windows_after_them_and_stale_ones_are_dropped() -> None:
    nodes, by_span = nodes_in_flight(3)
    swarm = SimSwarm(nodes, random.Random(3))
    watch = KvWatch(swarm)
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, max_drafts=4)
    assert result.tokens == REFERENCE and watch.wrong == []
    stale = sum(n.machine._stale_windows for n in nodes.values())
    assert stale > 0  # discarded windows reached the last stage after it moved on, and were dropped


def test_when_the_ring_is_quiet_every_stage_holds_the_accepted_tokens_first() -> None:
    """No stop: the ring runs to the session's budget and every queue drains. The last stage holds
    exactly the accepted history; a stage before it holds it first and at most the discarded drafts
    of the windows in flight after it (they go before anything else is computed there)."""
    windows, max_drafts = 3, 4
    nodes, by_span = nodes_in_flight(windows)
    swarm = SimSwarm(nodes, random.Random(11))
    watch = KvWatch(swarm)
    budget = len(PROMPT) + MAX_NEW - 1
    config = RouteConfig(
        session_id="s1",
        request_id="r",
        model_fingerprint=MODEL_FP,
        sampling=codec.SamplingSettings(temperature=0.0),
        kv_budget=budget,
        step_tokens=5,
        node_frame_bytes=1 << 20,
        push=True,
        max_drafts=max_drafts,
    )
    route = [by_span[s][0] for s in SPANS]
    stages = [StageSpec(n, n, nodes[n].start, nodes[n].end, RECIPE_FP, b"ticket") for n in route]
    counter = itertools.count(1)
    machine = RouteMachine(config, stages, new_token=lambda: next(counter).to_bytes(8, "little"))
    swarm.run += 1
    swarm.gateway_commands(machine, machine.open(swarm.now))
    begun = False
    for _ in range(100_000):
        if machine.phase == "ready" and not begun:
            begun = True
            swarm.gateway_commands(machine, machine.begin(PROMPT, swarm.now))
        if not swarm.ready():
            break
        swarm.step(machine, by_span, [])
    assert machine.committed == budget and watch.wrong == []
    assert swarm.emitted == REFERENCE[: len(swarm.emitted)] and len(swarm.emitted) >= MAX_NEW - 1
    for name in route:
        held = watch.kv[(name, "s1")][: nodes[name].kv["s1"]]
        assert held[:budget] == TRUTH[:budget]
        if nodes[name].is_last:
            assert len(held) == budget
        else:
            assert len(held) - budget <= windows * (max_drafts + 1)


faults = st.lists(
    st.builds(
        Fault,
        kind=st.sampled_from(["kill", "hang", "resume", "dup"]),
        at=st.integers(min_value=0, max_value=200),
        node=st.sampled_from([f"n{a}-{b}-{i}" for a, b in SPANS for i in range(3)]),
    ),
    max_size=4,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=faults,
    seed=st.integers(0, 2**16),
    push=st.booleans(),
    max_drafts=st.integers(1, 8),
    windows=st.integers(2, 4),
)
def test_failures_with_windows_in_flight_keep_the_text_exact_and_free_every_stage(
    plan: list[Fault], seed: int, push: bool, max_drafts: int, windows: int
) -> None:
    nodes, by_span = nodes_in_flight(windows, spares=2)
    swarm = SimSwarm(nodes, random.Random(seed))
    watch = KvWatch(swarm)
    result = run_request(swarm, by_span, PROMPT, MAX_NEW, faults=plan, push=push, max_drafts=max_drafts)
    if result.failed is None:
        assert result.tokens == REFERENCE
    else:
        assert result.tokens == REFERENCE[: len(result.tokens)]
    assert watch.wrong == []
    assert all_freed(swarm) == []
