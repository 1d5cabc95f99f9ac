"""Frames: validation, parsing hostile bytes, chunking and reassembly of steps."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from proto import codec, errors
from proto.codec import FrameLimits, SessionHeader
from proto.swarm.v1 import frame_pb2, status_pb2
from proto.tensor_codec import encode_tensor
from tests.node.loopback_client import relay_frame

F32, F16, INT8 = frame_pb2.ENCODING_F32, frame_pb2.ENCODING_F16, frame_pb2.ENCODING_INT8_BLOCK
PREFILL, DECODE = frame_pb2.PHASE_PREFILL, frame_pb2.PHASE_DECODE
HEADER = SessionHeader("sess-1", 3, "a" * 64, "b" * 64, 0, 15, request_id="req-1")
NEXT = SessionHeader("sess-1", 3, "a" * 64, "b" * 64, 15, 30, request_id="req-1")
TOLERANCE = {F32: 0.0, F16: 2.0**-11 * 8, INT8: 8 / 254 * 1.001}  # values in [-8, 8]


def hidden_states(max_rows: int = 120, max_cols: int = 48) -> st.SearchStrategy[npt.NDArray[np.float32]]:
    shapes = st.tuples(st.integers(1, max_rows), st.integers(1, max_cols))
    return hnp.arrays(np.float32, shapes, elements=st.floats(-8, 8, width=32))


def _wire(frames: list[frame_pb2.Frame], limits: FrameLimits = codec.DEFAULT_LIMITS) -> list[frame_pb2.Frame]:
    return [codec.parse_frame(codec.serialize_frame(f, limits), limits) for f in frames]


def _prefill(
    rows: int = 40, cols: int = 16, max_frame_bytes: int = 1500, start: int = 0
) -> list[frame_pb2.Frame]:
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    return codec.step_frames(
        HEADER,
        PREFILL,
        step_id=5,
        start=start,
        hidden=x,
        token_ids=range(rows),
        sample=True,
        max_frame_bytes=max_frame_bytes,
    )


# --------------------------------------------------------------------------- round trips


@settings(max_examples=40, deadline=None)
@given(
    x=hidden_states(),
    encoding=st.sampled_from([F32, F16, INT8]),
    max_frame_bytes=st.integers(1500, 40000),
    start=st.integers(0, 10000),
    with_tokens=st.booleans(),
)
def test_chunk_and_reassemble_round_trip(
    x: npt.NDArray[np.float32], encoding: int, max_frame_bytes: int, start: int, with_tokens: bool
) -> None:
    tokens = list(range(100, 100 + x.shape[0])) if with_tokens else None
    frames = codec.step_frames(
        HEADER,
        PREFILL,
        step_id=9,
        start=start,
        hidden=x,
        token_ids=tokens,
        sample=True,
        encoding=encoding,
        max_frame_bytes=max_frame_bytes,
    )
    assert all(len(codec.serialize_frame(f)) <= max_frame_bytes for f in frames)
    assert [f.activation.sample for f in frames] == [False] * (len(frames) - 1) + [True]
    step = codec.reassemble(_wire(frames))
    assert (step.start, step.end, step.step_id, step.n_frames) == (start, start + x.shape[0], 9, len(frames))
    assert step.expected_kv_len == start and step.sample and step.header == HEADER
    y = step.tensors[codec.HIDDEN]
    assert y.shape == x.shape
    assert np.max(np.abs(y - x)) <= TOLERANCE[encoding]
    if encoding == F32:
        assert y.tobytes() == x.tobytes()
    assert step.token_ids.tolist() == (tokens or [])


@settings(max_examples=25, deadline=None)
@given(x=hidden_states(), max_frame_bytes=st.integers(1500, 20000))
def test_result_chunks_relay_to_the_next_stage(x: npt.NDArray[np.float32], max_frame_bytes: int) -> None:
    rows = x.shape[0]
    request = codec.reassemble(
        codec.step_frames(
            HEADER, PREFILL, step_id=4, start=7, token_ids=range(rows), max_frame_bytes=max_frame_bytes
        )
    )
    replies = _wire(
        codec.result_frames(
            request, kv_len=7 + rows, hidden=x, compute_us=12, max_frame_bytes=max_frame_bytes
        )
    )
    reply = codec.reassemble(replies)
    assert reply.kind == "result" and reply.kv_len == 7 + rows and reply.compute_us == 12
    assert reply.tensors[codec.HIDDEN].tobytes() == x.tobytes()
    relayed = [
        relay_frame(
            r, NEXT, step_id=11, token_ids=range(r.positions.start - 7, r.positions.end - 7), sample=True
        )
        for r in replies
    ]
    forwarded = codec.reassemble(_wire(relayed))
    assert forwarded.header == NEXT and forwarded.step_id == 11 and forwarded.sample
    assert forwarded.tensors[codec.HIDDEN].tobytes() == x.tobytes()
    assert forwarded.token_ids.tolist() == list(range(rows))


def test_last_stage_reply_carries_the_sampled_token() -> None:
    request = codec.reassemble(
        codec.step_frames(HEADER, DECODE, step_id=8, start=12, token_ids=[42], sample=True)
    )
    token = frame_pb2.SampledToken(
        token_id=7, logprob=-0.25, top_logprobs=[frame_pb2.TokenLogprob(token_id=7, logprob=-0.25)]
    )
    (reply,) = _wire(codec.result_frames(request, kv_len=13, sampled=[token]))
    step = codec.reassemble([reply])
    assert step.sampled[0].token_id == 7 and step.kv_len == 13 and (step.start, step.end) == (12, 13)


def test_session_frames_round_trip() -> None:
    opened = codec.open_frame(
        HEADER,
        step_id=1,
        route_ticket=b"signed",
        kv_budget_tokens=512,
        sampling=codec.SamplingSettings(temperature=0.7, top_k=40, n_top_logprobs=5),
        output_encoding=F16,
    )
    (parsed,) = _wire([opened])
    assert codec.sampling_settings(parsed.open.sampling).top_k == 40
    assert codec.sampling_settings(frame_pb2.SamplingParams()) == codec.SamplingSettings()
    ack = codec.open_ack_frame(
        parsed, kv_len=0, node_id="n1", kv_tokens_granted=512, max_frame_bytes=1 << 22, max_step_tokens=4096
    )
    closed = codec.closed_frame(codec.release_frame(HEADER, step_id=9), freed_kv_tokens=40)
    cancel = codec.cancel_frame(HEADER, step_id=10, reason="client went away")
    for frame in _wire([ack, closed, cancel]):
        assert frame.session_id == "sess-1" and codec.is_reply(frame) == (codec.body_kind(frame) != "cancel")


# --------------------------------------------------------------------------- reassembly rejections


def test_missing_middle_chunk() -> None:
    frames = _prefill()
    assert len(frames) >= 3
    with pytest.raises(errors.ChunkSequenceError):
        codec.reassemble(frames[:1] + frames[2:])


def test_missing_last_chunk() -> None:
    with pytest.raises(errors.ChunkSequenceError, match="incomplete"):
        codec.reassemble(_prefill()[:-1])


def test_missing_first_chunk() -> None:
    with pytest.raises(errors.ChunkSequenceError):
        codec.reassemble(_prefill()[1:])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_reordered_chunks(data: st.DataObject) -> None:
    frames = _prefill()
    order = data.draw(st.permutations(range(len(frames))))
    if list(order) == sorted(order):
        order = list(reversed(order))
    with pytest.raises(errors.ChunkSequenceError):
        codec.reassemble([frames[i] for i in order])


def test_duplicate_chunk() -> None:
    frames = _prefill()
    with pytest.raises(errors.ChunkSequenceError):
        codec.reassemble([frames[0], frames[0], *frames[1:]])


def test_frame_after_completion() -> None:
    frames = _prefill()
    with pytest.raises(errors.ChunkSequenceError):
        codec.reassemble([*frames, frames[-1]])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda f: setattr(f, "step_id", 6),
        lambda f: setattr(f, "route_epoch", 4),
        lambda f: setattr(f, "expected_kv_len", 1),
        lambda f: setattr(f.chunk, "count", f.chunk.count + 1),
        lambda f: setattr(f.positions, "start", f.positions.start + 1),
        lambda f: f.activation.ClearField("token_ids"),
    ],
)
def test_inconsistent_chunk(mutate: Callable[[frame_pb2.Frame], None]) -> None:
    frames = _prefill()
    mutate(frames[1])
    with pytest.raises(errors.ChunkSequenceError):
        codec.reassemble(frames)


def test_chunk_with_other_width() -> None:
    frames = _prefill()
    rows = frames[1].positions.end - frames[1].positions.start
    frames[1].activation.tensors[0].CopyFrom(encode_tensor(codec.HIDDEN, np.zeros((rows, 8), np.float32)))
    with pytest.raises(errors.ShapeError):
        codec.reassemble(frames)


def test_reassembled_step_size_limits() -> None:
    with pytest.raises(errors.TooLargeError):
        codec.reassemble(_prefill(), FrameLimits(max_step_bytes=1000))
    with pytest.raises(errors.TooLargeError):
        codec.reassemble(_prefill(), FrameLimits(max_step_tokens=10))


def test_corrupted_chunk_payload_fails_reassembly() -> None:
    frames = _prefill()
    tensor = frames[1].activation.tensors[0]
    tensor.data = bytes([tensor.data[0] ^ 1]) + tensor.data[1:]
    with pytest.raises(errors.ChecksumError):
        codec.reassemble(frames)


# --------------------------------------------------------------------------- hostile bytes


@settings(max_examples=80, deadline=None)
@given(data=st.binary(max_size=600))
def test_garbage_bytes_raise_protocol_errors_only(data: bytes) -> None:
    with pytest.raises(errors.ProtocolError):
        codec.parse_frame(data)


@pytest.mark.parametrize(
    "data", [b"", b"\xff", b"\x0a\x05ab", b"\x08" + b"\xff" * 11, b"\x9a\x01\x03\x0a\x01"]
)
def test_malformed_protobuf_is_bad_frame(data: bytes) -> None:
    with pytest.raises(errors.BadFrameError):
        codec.parse_frame(data)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_truncated_or_flipped_frames_never_escape_the_error_tree(data: st.DataObject) -> None:
    frames = _prefill(rows=6, max_frame_bytes=1 << 20)
    raw = bytearray(codec.serialize_frame(frames[0]))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        codec.reassemble([codec.parse_frame(bytes(raw))])
    except errors.ProtocolError:
        pass


def test_oversized_frame_is_rejected_before_parsing() -> None:
    limits = FrameLimits(max_frame_bytes=100)
    with pytest.raises(errors.TooLargeError):
        codec.parse_frame(b"\x00" * 101, limits)
    (frame,) = _prefill(rows=4, max_frame_bytes=1 << 20)
    with pytest.raises(errors.TooLargeError):
        codec.serialize_frame(frame, limits)


def test_a_row_wider_than_the_frame_cannot_be_chunked() -> None:
    with pytest.raises(errors.TooLargeError):
        codec.step_frames(
            HEADER, PREFILL, step_id=1, start=0, hidden=np.zeros((2, 4096), np.float32), max_frame_bytes=4096
        )


# --------------------------------------------------------------------------- validation


def _single() -> frame_pb2.Frame:
    (frame,) = codec.step_frames(
        HEADER, PREFILL, step_id=2, start=0, hidden=np.ones((3, 4), np.float32), token_ids=[1, 2, 3]
    )
    return frame


def _mutated(mutate: Callable[[frame_pb2.Frame], object]) -> frame_pb2.Frame:
    frame = _single()
    mutate(frame)
    return frame


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda f: setattr(f, "schema_version", codec.SCHEMA_VERSION + 1), errors.SchemaVersionError),
        (lambda f: setattr(f, "schema_version", 0), errors.BadFrameError),
        (lambda f: f.ClearField("body"), errors.BadFrameError),
        (lambda f: setattr(f, "phase", frame_pb2.PHASE_OPEN), errors.BadFrameError),
        (lambda f: setattr(f, "phase", 42), errors.BadFrameError),
        (lambda f: setattr(f, "session_id", ""), errors.BadFrameError),
        (lambda f: setattr(f, "session_id", "x" * 500), errors.BadFrameError),
        (lambda f: setattr(f, "model_fingerprint", "A" * 64), errors.BadFrameError),
        (lambda f: setattr(f, "recipe_fingerprint", "b" * 63), errors.BadFrameError),
        (lambda f: setattr(f.shard, "end", 0), errors.BadFrameError),
        (lambda f: setattr(f, "route_epoch", 0), errors.BadFrameError),
        (lambda f: setattr(f, "step_id", 0), errors.BadFrameError),
        (lambda f: setattr(f.positions, "end", 0), errors.BadFrameError),
        (lambda f: setattr(f, "expected_kv_len", 1), errors.BadFrameError),
        (lambda f: setattr(f, "phase", DECODE), errors.BadFrameError),
        (lambda f: f.activation.token_ids.append(4), errors.ShapeError),
        (lambda f: f.activation.token_ids.__setitem__(0, -1), errors.BadFrameError),
        (lambda f: setattr(f.positions, "end", 4), errors.ShapeError),
        (lambda f: f.activation.tensors.append(f.activation.tensors[0]), errors.BadFrameError),
        (lambda f: setattr(f.activation.tensors[0], "dtype", 9), errors.DTypeError),
        (
            lambda f: (f.activation.ClearField("token_ids"), f.activation.ClearField("tensors")),
            errors.BadFrameError,
        ),
        (lambda f: setattr(f.positions, "end", 40000), errors.TooLargeError),
        (lambda f: (setattr(f.chunk, "count", 2), setattr(f.chunk, "index", 2)), errors.BadFrameError),
        (
            lambda f: (setattr(f.chunk, "count", 2), setattr(f.activation, "sample", True)),
            errors.BadFrameError,
        ),
        (lambda f: setattr(f.chunk, "count", 10**6), errors.TooLargeError),
    ],
)
def test_invalid_frames(
    mutate: Callable[[frame_pb2.Frame], object], error: type[errors.ProtocolError]
) -> None:
    frame = _mutated(mutate)
    with pytest.raises(error):
        codec.parse_frame(frame.SerializeToString())


@pytest.mark.parametrize(
    "sampling",
    [
        frame_pb2.SamplingParams(temperature=-1),
        frame_pb2.SamplingParams(top_p=0),
        frame_pb2.SamplingParams(min_p=2),
        frame_pb2.SamplingParams(repetition_penalty=0),
        frame_pb2.SamplingParams(n_top_logprobs=21),
        frame_pb2.SamplingParams(temperature=float("nan")),
    ],
)
def test_invalid_open(sampling: frame_pb2.SamplingParams) -> None:
    frame = codec.open_frame(HEADER, step_id=1, route_ticket=b"t", kv_budget_tokens=8)
    frame.open.sampling.CopyFrom(sampling)
    with pytest.raises(errors.BadFrameError):
        codec.parse_frame(frame.SerializeToString())


def test_open_needs_ticket_and_budget() -> None:
    for ticket, budget, error in [
        (b"", 8, errors.BadFrameError),
        (b"t", 0, errors.BadFrameError),
        (b"t" * 20000, 8, errors.TooLargeError),
    ]:
        frame = codec.open_frame(HEADER, step_id=1, route_ticket=ticket, kv_budget_tokens=budget)
        with pytest.raises(error):
            codec.parse_frame(frame.SerializeToString())


def test_the_gateway_proof_is_optional_and_bounded() -> None:
    frame = codec.open_frame(HEADER, step_id=1, route_ticket=b"t", kv_budget_tokens=8)
    assert codec.parse_frame(frame.SerializeToString()).open.gateway_proof == b""  # older gateways
    frame.open.gateway_proof = b"p" * 1000
    assert codec.parse_frame(frame.SerializeToString()).open.gateway_proof == b"p" * 1000
    frame.open.gateway_proof = b"p" * 20000
    with pytest.raises(errors.TooLargeError, match="gateway proof"):
        codec.parse_frame(frame.SerializeToString())


def test_expect_route() -> None:
    frame = _single()
    codec.expect_route(
        frame, model_fingerprint="a" * 64, recipe_fingerprint="b" * 64, shard_start=0, shard_end=15
    )
    with pytest.raises(errors.FingerprintMismatchError):
        codec.expect_route(
            frame, model_fingerprint="c" * 64, recipe_fingerprint="b" * 64, shard_start=0, shard_end=15
        )
    with pytest.raises(errors.FingerprintMismatchError):
        codec.expect_route(
            frame, model_fingerprint="a" * 64, recipe_fingerprint="c" * 64, shard_start=0, shard_end=15
        )
    with pytest.raises(errors.ShardMismatchError):
        codec.expect_route(
            frame, model_fingerprint="a" * 64, recipe_fingerprint="b" * 64, shard_start=0, shard_end=16
        )


# --------------------------------------------------------------------------- errors on the wire


def test_every_status_has_an_exception_with_a_retry_hint() -> None:
    for status in status_pb2.Status.values():
        if status in (status_pb2.STATUS_UNSPECIFIED, status_pb2.STATUS_OK):
            continue
        cls = errors.error_class(status)
        assert cls.status == status
        assert cls.retry != status_pb2.RETRY_UNSPECIFIED


def test_error_frames_round_trip() -> None:
    request = _single()
    exc = errors.PositionMismatchError("node holds 2 positions, frame expects 0")
    (reply,) = _wire([codec.error_frame(exc, request, kv_len=2)])
    remote = errors.error_from_body(reply.error)
    assert remote.status == status_pb2.STATUS_POSITION_MISMATCH and remote.retry == status_pb2.RETRY_RESYNC
    assert reply.kv_len == 2 and reply.step_id == request.step_id and not remote.session_closed
    (bare,) = _wire([codec.error_frame(errors.BadFrameError("unreadable"))])
    assert errors.error_from_body(bare.error).status == status_pb2.STATUS_BAD_FRAME
    body = errors.error_body(errors.PreemptedError("pool full", retry_after_ms=50))
    preempted = errors.error_from_body(body)
    assert preempted.status == status_pb2.STATUS_PREEMPTED and preempted.retry == status_pb2.RETRY_RESUME
    assert preempted.session_closed and preempted.retry_after_ms == 50
    unknown = errors.error_from_body(status_pb2.Error(status=999, message="newer peer"))
    assert unknown.retry == status_pb2.RETRY_REPLACE and "999" in str(unknown)
    assert errors.InternalError("x").session_closed and not errors.EncodeError("x").session_closed
    with pytest.raises(errors.BadFrameError):
        codec.parse_frame(
            frame_pb2.Frame(schema_version=codec.SCHEMA_VERSION, error=status_pb2.Error()).SerializeToString()
        )


def test_long_error_messages_are_cut_not_rejected() -> None:
    (reply,) = _wire([codec.error_frame(errors.InternalError("x" * 100_000), _single())])
    assert len(reply.error.message) == errors.MAX_MESSAGE_CHARS
