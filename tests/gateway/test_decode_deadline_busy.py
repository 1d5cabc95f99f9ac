"""The decode deadline on a busy route covers what a prefill step took (gateway.session_machine).

Under a burst of long prompts a decode step rides in the nodes' batches beside other sessions'
prefill slices, so it can take as long as a prefill step however quick the decode steps before it
were (sim/bench_mixed_swarm.py: 32 requests at once on a 2-core machine failed with "did not report
a step within 6.0 s"). A quick route's deadline stays what it was: a hung stage is still noticed in
seconds (tests/gateway/test_gateway_access.py).
"""

from __future__ import annotations

import dataclasses
import math

from gateway.session_machine import RouteConfig, RouteMachine, StageSpec
from proto import codec

MODEL_FP = "a" * 64
RECIPE_FP = "b" * 64


def _machine(expected_step_s: float) -> RouteMachine:
    config = RouteConfig(
        session_id="s",
        request_id="r",
        model_fingerprint=MODEL_FP,
        sampling=codec.SamplingSettings(temperature=0.0),
        kv_budget=100,
        step_tokens=8,
        node_frame_bytes=1 << 20,
        decode_step_timeout_s=30.0,
        decode_timeout_floor_s=3.0,
        expected_step_s=expected_step_s,
    )
    stages = [StageSpec("a", "a", 0, 15, RECIPE_FP, b"t"), StageSpec("b", "b", 15, 30, RECIPE_FP, b"t")]
    return RouteMachine(config, stages, new_token=lambda: b"12345678")


def test_before_any_decode_step_the_deadline_covers_twice_the_measured_prefill_step() -> None:
    m = _machine(expected_step_s=0.01)
    assert m._decode_timeout() == 6.0  # the prior: twice the floor
    m._ewma_prefill_s = 4.0
    assert m._decode_timeout() == 9.0
    m._ewma_prefill_s = 40.0
    assert m._decode_timeout() == 30.0  # never past the ceiling


def test_after_quick_decode_steps_a_slow_prefill_still_widens_the_deadline() -> None:
    m = _machine(expected_step_s=0.01)
    m._ewma_step_s = 0.1
    assert math.isclose(m._decode_timeout(), 3.0)
    m._ewma_prefill_s = 0.5  # a quick route: unchanged
    assert math.isclose(m._decode_timeout(), 3.0)
    m._ewma_prefill_s = 5.0
    assert math.isclose(m._decode_timeout(), 11.0)


def test_a_first_prefill_step_waits_behind_the_sessions_this_gateway_has_on_the_route() -> None:
    # 20 x 10 ms for every 8 of 256 positions + 2 s = 8.4 s, floored at 15 s alone; 32 sessions at
    # once on the busiest stage: 32 x 8.4 s, capped at the 120 s ceiling. Once a prefill step was
    # measured, the measurement rules (10 x it + 2 s), whatever the load.
    def machine(busy: int) -> RouteMachine:
        m = _machine(expected_step_s=0.01)
        m.config = dataclasses.replace(
            m.config,
            step_tokens=256,
            prefill_timeout_floor_s=15.0,
            prefill_step_timeout_s=120.0,
            busy_sessions=busy,
        )
        return m

    assert math.isclose(machine(1)._prefill_timeout(), 15.0)
    assert math.isclose(machine(4)._prefill_timeout(), 4 * 8.4)
    busy = machine(32)
    assert math.isclose(busy._prefill_timeout(), 120.0)
    busy._ewma_prefill_s = 2.0
    assert math.isclose(busy._prefill_timeout(), 22.0)
