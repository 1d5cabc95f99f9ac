"""Decode timings with windows in flight: a new head reusing a discarded window's step id.

Step ids follow positions, so after a rejection the last stage's new head may carry the id of the
window in flight it discarded, and a stage before the last may have reported that window to the
gateway already. The gateway's per-stage shares (HopTimed, which feed the node speeds it measures)
must then pair the head's reports, not the discarded window's: a stage's second, different report
of an id replaces its first; the same report again (a replayed reply) changes nothing.
"""

from __future__ import annotations

from gateway.session_machine import HopTimed, RouteConfig, RouteMachine, StageSpec, StepTimed
from proto import codec
from proto.swarm.v1 import frame_pb2

STEP = 42  # the step id both windows carry


def machine(n: int = 3) -> RouteMachine:
    config = RouteConfig(
        session_id="s",
        request_id="r",
        model_fingerprint="m" * 64,
        sampling=codec.SamplingSettings(temperature=0.0),
        kv_budget=64,
        step_tokens=16,
        node_frame_bytes=1 << 20,
    )
    stages = [StageSpec(f"n{k}", f"n{k}", 4 * k, 4 * k + 4, "r" * 64, b"t") for k in range(n)]
    return RouteMachine(config, stages, new_token=lambda: b"x" * 8)


def report(start: int, end: int, digest: bytes) -> frame_pb2.Frame:
    frame = frame_pb2.Frame(step_id=STEP, phase=frame_pb2.PHASE_DECODE)
    frame.positions.start, frame.positions.end = start, end
    frame.result.output_digest = digest
    return frame


def shares(out: list[object]) -> dict[int, float]:
    return {c.stage: c.seconds for c in out if isinstance(c, HopTimed)}


def test_a_discarded_windows_report_is_replaced_by_the_heads_report_of_the_same_id() -> None:
    m = machine()
    # Stage 0 computed the window in flight [10, 13) and reported it at t = 1.0 ...
    assert m._timed(0, report(10, 13, b"discarded"), 1.0) == []
    # ... then the window before it was verified with a rejection at t = 2.0: the last stage pushed a
    # new head at position 10 with the same step id, which the gateway times from now.
    m._start_timing(STEP, 2.0)
    out = m._timed(0, report(10, 12, b"head-0"), 3.0)
    out += m._timed(1, report(10, 12, b"head-1"), 4.5)
    out += m._timed(2, report(10, 12, b""), 5.0)
    assert [c.seconds for c in out if isinstance(c, StepTimed)] == [3.0]
    # The head's own reports: stage 0 took 1 s (2.0 -> 3.0), not 0 s from the discarded window's report.
    assert shares(out) == {0: 1.0, 1: 1.5, 2: 0.5}


def test_a_replayed_report_changes_nothing() -> None:
    m = machine()
    m._start_timing(STEP, 2.0)
    out = m._timed(0, report(10, 11, b"d0"), 3.0)
    out += m._timed(0, report(10, 11, b"d0"), 3.8)  # the same reply again: a duplicate
    out += m._timed(1, report(10, 11, b"d1"), 4.0)
    out += m._timed(2, report(10, 11, b""), 4.5)
    assert shares(out) == {0: 1.0, 1: 1.0, 2: 0.5}


def test_a_discarded_window_at_a_later_position_does_not_skew_the_step_that_reaches_it() -> None:
    """A rejection that accepted fewer drafts leaves the discarded window's reports under an id that a
    later step reaches (its own first position): that step's reports replace them."""
    m = machine(2)
    m._timed(0, report(10, 14, b"discarded"), 1.0)
    m._start_timing(STEP, 7.0)
    out = m._timed(0, report(10, 11, b"later"), 8.0)
    out += m._timed(1, report(10, 11, b""), 9.0)
    assert shares(out) == {0: 1.0, 1: 1.0}
