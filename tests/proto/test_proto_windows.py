"""Speculative decoding's frames: DECODE windows (Activation.drafts), their results, OPEN's Speculation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto import codec
from proto.codec import SessionHeader
from proto.errors import BadFrameError
from proto.swarm.v1 import frame_pb2

HEADER = SessionHeader("sess-1", 3, "a" * 64, "b" * 64, 0, 15, request_id="req-1")
DECODE = frame_pb2.PHASE_DECODE
RING = codec.push_target("n0", "10.0.0.1:1", b"t", (0, 4), "b" * 64)


def wire(frame: frame_pb2.Frame) -> frame_pb2.Frame:
    return codec.parse_frame(codec.serialize_frame(frame))


@given(st.integers(0, codec.MAX_DRAFT_TOKENS), st.integers(0, 1000))
def test_a_window_round_trips_and_its_result_echoes_the_drafts(drafts: int, start: int) -> None:
    tokens = list(range(1, drafts + 2))
    (frame,) = codec.step_frames(
        HEADER, DECODE, step_id=start + 2, start=start, token_ids=tokens, sample=True, drafts=drafts
    )
    step = codec.reassemble([wire(frame)])
    assert step.drafts == drafts and step.n_tokens == drafts + 1 and list(step.token_ids) == tokens
    produced = [frame_pb2.SampledToken(token_id=t, logprob=-0.5) for t in tokens[: drafts + 1]]
    accepted = 1 + drafts // 2
    (result,) = codec.result_frames(step, kv_len=start + accepted, sampled=produced[:accepted])
    back = wire(result)
    assert back.result.drafts == drafts or drafts == 0
    assert back.kv_len == start + accepted and len(back.result.sampled) == accepted


def window(drafts: int, rows: int, **kw: object) -> frame_pb2.Frame:
    frame = HEADER.frame(DECODE, step_id=5, expected_kv_len=4, positions=(4, 4 + rows))
    frame.activation.token_ids.extend(range(rows))
    frame.activation.drafts = drafts
    frame.activation.sample = bool(kw.get("sample", True))
    frame.activation.replay = bool(kw.get("replay", False))
    return frame


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (window(2, 2), "drafts"),
        (window(1, 1), "drafts"),
        (window(codec.MAX_DRAFT_TOKENS + 1, codec.MAX_DRAFT_TOKENS + 2), "limit"),
        (window(2, 3, sample=False), "sampled"),
    ],
)
def test_impossible_windows_are_bad_frames(frame: frame_pb2.Frame, message: str) -> None:
    with pytest.raises(BadFrameError, match=message):
        codec.validate_frame(frame)


def test_drafts_only_on_decode_steps_and_results_stay_within_their_window() -> None:
    prefill = HEADER.frame(frame_pb2.PHASE_PREFILL, step_id=5, expected_kv_len=4, positions=(4, 7))
    prefill.activation.token_ids.extend([1, 2, 3])
    prefill.activation.drafts = 2
    with pytest.raises(BadFrameError, match="only a DECODE"):
        codec.validate_frame(prefill)
    step = codec.reassemble([window(3, 4)])
    (result,) = codec.result_frames(step, kv_len=4, sampled=[])
    with pytest.raises(BadFrameError, match="kv_len"):
        codec.validate_frame(result)  # a window keeps at least its first position
    too_many = [frame_pb2.SampledToken(token_id=1, logprob=-1.0)] * 5
    (result,) = codec.result_frames(step, kv_len=8, sampled=too_many)
    with pytest.raises(BadFrameError, match="at most 4"):
        codec.validate_frame(result)


def test_speculation_in_open_is_bounded_and_needs_a_ring() -> None:
    ok = codec.open_frame(HEADER, step_id=1, route_ticket=b"t", kv_budget_tokens=9, ring=RING, max_drafts=8)
    assert wire(ok).open.speculation.max_drafts == 8
    off = codec.open_frame(HEADER, step_id=1, route_ticket=b"t", kv_budget_tokens=9, ring=RING)
    assert not wire(off).open.HasField("speculation")
    with pytest.raises(BadFrameError, match="limit"):
        codec.validate_frame(
            codec.open_frame(
                HEADER,
                step_id=1,
                route_ticket=b"t",
                kv_budget_tokens=9,
                ring=RING,
                max_drafts=codec.MAX_DRAFT_TOKENS + 1,
            )
        )
    with pytest.raises(BadFrameError, match="ring"):
        codec.validate_frame(
            codec.open_frame(HEADER, step_id=1, route_ticket=b"t", kv_budget_tokens=9, max_drafts=2)
        )
