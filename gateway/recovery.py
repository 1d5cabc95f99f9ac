"""Span recovery: what a Route Session keeps so one failed stage can be replaced mid-generation.

When a stage fails (its stream breaks, it stops answering, it reports an error
another node can fix), :class:`gateway.route_session.RouteSession` asks a
:data:`ReplacementFinder` for a live node serving **exactly the same layers**,
re-opens every surviving stage with the next route epoch (they keep their KV
up to the last step every stage completed), opens the replacement empty and
replays that span's input history into it as PREFILL steps; then the failed
step is run again. Healthy stages never re-prefill.

What the history holds, per session (bounded by ``max_history_bytes``):

* the token ids of every committed position (stage 0's input; also the last
  stage's penalty history), and
* for every stage after the first, the activation frames the gateway relayed
  to it, exactly as sent (the frame encoding: f32 hidden rows with their
  checksums), committed when every stage finished the step.

Why same-span only: a replacement with other boundaries would change the
neighbours' inputs or outputs too. Then (or when the hidden history passed its
bound) :class:`SpanRecoveryImpossible` -- a :class:`StageFailed` -- tells the
service to fall back to re-running the request on a fresh route with the whole
token history as prefill (``gateway.serving``). When no live node covers the
span at all, :class:`NoReplacement` names the uncovered layers.

Pure module: protobuf frames and numpy only (no trio, grpc or I/O).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from gateway.errors import NoRoute, StageFailed
from proto import codec, tensor_codec
from proto.swarm.v1 import frame_pb2

DEFAULT_MAX_HISTORY_BYTES = 64 * 1024 * 1024  # per session: ~14 000 positions x 2 stages of a 576-wide model
DEFAULT_MAX_RECOVERIES = 3  # stage replacements per session


class SpanRecoveryImpossible(StageFailed):
    """The failed span cannot be replaced in place (no same-span spare, or no hidden history kept)."""


class NoReplacement(NoRoute):
    """No live node covers the failed stage's layers: the request ends with this error."""


class NoSameSpan(Exception):
    """Raised by a finder: live nodes cover the layers, but none with exactly the failed stage's span."""


@dataclass(frozen=True)
class Replacement:
    """A live node for the failed span, and a tracker ticket that names it for those layers."""

    hop: object  # gateway.routes.Hop (kept untyped here: routes.py imports trio)
    info: object  # gateway.routes.StageInfo
    ticket: bytes


# (start, end, excluded node ids) -> Replacement; raises NoReplacement or SpanRecoveryImpossible.
ReplacementFinder = Callable[[int, int, frozenset[str]], Awaitable[Replacement]]


@dataclass(frozen=True)
class RecoveryReport:
    """One attempt to replace a stage, for metrics and logs."""

    failed_node: str
    replacement_node: str
    span: tuple[int, int]
    replayed_positions: int
    epoch: int
    seconds: float
    ok: bool
    error: str = ""


@dataclass
class RecoveryPolicy:
    find: ReplacementFinder
    max_recoveries: int = DEFAULT_MAX_RECOVERIES
    max_history_bytes: int = DEFAULT_MAX_HISTORY_BYTES
    on_report: Callable[[RecoveryReport], None] = lambda report: None


@dataclass
class SpanHistory:
    """Inputs of every stage for the committed positions ``[0, committed)``; bounded."""

    n_stages: int
    max_bytes: int = DEFAULT_MAX_HISTORY_BYTES
    tokens: list[int] = field(default_factory=list)
    frames: list[list[frame_pb2.Frame]] = field(default_factory=list)  # per stage; stage 0's stays empty
    hidden_kept: bool = True  # False once the bound was passed: stages > 0 can no longer be replayed
    bytes_held: int = 0
    _pending: list[list[frame_pb2.Frame]] = field(default_factory=list)
    _pending_bytes: int = 0

    def __post_init__(self) -> None:
        self.frames = [[] for _ in range(self.n_stages)]
        self._pending = [[] for _ in range(self.n_stages)]

    @property
    def committed(self) -> int:
        return len(self.tokens)

    def begin_step(self) -> None:
        for pending in self._pending:
            pending.clear()
        self._pending_bytes = 0

    def record(self, stage: int, frame: frame_pb2.Frame) -> None:
        """An activation frame relayed to ``stage`` (> 0) during the step in flight."""
        if not self.hidden_kept:
            return
        self._pending[stage].append(frame)
        self._pending_bytes += frame.ByteSize()

    def commit(self, tokens: Sequence[int]) -> None:
        """Every stage finished the step over ``tokens``: its inputs become history."""
        self.tokens.extend(int(t) for t in tokens)
        if self.hidden_kept:
            if self.bytes_held + self._pending_bytes > self.max_bytes:
                self.drop_hidden()
            else:
                for k, pending in enumerate(self._pending):
                    self.frames[k].extend(pending)
                self.bytes_held += self._pending_bytes
        self.begin_step()

    def drop_hidden(self) -> None:
        self.hidden_kept = False
        self.frames = [[] for _ in range(self.n_stages)]
        self.bytes_held = 0
        self.begin_step()

    def can_replay(self, stage: int) -> bool:
        return stage == 0 or self.hidden_kept


def hidden_rows(frames: Sequence[frame_pb2.Frame], limits: codec.FrameLimits) -> npt.NDArray[np.float32]:
    """The hidden-state rows of a stage's recorded input frames, in position order, as float32."""
    parts = []
    expected = 0
    for frame in frames:
        if frame.positions.start != expected:
            raise ValueError(f"history frames skip from {expected} to {frame.positions.start}")
        tensor = next(t for t in frame.activation.tensors if t.name == codec.HIDDEN)
        parts.append(tensor_codec.decode_tensor(tensor, limits.max_tensor_bytes))
        expected = frame.positions.end
    if not parts:
        return np.zeros((0, 0), dtype=np.float32)
    return np.concatenate(parts, axis=0)


def replay_frames(
    history: SpanHistory,
    stage: int,
    *,
    is_last: bool,
    header: codec.SessionHeader,
    first_step_id: int,
    step_tokens: int,
    max_frame_bytes: int,
    limits: codec.FrameLimits,
) -> list[list[frame_pb2.Frame]]:
    """The PREFILL steps (each a list of chunk frames) that bring a new ``stage`` to ``history.committed``.

    Stage 0 gets token ids; a later stage gets its recorded hidden rows
    (re-encoded f32, so bit-exact), plus the token ids when it is the last
    stage (its penalty history). Decode positions merge into prefill steps of
    up to ``step_tokens``. Nothing samples.
    """
    n = history.committed
    rows = hidden_rows(history.frames[stage], limits) if stage > 0 else None
    if rows is not None and rows.shape[0] != n:
        raise ValueError(f"history holds {rows.shape[0]} hidden rows for {n} positions")
    steps = []
    step_id = first_step_id
    for a in range(0, n, step_tokens):
        b = min(n, a + step_tokens)
        steps.append(
            codec.step_frames(
                header,
                frame_pb2.PHASE_PREFILL,
                step_id=step_id,
                start=a,
                token_ids=history.tokens[a:b] if (stage == 0 or is_last) else None,
                hidden=rows[a:b] if rows is not None else None,
                sample=False,
                max_frame_bytes=max_frame_bytes,
            )
        )
        step_id += 1
    return steps
