"""The frame codec: build, check, parse, chunk and reassemble activation frames.

Pure: numpy, the standard library and the generated messages; no I/O, no
event loop, no grpc. docs/protocol.md is the specification; this module is
its executable form.

Invariants the functions here guarantee or check:

* Every frame :func:`parse_frame` returns passed :func:`validate_frame`: known
  schema version, phase and body that agree, well-formed header, sane
  positions, tensor metadata consistent with its bytes. Malformed bytes raise
  :class:`~proto.errors.BadFrameError`, never a protobuf or numpy exception.
* :func:`serialize_frame` validates too, so a bug shows up on the sender.
* A step (one PREFILL or DECODE request, or its reply) is one frame or a run
  of chunk frames split by token rows. :func:`step_frames` and
  :func:`result_frames` keep every frame within ``max_frame_bytes``;
  :class:`StepAssembler` accepts chunks only in order, with contiguous
  positions and a consistent header, and decodes (checksums included) each
  chunk as it arrives so memory stays bounded by ``max_step_bytes``.
* Session-state checks (KV length, epoch, step order) belong to the node's
  session state machine; :func:`expect_route` checks a frame against what a
  node serves.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from proto.errors import (
    BadFrameError,
    ChunkSequenceError,
    EncodeError,
    FingerprintMismatchError,
    ProtocolError,
    SchemaVersionError,
    ShapeError,
    ShardMismatchError,
    TooLargeError,
    error_body,
)
from proto.swarm.v1 import frame_pb2, status_pb2
from proto.tensor_codec import (
    DEFAULT_BLOCK_SIZE,
    ENCODINGS,
    MAX_BLOCK_SIZE,
    decode_tensor,
    encode_tensor,
    encoded_row_bytes,
    tensor_layout,
)

SERVICE = "swarm.v1.ShardService"
SESSION_METHOD = f"/{SERVICE}/Session"  # gRPC method paths of the ShardService (raw bytes, no serializers)
INFO_METHOD = f"/{SERVICE}/Info"
HEALTH_METHOD = f"/{SERVICE}/Health"
VOCAB_METHOD = f"/{SERVICE}/GetVocab"
SCHEMA_VERSION = 2  # 2: direct push (PushTarget, hop tokens, reports, REPLAY)
HIDDEN = "hidden"  # name of the hidden-state tensor, float32 [n_tokens, n_embd]
MAX_TOP_LOGPROBS = 20
# Batch isolation (OpenSession.isolated): a node cuts an isolated session's step into pieces of this
# many positions, counted from the step's start, and runs each piece alone as one llama.cpp ubatch.
# A node's batch size is at least this (its config refuses less).
ISOLATED_SLICE_TOKENS = 64
MAX_LOGIT_BIAS = 1024  # logit_bias entries per session
MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar (tool schemas included) in one OPEN
MAX_CHOICES = 16  # n of one request (sessions sharing one prompt)
# Speculative decoding: most drafted tokens in one DECODE window (Activation.drafts), so a window
# holds at most MAX_DRAFT_TOKENS + 1 positions and its result at most that many sampled tokens.
MAX_DRAFT_TOKENS = 15
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024  # gRPC's default receive limit
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_LOGPROB_SLACK = 1e-4
_REQUEST_BODIES = frozenset({"open", "activation", "release", "cancel", "replay"})
MAX_TOKEN_BYTES = 64  # hop tokens and upstream tokens
MAX_ADDRESS_CHARS = 256
_BODIES_BY_PHASE: dict[int, frozenset[str]] = {
    frame_pb2.PHASE_OPEN: frozenset({"open", "open_ack", "error"}),
    frame_pb2.PHASE_PREFILL: frozenset({"activation", "result", "error"}),
    frame_pb2.PHASE_DECODE: frozenset({"activation", "result", "error"}),
    frame_pb2.PHASE_RELEASE: frozenset({"release", "closed", "error"}),
    frame_pb2.PHASE_CANCEL: frozenset({"cancel", "closed", "error"}),
    frame_pb2.PHASE_REPLAY: frozenset({"replay", "replay_ack", "error"}),
}
# Room for the header, the chunk, tensor metadata and length prefixes when
# sizing chunks; each built frame is measured afterwards anyway.
_FRAME_SLACK_BYTES = 1024


@dataclass(frozen=True)
class FrameLimits:
    """Size bounds a receiver enforces (and a sender respects)."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # one serialized frame
    max_tensor_bytes: int = 4 * DEFAULT_MAX_FRAME_BYTES  # one tensor, decoded to float32
    max_tensors_per_frame: int = 8
    max_step_tokens: int = 32768  # rows of one step, all chunks together
    max_step_bytes: int = 256 * 1024 * 1024  # one reassembled step, decoded
    max_chunks_per_step: int = 4096
    max_id_chars: int = 128  # session_id, request_id, node_id
    max_ticket_bytes: int = 16 * 1024
    max_text_chars: int = 4096  # error messages, cancel reasons


DEFAULT_LIMITS = FrameLimits()


# --------------------------------------------------------------------------- headers


@dataclass(frozen=True)
class SessionHeader:
    """The header fields that stay fixed for a Route Session on one stage and epoch."""

    session_id: str
    route_epoch: int
    model_fingerprint: str
    recipe_fingerprint: str
    shard_start: int
    shard_end: int
    request_id: str = ""

    def frame(
        self,
        phase: frame_pb2.Phase,
        *,
        step_id: int = 0,
        expected_kv_len: int = 0,
        kv_len: int = 0,
        positions: tuple[int, int] | None = None,
    ) -> frame_pb2.Frame:
        """A frame with this header and no body yet."""
        frame = frame_pb2.Frame(
            schema_version=SCHEMA_VERSION,
            request_id=self.request_id,
            session_id=self.session_id,
            route_epoch=self.route_epoch,
            model_fingerprint=self.model_fingerprint,
            recipe_fingerprint=self.recipe_fingerprint,
            shard=frame_pb2.LayerRange(start=self.shard_start, end=self.shard_end),
            phase=phase,
            step_id=step_id,
            expected_kv_len=expected_kv_len,
            kv_len=kv_len,
        )
        if positions is not None:
            frame.positions.start, frame.positions.end = positions
        return frame

    @classmethod
    def of(cls, frame: frame_pb2.Frame) -> SessionHeader:
        return cls(
            session_id=frame.session_id,
            route_epoch=frame.route_epoch,
            model_fingerprint=frame.model_fingerprint,
            recipe_fingerprint=frame.recipe_fingerprint,
            shard_start=frame.shard.start,
            shard_end=frame.shard.end,
            request_id=frame.request_id,
        )


def body_kind(frame: frame_pb2.Frame) -> str | None:
    """Name of the frame's body (``"open"``, ``"activation"``, ``"error"``...), or None."""
    kind = frame.WhichOneof("body")
    return None if kind is None else str(kind)


def is_reply(frame: frame_pb2.Frame) -> bool:
    """True for node -> gateway frames (open_ack, result, closed, error)."""
    kind = body_kind(frame)
    return kind is not None and kind not in _REQUEST_BODIES


def _reply(request: frame_pb2.Frame, kv_len: int) -> frame_pb2.Frame:
    reply = SessionHeader.of(request).frame(
        request.phase, step_id=request.step_id, expected_kv_len=request.expected_kv_len, kv_len=kv_len
    )
    return reply


def expect_route(
    frame: frame_pb2.Frame,
    *,
    model_fingerprint: str,
    recipe_fingerprint: str,
    shard_start: int,
    shard_end: int,
) -> None:
    """Raise unless the frame is for the model, recipe and shard a node serves."""
    if frame.model_fingerprint != model_fingerprint:
        raise FingerprintMismatchError(
            f"model fingerprint {frame.model_fingerprint[:16]}... is not this node's "
            f"{model_fingerprint[:16]}..."
        )
    if frame.recipe_fingerprint != recipe_fingerprint:
        raise FingerprintMismatchError(
            f"recipe fingerprint {frame.recipe_fingerprint[:16]}... is not this node's "
            f"{recipe_fingerprint[:16]}..."
        )
    if (frame.shard.start, frame.shard.end) != (shard_start, shard_end):
        raise ShardMismatchError(
            f"frame is for layers [{frame.shard.start}, {frame.shard.end}), this node serves "
            f"[{shard_start}, {shard_end})"
        )


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Sampled:
    """A token a last stage drew (the wire's ``SampledToken``): its id, its logprob, the top
    alternatives asked for, whether it ends the generation, and at ``completion_start`` with n > 1
    the other choices' first tokens (drawn from the same logits). The one sampled-token type: the
    node's sampler makes it, the session machines carry it, the gateway reads it."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    end_of_generation: bool = False
    choices: tuple[Sampled, ...] = ()


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling settings with the documented defaults applied."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    penalty_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n_top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str = ""
    completion_start: int = 0
    choices: int = 1
    # Speculative decoding's proposer (the request's); a value a node does not know means unspecified.
    proposer: int = frame_pb2.PROPOSER_UNSPECIFIED

    def to_wire(self) -> frame_pb2.SamplingParams:
        return frame_pb2.SamplingParams(
            proposer=self.proposer,  # type: ignore[arg-type]
            logit_bias=[frame_pb2.TokenBias(token_id=t, bias=b) for t, b in self.logit_bias],
            grammar=self.grammar,
            completion_start=self.completion_start,
            choices=self.choices,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            penalty_last_n=self.penalty_last_n,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            n_top_logprobs=self.n_top_logprobs,
        )


def sampling_settings(params: frame_pb2.SamplingParams) -> SamplingSettings:
    """Defaults applied and ranges checked (:class:`BadFrameError` when out of range)."""
    defaults = SamplingSettings()
    scalars = set(SamplingSettings.__dataclass_fields__) - {"logit_bias", "grammar"}
    values: dict[str, object] = {
        name: getattr(params, name) if params.HasField(name) else getattr(defaults, name) for name in scalars
    }
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise BadFrameError(f"sampling: at most {MAX_LOGIT_BIAS} logit_bias entries")
    if len(params.grammar) > MAX_GRAMMAR_CHARS:
        raise BadFrameError(f"sampling: grammar longer than {MAX_GRAMMAR_CHARS} characters")
    values["logit_bias"] = tuple((int(b.token_id), float(b.bias)) for b in params.logit_bias)
    values["grammar"] = params.grammar
    settings = SamplingSettings(**values)  # type: ignore[arg-type]
    checks = (
        (math.isfinite(settings.temperature) and settings.temperature >= 0, "temperature must be >= 0"),
        (0 < settings.top_p <= 1, "top_p must be in (0, 1]"),
        (0 <= settings.min_p <= 1, "min_p must be in [0, 1]"),
        (
            math.isfinite(settings.repetition_penalty) and settings.repetition_penalty > 0,
            "repetition_penalty > 0",
        ),
        (abs(settings.frequency_penalty) <= 2, "frequency_penalty must be in [-2, 2]"),
        (abs(settings.presence_penalty) <= 2, "presence_penalty must be in [-2, 2]"),
        (settings.n_top_logprobs <= MAX_TOP_LOGPROBS, f"n_top_logprobs must be <= {MAX_TOP_LOGPROBS}"),
        (
            all(math.isfinite(b) and abs(b) <= 100 for _, b in settings.logit_bias),
            "logit_bias values must be in [-100, 100]",
        ),
        (1 <= settings.choices <= MAX_CHOICES, f"choices must be in [1, {MAX_CHOICES}]"),
    )
    for ok, message in checks:
        if not ok:
            raise BadFrameError(f"sampling: {message}")
    return settings


# --------------------------------------------------------------------------- validation


def _check_text(value: str, limit: int, what: str) -> None:
    if len(value) > limit:
        raise BadFrameError(f"{what} longer than {limit} characters")


def _check_tensors(tensors: Sequence[frame_pb2.Tensor], rows: int, limits: FrameLimits) -> None:
    if len(tensors) > limits.max_tensors_per_frame:
        raise TooLargeError(f"{len(tensors)} tensors in one frame (limit {limits.max_tensors_per_frame})")
    names: set[str] = set()
    for tensor in tensors:
        if not tensor.name or tensor.name in names:
            raise BadFrameError(f"tensor names must be unique and non-empty, got {tensor.name!r}")
        names.add(tensor.name)
        layout = tensor_layout(tensor, limits.max_tensor_bytes)
        if layout.shape[0] != rows:
            raise ShapeError(f"tensor {tensor.name!r} has {layout.shape[0]} rows for {rows} positions")


def _is_last_chunk(frame: frame_pb2.Frame) -> bool:
    return not frame.HasField("chunk") or frame.chunk.index == frame.chunk.count - 1


def _validate_step(frame: frame_pb2.Frame, kind: str, limits: FrameLimits) -> None:
    start, end = frame.positions.start, frame.positions.end
    if end <= start:
        raise BadFrameError(f"empty or inverted position range [{start}, {end})")
    rows = end - start
    if rows > limits.max_step_tokens:
        raise TooLargeError(f"{rows} positions in one frame (limit {limits.max_step_tokens})")
    chunked = frame.HasField("chunk")
    if chunked:
        if frame.phase == frame_pb2.PHASE_DECODE:
            raise BadFrameError("a DECODE step is never chunked")
        if not 1 <= frame.chunk.count <= limits.max_chunks_per_step:
            raise TooLargeError(f"chunk count {frame.chunk.count} not in 1..{limits.max_chunks_per_step}")
        if frame.chunk.index >= frame.chunk.count:
            raise BadFrameError(f"chunk index {frame.chunk.index} >= count {frame.chunk.count}")
    drafts = frame.activation.drafts if kind == "activation" else frame.result.drafts
    if drafts and frame.phase != frame_pb2.PHASE_DECODE:
        raise BadFrameError("only a DECODE step carries drafted tokens")
    if drafts > MAX_DRAFT_TOKENS:
        raise BadFrameError(f"a window of {drafts} drafted tokens (limit {MAX_DRAFT_TOKENS})")
    if not chunked and frame.phase == frame_pb2.PHASE_DECODE and rows != 1 + drafts:
        raise BadFrameError(
            f"a DECODE step covers its token and its {drafts} drafts ({1 + drafts} positions), not {rows}"
        )
    first = not chunked or frame.chunk.index == 0
    if first and start != frame.expected_kv_len:
        raise BadFrameError(f"a step starts at expected_kv_len {frame.expected_kv_len}, not at {start}")
    if start < frame.expected_kv_len:
        raise BadFrameError(f"positions start {start} before expected_kv_len {frame.expected_kv_len}")
    if kind == "activation":
        body = frame.activation
        if not body.token_ids and not body.tensors:
            raise BadFrameError("an activation carries token ids or tensors")
        if body.token_ids and len(body.token_ids) != rows:
            raise ShapeError(f"{len(body.token_ids)} token ids for {rows} positions")
        if any(t < 0 for t in body.token_ids):
            raise BadFrameError("negative token id")
        if body.sample and not _is_last_chunk(frame):
            raise BadFrameError("sample is set only on the last chunk of a step")
        if len(body.hop_token) > MAX_TOKEN_BYTES:
            raise BadFrameError(f"hop token longer than {MAX_TOKEN_BYTES} bytes")
        if body.replay and body.sample:
            raise BadFrameError("a replayed step samples nothing")
        if body.drafts and (not body.sample or body.replay):
            raise BadFrameError("a window of drafts is sampled and never a replay")
        if body.window_gen and (frame.phase != frame_pb2.PHASE_DECODE or not body.sample or body.replay):
            raise BadFrameError("only a sampled DECODE step (not a replay) carries a window number")
        _check_tensors(body.tensors, rows, limits)
    else:
        result = frame.result
        # A window's last stage keeps only the accepted positions: at least the window's first.
        floor = start + 1 if result.drafts else end
        if frame.kv_len < floor:
            raise BadFrameError(f"kv_len {frame.kv_len} after a step ending at position {end}")
        if len(result.sampled) > MAX_CHOICES or (result.sampled and not _is_last_chunk(frame)):
            raise BadFrameError(f"at most {MAX_CHOICES} sampled tokens (choices), on the last chunk")
        if result.drafts and len(result.sampled) > 1 + result.drafts:
            raise BadFrameError(
                f"a window of {result.drafts} drafts produces at most {1 + result.drafts} tokens"
            )
        for token in result.sampled:
            if token.token_id < 0 or len(token.top_logprobs) > MAX_TOP_LOGPROBS:
                raise BadFrameError("bad sampled token")
            logprobs = [token.logprob, *(p.logprob for p in token.top_logprobs)]
            # Tolerate rounding noise above 0 (log-softmax of the top token).
            if any(math.isnan(p) or p > _LOGPROB_SLACK for p in logprobs):
                raise BadFrameError("logprobs must be <= 0 and not NaN")
        if result.pushed and result.tensors:
            raise BadFrameError("a pushed step's report carries no tensors")
        if len(result.output_digest) > 64:
            raise BadFrameError("output digest longer than 64 bytes")
        _check_tensors(result.tensors, rows, limits)


def _validate_target(target: frame_pb2.PushTarget, what: str, limits: FrameLimits) -> None:
    _check_text(target.node_id, limits.max_id_chars, f"{what} node_id")
    _check_text(target.address, MAX_ADDRESS_CHARS, f"{what} address")
    if not target.hop_token or len(target.hop_token) > MAX_TOKEN_BYTES:
        raise BadFrameError(f"{what} needs a hop token of 1..{MAX_TOKEN_BYTES} bytes")
    if target.shard.end <= target.shard.start:
        raise BadFrameError(f"{what} has an empty shard range")
    if not _FINGERPRINT.fullmatch(target.recipe_fingerprint):
        raise BadFrameError(f"{what} recipe_fingerprint is not 64 lowercase hex digits")
    if target.tls_fingerprint and not _FINGERPRINT.fullmatch(target.tls_fingerprint):
        raise BadFrameError(f"{what} tls_fingerprint is not empty or 64 lowercase hex digits")


def _validate_open(body: frame_pb2.OpenSession, limits: FrameLimits) -> None:
    if not body.route_ticket:
        raise BadFrameError("OPEN without a route ticket")
    if len(body.route_ticket) > limits.max_ticket_bytes:
        raise TooLargeError(
            f"route ticket of {len(body.route_ticket)} bytes (limit {limits.max_ticket_bytes})"
        )
    if len(body.gateway_proof) > limits.max_ticket_bytes:
        raise TooLargeError(
            f"gateway proof of {len(body.gateway_proof)} bytes (limit {limits.max_ticket_bytes})"
        )
    if body.kv_budget.max_tokens < 1:
        raise BadFrameError("OPEN asks for no KV budget")
    if body.output_encoding != frame_pb2.ENCODING_UNSPECIFIED and body.output_encoding not in ENCODINGS:
        raise BadFrameError(f"unknown output encoding {body.output_encoding}")
    if body.output_block_size > MAX_BLOCK_SIZE:
        raise BadFrameError(f"output block size {body.output_block_size} > {MAX_BLOCK_SIZE}")
    if len(body.upstream_token) > MAX_TOKEN_BYTES:
        raise BadFrameError(f"upstream token longer than {MAX_TOKEN_BYTES} bytes")
    if body.HasField("downstream"):
        _validate_target(body.downstream, "downstream", limits)
    if body.HasField("ring"):
        _validate_target(body.ring, "ring", limits)
        if body.HasField("downstream"):
            raise BadFrameError("a stage has a downstream (not last) or a ring (last), not both")
    sampling_settings(body.sampling)
    if body.HasField("speculation"):
        if body.speculation.max_drafts > MAX_DRAFT_TOKENS:
            raise BadFrameError(
                f"speculation of {body.speculation.max_drafts} drafts per window (limit {MAX_DRAFT_TOKENS})"
            )
        if body.speculation.max_drafts and not body.HasField("ring"):
            raise BadFrameError("speculation needs a ring (the last stage of a route of two or more)")


def validate_frame(frame: frame_pb2.Frame, limits: FrameLimits = DEFAULT_LIMITS) -> None:
    """Check everything about a frame that needs no session state; raise a ProtocolError."""
    if frame.schema_version == 0:
        raise BadFrameError("schema_version missing")
    if frame.schema_version != SCHEMA_VERSION:
        raise SchemaVersionError(f"schema version {frame.schema_version} (this side speaks {SCHEMA_VERSION})")
    kind = body_kind(frame)
    if kind is None:
        raise BadFrameError("frame without a body")
    _check_text(frame.session_id, limits.max_id_chars, "session_id")
    _check_text(frame.request_id, limits.max_id_chars, "request_id")
    if kind == "error":
        # An error may answer bytes that had no readable header.
        if frame.error.status == status_pb2.STATUS_UNSPECIFIED:
            raise BadFrameError("error frame without a status")
        _check_text(frame.error.message, limits.max_text_chars, "error message")
        return
    if frame.phase not in _BODIES_BY_PHASE:
        raise BadFrameError(f"unknown phase {frame.phase}")
    if kind not in _BODIES_BY_PHASE[frame.phase]:
        raise BadFrameError(f"body {kind!r} in a {frame_pb2.Phase.Name(frame.phase)} frame")
    if not frame.session_id:
        raise BadFrameError("session_id missing")
    for name in ("model_fingerprint", "recipe_fingerprint"):
        if not _FINGERPRINT.fullmatch(getattr(frame, name)):
            raise BadFrameError(f"{name} is not 64 lowercase hex digits")
    if frame.route_epoch < 1 or frame.step_id < 1:
        raise BadFrameError(f"route_epoch {frame.route_epoch} and step_id {frame.step_id} start at 1")
    if frame.shard.end <= frame.shard.start:
        raise BadFrameError(f"empty shard range [{frame.shard.start}, {frame.shard.end})")
    if frame.HasField("chunk") and kind not in ("activation", "result"):
        raise BadFrameError(f"chunk set on a {kind!r} frame")
    if kind in ("activation", "result"):
        _validate_step(frame, kind, limits)
    elif kind == "open":
        _validate_open(frame.open, limits)
    elif kind == "open_ack":
        if not frame.open_ack.node_id:
            raise BadFrameError("open_ack without node_id")
        _check_text(frame.open_ack.node_id, limits.max_id_chars, "node_id")
    elif kind == "cancel":
        _check_text(frame.cancel.reason, limits.max_text_chars, "cancel reason")
    elif kind == "replay":
        _validate_target(frame.replay.target, "replay target", limits)
        if frame.replay.end < 1 or frame.replay.step_tokens < 1:
            raise BadFrameError("a replay covers at least one position, in steps of at least one")


def parse_frame(data: bytes, limits: FrameLimits = DEFAULT_LIMITS) -> frame_pb2.Frame:
    """Bytes from the wire to a validated frame."""
    if len(data) > limits.max_frame_bytes:
        raise TooLargeError(f"frame of {len(data)} bytes (limit {limits.max_frame_bytes})")
    try:
        frame = frame_pb2.Frame.FromString(bytes(data))
    except DecodeError as err:
        raise BadFrameError(f"not a Frame: {err}") from err
    except Exception as err:  # the parser may raise other errors on hostile input
        raise BadFrameError(f"not a Frame ({type(err).__name__}): {err}") from err
    validate_frame(frame, limits)
    return frame


def serialize_frame(frame: frame_pb2.Frame, limits: FrameLimits = DEFAULT_LIMITS) -> bytes:
    """A validated frame to bytes for the wire."""
    validate_frame(frame, limits)
    data = frame.SerializeToString()
    if len(data) > limits.max_frame_bytes:
        raise TooLargeError(f"frame of {len(data)} bytes (limit {limits.max_frame_bytes})")
    return data


# --------------------------------------------------------------------------- builders


def open_frame(
    header: SessionHeader,
    *,
    step_id: int,
    route_ticket: bytes,
    kv_budget_tokens: int,
    sampling: SamplingSettings | None = None,
    output_encoding: frame_pb2.Encoding = frame_pb2.ENCODING_F32,
    output_block_size: int = 0,
    max_frame_bytes: int = 0,
    keep_kv_len: int = 0,
    downstream: frame_pb2.PushTarget | None = None,
    upstream_token: bytes = b"",
    ring: frame_pb2.PushTarget | None = None,
    history_bytes: int = 0,
    kv_source: tuple[str, int] | None = None,
    isolated: bool = False,
    kv_copy: bool = False,
    max_drafts: int = 0,
) -> frame_pb2.Frame:
    """OPEN; ``keep_kv_len`` is the KV prefix to keep when re-attaching (0 for a new session).

    ``isolated`` asks the node to compute the session's steps in batches of their own (batch
    isolation, docs/protocol.md).

    ``kv_source`` (session id, positions) starts a new session from another session's KV; ``kv_copy``
    copies a kept source instead of taking it over (a prefix shared with another client's request).

    ``max_drafts`` > 0 (the last stage of a ring) turns speculative decoding on: the stage drafts up
    to that many tokens per decode window (docs/protocol.md, Speculation).

    ``downstream``/``ring``/``upstream_token``/``history_bytes`` set up direct
    push (docs/protocol.md, Direct push); without them the stage answers every
    step on the session's own stream.
    """
    frame = header.frame(frame_pb2.PHASE_OPEN, step_id=step_id, expected_kv_len=keep_kv_len)
    frame.open.route_ticket = route_ticket
    frame.open.kv_budget.max_tokens = kv_budget_tokens
    frame.open.sampling.CopyFrom((sampling or SamplingSettings()).to_wire())
    frame.open.output_encoding = output_encoding
    frame.open.output_block_size = output_block_size
    frame.open.max_frame_bytes = max_frame_bytes
    if downstream is not None:
        frame.open.downstream.CopyFrom(downstream)
    if ring is not None:
        frame.open.ring.CopyFrom(ring)
    frame.open.upstream_token = upstream_token
    frame.open.history_bytes = history_bytes
    if kv_source is not None:
        frame.open.kv_source.session_id = kv_source[0]
        frame.open.kv_source.positions = kv_source[1]
        frame.open.kv_source.copy = kv_copy
    frame.open.isolated = isolated
    if max_drafts:
        frame.open.speculation.max_drafts = max_drafts
    return frame


def push_target(
    node_id: str,
    address: str,
    hop_token: bytes,
    shard: tuple[int, int],
    recipe_fingerprint: str,
    tls_fingerprint: str = "",
) -> frame_pb2.PushTarget:
    """Where a stage pushes: ``address`` empty means through the gateway; ``tls_fingerprint`` empty
    means the receiver serves plaintext."""
    return frame_pb2.PushTarget(
        node_id=node_id,
        address=address,
        hop_token=hop_token,
        shard=frame_pb2.LayerRange(start=shard[0], end=shard[1]),
        recipe_fingerprint=recipe_fingerprint,
        tls_fingerprint=tls_fingerprint,
    )


def replay_frame(
    header: SessionHeader, *, step_id: int, target: frame_pb2.PushTarget, end: int, step_tokens: int
) -> frame_pb2.Frame:
    """REPLAY: push the kept outputs of positions [0, end) to ``target``."""
    frame = header.frame(frame_pb2.PHASE_REPLAY, step_id=step_id)
    frame.replay.target.CopyFrom(target)
    frame.replay.end = end
    frame.replay.step_tokens = step_tokens
    return frame


def replay_ack_frame(request: frame_pb2.Frame, *, kv_len: int, steps: int, positions: int) -> frame_pb2.Frame:
    frame = _reply(request, kv_len)
    frame.replay_ack.steps = steps
    frame.replay_ack.positions = positions
    return frame


def output_digest(hidden: npt.NDArray[np.float32]) -> bytes:
    """blake2b-128 of float32 little-endian rows: what two honest nodes agree on bit for bit."""
    array = np.ascontiguousarray(hidden, dtype="<f4")
    return hashlib.blake2b(array.tobytes(), digest_size=16).digest()


def target_header(header: SessionHeader, target: frame_pb2.PushTarget) -> SessionHeader:
    """The header of frames pushed to ``target`` for the same session and epoch."""
    return SessionHeader(
        session_id=header.session_id,
        route_epoch=header.route_epoch,
        model_fingerprint=header.model_fingerprint,
        recipe_fingerprint=target.recipe_fingerprint,
        shard_start=target.shard.start,
        shard_end=target.shard.end,
        request_id=header.request_id,
    )


def open_ack_frame(
    request: frame_pb2.Frame,
    *,
    kv_len: int,
    node_id: str,
    kv_tokens_granted: int,
    max_frame_bytes: int,
    max_step_tokens: int,
    reattached: bool = False,
) -> frame_pb2.Frame:
    frame = _reply(request, kv_len)
    frame.open_ack.node_id = node_id
    frame.open_ack.kv_tokens_granted = kv_tokens_granted
    frame.open_ack.max_frame_bytes = max_frame_bytes
    frame.open_ack.max_step_tokens = max_step_tokens
    frame.open_ack.reattached = reattached
    return frame


def release_frame(
    header: SessionHeader,
    *,
    step_id: int,
    expected_kv_len: int = 0,
    keep_ms: int = 0,
    keep_positions: int = 0,
) -> frame_pb2.Frame:
    """RELEASE; ``keep_ms`` > 0 asks the node to keep the first ``keep_positions`` positions warm."""
    frame = header.frame(frame_pb2.PHASE_RELEASE, step_id=step_id, expected_kv_len=expected_kv_len)
    frame.release.SetInParent()
    frame.release.keep_ms = keep_ms
    frame.release.keep_positions = keep_positions
    return frame


def cancel_frame(header: SessionHeader, *, step_id: int, reason: str = "") -> frame_pb2.Frame:
    frame = header.frame(frame_pb2.PHASE_CANCEL, step_id=step_id)
    frame.cancel.reason = reason
    return frame


def closed_frame(request: frame_pb2.Frame, *, freed_kv_tokens: int) -> frame_pb2.Frame:
    frame = _reply(request, 0)
    frame.closed.freed_kv_tokens = freed_kv_tokens
    return frame


def error_frame(
    exc: ProtocolError, request: frame_pb2.Frame | None = None, *, kv_len: int = 0
) -> frame_pb2.Frame:
    """The error reply to ``request`` (None when the request could not be parsed)."""
    if request is None:
        frame = frame_pb2.Frame(schema_version=SCHEMA_VERSION, kv_len=kv_len)
    else:
        frame = _reply(request, kv_len)
        frame.positions.CopyFrom(request.positions)
        if request.HasField("chunk"):
            frame.chunk.CopyFrom(request.chunk)
    frame.error.CopyFrom(error_body(exc))
    return frame


def _row_chunks(n_rows: int, row_bytes: int, fixed_bytes: int, max_frame_bytes: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) such that fixed + rows * row_bytes fits the frame limit."""
    room = max_frame_bytes - fixed_bytes - _FRAME_SLACK_BYTES
    per_chunk = room // row_bytes if row_bytes else n_rows
    if per_chunk < 1:
        raise TooLargeError(f"one row of {row_bytes} bytes does not fit a {max_frame_bytes}-byte frame")
    return [(a, min(a + per_chunk, n_rows)) for a in range(0, n_rows, per_chunk)]


def _hidden_rows(
    hidden: npt.ArrayLike | None, n_rows: int | None
) -> tuple[npt.NDArray[np.float32] | None, int]:
    if hidden is None:
        if n_rows is None:
            raise EncodeError("a step needs token ids or hidden states")
        return None, n_rows
    array = np.asarray(hidden)
    if array.ndim != 2 or 0 in array.shape:
        raise EncodeError(f"hidden states must be [n_tokens, n_embd], got shape {array.shape}")
    if n_rows is not None and n_rows != array.shape[0]:
        raise EncodeError(f"{n_rows} token ids for {array.shape[0]} hidden rows")
    return array, array.shape[0]


def _split(
    template: frame_pb2.Frame,
    kind: str,
    start: int,
    *,
    token_ids: Sequence[int] | None,
    hidden: npt.ArrayLike | None,
    encoding: frame_pb2.Encoding,
    block_size: int,
    checksum_algorithm: frame_pb2.ChecksumAlgorithm,
    max_frame_bytes: int,
) -> list[frame_pb2.Frame]:
    tokens = None if token_ids is None or len(token_ids) == 0 else [int(t) for t in token_ids]
    array, n_rows = _hidden_rows(hidden, None if tokens is None else len(tokens))
    row_bytes = (5 if tokens is not None else 0) + (
        encoded_row_bytes(array.shape[1], encoding, block_size) if array is not None else 0
    )
    ranges = _row_chunks(n_rows, row_bytes, template.ByteSize(), max_frame_bytes)
    frames: list[frame_pb2.Frame] = []
    for index, (a, b) in enumerate(ranges):
        frame = frame_pb2.Frame()
        frame.CopyFrom(template)
        frame.positions.start, frame.positions.end = start + a, start + b
        if len(ranges) > 1:
            frame.chunk.index, frame.chunk.count = index, len(ranges)
        body = getattr(frame, kind)
        body.SetInParent()
        if tokens is not None and kind == "activation":
            frame.activation.token_ids.extend(tokens[a:b])
        if array is not None:
            body.tensors.append(
                encode_tensor(
                    HIDDEN, array[a:b], encoding, block_size=block_size, checksum_algorithm=checksum_algorithm
                )
            )
        if frame.ByteSize() > max_frame_bytes:  # the slack should make this unreachable
            raise TooLargeError(f"chunk of {frame.ByteSize()} bytes exceeds {max_frame_bytes}")
        frames.append(frame)
    return frames


def step_frames(
    header: SessionHeader,
    phase: frame_pb2.Phase,
    *,
    step_id: int,
    start: int,
    token_ids: Sequence[int] | None = None,
    hidden: npt.ArrayLike | None = None,
    sample: bool = False,
    encoding: frame_pb2.Encoding = frame_pb2.ENCODING_F32,
    block_size: int = DEFAULT_BLOCK_SIZE,
    checksum_algorithm: frame_pb2.ChecksumAlgorithm = frame_pb2.CHECKSUM_CRC32,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    hop_token: bytes = b"",
    replay: bool = False,
    drafts: int = 0,
    window_gen: int = 0,
) -> list[frame_pb2.Frame]:
    """A PREFILL or DECODE step starting at position ``start`` (= the KV length expected).

    Splits by token rows into as many chunk frames as ``max_frame_bytes``
    needs; ``sample`` goes on the last one. ``hop_token`` marks a pushed step,
    ``replay`` a recovery replay, ``drafts`` a DECODE window whose last ``drafts`` rows are drafted,
    ``window_gen`` its number among windows in flight (Activation.window_gen).
    """
    if phase not in (frame_pb2.PHASE_PREFILL, frame_pb2.PHASE_DECODE):
        raise EncodeError(f"a step is PREFILL or DECODE, not {phase}")
    template = header.frame(phase, step_id=step_id, expected_kv_len=start)
    template.activation.hop_token = hop_token  # in the template, so chunk sizing counts it
    template.activation.replay = replay
    template.activation.drafts = drafts
    template.activation.window_gen = window_gen
    frames = _split(
        template,
        "activation",
        start,
        token_ids=token_ids,
        hidden=hidden,
        encoding=encoding,
        block_size=block_size,
        checksum_algorithm=checksum_algorithm,
        max_frame_bytes=max_frame_bytes,
    )
    frames[-1].activation.sample = sample
    return frames


def result_frames(
    step: Step,
    *,
    kv_len: int,
    hidden: npt.ArrayLike | None = None,
    sampled: Sequence[frame_pb2.SampledToken] = (),
    compute_us: int = 0,
    digest: bytes = b"",
    pushed: bool = False,
    encoding: frame_pb2.Encoding = frame_pb2.ENCODING_F32,
    block_size: int = DEFAULT_BLOCK_SIZE,
    checksum_algorithm: frame_pb2.ChecksumAlgorithm = frame_pb2.CHECKSUM_CRC32,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> list[frame_pb2.Frame]:
    """The node's reply to a reassembled ``step``: output hidden states (chunked) or a sampled token.

    With ``pushed`` (or no ``hidden``) it is one report frame without tensors.
    """
    template = step.header.frame(
        step.phase, step_id=step.step_id, expected_kv_len=step.expected_kv_len, kv_len=kv_len
    )
    if hidden is None or pushed:
        frame = template
        frame.positions.start, frame.positions.end = step.start, step.end
        frame.result.SetInParent()
        frames = [frame]
    else:
        frames = _split(
            template,
            "result",
            step.start,
            token_ids=None,
            hidden=hidden,
            encoding=encoding,
            block_size=block_size,
            checksum_algorithm=checksum_algorithm,
            max_frame_bytes=max_frame_bytes,
        )
        if frames[-1].positions.end != step.end:
            raise EncodeError(
                f"{frames[-1].positions.end - step.start} hidden rows for {step.n_tokens} positions"
            )
    frames[-1].result.sampled.extend(sampled)
    frames[-1].result.compute_us = compute_us
    frames[-1].result.output_digest = digest
    frames[-1].result.pushed = pushed
    for frame in frames:
        frame.result.drafts = step.drafts
    return frames


# --------------------------------------------------------------------------- reassembly


@dataclass(frozen=True)
class Step:
    """A whole PREFILL/DECODE step (request or reply), decoded, from one or more frames."""

    header: SessionHeader
    phase: frame_pb2.Phase
    kind: str  # "activation" (gateway -> node) or "result" (node -> gateway)
    step_id: int
    start: int
    end: int
    expected_kv_len: int
    kv_len: int
    token_ids: npt.NDArray[np.int32]  # empty when the frames carried none
    tensors: Mapping[str, npt.NDArray[np.float32]]
    sample: bool = False
    sampled: tuple[frame_pb2.SampledToken, ...] = ()
    compute_us: int = 0
    n_frames: int = 1
    replay: bool = False  # a recovery replay: compute and report, push and sample nothing
    drafts: int = 0  # a DECODE window: its last ``drafts`` positions hold drafted tokens
    window_gen: int = 0  # windows in flight: the window's number (Activation.window_gen)

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


@dataclass
class StepAssembler:
    """Collects the chunk frames of one step, in order, and decodes them as they arrive.

    Feed validated frames (from :func:`parse_frame`) to :meth:`add`; it
    returns the :class:`Step` once the last chunk is in, else None. Any
    out-of-order, duplicate, foreign or inconsistent chunk raises
    :class:`ChunkSequenceError` (or ``ShapeError``/``TooLargeError``), after
    which the assembler must be discarded. :meth:`missing` tells what is
    still expected; a caller that sees a frame of another step while
    assembling reports ``ChunkSequenceError`` itself.
    """

    limits: FrameLimits = DEFAULT_LIMITS
    _first: frame_pb2.Frame | None = None
    _next_index: int = 0
    _end: int = 0
    _decoded_bytes: int = 0
    _has_tokens: bool = False
    _done: bool = False
    _tokens: list[int] = field(default_factory=list)
    _parts: dict[str, list[npt.NDArray[np.float32]]] = field(default_factory=dict)

    def missing(self) -> str:
        if self._first is None:
            return "no chunk yet"
        return f"chunks {self._next_index}..{self._first.chunk.count - 1} of step {self._first.step_id}"

    def _check_consistent(self, frame: frame_pb2.Frame, first: frame_pb2.Frame) -> None:
        same = (
            frame.step_id == first.step_id
            and frame.session_id == first.session_id
            and frame.route_epoch == first.route_epoch
            and frame.phase == first.phase
            and body_kind(frame) == body_kind(first)
            and frame.expected_kv_len == first.expected_kv_len
            and frame.model_fingerprint == first.model_fingerprint
            and frame.recipe_fingerprint == first.recipe_fingerprint
            and frame.shard == first.shard
            and frame.chunk.count == first.chunk.count
        )
        if not same:
            raise ChunkSequenceError(f"chunk {frame.chunk.index} does not belong to step {first.step_id}")
        if frame.chunk.index != self._next_index:
            raise ChunkSequenceError(f"chunk {frame.chunk.index} arrived, expected chunk {self._next_index}")
        if frame.positions.start != self._end:
            raise ChunkSequenceError(
                f"chunk starts at position {frame.positions.start}, expected {self._end}"
            )

    def add(self, frame: frame_pb2.Frame) -> Step | None:
        if self._done:
            raise ChunkSequenceError(f"frame after the last chunk of step {frame.step_id}")
        kind = body_kind(frame)
        if kind not in ("activation", "result"):
            raise ChunkSequenceError(f"a {kind!r} frame arrived while assembling a step")
        if self._first is None:
            if frame.HasField("chunk") and frame.chunk.index != 0:
                raise ChunkSequenceError(f"step {frame.step_id} starts with chunk {frame.chunk.index}, not 0")
            self._first = frame
            self._end = frame.positions.start
        else:
            self._check_consistent(frame, self._first)
        body = frame.activation if kind == "activation" else frame.result
        rows = frame.positions.end - frame.positions.start
        if self._end + rows - self._first.positions.start > self.limits.max_step_tokens:
            raise TooLargeError(f"step exceeds {self.limits.max_step_tokens} positions")
        has_tokens = kind == "activation" and len(frame.activation.token_ids) > 0
        if self._next_index == 0:
            self._has_tokens = has_tokens
        elif has_tokens != self._has_tokens:
            raise ChunkSequenceError("token ids present in some chunks only")
        if self._next_index > 0 and {t.name for t in body.tensors} != set(self._parts):
            raise ChunkSequenceError("chunks carry different tensor names")
        for tensor in body.tensors:
            layout = tensor_layout(tensor, self.limits.max_tensor_bytes)
            parts = self._parts.setdefault(tensor.name, [])
            if parts and parts[0].shape[1:] != layout.shape[1:]:
                raise ShapeError(
                    f"tensor {tensor.name!r}: chunk rows of shape {layout.shape[1:]} after "
                    f"{parts[0].shape[1:]}"
                )
            self._decoded_bytes += layout.decoded_bytes  # bounded before decoding allocates it
            if self._decoded_bytes > self.limits.max_step_bytes:
                raise TooLargeError(f"step exceeds {self.limits.max_step_bytes} decoded bytes")
            parts.append(decode_tensor(tensor, self.limits.max_tensor_bytes))
        if kind == "activation":
            self._tokens.extend(frame.activation.token_ids)
        self._end = frame.positions.end
        self._next_index += 1
        if not _is_last_chunk(frame):
            return None
        return self._finish(frame, kind)

    def _finish(self, last: frame_pb2.Frame, kind: str) -> Step:
        first = self._first
        if first is None:
            raise ChunkSequenceError("no chunk yet")
        self._done = True
        tensors = {
            name: parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            for name, parts in self._parts.items()
        }
        return Step(
            header=SessionHeader.of(first),
            phase=first.phase,
            kind=kind,
            step_id=first.step_id,
            start=first.positions.start,
            end=last.positions.end,
            expected_kv_len=first.expected_kv_len,
            kv_len=last.kv_len,
            token_ids=np.asarray(self._tokens, dtype=np.int32),
            tensors=tensors,
            sample=kind == "activation" and last.activation.sample,
            sampled=tuple(last.result.sampled) if kind == "result" else (),
            compute_us=last.result.compute_us if kind == "result" else 0,
            n_frames=self._next_index,
            replay=kind == "activation" and last.activation.replay,
            drafts=int(last.activation.drafts if kind == "activation" else last.result.drafts),
            window_gen=int(last.activation.window_gen) if kind == "activation" else 0,
        )


def reassemble(frames: Sequence[frame_pb2.Frame], limits: FrameLimits = DEFAULT_LIMITS) -> Step:
    """The step a complete, ordered run of frames carries (ChunkSequenceError if incomplete)."""
    assembler = StepAssembler(limits)
    step: Step | None = None
    for frame in frames:
        if step is not None:
            raise ChunkSequenceError(f"frame after the last chunk of step {step.step_id}")
        step = assembler.add(frame)
    if step is None:
        raise ChunkSequenceError(f"incomplete step: missing {assembler.missing()}")
    return step
