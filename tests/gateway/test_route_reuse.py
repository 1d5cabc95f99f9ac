"""Warm KV through the gateway's Route Session machine and real node machines, in memory (session_sim):
RELEASE keeps the committed prefix on every stage, the next request reuses it and prefills only the rest,
and its tokens equal a cold run's; a route whose stages disagree about the source starts empty."""

from __future__ import annotations

import itertools
import random

from session_sim import MODEL_FP, RECIPE_FP, SimSwarm, make_nodes

from gateway.session_machine import RouteConfig, RouteMachine, StageSpec
from proto import codec

SPANS = [(0, 4), (4, 8), (8, 12)]


def run(
    swarm: SimSwarm,
    route: list[str],
    sid: str,
    prompt: list[int],
    max_new: int,
    *,
    keep_ms: int = 0,
    kv_source: tuple[str, int] | None = None,
) -> tuple[list[int], RouteMachine]:
    config = RouteConfig(
        session_id=sid,
        request_id="r",
        model_fingerprint=MODEL_FP,
        sampling=codec.SamplingSettings(temperature=0.0),
        kv_budget=len(prompt) + max_new - 1,
        step_tokens=4,
        node_frame_bytes=1 << 20,
        prefill_pipeline_steps=2,
        max_recoveries=0,
        kv_source=kv_source,
        keep_ms=keep_ms,
    )
    stages = [StageSpec(n, n, swarm.nodes[n].start, swarm.nodes[n].end, RECIPE_FP, b"t") for n in route]
    counter = itertools.count(1)
    machine = RouteMachine(config, stages, new_token=lambda: next(counter).to_bytes(8, "little"))
    swarm.run += 1
    swarm.emitted, swarm.failure, swarm.outcome = [], None, None
    swarm.gateway_commands(machine, machine.open(swarm.now))
    out: list[int] = []
    begun = stopped = False
    for _ in range(100_000):
        if machine.phase == "ready" and not begun:
            begun = True
            swarm.gateway_commands(machine, machine.begin(prompt, swarm.now))
        if swarm.emitted and not stopped:
            out += swarm.emitted
            swarm.emitted = []
            if len(out) >= max_new:
                stopped = True
                swarm.gateway_commands(machine, machine.stop(release=True, now=swarm.now))
        if machine.done or not swarm.step(machine, {}, []):
            break
    assert swarm.failure is None, swarm.failure
    return out[:max_new], machine


def test_a_kept_prefix_is_reused_and_gives_the_cold_tokens() -> None:
    nodes, by_span = make_nodes(SPANS, spares=0)
    route = [by_span[s][0] for s in SPANS]
    swarm = SimSwarm(nodes, random.Random(5))
    turn1 = list(range(1, 30))
    first, m1 = run(swarm, route, "turn1", turn1, 6, keep_ms=10_000)
    kept = m1.kept_prefix()
    assert len(kept) == len(turn1) + 5  # prompt + the generated tokens fed back (the last is not)
    assert all(n.machine.statistics().kept_sessions == 1 for n in nodes.values())
    turn2 = [*kept, 7, 8, 9]
    warm, m2 = run(swarm, route, "turn2", turn2, 5, kv_source=("turn1", len(kept)))
    assert m2.reused == len(kept)
    # Only the new positions went through the stages (3 new prompt positions, 4 fed-back tokens and
    # at most two more the ring ran past the stop).
    computed = [tokens for _node, tokens, _steps in m2.usage()]
    assert max(computed) >= 7 and all(t <= 9 for t in computed), computed
    cold, m3 = run(SimSwarm(make_nodes(SPANS, 0)[0], random.Random(9)), route, "cold", turn2, 5)
    assert warm == cold and m3.reused == 0
    assert all(n.machine.statistics().kept_sessions == 0 for n in nodes.values())  # taken over


def test_stages_that_disagree_about_the_source_start_empty() -> None:
    nodes, by_span = make_nodes(SPANS, spares=0)
    route = [by_span[s][0] for s in SPANS]
    swarm = SimSwarm(nodes, random.Random(2))
    prompt = list(range(3, 20))
    _, m1 = run(swarm, route, "a", prompt, 3, keep_ms=10_000)
    kept = m1.kept_prefix()
    # The middle stage lost its kept session (evicted under pressure, say).
    middle = nodes[route[1]]
    swarm.node_actions(middle, middle.machine.tick(swarm.now + 11))  # past its keep_ms
    assert middle.machine.statistics().kept_sessions == 0 and not middle.kv
    tokens, m2 = run(swarm, route, "b", [*kept, 1, 2], 4, kv_source=("a", len(kept)))
    assert m2.reused == 0 and m2.epoch == 2
    cold, _ = run(SimSwarm(make_nodes(SPANS, 0)[0], random.Random(1)), route, "c", [*kept, 1, 2], 4)
    assert tokens == cold


def test_no_keep_without_keep_ms_and_no_reuse_without_a_source() -> None:
    nodes, by_span = make_nodes(SPANS, spares=0)
    route = [by_span[s][0] for s in SPANS]
    swarm = SimSwarm(nodes, random.Random(3))
    _, m = run(swarm, route, "x", list(range(1, 12)), 3)
    assert m.kept_prefix() == []
    assert all(n.machine.statistics().kept_sessions == 0 and not n.kv for n in nodes.values())
