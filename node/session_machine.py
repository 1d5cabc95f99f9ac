"""The node's Route Session state machine: frame bytes in, actions out (sans-IO).

No trio, no grpc, no llama.cpp: a transport (the gRPC adapter, a WebSocket
relay, a test) calls :meth:`FrameServer.handle` with the bytes of one frame and
the connection they came on, and carries out the returned actions in order:

    Send(conn, frames)            put these reply frames on that connection
    OpenKv(session, budget, ...)  reserve a KV sequence on the engine
    TruncateKv(session, pos)      drop KV positions >= pos (re-attach)
    FreeKv(session)               release the session's KV at once
    Compute(job)                  run one step on the engine (the scheduler batches it)
    Drop(job_id)                  forget a queued job (cancel); a running one finishes and is ignored
    Push(session, target, frames) send these frames to another node (direct push; docs/protocol.md)

Engine effects must reach the engine in the order they were emitted (the
scheduler keeps one FIFO for them), and a ``Send`` that follows an engine
effect in the same list must wait for that effect. When the scheduler finishes
a job, the transport calls :meth:`FrameServer.complete` with its
:class:`StepOutcome` and carries out the actions it returns the same way.

Checks, in the order of docs/protocol.md ("What a node checks, in order")::

    1 parse            TOO_LARGE BAD_FRAME SCHEMA_VERSION SHAPE DTYPE      (codec.parse_frame)
    2 route            FINGERPRINT_MISMATCH SHARD_MISMATCH                 (codec.expect_route)
    3 OPEN             TICKET_INVALID RESOURCE_EXHAUSTED CONTEXT_EXCEEDED UNAVAILABLE
      else             UNKNOWN_SESSION SESSION_CLOSED
    4 epoch            ROUTE_EPOCH
    5 sender           TICKET_INVALID: a step from a connection other than the session's
                       owner without the session's hop token; RELEASE/CANCEL/REPLAY only
                       from the owner
    6 step id          == last applied: re-send the cached reply; < : STEP_CONFLICT
    7 KV               POSITION_MISMATCH CONTEXT_EXCEEDED (against the KV length after the
                       steps already accepted)
    8 chunks/payload   CHUNK_SEQUENCE CHECKSUM TOO_LARGE SHAPE             (codec.StepAssembler)
    9 compute          RESOURCE_EXHAUSTED (step or pending queue full) INTERNAL

Session states::

    (none) --OPEN ok--> IDLE --step--> BUSY --outcome--> IDLE (or BUSY with the next pending step)
    IDLE|BUSY --RELEASE/CANCEL/lease expiry--> closed (remembered, bounded)
    closed --OPEN--> IDLE (a fresh session under the same id)

Direct push (docs/protocol.md): the connection that OPENed a session (the
gateway) owns it. A stage with a ``downstream`` target sends each step's output
to the next stage as that stage's input (``Push``, or through the owner when
the target has no address) and only a small report (kv_len, digest, compute
time) to the owner; it keeps the pushed outputs, bounded by ``history_bytes``,
so a replacement of the next stage can be replayed from here (REPLAY). The
last stage with a ``ring`` target pushes the next decode step (the token it
sampled) to the first stage, so generation goes on without the gateway until
the KV budget is reached or an end-of-generation token is sampled. Steps
pushed in carry the session's ``upstream_token``.

Data step ids follow one rule in an epoch whose OPEN had step id B: the step
starting at position p has id B + p + 1 (so the last stage knows the id of the
decode step it pushes, and a replay's steps fit below the steps after it).

Invariants:

* Nothing is sent to the engine before check 8 passes, so every refusal leaves
  the session exactly as it was.
* A session has at most one job in flight; further steps wait in its pending
  queue (at most ``max_pending_steps`` -- replayed steps excepted, which the
  session's KV budget bounds --, and at most ``max_pending_bytes`` of
  decoded tensors on the node), so a pipelined prefill's chunks can arrive
  while the previous one computes; past the bounds a step is refused with
  RESOURCE_EXHAUSTED (retry SAME). CANCEL and RELEASE are answered at once.
* The reply frames of the last applied step are kept per session (one step),
  so a re-sent step id is answered from the cache and never touches the KV twice.
* The number of queued jobs never exceeds ``max_queued_steps``; the number of
  sessions never exceeds ``max_sessions``; a session's positions never pass
  its granted budget.
* A session whose connection ends without RELEASE/CANCEL is kept for
  ``reattach_window_s``; any session idle for ``idle_lease_s`` is evicted.
"""

from __future__ import annotations

import hmac
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from common.logs import event
from common.prefix_chain import parse_source_id
from node.drafting import ProposerFactory, SessionDrafter, proposer_choice, verdict
from node.kept_sessions import KeptSessions
from node.kvpool import BLOCK_TOKENS, blocks_for
from node.preemption import Holder, choose_victims
from node.prefix_blocks import MAX_HEADS
from node.sampling import SamplingParams
from proto import codec
from proto.codec import Sampled
from proto.errors import (
    BadFrameError,
    ChunkSequenceError,
    ContextExceededError,
    DownstreamFailedError,
    InternalError,
    NoHistoryError,
    PositionMismatchError,
    PreemptedError,
    ProtocolError,
    ResourceExhaustedError,
    RouteEpochError,
    SessionClosedError,
    ShapeError,
    StepConflictError,
    TicketInvalidError,
    UnavailableError,
    UnknownSessionError,
    error_body,
    error_class,
)
from proto.swarm.v1 import frame_pb2, status_pb2
from proto.tensor_codec import DEFAULT_BLOCK_SIZE

log = logging.getLogger("swarm.node.session")

MAX_CLOSED_REMEMBERED = 4096


# --------------------------------------------------------------------------- what the node serves


@dataclass(frozen=True)
class ServingSpec:
    """What this node serves and the bounds it enforces (from the engine and the config)."""

    node_id: str
    model_fingerprint: str
    recipe_fingerprint: str
    shard_start: int
    shard_end: int
    n_embd: int
    n_vocab: int
    is_first: bool
    is_last: bool
    max_sessions: int
    session_kv_tokens: int  # most positions one session may hold (the engine's per-sequence KV)
    n_ctx_train: int  # the model's trained context; a larger budget is CONTEXT_EXCEEDED
    kv_pool_tokens: int = 0  # the engine's KV pool (0: per-sequence layout, max_sessions x session_kv_tokens)
    max_queued_steps: int = 64
    idle_lease_s: float = 300.0
    reattach_window_s: float = 30.0
    busy_retry_after_ms: int = 50
    limits: codec.FrameLimits = codec.DEFAULT_LIMITS
    max_pending_steps: int = 8  # per session, behind the one computing
    max_pending_bytes: int = 256 * 1024 * 1024  # decoded tensors of pending steps, all sessions
    max_history_bytes: int = 64 * 1024 * 1024  # kept pushed outputs per session (OPEN may ask less)
    max_history_total_bytes: int = 512 * 1024 * 1024  # all sessions; the oldest histories go first
    max_kept_sessions: int = 4  # released sessions kept warm (Release.keep_ms); 0: never keep
    # Positions all kept sessions hold together, in the per-sequence layout. With a pool kept sessions
    # are its evictable cache: bounded by the pool, evicted (oldest first) before a live session waits.
    max_kept_kv_tokens: int = 8192
    max_keep_s: float = 120.0  # longest a released session is kept
    max_preemptions: int = 3  # with a pool: a session preempted this often here is never chosen again
    kv_retry_after_ms: int = 500  # retry hint of a step refused because the KV pool has no room
    # Speculative decoding (last stage): most drafts per window this node's model computes exactly
    # (a position inside a window bit for bit like a one-position step); 0: never speculate.
    max_draft_tokens: int = 8
    # ... and only while at most this many sessions are open here (vLLM's disable-by-batch-size): on a
    # compute-bound node every extra window position costs nearly a whole position, so under load the
    # rejected drafts would take compute from the other sessions.
    speculate_max_sessions: int = 4
    # Windows in flight (last stage, docs/protocol.md): most verify windows round the ring at once; 1 =
    # the next window leaves only when the last one is verified.
    windows_in_flight: int = 1


# --------------------------------------------------------------------------- actions and outcomes


@dataclass(frozen=True)
class StepJob:
    """One step for the engine: ``n`` positions of one session starting at ``start``."""

    job_id: int
    session_id: str
    start: int
    tokens: npt.NDArray[np.int32] | None  # first stage
    hidden: npt.NDArray[np.float32] | None  # other stages, [n, n_embd]
    sample: bool
    history: npt.NDArray[np.int32] | None  # last stage with penalties or a grammar: tokens so far
    is_decode: bool
    token_ids: npt.NDArray[np.int32] | None = None  # the step's token ids whatever the stage (may be empty)
    # Batch isolation (OpenSession.isolated): the scheduler runs this step in batches holding only its
    # rows, cut into ISOLATED_SLICE_TOKENS pieces counted from ``start`` (node.batching).
    isolated: bool = False
    # A DECODE window (Activation.drafts): the last stage draws a token after every position.
    drafts: int = 0

    @property
    def n_tokens(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        return 0 if data is None else int(len(data))


@dataclass(frozen=True)
class StepOutcome:
    """What the engine made of a job. ``error_status`` is a wire status name (``"SHAPE"``...)."""

    job_id: int
    kv_len: int
    hidden: npt.NDArray[np.float32] | None = None
    sampled: Sampled | None = None
    compute_us: int = 0
    error_status: str | None = None
    error_message: str = ""
    queue_us: int | None = None  # the job's wait in the scheduler before its first batch (metrics)
    window: tuple[Sampled, ...] = ()  # a window (StepJob.drafts), last stage: the draw after each position


@dataclass(frozen=True)
class Send:
    conn: int
    frames: tuple[frame_pb2.Frame, ...]
    # Answered from a session's cache (a re-sent step, OPEN or RELEASE): the transport may skip it
    # while the connection has not read the previous cached answer yet (node/hub.py, Replays).
    replay: bool = False


@dataclass(frozen=True)
class OpenKv:
    session_id: str
    budget: int
    sampling: SamplingParams
    source: str = ""  # start from this session's KV (KvSource): its first source_positions positions
    source_positions: int = 0
    move: bool = False  # the source is a kept session: take its sequence over instead of copying


@dataclass(frozen=True)
class TruncateKv:
    session_id: str
    position: int


@dataclass(frozen=True)
class FreeKv:
    session_id: str


@dataclass(frozen=True)
class Compute:
    job: StepJob


@dataclass(frozen=True)
class Drop:
    job_id: int


@dataclass(frozen=True)
class Push:
    """Frames for another node (``target.address``), pushed on a stream of this session."""

    session_id: str
    target: frame_pb2.PushTarget
    frames: tuple[frame_pb2.Frame, ...]


Action = Send | OpenKv | TruncateKv | FreeKv | Compute | Drop | Push
EngineEffect = OpenKv | TruncateKv | FreeKv | Compute | Drop


@dataclass(frozen=True)
class OpenClaim:
    """What an OPEN says about itself besides its ticket, for the gateway binding of tickets."""

    route_epoch: int
    step_id: int
    gateway_proof: bytes  # OpenSession.gateway_proof: the named gateway's signature over this OPEN


# Checks a route ticket (the raw OpenSession.route_ticket bytes) for this node, for this session, and
# -- when the ticket names a gateway -- the OPEN's proof that it comes from that gateway; raises
# TicketInvalidError. Injected so the machine stays free of keys and clocks.
TicketCheck = Callable[[bytes, str, OpenClaim], None]


# --------------------------------------------------------------------------- state


@dataclass
class _Session:
    session_id: str
    conn: int | None
    epoch: int
    budget: int
    sampling: SamplingParams
    out_encoding: frame_pb2.Encoding
    out_block_size: int
    out_max_frame_bytes: int
    kv_len: int = 0
    last_step_id: int = 0
    last_reply: tuple[frame_pb2.Frame, ...] = ()
    # Applied token ids, = its KV (every stage, while steps carry them; a step without them ends the
    # record there: what is known is a correct prefix).
    history_tokens: list[int] = field(default_factory=list)
    busy_job: int | None = None
    busy_conn: int | None = None
    busy_step: codec.Step | None = None
    busy_frame: frame_pb2.Frame | None = None
    assembler: codec.StepAssembler | None = None
    assembling_step: int = 0
    assembling_first: frame_pb2.Frame | None = None
    ignore_step: int = 0  # chunks (index > 0) of this step id are ignored silently
    expires_at: float = 0.0
    open_step_id: int = 0  # B of the epoch: data steps have ids B + start + 1
    downstream: frame_pb2.PushTarget | None = None
    ring: frame_pb2.PushTarget | None = None
    upstream_token: bytes = b""
    pending: list[_Pending] = field(default_factory=list)
    accepted_end: int = 0  # KV length once the busy and pending steps are applied
    accepted_step: int = 0  # highest step id accepted (busy or pending)
    history_limit: int = 0
    history: _History | None = None
    isolated: bool = False  # OpenSession.isolated: its steps run in batches of their own
    opened_seq: int = 0  # the order sessions opened here (higher = younger; kept across a preemption)
    drafter: SessionDrafter | None = None  # last stage of a speculating session (OpenSession.speculation)
    window_slack: int = 0  # drafts of the last accepted DECODE window: positions the next step may drop
    # Windows in flight (Activation.window_gen): the number of the last head seen (every stage; the last
    # stage's own count of the heads it pushed) and the lowest position a later head may drop.
    window_gen: int = 0
    spec_floor: int = 0
    flight_limit: int = 1  # last stage: windows it keeps round the ring at once (1: one at a time)
    # Last stage: the windows pushed and not verified yet, oldest first: (start, token ids).
    flight: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    # Computed in whole steps of first_step positions from position 0 up to aligned_end: a copy of at
    # most that many positions, cut at a multiple of the step, is bit-exact with a cold prefill.
    first_step: int = 0
    aligned_end: int = 0


@dataclass(frozen=True)
class _Pending:
    step: codec.Step
    frame: frame_pb2.Frame
    conn: int
    nbytes: int
    rollback: bool = False  # a head queued behind a discarded window: the KV goes back to its start first


class _History:
    """The outputs a stage pushed, bounded: position-ordered rows and their token ids."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.rows: list[npt.NDArray[np.float32]] = []
        self.tokens: list[npt.NDArray[np.int32]] = []
        self.end = 0
        self.nbytes = 0
        self.overflowed = False

    def add(self, start: int, rows: npt.NDArray[np.float32], tokens: npt.NDArray[np.int32]) -> int:
        """Keep rows for positions [start, start + n); returns the bytes added (0 when not kept)."""
        if self.overflowed:
            return 0
        if start < self.end:  # a truncation (re-attach) came first: drop what follows start
            self.truncate(start)
        if start != self.end or self.nbytes + rows.nbytes > self.limit:
            self.overflowed = True
            self.release()
            return 0
        self.rows.append(rows)
        self.tokens.append(tokens)
        self.end += len(rows)
        self.nbytes += rows.nbytes
        return rows.nbytes

    def truncate(self, position: int) -> None:
        if position >= self.end:
            return
        rows = np.concatenate(self.rows)[:position] if self.rows else np.zeros((0, 0), np.float32)
        tokens = np.concatenate(self.tokens)[:position] if self.tokens else np.zeros(0, np.int32)
        self.rows, self.tokens = ([rows], [tokens]) if position else ([], [])
        self.end = position
        self.nbytes = rows.nbytes if position else 0

    def release(self) -> None:
        self.rows, self.tokens, self.nbytes = [], [], 0

    def covers(self, end: int) -> bool:
        return not self.overflowed and self.end >= end

    def span(self, start: int, end: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int32]]:
        rows = np.concatenate(self.rows) if len(self.rows) > 1 else self.rows[0]
        tokens = np.concatenate(self.tokens) if len(self.tokens) > 1 else self.tokens[0]
        if len(self.rows) > 1:  # keep one array: later spans need no concatenation
            self.rows, self.tokens = [rows], [tokens]
        return rows[start:end], tokens[start:end]


@dataclass
class _Kept:
    """A released session whose KV stays on the engine for a while (warm conversations)."""

    session_id: str
    kv_len: int
    history_tokens: list[int]
    history: _History | None
    expires_at: float
    first_step: int = 0  # as _Session: its first aligned_end positions were computed in steps of first_step
    aligned_end: int = 0


@dataclass(frozen=True)
class _Closed:
    reason: str  # "released", "cancelled", "evicted", "failed"
    last_step_id: int
    reply: tuple[frame_pb2.Frame, ...]


@dataclass(frozen=True)
class MachineStats:
    sessions: int
    busy_sessions: int
    queued_jobs: int
    pending_steps: int
    pending_bytes: int
    history_bytes: int
    kv_tokens_used: int
    kv_tokens_granted: int
    kv_tokens_capacity: int
    kept_sessions: int
    kept_kv_tokens: int
    connections: int
    frames_in: int
    frames_out: int
    frames_pushed: int
    replays: int
    evictions: int
    errors_by_status: dict[str, int]
    draining: bool
    kv_pool_blocks: int = 0  # the pool's 16-position blocks (0: per-sequence layout)
    kv_blocks_reserved: int = 0  # blocks sessions hold or have steps accepted for (kept sessions too)
    preemptions: int = 0  # sessions preempted to make room in the pool
    kv_refusals: int = 0  # steps refused because the pool had no room and nobody could be preempted
    prefix_cached_blocks: int = 0  # distinct 16-token blocks the kept sessions hold (node.prefix_blocks)
    prefix_lookups_hit: int = 0  # OPENs naming a prefix by its chain hash that found it here
    prefix_lookups_miss: int = 0  # ... that did not (or could not use it): the session started empty
    reused_positions: int = 0  # positions sessions started with from another session's KV
    # Speculating sessions (last stage) by the proposer they draft with: "ngram", "draft", and
    # "draft_unavailable" (the request asked for the draft model, this node has none: n-gram lookup).
    spec_proposers: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class KvAnnouncement:
    """What a heartbeat says of this node's KV (proto.announce.Heartbeat), in positions."""

    free_tokens: int  # free for new work: the pool's unreserved blocks, or the slots not granted yet
    pool_tokens: int  # the pool's size (without a pool: all slots together)
    session_max_tokens: int  # the most one session may hold here


def kv_announcement(stats: MachineStats, spec: ServingSpec) -> KvAnnouncement:
    """The heartbeat's KV figures: with a pool the machine's view (blocks reserved by accepted steps
    count as used: it runs ahead of the engine's), else the per-sequence slots."""
    if stats.kv_pool_blocks:
        free = max(0, stats.kv_pool_blocks - stats.kv_blocks_reserved) * BLOCK_TOKENS
    else:
        free = max(0, stats.kv_tokens_capacity - stats.kv_tokens_granted)
    return KvAnnouncement(free, stats.kv_tokens_capacity, spec.session_kv_tokens)


class FrameServer:
    """All Route Sessions of one node; transport-independent (see the module docstring)."""

    def __init__(
        self,
        spec: ServingSpec,
        check_ticket: TicketCheck,
        proposers: ProposerFactory | None = None,
        choice: str = "always",
    ) -> None:
        self.spec = spec
        self._check_ticket = check_ticket
        # A speculating session's draft model (--draft-model; None: n-gram lookup only) and how the
        # session chooses between the two (--draft-model-choice; node.drafting.SessionDrafter).
        self._proposers = proposers
        self._choice = None if proposers is None else proposer_choice(choice)
        self._sessions: dict[str, _Session] = {}
        self._closed: OrderedDict[str, _Closed] = OrderedDict()
        self._jobs: dict[int, str] = {}  # job id -> session id, for queued or running jobs
        self._job_ids = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._conns: set[int] = set()
        # Connections that proved themselves: an OPEN accepted (ticket, and the gateway's proof for a
        # bound ticket) or a step pushed with a session's hop token. The hub bounds the others.
        self._proven: set[int] = set()
        self._frames_in = 0
        self._frames_out = 0
        self._frames_pushed = 0
        self._replays = 0
        self._stale_windows = 0  # discarded windows dropped on arrival (windows in flight)
        self._spec_proposers: dict[str, int] = {}  # speculating sessions by proposer (MachineStats)
        self._evictions = 0
        self._errors: dict[str, int] = {}
        self._pending_bytes = 0
        self._history_bytes = 0
        self._histories: OrderedDict[str, None] = OrderedDict()  # sessions with kept outputs, oldest first
        # Released sessions kept warm (node.kept_sessions): bounded by the pool when there is one.
        self._kept: KeptSessions[_Kept] = KeptSessions(
            spec.max_kept_sessions, spec.kv_pool_tokens or spec.max_kept_kv_tokens, spec.recipe_fingerprint
        )
        self._reused = 0
        self._prefix_hits = 0
        self._prefix_misses = 0
        self._open_order = itertools.count(1)
        # Sessions preempted here: (times, their opened_seq), so a resumed session keeps its age and its
        # count (the bound of node.preemption); bounded like the closed sessions.
        self._preempted: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._preemptions = 0
        self._kv_refusals = 0
        self.draining = False

    # -- connections ---------------------------------------------------------------------------

    def connect(self) -> int:
        conn = next(self._conn_ids)
        self._conns.add(conn)
        return conn

    def disconnect(self, conn: int, now: float) -> list[Action]:
        """The connection ended: sessions it owned wait ``reattach_window_s`` for a re-OPEN."""
        self._conns.discard(conn)
        self._proven.discard(conn)
        for sess in self._sessions.values():
            if sess.conn == conn:
                sess.conn = None
                sess.assembler = None
                sess.expires_at = min(sess.expires_at, now + self.spec.reattach_window_s)
        return []

    def is_proven(self, conn: int) -> bool:
        """Whether ``conn`` had an OPEN accepted or pushed a step with a valid hop token."""
        return conn in self._proven

    def owns_sessions(self, conn: int) -> bool:
        """Whether ``conn`` is the owner of a session held now."""
        return any(s.conn == conn for s in self._sessions.values())

    # -- frames in -----------------------------------------------------------------------------

    def handle(self, conn: int, data: bytes, now: float) -> list[Action]:
        """One frame's bytes from ``conn``: the actions that answer it (maybe none yet)."""
        self._frames_in += 1
        try:
            frame = codec.parse_frame(data, self.spec.limits)
        except ProtocolError as exc:
            return [self._error(conn, exc, None, 0)]
        try:
            if codec.is_reply(frame):
                raise BadFrameError(f"a node does not accept {codec.body_kind(frame)!r} frames")
            codec.expect_route(
                frame,
                model_fingerprint=self.spec.model_fingerprint,
                recipe_fingerprint=self.spec.recipe_fingerprint,
                shard_start=self.spec.shard_start,
                shard_end=self.spec.shard_end,
            )
            kind = codec.body_kind(frame)
            if kind == "open":
                return self._open(conn, frame, now)
            return self._existing(conn, frame, kind, now)
        except ProtocolError as exc:
            sess = self._sessions.get(frame.session_id)
            return [self._error(conn, exc, frame, sess.kv_len if sess else 0)]

    def _error(self, conn: int, exc: ProtocolError, frame: frame_pb2.Frame | None, kv_len: int) -> Send:
        name = exc.status_name
        self._errors[name] = self._errors.get(name, 0) + 1
        reply = codec.error_frame(exc, frame, kv_len=kv_len)
        reply.error.session_closed = exc.session_closed
        event(
            log,
            "frame_refused",
            level=logging.DEBUG,
            status=name,
            session_id=frame.session_id if frame else "",
            message=exc.message,
        )
        return self._send(conn, (reply,))

    def _send(self, conn: int, frames: tuple[frame_pb2.Frame, ...], *, replay: bool = False) -> Send:
        self._frames_out += len(frames)
        return Send(conn, frames, replay)

    def _push(
        self, sess: _Session, target: frame_pb2.PushTarget, frames: list[frame_pb2.Frame]
    ) -> Action | None:
        """Frames for ``target``: pushed to its address, or through the owner when it has none."""
        self._frames_pushed += len(frames)
        if target.address:
            return Push(sess.session_id, target, tuple(frames))
        if sess.conn is None:
            return None  # the owner is gone: the step's output waits for a re-attach and a replay
        return self._send(sess.conn, tuple(frames))

    def _header(self, sess: _Session) -> codec.SessionHeader:
        return codec.SessionHeader(
            sess.session_id,
            sess.epoch,
            self.spec.model_fingerprint,
            self.spec.recipe_fingerprint,
            self.spec.shard_start,
            self.spec.shard_end,
        )

    # -- OPEN ----------------------------------------------------------------------------------

    def _open(self, conn: int, frame: frame_pb2.Frame, now: float) -> list[Action]:
        sid = frame.session_id
        sess = self._sessions.get(sid)
        if sess is not None and frame.route_epoch <= sess.epoch:
            if frame.route_epoch == sess.epoch and frame.step_id == sess.last_step_id and sess.last_reply:
                return self._replay(conn, sess)  # a re-sent OPEN
            raise RouteEpochError(
                f"OPEN for an existing session needs an epoch above {sess.epoch}, got {frame.route_epoch}"
            )
        if self.draining:
            raise UnavailableError("node is shutting down", retry_after_ms=0)
        try:
            claim = OpenClaim(int(frame.route_epoch), int(frame.step_id), bytes(frame.open.gateway_proof))
            self._check_ticket(frame.open.route_ticket, sid, claim)
        except ProtocolError as exc:
            # A refused re-attach leaves the existing session as it was (its lease still runs).
            raise TicketInvalidError(exc.message, session_closed=sess is None) from exc
        budget = int(frame.open.kv_budget.max_tokens)
        if budget > self.spec.n_ctx_train:
            raise ContextExceededError(
                f"KV budget of {budget} tokens passes the model's context of {self.spec.n_ctx_train}"
            )
        if budget > self.spec.session_kv_tokens:
            raise ResourceExhaustedError(
                f"KV budget of {budget} tokens asked; this node grants at most "
                f"{self.spec.session_kv_tokens} per session"
            )
        self._check_targets(frame.open)
        sampling = self._sampling(frame.open.sampling)
        max_out = self.spec.limits.max_frame_bytes
        if frame.open.max_frame_bytes:
            max_out = min(max_out, int(frame.open.max_frame_bytes))
        encoding = frame.open.output_encoding or frame_pb2.ENCODING_F32
        block = int(frame.open.output_block_size) or DEFAULT_BLOCK_SIZE
        if sess is not None:
            return self._reattach(conn, frame, sess, encoding, block, max_out, now)
        actions: list[Action] = []
        source, positions, move = self._kv_source(frame.open, budget)
        if source == sid:
            source, positions, move = "", 0, False
        if positions and not move and self.spec.kv_pool_tokens:
            # A copy holds its positions at once: without free blocks for it, the session starts empty
            # (the gateway prefills it whole) rather than preempting anyone for an optimisation.
            free = self.spec.kv_pool_tokens // BLOCK_TOKENS - self._reserved_blocks()
            if blocks_for(positions) > free:
                source, positions, move = "", 0, False
        victims = [sid] if sid in self._kept else []  # a kept session's id opened afresh: its KV goes
        if not move:
            # Kept sessions are given up first (least recently used first) when a new session needs a slot.
            over = len(self._sessions) + len(self._kept) - (self.spec.max_sessions - 1) - len(victims)
            others = self._kept.evictable(spare=(sid, source))  # never the source being copied
            if over > len(others):
                raise ResourceExhaustedError(
                    f"all {self.spec.max_sessions} session slots are in use", retry_after_ms=1000
                )
            victims += others[: max(0, over)]
        for victim in victims:
            actions += self._evict_kept(victim)
        self._closed.pop(sid, None)
        remembered = self._preempted.get(sid)
        sess = _Session(
            session_id=sid,
            conn=conn,
            epoch=int(frame.route_epoch),
            budget=budget,
            sampling=sampling,
            out_encoding=encoding,
            out_block_size=block,
            out_max_frame_bytes=max_out,
            last_step_id=int(frame.step_id),
            expires_at=now + self.spec.idle_lease_s,
            isolated=bool(frame.open.isolated),
            opened_seq=remembered[1] if remembered is not None else next(self._open_order),
        )
        if positions:
            sess.kv_len = positions
            if move:
                kept = self._kept.pop(source)
                assert kept is not None  # _kv_source found it
                sess.history_tokens = kept.history_tokens[:positions]
                sess.first_step, sess.aligned_end = kept.first_step, min(kept.aligned_end, positions)
                if kept.history is not None:
                    self._histories.pop(source, None)
                    sess.history = kept.history
                    self._histories[sid] = None
            else:
                origin = self._sessions.get(source) or self._kept.get(source)
                assert origin is not None  # _kv_source found it
                sess.history_tokens = origin.history_tokens[:positions]
                sess.first_step, sess.aligned_end = origin.first_step, min(origin.aligned_end, positions)
                self._kept.used(source)  # a shared prefix just used: the last kept session to go
            self._reused += positions
        self._configure_push(sess, frame)
        reply = self._ack(frame, sess, reattached=False)
        self._sessions[sid] = sess
        self._proven.add(conn)
        event(
            log,
            "session_opened",
            session_id=sid,
            epoch=sess.epoch,
            kv_budget=budget,
            conn=conn,
            reused_positions=positions or None,
        )
        opened = (
            OpenKv(sid, budget, sampling, source, positions, move)
            if positions
            else OpenKv(sid, budget, sampling)
        )
        return [*actions, opened, self._send(conn, reply)]

    def _kv_source(self, body: frame_pb2.OpenSession, budget: int) -> tuple[str, int, bool]:
        """(source, positions, move) for an OPEN with a KvSource this node can honour, else ("", 0, False)."""
        if not body.HasField("kv_source"):
            return "", 0, False
        source, positions = body.kv_source.session_id, int(body.kv_source.positions)
        if positions < 1 or positions > budget:
            return "", 0, False
        named = parse_source_id(source)
        if named is not None:
            return self._kv_prefix(named[0], named[1], positions)
        kept = self._kept.get(source)
        if kept is not None:
            # A kept source is taken over, or (KvSource.copy: a prefix another request shares) copied
            # and left kept for its owner.
            return (
                (source, positions, not body.kv_source.copy) if kept.kv_len >= positions else ("", 0, False)
            )
        live = self._sessions.get(source)
        if live is not None and live.kv_len >= positions:
            return source, positions, False
        return "", 0, False

    def _kv_prefix(self, hashes: tuple[bytes, ...], step: int, positions: int) -> tuple[str, int, bool]:
        """A KvSource naming a prefix by chain hashes (common.prefix_chain.source_id): a copy of the
        deepest one a kept session holds (node.kept_sessions.KeptSessions.prefix_source); else
        nothing (the session starts empty and the gateway prefills it whole)."""
        found = self._kept.prefix_source(hashes, step, positions)
        if found is None:
            self._prefix_misses += 1
            return "", 0, False
        self._prefix_hits += 1
        return found[0], found[1], False

    def _evict_kept(self, sid: str) -> list[Action]:
        kept = self._kept.pop(sid)
        if kept is None:
            return []
        if kept.history is not None:
            self._history_bytes -= kept.history.nbytes
            kept.history.release()
        self._histories.pop(sid, None)
        self._evictions += 1
        event(log, "kept_session_dropped", session_id=sid, freed_kv_tokens=kept.kv_len)
        return [FreeKv(sid)]

    def _drafter(self, sess: _Session, max_drafts: int, wanted: int) -> SessionDrafter:
        """A speculating session's drafter, with the proposer its request chose (SamplingParams.proposer):
        n-gram lookup, the draft model (n-gram lookup where this node has none: counted and logged), or
        unspecified (or a value this node does not know): the node's own (its draft model and
        --draft-model-choice, else n-gram lookup)."""
        if wanted == frame_pb2.PROPOSER_NGRAM or (
            wanted != frame_pb2.PROPOSER_DRAFT and self._proposers is None
        ):
            kind, drafter = "ngram", SessionDrafter(max_drafts)
        elif self._proposers is None:  # the draft model was asked for
            kind, drafter = "draft_unavailable", SessionDrafter(max_drafts)
            event(
                log,
                "draft_model_unavailable",
                level=logging.WARNING,
                session_id=sess.session_id,
                message="the request asked for the draft model; this node has none: n-gram lookup drafts",
            )
        elif wanted == frame_pb2.PROPOSER_DRAFT:  # the request's choice: the model drafts every window
            kind, drafter = "draft", SessionDrafter(max_drafts, self._proposers, proposer_choice("always"))
        else:
            kind, drafter = "draft", SessionDrafter(max_drafts, self._proposers, self._choice)
        self._spec_proposers[kind] = self._spec_proposers.get(kind, 0) + 1
        return drafter

    def _check_targets(self, body: frame_pb2.OpenSession) -> None:
        if body.HasField("downstream") and self.spec.is_last:
            raise BadFrameError("the last stage has no downstream stage")
        if body.HasField("ring") and not self.spec.is_last:
            raise BadFrameError("only the last stage pushes the next decode step (ring)")

    def _configure_push(self, sess: _Session, frame: frame_pb2.Frame) -> None:
        body = frame.open
        sess.open_step_id = int(frame.step_id)
        sess.downstream = frame_pb2.PushTarget() if body.HasField("downstream") else None
        if sess.downstream is not None:
            sess.downstream.CopyFrom(body.downstream)
        sess.ring = frame_pb2.PushTarget() if body.HasField("ring") else None
        if sess.ring is not None:
            sess.ring.CopyFrom(body.ring)
        sess.upstream_token = bytes(body.upstream_token)
        sess.accepted_end = sess.kv_len
        sess.accepted_step = sess.last_step_id
        sess.window_slack = 0
        max_drafts = min(int(body.speculation.max_drafts), self.spec.max_draft_tokens)
        if not (self.spec.is_last and sess.ring is not None and max_drafts > 0 and not sess.sampling.grammar):
            sess.drafter = None  # grammar sessions never speculate: the grammar cannot roll back
        elif sess.drafter is None or sess.drafter.policy.max_k != max_drafts:
            sess.drafter = self._drafter(sess, max_drafts, int(body.sampling.proposer))
        # A new epoch starts with one window at a time again: its first decode step comes from the
        # gateway (window number 0), and the last stage's numbers start over.
        sess.window_gen = sess.spec_floor = 0
        sess.flight = []
        direct = sess.ring is not None and bool(sess.ring.address)  # through the gateway: one at a time
        sess.flight_limit = self.spec.windows_in_flight if sess.drafter is not None and direct else 1
        limit = 0 if self.spec.is_last else min(int(body.history_bytes), self.spec.max_history_bytes)
        if sess.history is not None and sess.history.limit != limit:
            self._drop_history(sess)
        if limit > 0:
            if sess.history is None:
                sess.history = _History(limit)
                self._histories[sess.session_id] = None
            before = sess.history.nbytes
            sess.history.truncate(sess.kv_len)
            self._history_bytes += sess.history.nbytes - before

    def _reattach(
        self,
        conn: int,
        frame: frame_pb2.Frame,
        sess: _Session,
        encoding: frame_pb2.Encoding,
        block: int,
        max_out: int,
        now: float,
    ) -> list[Action]:
        if sess.busy_job is not None:
            raise ResourceExhaustedError(
                "a step of this session is still running; re-send the OPEN shortly",
                retry=status_pb2.RETRY_SAME,
                retry_after_ms=self.spec.busy_retry_after_ms,
            )
        keep = int(frame.expected_kv_len)
        actions: list[Action] = []
        self._drop_pending(sess)
        if keep < sess.kv_len:
            actions.append(TruncateKv(sess.session_id, keep))
            sess.kv_len = keep
            del sess.history_tokens[keep:]
            sess.aligned_end = min(sess.aligned_end, keep)
        sess.conn = conn
        self._proven.add(conn)
        sess.epoch = int(frame.route_epoch)
        sess.isolated = bool(frame.open.isolated)
        # The KV budget and the sampling settings were fixed when the engine opened the sequence; a
        # re-attach keeps them (the ack reports the budget that holds).
        sess.out_encoding, sess.out_block_size, sess.out_max_frame_bytes = encoding, block, max_out
        sess.last_step_id = int(frame.step_id)
        sess.assembler = None
        sess.ignore_step = 0
        sess.expires_at = now + self.spec.idle_lease_s
        self._configure_push(sess, frame)
        reply = self._ack(frame, sess, reattached=True)
        event(
            log,
            "session_reattached",
            session_id=sess.session_id,
            epoch=sess.epoch,
            kv_len=sess.kv_len,
            conn=conn,
        )
        actions.append(self._send(conn, reply))
        return actions

    def _ack(
        self, frame: frame_pb2.Frame, sess: _Session, *, reattached: bool
    ) -> tuple[frame_pb2.Frame, ...]:
        reply = codec.open_ack_frame(
            frame,
            kv_len=sess.kv_len,
            node_id=self.spec.node_id,
            kv_tokens_granted=sess.budget,
            max_frame_bytes=self.spec.limits.max_frame_bytes,
            max_step_tokens=self.spec.limits.max_step_tokens,
            reattached=reattached,
        )
        sess.last_reply = (reply,)
        return (reply,)

    def _sampling(self, params: frame_pb2.SamplingParams) -> SamplingParams:
        s = codec.sampling_settings(params)
        if not self.spec.is_last:
            return SamplingParams()
        if s.temperature > 100:
            raise BadFrameError("sampling: temperature must be <= 100")
        if s.min_p >= 1:
            raise BadFrameError("sampling: min_p must be < 1")
        if s.seed >= 2**63:
            raise BadFrameError("sampling: seed must be < 2**63")
        if s.repetition_penalty > 10:
            raise BadFrameError("sampling: repetition_penalty must be <= 10")
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=s.seed,
            repetition_penalty=s.repetition_penalty,
            penalty_last_n=s.penalty_last_n,
            top_logprobs=s.n_top_logprobs,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            logit_bias=s.logit_bias,
            grammar=s.grammar,
            completion_start=s.completion_start,
            choices=s.choices,
        )

    # -- frames of an existing session ----------------------------------------------------------

    def _existing(self, conn: int, frame: frame_pb2.Frame, kind: str | None, now: float) -> list[Action]:
        sid = frame.session_id
        sess = self._sessions.get(sid)
        if sess is None:
            closed = self._closed.get(sid)
            if closed is None:
                raise UnknownSessionError(f"no session {sid!r} on this node")
            if kind == "cancel":
                return [self._send(conn, (codec.closed_frame(frame, freed_kv_tokens=0),))]
            if kind == "release" and frame.step_id == closed.last_step_id and closed.reply:
                self._replays += 1
                return [self._send(conn, closed.reply, replay=True)]
            if frame.HasField("chunk") and frame.chunk.index > 0:
                return []  # the rest of a step whose first chunk was already refused
            if closed.reason == "preempted":
                # A frame sent before the owner read the preemption notice: answer it as the notice
                # did, so the owner resumes the session instead of taking this node for failed.
                raise PreemptedError(
                    f"session {sid!r} was preempted here: its KV was freed for an older session"
                )
            raise SessionClosedError(f"session {sid!r} was {closed.reason}")
        owner = conn == sess.conn
        if frame.route_epoch != sess.epoch:
            # Before the sender check: a step pushed in an older epoch is stale, not forged.
            raise RouteEpochError(
                f"frame of route epoch {frame.route_epoch}; the session is at epoch {sess.epoch}"
            )
        if not owner:
            self._check_sender(frame, kind, sess)
            self._proven.add(conn)  # it holds the session's hop token: the upstream stage
        if kind == "cancel":
            return self._close(conn, frame, sess, "cancelled", now)
        if kind == "replay":
            return self._replay_history(conn, frame, sess)
        head = False
        if kind == "activation" and frame.activation.window_gen:
            gen = int(frame.activation.window_gen)
            if gen < sess.window_gen:
                # A window discarded by a later head (windows in flight): it arrives after the stage
                # that discarded it moved on, and is dropped unanswered, without touching the KV.
                self._stale_windows += 1
                return []
            head = gen > sess.window_gen
        reply_conn = conn if owner else sess.conn
        if head:
            return self._step(conn, frame, sess, now, head=True)
        if frame.step_id == sess.last_step_id:
            if frame.HasField("chunk") and frame.chunk.index > 0:
                return []  # chunks after chunk 0 of a replayed step
            if kind == "activation" and frame.HasField("chunk"):
                sess.ignore_step = int(frame.step_id)
            return [] if reply_conn is None else self._replay(reply_conn, sess)
        if frame.step_id < sess.last_step_id:
            raise StepConflictError(
                f"step id {frame.step_id} is not above the last applied {sess.last_step_id}"
            )
        if kind == "release":
            return self._close(conn, frame, sess, "released", now)
        return self._step(conn, frame, sess, now)

    def _check_sender(self, frame: frame_pb2.Frame, kind: str | None, sess: _Session) -> None:
        """A frame from a connection that does not own the session: only a step pushed with the token."""
        if kind != "activation":
            raise TicketInvalidError(
                f"only the connection that opened session {sess.session_id!r} may send "
                f"{kind!r} frames for it",
                session_closed=False,
            )
        token = bytes(frame.activation.hop_token)
        if not sess.upstream_token or not hmac.compare_digest(token, sess.upstream_token):
            raise TicketInvalidError(
                "a step from another connection needs the session's hop token", session_closed=False
            )

    def _replay(self, conn: int, sess: _Session) -> list[Action]:
        self._replays += 1
        frames = []
        for cached in sess.last_reply:
            copy = frame_pb2.Frame()
            copy.CopyFrom(cached)
            copy.route_epoch = sess.epoch
            frames.append(copy)
        return [self._send(conn, tuple(frames), replay=True)]

    def _close(
        self, conn: int, frame: frame_pb2.Frame, sess: _Session, reason: str, now: float
    ) -> list[Action]:
        actions: list[Action] = []
        if sess.busy_job is not None:
            actions.append(Drop(sess.busy_job))
            self._jobs.pop(sess.busy_job, None)  # its result is dropped, never sent
        freed = sess.kv_len
        keep = 0
        if reason == "released" and frame.release.keep_ms and self.spec.max_kept_sessions > 0:
            keep = min(int(frame.release.keep_positions), sess.kv_len, self._kept.max_positions)
        if keep > 0:
            actions += self._keep(sess, keep, now + min(frame.release.keep_ms / 1000, self.spec.max_keep_s))
            freed -= keep
        else:
            self._forget(sess)
            actions.append(FreeKv(sess.session_id))
        reply = (codec.closed_frame(frame, freed_kv_tokens=freed),)
        self._remember_closed(sess.session_id, _Closed(reason, int(frame.step_id), reply))
        event(log, f"session_{reason}", session_id=sess.session_id, freed_kv_tokens=freed)
        actions.append(self._send(conn, reply))
        return actions

    def _keep(self, sess: _Session, positions: int, until: float) -> list[Action]:
        """RELEASE with keep_ms: the session's first ``positions`` stay on the engine until ``until``."""
        sid = sess.session_id
        self._drop_pending(sess)
        history = sess.history
        if history is not None:
            before = history.nbytes
            history.truncate(positions)
            self._history_bytes += history.nbytes - before
        self._sessions.pop(sid, None)
        entry = _Kept(
            sid,
            positions,
            sess.history_tokens[:positions],
            history,
            until,
            sess.first_step,
            min(sess.aligned_end, positions),
        )
        over = self._kept.keep(sid, entry, entry.history_tokens)
        actions: list[Action] = [TruncateKv(sid, positions)]
        for victim in over:
            actions += self._evict_kept(victim)
        event(log, "session_kept", session_id=sid, kept_kv_tokens=positions)
        return actions

    def _forget(self, sess: _Session) -> None:
        """Drop a session's state (its KV is freed by the caller's FreeKv)."""
        self._drop_pending(sess)
        self._drop_history(sess)
        self._sessions.pop(sess.session_id, None)

    def _remember_closed(self, sid: str, closed: _Closed) -> None:
        self._closed[sid] = closed
        self._closed.move_to_end(sid)
        while len(self._closed) > MAX_CLOSED_REMEMBERED:
            self._closed.popitem(last=False)

    # -- pending steps and kept outputs -----------------------------------------------------------

    def _drop_pending(self, sess: _Session) -> None:
        for p in sess.pending:
            self._pending_bytes -= p.nbytes
        sess.pending.clear()
        sess.accepted_end = sess.kv_len
        sess.accepted_step = sess.last_step_id

    def _drop_history(self, sess: _Session) -> None:
        if sess.history is not None:
            self._history_bytes -= sess.history.nbytes
            sess.history.release()
            sess.history = None
        self._histories.pop(sess.session_id, None)

    def _keep_output(
        self, sess: _Session, start: int, rows: npt.NDArray[np.float32], tokens: npt.NDArray[np.int32]
    ) -> None:
        history = sess.history
        if history is None:
            return
        before = history.nbytes
        history.add(start, rows, tokens)
        self._history_bytes += history.nbytes - before
        self._histories.move_to_end(sess.session_id)
        while self._history_bytes > self.spec.max_history_total_bytes and self._histories:
            oldest = next(iter(self._histories))
            victim = self._sessions.get(oldest) or self._kept.get(oldest)
            self._histories.pop(oldest)
            if victim is not None and victim.history is not None:
                self._history_bytes -= victim.history.nbytes
                victim.history.release()
                victim.history.overflowed = True

    def _replay_history(self, conn: int, frame: frame_pb2.Frame, sess: _Session) -> list[Action]:
        """REPLAY: push the kept outputs of [0, end) to the new downstream, as replayed steps."""
        body = frame.replay
        end = int(body.end)
        history = sess.history
        if history is None or not history.covers(end):
            kept = "none" if history is None or history.overflowed else f"[0, {history.end})"
            raise NoHistoryError(f"outputs of [0, {end}) were not kept here (kept: {kept})")
        if end > sess.kv_len:
            raise PositionMismatchError(f"replay up to {end}; this stage holds {sess.kv_len} positions")
        header = codec.target_header(self._header(sess), body.target)
        frames: list[frame_pb2.Frame] = []
        steps = 0
        for start in range(0, end, int(body.step_tokens)):
            stop = min(end, start + int(body.step_tokens))
            rows, tokens = history.span(start, stop)
            frames += codec.step_frames(
                header,
                frame_pb2.PHASE_PREFILL,
                step_id=sess.open_step_id + start + 1,
                start=start,
                token_ids=tokens.tolist() if len(tokens) == len(rows) else None,
                hidden=rows,
                hop_token=body.target.hop_token,
                replay=True,
                max_frame_bytes=self.spec.limits.max_frame_bytes,
            )
            steps += 1
        actions: list[Action] = []
        pushed = self._push(sess, body.target, frames)
        if pushed is not None:
            actions.append(pushed)
        ack = codec.replay_ack_frame(frame, kv_len=sess.kv_len, steps=steps, positions=end)
        actions.append(self._send(conn, (ack,)))
        event(log, "history_replayed", session_id=sess.session_id, positions=end, steps=steps)
        return actions

    # -- steps -----------------------------------------------------------------------------------

    def _step(
        self, conn: int, frame: frame_pb2.Frame, sess: _Session, now: float, *, head: bool = False
    ) -> list[Action]:
        chunked = frame.HasField("chunk")
        first_chunk = not chunked or frame.chunk.index == 0
        actions: list[Action] = []
        if sess.assembler is not None and (first_chunk or frame.step_id != sess.assembling_step):
            # The step being assembled was abandoned: a retry of it (chunk 0 again) starts afresh
            # silently; anything else ends it with one CHUNK_SEQUENCE reply for that step.
            abandoned = sess.assembling_first
            same_retry = frame.step_id == sess.assembling_step and first_chunk
            sess.assembler = None
            sess.assembling_first = None
            if abandoned is not None and not same_retry:
                actions.append(
                    self._error(
                        conn,
                        ChunkSequenceError(f"step {sess.assembling_step} abandoned before its last chunk"),
                        abandoned,
                        sess.kv_len,
                    )
                )
        if not first_chunk and sess.assembler is None:
            if frame.step_id == sess.ignore_step:
                return actions  # rest of an attempt that was already answered
            sess.ignore_step = int(frame.step_id)
            actions.append(
                self._error(
                    conn,
                    ChunkSequenceError(f"chunk {frame.chunk.index} of step {frame.step_id} without chunk 0"),
                    frame,
                    sess.kv_len,
                )
            )
            return actions
        try:
            step = self._assemble(frame, sess, first_chunk, head)
        except ProtocolError as exc:
            sess.assembler = None
            sess.assembling_first = None
            if chunked:
                sess.ignore_step = int(frame.step_id)
            actions.append(self._error(conn, exc, frame, sess.kv_len))
            return actions
        if step is None:
            return actions
        sess.assembler = None
        sess.assembling_first = None
        try:
            actions += self._accept(conn, frame, step, sess, now, head)
        except ProtocolError as exc:
            if chunked:
                sess.ignore_step = int(frame.step_id)
            actions.append(self._error(conn, exc, frame, sess.kv_len))
        return actions

    def _assemble(
        self, frame: frame_pb2.Frame, sess: _Session, first_chunk: bool, head: bool = False
    ) -> codec.Step | None:
        if head:
            # A new head (windows in flight): its step id may repeat a discarded window's.
            if not self._head_fits(frame, sess):
                raise PositionMismatchError(
                    f"window {frame.activation.window_gen} starts at {frame.expected_kv_len}; the node "
                    f"holds {sess.kv_len}, may drop down to {self._head_floor(sess)} and has steps queued "
                    f"up to {sess.accepted_end}"
                )
        elif first_chunk:
            if frame.step_id <= sess.accepted_step:
                raise ResourceExhaustedError(
                    f"step {frame.step_id} is already queued or running on this node",
                    retry=status_pb2.RETRY_SAME,
                    retry_after_ms=self.spec.busy_retry_after_ms,
                )
            if frame.expected_kv_len != sess.accepted_end and not self._may_roll_back(frame, sess):
                raise PositionMismatchError(
                    f"step expects KV length {frame.expected_kv_len}; the node holds {sess.kv_len}"
                    + (
                        f" and has steps queued up to {sess.accepted_end}"
                        if sess.accepted_end != sess.kv_len
                        else ""
                    )
                )
        if frame.positions.end > sess.budget:
            raise ContextExceededError(
                f"position {frame.positions.end} passes the session's KV budget of {sess.budget}"
            )
        if first_chunk:
            sess.assembler = codec.StepAssembler(self.spec.limits)
            sess.assembling_step = int(frame.step_id)
            sess.assembling_first = frame
        assert sess.assembler is not None  # set just above for chunk 0; checked by the caller otherwise
        return sess.assembler.add(frame)

    def _head_floor(self, sess: _Session) -> int:
        """The lowest position a new head may start at: its predecessor's start + 1 (the positions after
        a head are drafts until verified); before the first head, nothing may go."""
        return sess.spec_floor if sess.window_gen else sess.accepted_end

    def _head_fits(self, frame: frame_pb2.Frame, sess: _Session) -> bool:
        """A new head (a higher window number) starts inside the drafts since the last head, and every
        step the session still computes or queues is a discarded window: an older number, at or after
        the head's start. Nothing accepted is ever dropped, nothing is computed on a wrong position."""
        start = int(frame.expected_kv_len)
        gen = int(frame.activation.window_gen)
        if frame.phase != frame_pb2.PHASE_DECODE or not self._head_floor(sess) <= start <= sess.accepted_end:
            return False
        waiting = [p.step for p in sess.pending]
        if sess.busy_step is not None:
            waiting.append(sess.busy_step)
        return all(0 < s.window_gen < gen and s.start >= start for s in waiting)

    def _roll_back(self, sess: _Session, position: int) -> list[Action]:
        """Drop KV positions from ``position`` on, with the token record and the kept outputs."""
        actions: list[Action] = []
        if position < sess.kv_len:
            actions.append(TruncateKv(sess.session_id, position))
            sess.kv_len = position
        del sess.history_tokens[position:]
        sess.aligned_end = min(sess.aligned_end, position)
        if sess.history is not None:
            before = sess.history.nbytes
            sess.history.truncate(position)
            self._history_bytes += sess.history.nbytes - before
        return actions

    def _may_roll_back(self, frame: frame_pb2.Frame, sess: _Session) -> bool:
        """A DECODE step that starts inside the previous window's drafts: those were rejected.

        Bounded to the previous window (``window_slack``) and only on an idle session, so a step
        never drops an accepted position or one that is still being computed.
        """
        drop = sess.accepted_end - int(frame.expected_kv_len)
        return (
            frame.phase == frame_pb2.PHASE_DECODE
            and 0 < drop <= sess.window_slack
            and sess.busy_job is None
            and not sess.pending
        )

    def _accept(
        self,
        conn: int,
        frame: frame_pb2.Frame,
        step: codec.Step,
        sess: _Session,
        now: float,
        head: bool = False,
    ) -> list[Action]:
        """A whole step passed every check: compute it now, or queue it behind the running one.

        A step that starts inside the previous window's drafts drops them first (speculation: the KV
        is cut back to the step's start); so does a new head of windows in flight (``head``: a higher
        window number, :meth:`_head_fits`), after the step still computing, if any. With a KV pool,
        room for the step's growth is made next (:meth:`_make_room`): it may preempt younger
        sessions, refuse the step (RESOURCE_EXHAUSTED, retry SAME) or preempt this session."""
        job: StepJob | None = None
        nbytes = 0
        rollback: list[Action] = []
        queued_rollback = False
        if head:
            # Windows in flight: the discarded windows queued here go unanswered; one still computing
            # finishes (its output is a discarded window downstream too), and the KV goes back to the
            # head's start before the head computes.
            self._job(step, sess, check_queue=sess.busy_job is None)  # its checks first
            for p in sess.pending:
                self._pending_bytes -= p.nbytes
            sess.pending.clear()
            if sess.busy_job is None:
                rollback += self._roll_back(sess, step.start)
            else:
                queued_rollback = True
            sess.accepted_end = step.start
        elif step.start < sess.accepted_end:  # _may_roll_back allowed it: drop the rejected drafts
            self._job(step, sess, check_queue=True)  # its checks first: a refusal changes nothing
            rollback.append(TruncateKv(sess.session_id, step.start))
            sess.kv_len = sess.accepted_end = step.start
            del sess.history_tokens[step.start :]
            sess.aligned_end = min(sess.aligned_end, step.start)
        if sess.busy_job is None:
            job = self._job(step, sess, check_queue=True)
        else:
            self._job(step, sess, check_queue=False)  # the same checks now, so a refusal is immediate
            nbytes = sum(int(t.nbytes) for t in step.tensors.values())
            # A replay (a replaced stage catching up) arrives all at once: its steps are bounded by the
            # session's KV budget (positions must follow on) and by the bytes bound, not by the count.
            if not step.replay and len(sess.pending) >= self.spec.max_pending_steps:
                raise ResourceExhaustedError(
                    f"{len(sess.pending)} steps of this session are already waiting here",
                    retry=status_pb2.RETRY_SAME,
                    retry_after_ms=self.spec.busy_retry_after_ms,
                )
            if self._pending_bytes + nbytes > self.spec.max_pending_bytes:
                raise ResourceExhaustedError(
                    "this node's queue of waiting steps is full",
                    retry=status_pb2.RETRY_SAME,
                    retry_after_ms=self.spec.busy_retry_after_ms,
                )
        made, proceed = self._make_room(sess, step.end, frame)
        actions = [*rollback, *made]
        if not proceed:
            return actions  # a head refused here is a head again when it is sent again
        if head:
            sess.window_gen = step.window_gen
            sess.spec_floor = step.start + 1
        if job is not None:
            self._run(sess, job, step, frame, conn)
            actions.append(Compute(job))
        else:
            sess.pending.append(_Pending(step, frame, conn, nbytes, queued_rollback))
            self._pending_bytes += nbytes
        sess.accepted_end = step.end
        sess.accepted_step = step.step_id
        sess.window_slack = step.drafts
        if not step.window_gen:
            sess.spec_floor = step.end  # a step outside windows in flight is never dropped by a head
        sess.expires_at = now + self.spec.idle_lease_s
        return actions

    # -- the KV pool: room, preemption ------------------------------------------------------------

    def _reserved_blocks(self) -> int:
        """Blocks the pool must hold: every session's KV once its accepted steps ran, and kept sessions.
        Never less than the engine's own count (node.kvpool), which grows only as steps run."""
        live = sum(blocks_for(s.accepted_end) for s in self._sessions.values())
        return live + self._kept.blocks()

    def _preemption_count(self, sid: str) -> int:
        remembered = self._preempted.get(sid)
        return remembered[0] if remembered is not None else 0

    def _make_room(self, sess: _Session, end: int, frame: frame_pb2.Frame) -> tuple[list[Action], bool]:
        """Room in the pool for ``sess`` to grow to ``end`` positions: (actions, whether the step runs).

        Free blocks first, then kept sessions (oldest first: nobody waits on them), then the plan of
        :func:`node.preemption.choose_victims` -- the youngest sessions, or this one when it is the
        youngest. When nothing can make room the step is refused (RESOURCE_EXHAUSTED, retry SAME after
        ``kv_retry_after_ms``) and nothing is freed. Errors go to the session's owner (the gateway),
        also for a step pushed by the previous stage: a refusal on a push stream would read as that
        stage's push failing."""
        if not self.spec.kv_pool_tokens:
            return [], True
        need = blocks_for(end) - blocks_for(sess.accepted_end)
        free = self.spec.kv_pool_tokens // BLOCK_TOKENS - self._reserved_blocks()
        if need <= free:
            return [], True
        kept = self._kept.blocks()
        holders = [
            Holder(
                s.session_id, s.opened_seq, blocks_for(s.accepted_end), self._preemption_count(s.session_id)
            )
            for s in self._sessions.values()
        ]
        plan = choose_victims(
            holders,
            requester=sess.session_id,
            requester_opened_seq=sess.opened_seq,
            need_blocks=need,
            free_blocks=free + kept,
            max_preemptions=self.spec.max_preemptions,
            requester_preemptions=self._preemption_count(sess.session_id),
        )
        if need > free + kept and not plan.preempts:
            self._kv_refusals += 1
            refusal = ResourceExhaustedError(
                f"the KV pool has {max(0, free)} free blocks of {BLOCK_TOKENS} positions; "
                f"{end - sess.accepted_end} more positions need {need} and no session can be preempted",
                retry=status_pb2.RETRY_SAME,
                retry_after_ms=self.spec.kv_retry_after_ms,
            )
            event(log, "kv_pool_refused", session_id=sess.session_id, need_blocks=need, free_blocks=free)
            return ([] if sess.conn is None else [self._error(sess.conn, refusal, frame, sess.kv_len)]), False
        actions: list[Action] = []
        while need > free and sess.session_id not in plan.victims:
            oldest = self._kept.oldest()
            if oldest is None:
                break
            entry = self._kept.get(oldest)
            free += blocks_for(entry.kv_len) if entry is not None else 0
            actions += self._evict_kept(oldest)
        if need <= free:
            return actions, True
        for victim in plan.victims:
            if victim == sess.session_id:
                return actions + self._preempt(sess, frame), False
            actions += self._preempt(self._sessions[victim], None)
        return actions, True

    def _preempt(self, sess: _Session, frame: frame_pb2.Frame | None) -> list[Action]:
        """Free ``sess``'s KV for an older session and tell its owner (PREEMPTED, RETRY_RESUME, closed).

        ``frame``: the session's own refused step when it is the one that yields (the answer echoes
        it); else an unsolicited notice."""
        sid = sess.session_id
        count = self._preemption_count(sid) + 1
        self._preempted[sid] = (count, sess.opened_seq)
        self._preempted.move_to_end(sid)
        while len(self._preempted) > MAX_CLOSED_REMEMBERED:
            self._preempted.popitem(last=False)
        self._preemptions += 1
        actions: list[Action] = []
        if sess.busy_job is not None:
            actions.append(Drop(sess.busy_job))
            self._jobs.pop(sess.busy_job, None)  # its result is dropped, never sent
        conn, freed = sess.conn, sess.kv_len
        exc = PreemptedError(
            f"this node's KV pool ran out: the session's KV was freed for an older session "
            f"(preempted {count} time(s) here; at most {self.spec.max_preemptions})"
        )
        self._forget(sess)
        self._remember_closed(sid, _Closed("preempted", sess.last_step_id, ()))
        actions.append(FreeKv(sid))
        if conn is not None:
            if frame is not None:
                actions.append(self._error(conn, exc, frame, 0))
            else:
                notice = self._header(sess).frame(
                    frame_pb2.PHASE_UNSPECIFIED, step_id=sess.last_step_id, kv_len=0
                )
                notice.error.CopyFrom(error_body(exc))
                notice.error.session_closed = True
                self._errors[exc.status_name] = self._errors.get(exc.status_name, 0) + 1
                actions.append(self._send(conn, (notice,)))
        event(log, "session_preempted", session_id=sid, freed_kv_tokens=freed, times=count)
        return actions

    def _run(self, sess: _Session, job: StepJob, step: codec.Step, frame: frame_pb2.Frame, conn: int) -> None:
        sess.busy_job = job.job_id
        sess.busy_step = step
        sess.busy_frame = frame
        sess.busy_conn = conn
        self._jobs[job.job_id] = sess.session_id

    def _start_next(self, sess: _Session) -> list[Action]:
        """The step waiting behind the one that just finished, if any, goes to the engine."""
        if not sess.pending or sess.busy_job is not None:
            return []
        p = sess.pending.pop(0)
        self._pending_bytes -= p.nbytes
        actions = self._roll_back(sess, p.step.start) if p.rollback else []
        job = self._job(p.step, sess, check_queue=False)
        self._run(sess, job, p.step, p.frame, p.conn)
        return [*actions, Compute(job)]

    def _job(self, step: codec.Step, sess: _Session, *, check_queue: bool) -> StepJob:
        n = step.n_tokens
        tokens: npt.NDArray[np.int32] | None = None
        hidden: npt.NDArray[np.float32] | None = None
        extra = set(step.tensors) - {codec.HIDDEN}
        if extra:
            raise ShapeError(f"unexpected tensors {sorted(extra)}; this node takes {codec.HIDDEN!r} only")
        if self.spec.is_first:
            if len(step.token_ids) != n:
                raise ShapeError("the first stage takes token ids, one per position")
            if step.tensors:
                raise ShapeError("the first stage takes token ids, not hidden states")
            if int(step.token_ids.max()) >= self.spec.n_vocab:
                raise ShapeError(f"token id outside the vocabulary [0, {self.spec.n_vocab})")
            tokens = step.token_ids
        else:
            h = step.tensors.get(codec.HIDDEN)
            if h is None:
                raise ShapeError(f"this stage takes a {codec.HIDDEN!r} tensor [n_tokens, {self.spec.n_embd}]")
            if h.ndim != 2 or h.shape[1] != self.spec.n_embd:
                raise ShapeError(
                    f"hidden states of shape {list(h.shape)}; this node needs [n, {self.spec.n_embd}]"
                )
            if not np.isfinite(h).all():
                raise ShapeError("hidden states contain NaN or infinity")
            hidden = np.ascontiguousarray(h, dtype=np.float32)
        if step.drafts and self.spec.is_last and sess.sampling.grammar:
            raise BadFrameError("a grammar-constrained session takes no drafted tokens")
        history: npt.NDArray[np.int32] | None = None
        if self.spec.is_last and sess.sampling.needs_history:
            history = np.asarray([*sess.history_tokens, *step.token_ids.tolist()], dtype=np.int32)
        if check_queue and len(self._jobs) >= self.spec.max_queued_steps:
            raise ResourceExhaustedError(
                f"step queue full ({self.spec.max_queued_steps} steps)",
                retry=status_pb2.RETRY_SAME,
                retry_after_ms=self.spec.busy_retry_after_ms,
            )
        return StepJob(
            job_id=next(self._job_ids),
            session_id=sess.session_id,
            start=step.start,
            tokens=tokens,
            hidden=hidden,
            sample=step.sample and self.spec.is_last and not step.replay,
            history=history,
            is_decode=step.phase == frame_pb2.PHASE_DECODE,
            token_ids=step.token_ids,
            isolated=sess.isolated,
            drafts=step.drafts if self.spec.is_last else 0,
        )

    # -- outcomes ----------------------------------------------------------------------------------

    def complete(self, outcome: StepOutcome, now: float) -> list[Action]:
        """A job finished on the engine: its reports and pushes, then the next waiting step."""
        sid = self._jobs.pop(outcome.job_id, None)
        sess = self._sessions.get(sid) if sid is not None else None
        if (
            sess is None
            or sess.busy_job != outcome.job_id
            or sess.busy_step is None
            or sess.busy_frame is None
        ):
            return []  # cancelled or released meanwhile
        step, frame = sess.busy_step, sess.busy_frame
        sess.busy_job = sess.busy_step = sess.busy_frame = None
        # A session whose stream ended while the step ran keeps only its re-attach window.
        sess.expires_at = now + (
            self.spec.idle_lease_s if sess.conn is not None else self.spec.reattach_window_s
        )
        sess.kv_len = outcome.kv_len
        if outcome.error_status is not None:
            return self._failed_step(sess, step, frame, outcome)
        try:
            actions = self._outputs(sess, step, outcome, now)
        except ProtocolError as exc:
            # Could not encode the output (e.g. f16 overflow): the KV advanced, so report it as applied
            # but failed; the gateway re-opens to truncate.
            self._drop_pending(sess)
            err = InternalError(f"cannot encode the step's output: {exc.message}", session_closed=False)
            return [] if sess.conn is None else [self._error(sess.conn, err, frame, sess.kv_len)]
        sess.last_step_id = step.step_id
        applied = sess.kv_len - step.start
        if len(step.token_ids) and (self.spec.is_last or len(sess.history_tokens) == step.start):
            # A window keeps only its accepted positions (_outputs truncated the KV to them).
            sess.history_tokens.extend(step.token_ids[:applied].tolist())
        if step.start == 0 and applied > 0:
            sess.first_step = sess.aligned_end = applied
        elif applied == sess.first_step and step.start == sess.aligned_end and sess.first_step > 0:
            sess.aligned_end += applied
        return actions + self._start_next(sess)

    def _failed_step(
        self, sess: _Session, step: codec.Step, frame: frame_pb2.Frame, outcome: StepOutcome
    ) -> list[Action]:
        self._drop_pending(sess)  # they follow a step that did not happen
        cls = error_class(getattr(status_pb2, f"STATUS_{outcome.error_status}", status_pb2.STATUS_INTERNAL))
        if outcome.error_status == "UNKNOWN_SESSION":  # the engine lost the sequence: drop ours too
            conn = sess.conn
            actions = self.fail_session(sess.session_id, outcome.error_message or "engine lost the session")
            lost = cls(outcome.error_message or "the engine lost this session", session_closed=True)
            return actions + ([] if conn is None else [self._error(conn, lost, frame, 0)])
        # The engine rolled the step back; the session is intact and the step may be retried.
        exc = cls(outcome.error_message or outcome.error_status or "INTERNAL", session_closed=False)
        if step.n_frames > 1:
            sess.ignore_step = step.step_id
        return [] if sess.conn is None else [self._error(sess.conn, exc, frame, sess.kv_len)]

    def _outputs(self, sess: _Session, step: codec.Step, outcome: StepOutcome, now: float) -> list[Action]:
        """What a finished step sends: a report or result to the owner, pushes to the next stage."""
        actions: list[Action] = []
        owner = sess.conn
        if self.spec.is_last:
            sampled = []
            produced: tuple[Sampled, ...] = ()
            if step.drafts:
                produced = self._verify_window(sess, step, outcome, actions)
            elif outcome.sampled is not None:
                produced = (outcome.sampled, *outcome.sampled.choices)
            if produced:
                for s in produced:
                    token = frame_pb2.SampledToken(
                        token_id=s.token_id, logprob=s.logprob, end_of_generation=s.end_of_generation
                    )
                    token.top_logprobs.extend(
                        frame_pb2.TokenLogprob(token_id=t, logprob=p) for t, p in s.top_logprobs
                    )
                    sampled.append(token)
            replies = codec.result_frames(
                step, kv_len=sess.kv_len, sampled=sampled, compute_us=outcome.compute_us
            )
            sess.last_reply = tuple(replies)
            if owner is not None:
                actions.append(self._send(owner, tuple(replies)))
            ring = sess.ring
            drawn = produced[-1] if step.drafts and produced else outcome.sampled
            nxt = sess.kv_len if step.drafts else step.end  # the drawn token's position
            if sess.flight_limit > 1:
                return actions + self._fly(sess, step, drawn, nxt, now)
            if (
                ring is not None
                and drawn is not None
                and not drawn.end_of_generation
                and nxt + 1 <= sess.budget
            ):
                # The next decode step goes straight to the first stage: step ids follow positions. A
                # speculating session sends a window: the token and the drafts that may follow it.
                drafts: tuple[int, ...] = ()
                if sess.drafter is not None and len(self._sessions) <= self.spec.speculate_max_sessions:
                    drafts = sess.drafter.drafts(
                        sess.history_tokens,
                        step.token_ids[: nxt - step.start].tolist(),
                        drawn.token_id,
                        sess.budget - nxt - 1,
                        now,
                    )
                frames = codec.step_frames(
                    codec.target_header(self._header(sess), ring),
                    frame_pb2.PHASE_DECODE,
                    step_id=sess.open_step_id + nxt + 1,
                    start=nxt,
                    token_ids=[drawn.token_id, *drafts],
                    sample=True,
                    hop_token=ring.hop_token,
                    max_frame_bytes=self.spec.limits.max_frame_bytes,
                    drafts=len(drafts),
                )
                pushed = self._push(sess, ring, frames)
                if pushed is not None:
                    actions.append(pushed)
            return actions
        hidden = outcome.hidden
        if hidden is None:
            raise InternalError("a stage before the last produced no hidden states")
        digest = codec.output_digest(hidden)
        target = sess.downstream
        if target is None:  # no push: the outputs go back to the owner, as in schema 1
            replies = codec.result_frames(
                step,
                kv_len=sess.kv_len,
                hidden=hidden,
                compute_us=outcome.compute_us,
                digest=digest,
                encoding=sess.out_encoding,
                block_size=sess.out_block_size,
                max_frame_bytes=sess.out_max_frame_bytes,
            )
            sess.last_reply = tuple(replies)
            return [] if owner is None else [self._send(owner, tuple(replies))]
        tokens = step.token_ids
        frames = codec.step_frames(
            codec.target_header(self._header(sess), target),
            step.phase,
            step_id=step.step_id,
            start=step.start,
            token_ids=tokens.tolist() if len(tokens) else None,
            hidden=hidden,
            sample=step.sample,
            encoding=sess.out_encoding,
            block_size=sess.out_block_size,
            hop_token=target.hop_token,
            max_frame_bytes=self.spec.limits.max_frame_bytes,
            drafts=step.drafts,
            window_gen=step.window_gen,
        )
        if sess.history is not None:
            # Keep what the next stage received (decoded again when the encoding is lossy).
            kept = (
                hidden
                if sess.out_encoding == frame_pb2.ENCODING_F32
                else codec.reassemble(frames).tensors[codec.HIDDEN]
            )
            self._keep_output(sess, step.start, kept, tokens)
        if not step.replay:
            pushed = self._push(sess, target, frames)
            if pushed is not None:
                actions.append(pushed)
        report = codec.result_frames(
            step, kv_len=sess.kv_len, compute_us=outcome.compute_us, digest=digest, pushed=True
        )
        sess.last_reply = tuple(report)
        if owner is not None:
            actions.append(self._send(owner, tuple(report)))
        return actions

    def _fly(
        self, sess: _Session, step: codec.Step, drawn: Sampled | None, nxt: int, now: float
    ) -> list[Action]:
        """Windows in flight (last stage; docs/protocol.md): after a step, keep up to ``flight_limit``
        windows round the ring.

        The windows pushed are ``sess.flight``, oldest first; the step that just finished is the oldest
        (its drafts were verified, and ``drawn`` at position ``nxt`` is the target's token after the
        accepted ones). The next window in flight was drafted as if this one were wholly accepted and
        its first token were ``drawn``: if so it goes on. Otherwise every window after this one is
        discarded -- the ones queued here now, the ones still on the way by their lower number -- and a
        new head (the next number) leaves from ``nxt`` with ``drawn`` and fresh drafts. Then, while the
        last verified window accepted all its drafts, further windows follow the last one in flight,
        each drafted as if all before it were accepted.
        """
        flight = sess.flight
        if flight and flight[0][0] == step.start:
            flight.pop(0)
        ended = drawn is None or drawn.end_of_generation or nxt + 1 > sess.budget
        goes_on = (
            drawn is not None
            and not ended
            and bool(flight)
            and flight[0][0] == nxt
            and flight[0][1][0] == drawn.token_id
        )
        if flight and not goes_on:
            flight.clear()
            self._drop_pending(sess)  # discarded windows queued here
            sess.window_gen += 1  # ... and the ones still on the way: a lower number from now on
            if sess.drafter is not None:
                sess.drafter.forget(nxt)  # the proposer followed their guesses
        ring = sess.ring
        if ended or ring is None or drawn is None:
            return []
        actions: list[Action] = []
        speculate = sess.drafter is not None and len(self._sessions) <= self.spec.speculate_max_sessions
        if not goes_on:
            drafts: tuple[int, ...] = ()
            if speculate and sess.drafter is not None:
                drafts = sess.drafter.drafts(
                    sess.history_tokens,
                    step.token_ids[: nxt - step.start].tolist(),
                    drawn.token_id,
                    sess.budget - nxt - 1,
                    now,
                )
            sess.window_gen += 1
            actions += self._push_window(sess, ring, nxt, (drawn.token_id, *drafts))
        while (
            speculate
            and sess.drafter is not None
            and sess.drafter.last_full
            and flight
            and len(flight) < sess.flight_limit
        ):
            first = flight[0][0]
            tail = [t for _, tokens in flight for t in tokens]
            start = first + len(tail)
            guess = sess.drafter.continue_drafts(first, tail, sess.budget - start)
            if not guess:
                break
            actions += self._push_window(sess, ring, start, guess)
        return actions

    def _push_window(
        self, sess: _Session, ring: frame_pb2.PushTarget, start: int, tokens: tuple[int, ...]
    ) -> list[Action]:
        """Push a window of ``tokens`` at ``start`` round the ring, numbered ``sess.window_gen``."""
        frames = codec.step_frames(
            codec.target_header(self._header(sess), ring),
            frame_pb2.PHASE_DECODE,
            step_id=sess.open_step_id + start + 1,
            start=start,
            token_ids=list(tokens),
            sample=True,
            hop_token=ring.hop_token,
            max_frame_bytes=self.spec.limits.max_frame_bytes,
            drafts=len(tokens) - 1,
            window_gen=sess.window_gen,
        )
        sess.flight.append((start, tokens))
        pushed = self._push(sess, ring, frames)
        return [] if pushed is None else [pushed]

    def _verify_window(
        self, sess: _Session, step: codec.Step, outcome: StepOutcome, actions: list[Action]
    ) -> tuple[Sampled, ...]:
        """A window came back (last stage): keep the accepted drafts and the correction, drop the rest
        of the window from the KV (a ``TruncateKv`` appended to ``actions``)."""
        window = outcome.window
        if len(window) != step.n_tokens:
            raise InternalError(f"{len(window)} draws for a window of {step.n_tokens} positions")
        found = verdict(
            step.token_ids.tolist(), [w.token_id for w in window], [w.end_of_generation for w in window]
        )
        produced = window[: len(found.tokens)]
        keep = step.start + len(produced)
        if sess.drafter is not None:
            sess.drafter.observe(step.drafts, found.accepted)
        if keep < sess.kv_len:
            actions.append(TruncateKv(sess.session_id, keep))
            sess.kv_len = keep
            self._drop_pending(sess)  # nothing may follow a window but its successor
        return produced

    def push_failed(self, session_id: str, message: str, epoch: int | None = None) -> list[Action]:
        """The transport could not deliver a push of this session: tell the owner (the next stage failed).

        ``epoch`` is the route epoch of the push that failed, when known: a failure of an older
        epoch's push is stale (the session has been re-attached since) and dropped.
        """
        sess = self._sessions.get(session_id)
        if sess is None or sess.conn is None or (epoch is not None and epoch < sess.epoch):
            return []
        notice = self._header(sess).frame(
            frame_pb2.PHASE_UNSPECIFIED, step_id=sess.last_step_id, kv_len=sess.kv_len
        )
        exc = DownstreamFailedError(message)
        notice.error.CopyFrom(error_body(exc))
        self._errors[exc.status_name] = self._errors.get(exc.status_name, 0) + 1
        return [self._send(sess.conn, (notice,))]

    def fail_session(self, session_id: str, message: str) -> list[Action]:
        """The engine could not carry out an effect for this session (it should not happen): drop it."""
        sess = self._sessions.get(session_id)
        if sess is None:
            return []
        if sess.busy_job is not None:
            self._jobs.pop(sess.busy_job, None)
        self._forget(sess)
        self._remember_closed(session_id, _Closed("failed", sess.last_step_id, ()))
        event(log, "session_failed", level=logging.ERROR, session_id=session_id, message=message)
        return [FreeKv(session_id)]

    # -- time and shutdown ---------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Evict sessions whose lease or re-attach window has passed."""
        actions: list[Action] = []
        for sid, sess in list(self._sessions.items()):
            if sess.busy_job is None and now >= sess.expires_at:
                self._forget(sess)
                self._evictions += 1
                self._remember_closed(sid, _Closed("evicted", sess.last_step_id, ()))
                event(log, "session_evicted", session_id=sid, freed_kv_tokens=sess.kv_len)
                actions.append(FreeKv(sid))
        for sid in self._kept.expired(now):
            actions += self._evict_kept(sid)
        return actions

    def drain(self) -> list[Action]:
        """Shutting down: refuse new sessions, free every session's KV."""
        self.draining = True
        actions: list[Action] = []
        for sid, sess in list(self._sessions.items()):
            if sess.busy_job is not None:
                actions.append(Drop(sess.busy_job))
                self._jobs.pop(sess.busy_job, None)
            if sess.conn is not None:
                # Unsolicited: tells the gateway at once to replace this stage and replay.
                notice = self._header(sess).frame(
                    frame_pb2.PHASE_UNSPECIFIED, step_id=sess.last_step_id, kv_len=0
                )
                notice.error.CopyFrom(
                    error_body(UnavailableError("node is shutting down; the session was freed"))
                )
                notice.error.session_closed = True
                actions.append(self._send(sess.conn, (notice,)))
            self._forget(sess)
            self._remember_closed(sid, _Closed("evicted", sess.last_step_id, ()))
            actions.append(FreeKv(sid))
        for sid in self._kept:
            actions += self._evict_kept(sid)
        return actions

    # -- introspection -------------------------------------------------------------------------------

    def busy_on(self, conn: int) -> int:
        """Steps of sessions owned by ``conn`` whose replies are still to come."""
        return sum(
            1 + len(s.pending) for s in self._sessions.values() if s.conn == conn and s.busy_job is not None
        )

    def prefix_heads(self, limit: int = MAX_HEADS) -> list[str]:
        """What the heartbeat reports of the kept KV: heads of its block chains (node.prefix_blocks)."""
        return self._kept.index.heads(limit)

    def kv_len(self, session_id: str) -> int | None:
        sess = self._sessions.get(session_id)
        return None if sess is None else sess.kv_len

    def statistics(self) -> MachineStats:
        sessions = list(self._sessions.values())
        return MachineStats(
            sessions=len(sessions),
            busy_sessions=sum(1 for s in sessions if s.busy_job is not None),
            queued_jobs=len(self._jobs),
            pending_steps=sum(len(s.pending) for s in sessions),
            pending_bytes=self._pending_bytes,
            history_bytes=self._history_bytes,
            kv_tokens_used=sum(s.kv_len for s in sessions),
            kv_tokens_granted=sum(s.budget for s in sessions),
            kv_tokens_capacity=self.spec.kv_pool_tokens
            or self.spec.max_sessions * self.spec.session_kv_tokens,
            kept_sessions=len(self._kept),
            kept_kv_tokens=self._kept.positions(),
            connections=len(self._conns),
            frames_in=self._frames_in,
            frames_out=self._frames_out,
            frames_pushed=self._frames_pushed,
            replays=self._replays,
            evictions=self._evictions,
            errors_by_status=dict(self._errors),
            draining=self.draining,
            kv_pool_blocks=self.spec.kv_pool_tokens // BLOCK_TOKENS,
            kv_blocks_reserved=self._reserved_blocks() if self.spec.kv_pool_tokens else 0,
            prefix_cached_blocks=self._kept.index.blocks(),
            prefix_lookups_hit=self._prefix_hits,
            prefix_lookups_miss=self._prefix_misses,
            reused_positions=self._reused,
            preemptions=self._preemptions,
            kv_refusals=self._kv_refusals,
            spec_proposers=dict(self._spec_proposers),
        )
