"""The gateway's Route Session as a sans-IO state machine: events in, commands out.

No trio, no grpc, no clock of its own (every event carries ``now``); the shell
(``gateway/route_session.py``) opens the streams, delivers what they receive,
runs the timers and the tracker look-ups, and carries out the commands::

    OpenStream(slot, stage)        open a Session stream to that node (one slot per stage attachment)
    CloseStream(slot)              close it
    SendFrame(slot, frame)         serialize a frame and send it on that stream
    ForwardBytes(slot, data)       send bytes received from one stage to another unchanged
    FindReplacement(index, ...)    ask the tracker for a node with exactly that stage's layers
    EmitToken(sampled, position)   a generated token for the client
    Recovered(report)              a stage was replaced (metrics, logs)
    StepTimed(seconds)             a decode step went once round the route (metrics)
    HopTimed(stage, node, seconds) one stage's share of a decode step (metrics)
    Closed(released)               the session is over; every stage freed its KV or stopped answering
    SessionFailed(failure)         the session cannot go on (after ``Closed``-like cleanup was sent)

Events: :meth:`RouteMachine.open`, :meth:`begin` (the prompt),
:meth:`on_bytes` (a frame from a slot), :meth:`on_stream_failed`,
:meth:`on_replacement`, :meth:`on_tick` (at :attr:`deadline`) and :meth:`stop`.

Data plane (docs/protocol.md, Direct push). Every stage is OPENed with where
its output goes: the next stage's gRPC address and a hop token (direct push),
or an empty address when either end is behind this gateway's relay (or the
route runs in relay mode), in which case the stage sends its output on its own
stream and this machine forwards the bytes. The last stage of a route of two
or more pushes the next decode step (the token it sampled) to the first stage
itself, so decode runs as a ring and the gateway only receives tokens. Prefill
goes to the first stage in steps of ``step_tokens``, at most
``prefill_pipeline_steps`` of them in flight, so stage k+1 works on chunk c while stage
k works on chunk c+1.

Step ids: in an epoch whose OPEN had step id B, the data step starting at
position p has id B + p + 1; RELEASE/CANCEL use B + budget + 1 and the next
epoch's OPEN B + budget + 2, so ids only grow whatever the ring did.

Recovery. A stage fails when its stream breaks, it reports an error another
node can fix, the stage before it cannot push to it (DOWNSTREAM_FAILED), or it
misses its deadline. Deadlines follow the route's speed, so a stage that
hangs (a stopped process, a tarpit) is noticed in seconds: decode waits
``20 x`` the measured step time ``+ 1 s`` (EWMA; before the first measurement
``20 x`` the tracker's estimate ``+ 1 s``, at least twice the floor; and at least twice the
measured prefill step ``+ 1 s``: on a busy route a decode step rides in batches with other
sessions' prefill slices), between
``decode_timeout_floor_s`` and ``decode_step_timeout_s``; a prefill step, which
carries up to ``step_tokens`` positions, gets ``10 x`` the measured prefill
step ``+ 2 s`` (before one was measured: ``20 x`` the decode estimate for every
8 positions ``+ 2 s``, times the sessions this gateway has on the route's busiest
stage), between ``prefill_timeout_floor_s`` and ``prefill_step_timeout_s``. Without any
estimate the ceilings apply. Then: CANCEL to the failed stage, a replacement with the same
layers from the tracker, the next epoch
OPENed on every stage (survivors keep the ``committed`` positions, the ones the
last stage reported), the replacement's inputs replayed (stage 0: the token
ids; stage j: ``REPLAY`` asks stage j-1 to push the outputs it kept), then
generation resumes at ``committed``. Whatever cannot be replaced in place (no
same-span node, no kept outputs, a second failure meanwhile, too many
recoveries) ends the session with a failure the service answers by re-running
the whole token history on another route.

Preemption. A stage whose KV pool ran out may free this session's KV to make
room for an older session and say so with STATUS_PREEMPTED (retry hint
RETRY_RESUME, session closed on that node). Nothing is replaced in place: the
machine ends the session at once (CANCEL to every other stage, which frees
their KV; the preempting stage is not waited for) and reports a failure of
kind "preempted". The service keeps the tokens and resumes the request by
re-prefilling them when a route has room again (gateway/choice_runner.py). A stage
that refuses a step mid-generation with RESOURCE_EXHAUSTED (no room in its
pool and nobody it may preempt, or its queue of waiting steps full) is
answered the same way: a "busy" failure with ``kv_short``, no in-place
replacement.

Timings (decode steps only; the machine's clock is the ``now`` of its events).
A decode step *starts* when its input leaves: the gateway sends it (one stage,
a resume, another choice) or the last stage reported the step before, which is
when it pushed this one round the ring. :class:`StepTimed` is the time from
that start to the last stage's report of the step. :class:`HopTimed` is stage
k's share: from the report of the stage before it (stage 0: from the step's
start) to its own report, i.e. the transfer into the stage, its compute and the
difference between the two reports' ways back to this gateway; a report that
overtook its predecessor's counts 0. The shares of one step are emitted once
every stage reported it (reports after the stop count too), n per step; they
add up to the time from the step's start to its latest report, which is the
step's time when the reports arrive in stage order. A step cut by a stage
replacement is timed again from its re-send in the next epoch (the replacement
itself is the recovery's time, not the step's); timings are kept for at most
``TIMED_STEPS`` steps at once. With windows in flight a new head may carry the
step id of a window it discarded (ids follow positions), and a stage before the
last may have reported that window already: a stage's second report of a step id
that differs from its first (other positions or output digest) replaces it, as
the first one was the discarded window's; the same report again (a replayed
reply) changes nothing.

Invariants: tokens are emitted in position order, once each; a stage's KV is
freed by RELEASE/CANCEL when the session ends (or by the node's lease when it
cannot be reached); frames of an older epoch are ignored; every bound is
stated (pipeline depth, recoveries, deadlines).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.prefix_chain import parse_source_id
from proto import codec
from proto.codec import Sampled
from proto.errors import ProtocolError, error_from_body
from proto.swarm.v1 import frame_pb2, status_pb2

S = status_pb2
# A node's retry_after_ms is a hint from a stranger: a re-attach is retried after at most this long
# (the session's own deadlines still apply), and a client is told to come back after at most
# MAX_CLIENT_RETRY_AFTER_S (Retry-After).
MAX_NODE_RETRY_AFTER_MS = 1000
MAX_CLIENT_RETRY_AFTER_S = 30

TIMED_STEPS = 8  # decode steps whose timings are being collected at once (a bound; normally 1)


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class StageSpec:
    """One stage of a route: the node, where it listens, its layers, and the ticket naming it."""

    node_id: str
    address: str  # gRPC host:port ("" for a node reachable only through this gateway's relay)
    start: int
    end: int
    recipe_fingerprint: str
    ticket: bytes
    relayed: bool = False
    tls_fingerprint: str = ""  # the node's announced gRPC certificate ("" = it serves plaintext)


@dataclass(frozen=True)
class RouteConfig:
    session_id: str
    request_id: str
    model_fingerprint: str
    sampling: codec.SamplingSettings
    kv_budget: int  # positions every stage reserves: prompt + max new tokens - 1
    step_tokens: int  # positions per prefill step
    node_frame_bytes: int  # largest frame a node may send us
    limits: codec.FrameLimits = codec.DEFAULT_LIMITS
    push: bool = True  # direct push between nodes; False: every hop through the gateway
    encoding: frame_pb2.Encoding = frame_pb2.ENCODING_F32
    # Per stage position, the encoding of the hidden states it sends on (gateway.encodings); positions
    # past its end use ``encoding``. A replacement takes over its position's encoding.
    encodings: tuple[frame_pb2.Encoding, ...] = ()
    recovery_history_bytes: int = 64 * 1024 * 1024  # outputs each stage keeps for a replacement's replay
    prefill_pipeline_steps: int = 4  # prefill steps in flight at once (1: one stage after the other)
    max_recoveries: int = 3
    open_timeout_s: float = 30.0
    prefill_step_timeout_s: float = 120.0  # ceiling of the adaptive deadline of one prefill step
    decode_step_timeout_s: float = 30.0  # ceiling of the adaptive decode deadline
    decode_timeout_floor_s: float = 3.0
    prefill_timeout_floor_s: float = 15.0
    # The tracker's estimate of one decode step through the route (its expected_ms_per_token), the
    # prior of both deadlines until steps were measured; nan: unknown (the ceilings apply).
    expected_step_s: float = math.nan
    # Sessions this gateway had on the route's busiest stage when it opened, this one included: a
    # first prefill step waits behind theirs, so the prior of its deadline is that many times longer.
    busy_sessions: int = 1
    close_timeout_s: float = 5.0
    # Start from another session's KV on every stage (its first positions): a kept session of an
    # earlier request (warm conversations) or the live session of choice 0 (n > 1). Nodes that cannot
    # honour it start empty; a route whose stages disagree is re-opened empty.
    kv_source: tuple[str, int] | None = None
    kv_copy: bool = False  # copy a kept source, leaving it kept (a prefix shared across clients)
    keep_ms: int = 0  # RELEASE asks every stage to keep the KV (its committed prefix) this long
    # Prefill positions at or past this one go one per step: a resumed or replayed session's generated
    # tokens, computed again exactly as their decode steps computed them (llama.cpp's low-order bits may
    # depend on how positions are cut into batches); 0 = every prefill in step_tokens chunks.
    single_from: int = 0
    report_steps: bool = False  # emit every stage's step report (spot checks compare them)
    # Every stage computes this session's steps in batches of their own (OpenSession.isolated): the
    # runs of a spot check then report the same digests even where batching changes the numbers.
    isolated: bool = False
    # Speculative decoding (docs/protocol.md, Speculation): the last stage of a ring drafts up to this
    # many tokens per decode window and verifies them in one pass through the route. 0: off.
    max_drafts: int = 0


@dataclass(frozen=True)
class Failure:
    """Why the session (or a stage) failed.

    ``kind``: "stage" (one node failed; another route can fix it when
    ``replaceable``), "busy" (a node is full), "preempted" (a node freed the
    session's KV for an older session: resume by re-prefill, the node is not
    at fault), "context" (the request does not fit: a client error),
    "protocol" (a node broke the protocol: not retried on it).
    """

    kind: str
    message: str
    node_id: str = ""
    replaceable: bool = True
    retry_after_s: float | None = None
    status: status_pb2.Status = status_pb2.STATUS_UNSPECIFIED
    retry: status_pb2.RetryHint = status_pb2.RETRY_UNSPECIFIED
    retry_after_ms: int = 0
    # Every node this session lost (a stage replaced, then its replacement failed too): a whole-route
    # re-run must avoid them all, not only ``node_id``.
    failed_nodes: frozenset[str] = frozenset()
    # "busy" because a stage granted fewer KV positions than the session's budget (a KV shortage the
    # service may wait out), not because it has no session slot or is draining.
    kv_short: bool = False


@dataclass(frozen=True)
class RecoveryReport:
    failed_node: str
    replacement_node: str
    span: tuple[int, int]
    replayed_positions: int
    epoch: int
    seconds: float
    ok: bool
    error: str = ""


# --------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class OpenStream:
    slot: int
    stage: StageSpec


@dataclass(frozen=True)
class CloseStream:
    slot: int


@dataclass(frozen=True)
class SendFrame:
    slot: int
    frame: frame_pb2.Frame


@dataclass(frozen=True)
class ForwardBytes:
    slot: int
    data: bytes


@dataclass(frozen=True)
class FindReplacement:
    index: int
    start: int
    end: int
    exclude: frozenset[str]


@dataclass(frozen=True)
class EmitToken:
    sampled: Sampled
    position: int


@dataclass(frozen=True)
class Recovered:
    report: RecoveryReport


@dataclass(frozen=True)
class StepReport:
    """What stage ``stage`` (node ``node_id``) reported for a step (with ``report_steps``): two honest
    nodes given the same inputs report the same digest, token and logprobs, bit for bit."""

    stage: int
    node_id: str
    epoch: int
    step_id: int
    start: int
    end: int
    digest: bytes
    sampled: Sampled | None


@dataclass(frozen=True)
class StepTimed:
    """A decode step's round through the route (module docstring, Timings)."""

    seconds: float


@dataclass(frozen=True)
class HopTimed:
    """Stage ``stage``'s share of a decode step (module docstring, Timings)."""

    stage: int
    node_id: str
    seconds: float


@dataclass(frozen=True)
class Closed:
    released: bool


@dataclass(frozen=True)
class SessionFailed:
    failure: Failure


Command = (
    OpenStream
    | CloseStream
    | SendFrame
    | ForwardBytes
    | FindReplacement
    | EmitToken
    | Recovered
    | StepReport
    | StepTimed
    | HopTimed
    | Closed
    | SessionFailed
)


# --------------------------------------------------------------------------- state


def _sampled(frame: frame_pb2.Frame) -> Sampled | None:
    """The sampled token of a last stage's result (n > 1: the other choices ride along)."""
    if not frame.result.sampled:
        return None
    first, *others = [
        Sampled(
            int(t.token_id),
            float(t.logprob),
            tuple((int(p.token_id), float(p.logprob)) for p in t.top_logprobs),
            bool(t.end_of_generation),
        )
        for t in frame.result.sampled
    ]
    return Sampled(first.token_id, first.logprob, first.top_logprobs, first.end_of_generation, tuple(others))


# What a stage's report of a decode step said: its positions and output digest. Two reports of one step
# id from one stage that differ here are two windows (windows in flight: a head reusing a discarded
# window's id), the same again a replayed reply.
_ReportMark = tuple[int, int, bytes]


def _report_mark(frame: frame_pb2.Frame) -> _ReportMark:
    return int(frame.positions.start), int(frame.positions.end), bytes(frame.result.output_digest)


def _window_tokens(frame: frame_pb2.Frame) -> list[Sampled]:
    """The tokens a decode window produced (a last stage's result with ``drafts``), in position order."""
    return [
        Sampled(
            int(t.token_id),
            float(t.logprob),
            tuple((int(p.token_id), float(p.logprob)) for p in t.top_logprobs),
            bool(t.end_of_generation),
        )
        for t in frame.result.sampled
    ]


def _status_name(status: int) -> str:
    return S.Status.Name(status) if status in S.Status.values() else f"status {status}"


@dataclass
class _Stage:
    spec: StageSpec
    slot: int
    header: codec.SessionHeader
    acked: bool = False
    keep: int = 0  # KV length the epoch's OPEN asks this stage to keep
    open_frame: frame_pb2.Frame | None = None
    reopen_at: float = math.inf  # a busy survivor: re-send the OPEN then
    kv: int = 0
    reported_step: int = 0
    closed: bool = False
    closed_ok: bool = False  # the stage confirmed RELEASE/CANCEL (not a timeout or a broken stream)
    tokens: int = 0  # positions computed (usage)
    steps: int = 0
    granted: int = 0


@dataclass(frozen=True)
class _Inflight:
    start: int
    end: int
    step_id: int
    sent_at: float


@dataclass
class _Recovery:
    index: int
    failure: Failure
    started: float
    replacement: StageSpec | None = None
    replaying: bool = False


@dataclass(frozen=True)
class MachineStats:
    epoch: int
    recoveries: int
    forwarded_frames: int
    forwarded_bytes: int
    committed: int
    ewma_step_s: float
    reused: int
    windows: int = 0  # speculative decode windows the last stage verified
    window_tokens: int = 0  # tokens those windows produced (1 to drafts + 1 each)
    drafted: int = 0  # drafted tokens those windows carried


_OPENING, _READY, _RUNNING, _RECOVERING, _CLOSING, _DONE = (
    "opening",
    "ready",
    "running",
    "recovering",
    "closing",
    "done",
)


class RouteMachine:
    """One Route Session (see the module docstring)."""

    def __init__(
        self, config: RouteConfig, stages: Sequence[StageSpec], *, new_token: Callable[[], bytes]
    ) -> None:
        if not stages:
            raise ValueError("a route has at least one stage")
        self.config = config
        self._new_token = new_token
        self._slots = 0
        self.epoch = 1
        self.base = 1  # step id of the current epoch's OPEN
        self._stages = [self._stage(spec, i) for i, spec in enumerate(stages)]
        self._retired: list[_Stage] = []
        self.phase = _OPENING
        self.tokens: list[int] = []  # prompt, then every generated token, by position
        self.prompt_len = 0
        self.committed = 0  # positions every stage applied (the last stage reported them)
        self._sent_end = 0  # positions sent into the pipeline this epoch
        self._inflight: list[_Inflight] = []
        self._stopped = False  # the client has what it wants: no more steps
        self._eog = False
        self.recoveries = 0
        self._failed_nodes: set[str] = set()
        self._recovery: _Recovery | None = None
        self._deadline = math.inf
        self._progress_at = 0.0
        self._ewma_step_s = math.nan
        self._ewma_prefill_s = math.nan  # one prefill step, first stage to last
        self._last_report_at = math.nan
        self._forwarded = 0
        self._forwarded_bytes = 0
        self._released = False
        self.reused = 0  # prompt positions taken from the KV source instead of prefilled
        self._windows = self._window_tokens = self._drafted = 0  # speculative decoding (statistics)
        self._reuse_open = config.kv_source is not None and config.kv_source[1] > 0
        named = None if config.kv_source is None else parse_source_id(config.kv_source[0])
        self._shorter_ok = named is not None and len(named[0]) > 1
        # Decode timings (module docstring): step id -> when it started, and -> {stage: (report time,
        # what the report said: positions and output digest)}.
        self._step_started: dict[int, float] = {}
        self._step_reports: dict[int, dict[int, tuple[float, _ReportMark]]] = {}

    # -- small helpers ------------------------------------------------------------------------------

    def _next_slot(self) -> int:
        self._slots += 1
        return self._slots

    def _stage(self, spec: StageSpec, index: int) -> _Stage:
        header = codec.SessionHeader(
            session_id=self.config.session_id,
            route_epoch=self.epoch,
            model_fingerprint=self.config.model_fingerprint,
            recipe_fingerprint=spec.recipe_fingerprint,
            shard_start=spec.start,
            shard_end=spec.end,
            request_id=self.config.request_id,
        )
        return _Stage(spec, self._next_slot(), header)

    @property
    def n(self) -> int:
        return len(self._stages)

    @property
    def deadline(self) -> float:
        """When :meth:`on_tick` must run next (``inf``: no timer)."""
        return self._deadline

    @property
    def done(self) -> bool:
        return self.phase == _DONE

    @property
    def stages(self) -> list[StageSpec]:
        return [s.spec for s in self._stages]

    def usage(self) -> list[tuple[str, int, int]]:
        """Per node that computed for this session: (node id, positions, steps)."""
        return [(s.spec.node_id, s.tokens, s.steps) for s in [*self._retired, *self._stages]]

    def statistics(self) -> MachineStats:
        return MachineStats(
            self.epoch,
            self.recoveries,
            self._forwarded,
            self._forwarded_bytes,
            self.committed,
            self._ewma_step_s,
            self.reused,
            self._windows,
            self._window_tokens,
            self._drafted,
        )

    def _direct(self, a: int, b: int) -> bool:
        """Whether stage a pushes to stage b itself (else through this gateway).

        A TLS node pushes only over TLS pinned to the next stage's certificate, and a node serving
        plaintext (insecure_plaintext, or older than TLS) may dial only plaintext: a hop between one of
        each goes through here.
        """
        sa, sb = self._stages[a].spec, self._stages[b].spec
        secure = bool(sa.tls_fingerprint) == bool(sb.tls_fingerprint)
        return self.config.push and not sa.relayed and not sb.relayed and bool(sb.address) and secure

    def _target(self, a: int, b: int, token: bytes) -> frame_pb2.PushTarget:
        spec = self._stages[b].spec
        return codec.push_target(
            spec.node_id,
            spec.address if self._direct(a, b) else "",
            token,
            (spec.start, spec.end),
            spec.recipe_fingerprint,
            spec.tls_fingerprint,
        )

    def output_encoding(self, k: int) -> frame_pb2.Encoding:
        """The encoding stage ``k`` is told to send its hidden states in."""
        encodings = self.config.encodings
        return encodings[k] if k < len(encodings) else self.config.encoding

    def _close_id(self) -> int:
        return self.base + self.config.kv_budget + 1

    # -- decode timings (module docstring) ---------------------------------------------------------------

    def _start_timing(self, step_id: int, now: float) -> None:
        self._step_started[step_id] = now
        self._bound_timing()

    def _bound_timing(self) -> None:
        """Steps that never complete (stopped, failed) are forgotten, oldest first."""
        for table in (self._step_started, self._step_reports):
            while len(table) > TIMED_STEPS:
                del table[min(table)]

    def _reset_timing(self) -> None:
        self._step_started.clear()
        self._step_reports.clear()

    def _timed(self, k: int, frame: frame_pb2.Frame, now: float) -> list[Command]:
        """Stage ``k`` reported decode step ``frame.step_id``: the step's time (last stage), and every
        stage's share once all of them reported it. A report may come before the gateway learnt that
        the step started (stage 0's report overtaking the last stage's report of the step before); the
        last report of a step always comes after its start. A stage's second report of the step id
        replaces its first unless it is the same report (module docstring: windows in flight)."""
        step_id = int(frame.step_id)
        mark = _report_mark(frame)
        seen = self._step_reports.setdefault(step_id, {})
        if k in seen and seen[k][1] == mark:
            return []  # a duplicate report
        seen[k] = (now, mark)
        self._bound_timing()
        started = self._step_started.get(step_id)
        if started is None:
            return []
        out: list[Command] = []
        if k == self.n - 1:
            out.append(StepTimed(max(0.0, now - started)))
        if len(seen) == self.n:
            previous = started
            for j in range(self.n):
                at = seen[j][0]
                out.append(HopTimed(j, self._stages[j].spec.node_id, max(0.0, at - previous)))
                previous = max(previous, at)
            del self._step_started[step_id]
            del self._step_reports[step_id]
        return out

    def _data_id(self, start: int) -> int:
        return self.base + start + 1

    # -- opening --------------------------------------------------------------------------------------

    def open(self, now: float) -> list[Command]:
        """Open a stream to every stage and OPEN the session on all of them at once."""
        out: list[Command] = [OpenStream(s.slot, s.spec) for s in self._stages]
        out += self._open_epoch(now, keep=0, fresh=frozenset(range(self.n)))
        self._deadline = now + self.config.open_timeout_s
        return out

    def _open_epoch(self, now: float, *, keep: int, fresh: frozenset[int]) -> list[Command]:
        """OPEN (or re-attach) every stage for the current epoch; stages in ``fresh`` start empty."""
        n = self.n
        hop = [self._new_token() for _ in range(n)]  # hop[k]: stage k -> k+1; hop[n-1]: the ring
        self._reset_timing()  # step ids restart with the epoch
        out: list[Command] = []
        for k, stage in enumerate(self._stages):
            stage.header = codec.SessionHeader(
                session_id=self.config.session_id,
                route_epoch=self.epoch,
                model_fingerprint=self.config.model_fingerprint,
                recipe_fingerprint=stage.spec.recipe_fingerprint,
                shard_start=stage.spec.start,
                shard_end=stage.spec.end,
                request_id=self.config.request_id,
            )
            last = k == n - 1
            stage.acked = False
            stage.keep = 0 if k in fresh else keep
            source = self.config.kv_source if self._reuse_open else None
            if source is not None:
                stage.keep = source[1]
            stage.reopen_at = math.inf
            stage.open_frame = codec.open_frame(
                stage.header,
                step_id=self.base,
                route_ticket=stage.spec.ticket,
                kv_budget_tokens=self.config.kv_budget,
                sampling=self.config.sampling if last else None,
                output_encoding=self.output_encoding(k),
                max_frame_bytes=self.config.node_frame_bytes,
                keep_kv_len=stage.keep,
                downstream=None if last else self._target(k, k + 1, hop[k]),
                upstream_token=hop[k - 1] if k > 0 else (hop[n - 1] if n > 1 else b""),
                ring=self._target(k, 0, hop[k]) if last and n > 1 else None,
                history_bytes=0 if last else self.config.recovery_history_bytes,
                kv_source=source,
                isolated=self.config.isolated,
                kv_copy=self.config.kv_copy,
                max_drafts=self.config.max_drafts if last and n > 1 else 0,
            )
            if source is not None:  # the frame's expected_kv_len stays 0: the session is new
                stage.open_frame.expected_kv_len = 0
            out.append(SendFrame(stage.slot, stage.open_frame))
        self._progress_at = now
        return out

    def _acked(self, k: int, frame: frame_pb2.Frame, now: float) -> list[Command]:
        stage = self._stages[k]
        if frame.step_id != self.base or stage.acked:
            return []  # an ack of an older OPEN
        if self._reuse_open and frame.kv_len == 0:
            stage.keep = 0  # this node could not reuse the source: it starts empty
        elif self._reuse_open and frame.kv_len < stage.keep and self._shorter_ok:
            stage.keep = int(frame.kv_len)  # a shorter prefix the source named (blocks:<deep>+<shorter>)
        if frame.kv_len != stage.keep:
            return self._stage_failed(
                k,
                Failure(
                    "protocol",
                    f"node {stage.spec.node_id[:8]} answered OPEN with kv_len {frame.kv_len}, "
                    f"expected {stage.keep}",
                    stage.spec.node_id,
                ),
                now,
            )
        stage.acked = True
        stage.kv = stage.keep
        stage.granted = int(frame.open_ack.kv_tokens_granted)
        if stage.granted < self.config.kv_budget:
            return self._stage_failed(
                k,
                Failure(
                    "busy",
                    f"node {stage.spec.node_id[:8]} granted {stage.granted} KV positions, "
                    f"{self.config.kv_budget} were asked",
                    stage.spec.node_id,
                    retry_after_s=2,
                    kv_short=True,
                ),
                now,
            )
        if not all(s.acked for s in self._stages):
            return []
        if self.phase == _OPENING and self._reuse_open:
            self._reuse_open = False
            held = {s.kv for s in self._stages}
            if len(held) > 1:
                # Some stages reused the source, others could not: start every stage empty (next epoch).
                self.epoch += 1
                self.base = self._close_id() + 1
                return self._open_epoch(now, keep=0, fresh=frozenset(range(self.n)))
            self.reused = self.committed = held.pop()
        if self.phase == _OPENING:
            self.phase = _READY
            self._deadline = math.inf
            return []
        if self.phase == _RECOVERING:
            return self._replay(now)
        return []

    # -- generation -----------------------------------------------------------------------------------

    def begin(self, prompt: Sequence[int], now: float) -> list[Command]:
        """Start prefilling ``prompt`` (the session must be open)."""
        if self.phase != _READY:
            raise RuntimeError(f"begin() in phase {self.phase}")
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) > self.config.kv_budget:
            raise ValueError(f"a prompt of {len(prompt)} positions does not fit the budget")
        if self.reused >= len(prompt):
            raise ValueError(f"{self.reused} positions were reused; the prompt must be longer")
        self.tokens = [int(t) for t in prompt]
        self.prompt_len = len(self.tokens)
        self._sent_end = self.committed = self.reused
        self.phase = _RUNNING
        self._progress_at = now
        return self._pump(now)

    def begin_choice(self, prompt: Sequence[int], first: Sampled, now: float) -> list[Command]:
        """n > 1: another choice of a prompt whose KV this session copied (``kv_source``), with its
        first token already drawn by the last stage of choice 0. If the copy was refused, the prompt
        is prefilled here and the same token is drawn again (same logits, same seed)."""
        if self.phase != _READY:
            raise RuntimeError(f"begin_choice() in phase {self.phase}")
        if self.reused != len(prompt):
            self.reused = self.committed = 0
            return self.begin(prompt, now)
        self.tokens = [*(int(t) for t in prompt), first.token_id]
        self.prompt_len = len(prompt)
        self._sent_end = self.committed = len(prompt)
        self._eog = first.end_of_generation
        self.phase = _RUNNING
        self._progress_at = now
        out: list[Command] = [EmitToken(first, len(prompt))]
        out += self._decode_step(now)
        self._arm(now)
        return out

    def _pump(self, now: float) -> list[Command]:
        """Send what the pipeline has room for: prefill steps, or the next decode step."""
        out: list[Command] = []
        if self.phase != _RUNNING or self._stopped:
            return out
        first = self._stages[0]
        single = self.config.single_from
        while self._sent_end < self.prompt_len and len(self._inflight) < self.config.prefill_pipeline_steps:
            start = self._sent_end
            if single and start >= single:
                end = start + 1  # a generated token, as its decode step computed it
            elif single:
                end = min(self.prompt_len, single, start + self.config.step_tokens)
            else:
                end = min(self.prompt_len, start + self.config.step_tokens)
            for frame in codec.step_frames(
                first.header,
                frame_pb2.PHASE_PREFILL,
                step_id=self._data_id(start),
                start=start,
                token_ids=self.tokens[start:end],
                sample=end == self.prompt_len,
                max_frame_bytes=self.config.limits.max_frame_bytes,
            ):
                out.append(SendFrame(first.slot, frame))
            self._inflight.append(_Inflight(start, end, self._data_id(start), now))
            self._sent_end = end
        self._arm(now)
        return out

    def _decode_step(self, now: float) -> list[Command]:
        """The gateway sends the decode step of the token at ``committed`` (one stage, or a resume)."""
        p = self.committed
        if self._stopped or self._eog or p >= len(self.tokens) or p + 1 > self.config.kv_budget:
            return []
        first = self._stages[0]
        (frame,) = codec.step_frames(
            first.header,
            frame_pb2.PHASE_DECODE,
            step_id=self._data_id(p),
            start=p,
            token_ids=[self.tokens[p]],
            sample=True,
            max_frame_bytes=self.config.limits.max_frame_bytes,
        )
        self._inflight.append(_Inflight(p, p + 1, self._data_id(p), now))
        self._sent_end = p + 1
        self._start_timing(self._data_id(p), now)
        self._arm(now)
        return [SendFrame(first.slot, frame)]

    def _ring_expected(self) -> bool:
        """The last stage pushed (or will push) the next decode step itself."""
        p = self.committed
        return (
            self.n > 1
            and self.prompt_len > 0
            and p >= self.prompt_len
            and not self._eog
            and not self._stopped
            and p + 1 <= self.config.kv_budget
            and p < len(self.tokens)
        )

    def _arm(self, now: float) -> None:
        """The deadline for the next report of the last stage."""
        if self.phase != _RUNNING:
            return
        if self._inflight:
            oldest = self._inflight[0]
            if oldest.end <= self.prompt_len:
                self._deadline = max(oldest.sent_at, self._progress_at) + self._prefill_timeout()
            else:
                self._deadline = self._progress_at + self._decode_timeout()
        elif self._ring_expected():
            self._deadline = self._progress_at + self._decode_timeout()
        else:
            self._deadline = math.inf

    def _decode_timeout(self) -> float:
        cfg = self.config
        # A decode step rides in the nodes' batches beside other sessions' prefill slices: on a busy
        # route it can take what a prefill step took, however quick the steps before it were.
        busy = math.nan if math.isnan(self._ewma_prefill_s) else 2 * self._ewma_prefill_s + 1.0
        if math.isnan(self._ewma_step_s):
            if math.isnan(cfg.expected_step_s):
                return cfg.decode_step_timeout_s
            prior = max(2 * cfg.decode_timeout_floor_s, 20 * cfg.expected_step_s + 1.0)
            return min(cfg.decode_step_timeout_s, prior if math.isnan(busy) else max(prior, busy))
        wanted = max(cfg.decode_timeout_floor_s, 20 * self._ewma_step_s + 1.0)
        return min(cfg.decode_step_timeout_s, wanted if math.isnan(busy) else max(wanted, busy))

    def _prefill_timeout(self) -> float:
        cfg = self.config
        if not math.isnan(self._ewma_prefill_s):
            wanted = 10 * self._ewma_prefill_s + 2.0
        elif not math.isnan(cfg.expected_step_s):
            wanted = (20 * cfg.expected_step_s * max(1.0, cfg.step_tokens / 8) + 2.0) * max(
                1, cfg.busy_sessions
            )
        else:
            return cfg.prefill_step_timeout_s
        return min(cfg.prefill_step_timeout_s, max(cfg.prefill_timeout_floor_s, wanted))

    # -- frames in ------------------------------------------------------------------------------------

    def _index(self, slot: int) -> int | None:
        for i, s in enumerate(self._stages):
            if s.slot == slot:
                return i
        return None

    def on_bytes(self, slot: int, data: bytes, now: float) -> list[Command]:
        """A message received on ``slot``'s stream."""
        k = self._index(slot)
        if k is None or self.phase == _DONE:
            return []  # a retired stage's late frame
        stage = self._stages[k]
        try:
            frame = codec.parse_frame(
                data, codec.FrameLimits(max_frame_bytes=self.config.limits.max_frame_bytes)
            )
        except ProtocolError as err:
            return self._stage_failed(
                k,
                Failure(
                    "protocol",
                    f"node {stage.spec.node_id[:8]} sent an unreadable frame: {err}",
                    stage.spec.node_id,
                ),
                now,
            )
        kind = codec.body_kind(frame)
        if kind == "error":
            return self._error(k, frame, now)
        if frame.session_id != self.config.session_id:
            return self._stage_failed(
                k,
                Failure(
                    "protocol",
                    f"node {stage.spec.node_id[:8]} answered for another session",
                    stage.spec.node_id,
                ),
                now,
            )
        if frame.route_epoch != self.epoch:
            return []  # an older epoch's frame: superseded
        if self.phase == _CLOSING:
            if kind == "closed":
                stage.closed = stage.closed_ok = True
                return self._maybe_closed(now)
            if kind == "result" and frame.phase == frame_pb2.PHASE_DECODE:
                # The last step's earlier stages may report after the last stage (and the stop).
                return self._timed(k, frame, now)
            return []
        if kind == "open_ack":
            return self._acked(k, frame, now)
        if kind == "activation":
            return self._forward(k, data, frame)
        if kind == "result":
            return self._report(k, frame, now)
        return []  # replay_ack, closed outside closing: nothing to do

    def _forward(self, k: int, data: bytes, frame: frame_pb2.Frame) -> list[Command]:
        """A stage's output for the next stage, sent through this gateway (a hop without direct push)."""
        target = (k + 1) % self.n
        if self.phase not in (_RUNNING, _RECOVERING) or (target == 0 and self._stopped):
            return []
        if frame.phase == frame_pb2.PHASE_DECODE and target == 0:
            # The ring through the gateway: this decode step is in flight from now on.
            if frame.positions.start != self.committed or self._eog or self._stopped:
                return []
            self._inflight.append(
                _Inflight(frame.positions.start, frame.positions.end, frame.step_id, self._progress_at)
            )
            self._sent_end = frame.positions.end
        self._forwarded += 1
        self._forwarded_bytes += len(data)
        return [ForwardBytes(self._stages[target].slot, data)]

    def _report(self, k: int, frame: frame_pb2.Frame, now: float) -> list[Command]:
        stage = self._stages[k]
        if frame.HasField("chunk") and frame.chunk.index < frame.chunk.count - 1:
            return []  # a result sent back in chunks (no push): the last chunk counts
        end = int(frame.positions.end)
        stage.kv = int(frame.kv_len)
        stage.reported_step = max(stage.reported_step, int(frame.step_id))
        stage.tokens += end - int(frame.expected_kv_len)  # the whole step (its last chunk, when chunked)
        stage.steps += 1
        reported: list[Command] = []
        if self.config.report_steps:
            reported.append(
                StepReport(
                    k,
                    stage.spec.node_id,
                    self.epoch,
                    int(frame.step_id),
                    int(frame.expected_kv_len),
                    end,
                    bytes(frame.result.output_digest),
                    _sampled(frame),
                )
            )
        if self.phase == _RUNNING and frame.phase == frame_pb2.PHASE_DECODE:
            reported += self._timed(k, frame, now)
        if self.phase == _RECOVERING:
            rec = self._recovery
            if rec is not None and rec.replaying and k == rec.index and end >= self.committed:
                return reported + self._resume(now)
            return reported
        if k != self.n - 1 or self.phase != _RUNNING:
            return reported
        window = frame.phase == frame_pb2.PHASE_DECODE and frame.result.drafts > 0
        if window:
            # A verified window: the stage kept its accepted positions (kv_len); its tokens follow the
            # window's first position, one each, up to kv_len (the last one not in the KV yet).
            end = int(frame.kv_len)
            if not int(frame.positions.start) < end <= int(frame.positions.end) or len(
                frame.result.sampled
            ) != end - int(frame.positions.start):
                return reported + self._stage_failed(
                    k,
                    Failure(
                        "protocol",
                        f"node {stage.spec.node_id[:8]} reported a window of {frame.result.drafts} drafts "
                        f"with kv_len {frame.kv_len} and {len(frame.result.sampled)} tokens",
                        stage.spec.node_id,
                    ),
                    now,
                )
        # The last stage finished a step: every stage has it.
        if self._inflight and self._inflight[0].end <= self.prompt_len and end <= self.prompt_len:
            took = now - max(self._inflight[0].sent_at, self._progress_at)
            self._ewma_prefill_s = (
                took if math.isnan(self._ewma_prefill_s) else 0.8 * self._ewma_prefill_s + 0.2 * took
            )
        while self._inflight and (self._inflight[0].end <= end or (window and self._inflight[0].start < end)):
            self._inflight.pop(0)
        if end <= self.committed:
            return reported  # a duplicate report
        self.committed = end
        if frame.phase == frame_pb2.PHASE_DECODE and not math.isnan(self._last_report_at):
            took = now - self._last_report_at
            self._ewma_step_s = (
                took if math.isnan(self._ewma_step_s) else 0.8 * self._ewma_step_s + 0.2 * took
            )
        self._last_report_at = now
        self._progress_at = now
        out: list[Command] = reported
        token = _sampled(frame)
        if window:
            first = int(frame.positions.start) + 1
            if len(self.tokens) == first:
                produced = _window_tokens(frame)
                self._windows += 1
                self._window_tokens += len(produced)
                self._drafted += int(frame.result.drafts)
                for i, t in enumerate(produced):
                    self.tokens.append(t.token_id)
                    out.append(EmitToken(t, first + i))
                self._eog = produced[-1].end_of_generation
                if self._ring_expected():
                    self._start_timing(self._data_id(self.committed), now)
        elif token is not None:
            if len(self.tokens) == end:
                self.tokens.append(token.token_id)
                self._eog = token.end_of_generation
                out.append(EmitToken(token, end))
                if self._ring_expected():
                    # The last stage pushed the next decode step round the ring as it reported this one.
                    self._start_timing(self._data_id(self.committed), now)
            if self.n == 1:
                out += self._decode_step(now)
        out += self._pump(now)
        self._arm(now)
        return out

    # -- errors and failures --------------------------------------------------------------------------

    def _error(self, k: int, frame: frame_pb2.Frame, now: float) -> list[Command]:
        stage = self._stages[k]
        if self.phase in (_CLOSING, _DONE):
            if frame.phase in (frame_pb2.PHASE_RELEASE, frame_pb2.PHASE_CANCEL) or frame.error.session_closed:
                stage.closed = True
                return self._maybe_closed(now)
            return []
        if frame.route_epoch and frame.route_epoch < self.epoch:
            return []  # about an older epoch
        remote = error_from_body(frame.error)
        who = f"node {stage.spec.node_id[:8]} ({stage.spec.address or 'relay'})"
        if remote.status == S.STATUS_DOWNSTREAM_FAILED:
            nxt = (k + 1) % self.n
            target = self._stages[nxt]
            return self._stage_failed(
                nxt,
                Failure(
                    "stage",
                    f"node {target.spec.node_id[:8]} could not take a step from {who}: {remote.message}",
                    target.spec.node_id,
                ),
                now,
            )
        if frame.phase == frame_pb2.PHASE_OPEN and remote.status == S.STATUS_RESOURCE_EXHAUSTED:
            if remote.retry == S.RETRY_SAME and self.phase == _RECOVERING and stage.open_frame is not None:
                # A survivor still computing an abandoned step: ask again shortly.
                # Capped: a node's hint is not trusted to stall the session (MAX_NODE_RETRY_AFTER_MS).
                stage.reopen_at = now + min(MAX_NODE_RETRY_AFTER_MS, max(50, remote.retry_after_ms)) / 1000
                self._deadline = min(self._deadline, stage.reopen_at)
                return []
        retry_s = (
            min(MAX_CLIENT_RETRY_AFTER_S, max(1, math.ceil(remote.retry_after_ms / 1000)))
            if remote.retry_after_ms
            else None
        )
        if remote.status == S.STATUS_PREEMPTED:
            # The node freed the session's KV for an older session: nothing to replace in place. The
            # session ends here (CANCEL to the other stages frees theirs); the service resumes it by
            # re-prefilling its tokens once there is room (RETRY_RESUME). The CANCEL to the preempting
            # node too: harmless where it freed the session, and frees it where it did not say so.
            return self._give_up(
                Failure(
                    "preempted",
                    f"{who} preempted the session: {remote.message}",
                    stage.spec.node_id,
                    retry_after_s=retry_s,
                    status=remote.status,
                    retry=remote.retry,
                    retry_after_ms=int(remote.retry_after_ms),
                ),
                now,
            )
        if remote.status == S.STATUS_CONTEXT_EXCEEDED:
            failure = Failure("context", f"{who}: {remote.message}", stage.spec.node_id, replaceable=False)
        elif remote.status == S.STATUS_RESOURCE_EXHAUSTED and self.phase == _RUNNING:
            # Mid-generation: the stage has no room (its KV pool, or its queue of waiting steps) for the
            # next step and nothing it may preempt. Another node of the span would need the whole span
            # replayed; the service instead releases the session everywhere, waits for room and resumes
            # it by re-prefill, as after a preemption.
            return self._give_up(
                Failure(
                    "busy",
                    f"{who} has no room for the next step: {remote.message}",
                    stage.spec.node_id,
                    retry_after_s=retry_s or 1,
                    status=remote.status,
                    retry=remote.retry,
                    retry_after_ms=int(remote.retry_after_ms),
                    kv_short=True,
                ),
                now,
            )
        elif remote.status in (S.STATUS_RESOURCE_EXHAUSTED, S.STATUS_UNAVAILABLE):
            failure = Failure(
                "busy",
                f"{who} is full or draining: {remote.message}",
                stage.spec.node_id,
                retry_after_s=retry_s or 2,
                status=remote.status,
                retry=remote.retry,
            )
        elif remote.status == S.STATUS_NO_HISTORY:
            failure = Failure("stage", f"{who} cannot replay: {remote.message}", stage.spec.node_id)
            return self._give_up(failure, now)
        else:
            failure = Failure(
                "stage",
                f"{who} failed: {_status_name(remote.status)}: {remote.message}",
                stage.spec.node_id,
                replaceable=remote.retry != S.RETRY_NONE,
                retry_after_s=retry_s,
                status=remote.status,
                retry=remote.retry,
            )
        return self._stage_failed(k, failure, now)

    def on_stream_failed(self, slot: int, reason: str, now: float) -> list[Command]:
        k = self._index(slot)
        if k is None:
            return []
        stage = self._stages[k]
        if self.phase in (_CLOSING, _DONE):
            stage.closed = True
            return self._maybe_closed(now)
        return self._stage_failed(
            k, Failure("stage", f"node {stage.spec.node_id[:8]}: {reason}", stage.spec.node_id), now
        )

    def _stage_failed(self, k: int, failure: Failure, now: float) -> list[Command]:
        if self.phase in (_CLOSING, _DONE):
            return []
        if self.phase in (_OPENING, _READY):
            return self._give_up(failure, now)
        rec = self._recovery
        if rec is not None:
            if failure.node_id in self._failed_nodes:
                return []  # the same failure seen again (its stream broke, and its upstream could not push)
            # A second failure while replacing a stage: the whole route is re-run elsewhere.
            return self._give_up(failure, now)
        if (
            failure.kind in ("context", "protocol")
            or not failure.replaceable
            or self.recoveries >= self.config.max_recoveries
        ):
            return self._give_up(failure, now)
        return self._start_recovery(k, failure, now)

    def _give_up(self, failure: Failure, now: float) -> list[Command]:
        """The session ends: CANCEL everywhere (best effort), then report the failure.

        The service decides what the failure means: before the first token it
        tries another route; later, a ``replaceable`` failure re-runs the whole
        token history on another route.
        """
        lost = frozenset({*self._failed_nodes, *([failure.node_id] if failure.node_id else [])})
        out: list[Command] = [SessionFailed(dataclasses.replace(failure, failed_nodes=lost))]
        out += self._close_all(release=False, now=now)
        # The failed node's CANCEL goes out, but its answer is not waited for: a stopped or silent
        # node would hold the request for close_timeout_s more (its KV lease frees it anyway).
        if failure.node_id:
            for stage in self._stages:
                if stage.spec.node_id == failure.node_id:
                    stage.closed = True
            out += self._maybe_closed(now)
        return out

    # -- recovery -------------------------------------------------------------------------------------

    def _start_recovery(self, k: int, failure: Failure, now: float) -> list[Command]:
        """Replace stage ``k``: CANCEL it, close its stream, ask for a node with the same layers."""
        stage = self._stages[k]
        self.recoveries += 1
        self._failed_nodes.add(stage.spec.node_id)
        self.phase = _RECOVERING
        self._recovery = _Recovery(k, failure, now)
        self._inflight.clear()
        self._deadline = math.inf  # the shell bounds the tracker look-up; the OPENs get their own deadline
        out: list[Command] = []
        if not stage.closed:
            out.append(
                SendFrame(
                    stage.slot, codec.cancel_frame(stage.header, step_id=self._close_id(), reason="replaced")
                )
            )
        out.append(CloseStream(stage.slot))
        stage.closed = True
        out.append(FindReplacement(k, stage.spec.start, stage.spec.end, frozenset(self._failed_nodes)))
        return out

    def on_replacement(
        self, index: int, spec: StageSpec | None, failure: Failure | None, now: float
    ) -> list[Command]:
        """The tracker look-up for stage ``index`` finished: a node (``spec``) or why there is none."""
        rec = self._recovery
        if rec is None or rec.index != index or self.phase != _RECOVERING:
            return []
        old = self._stages[index]
        if spec is None:
            why = failure or Failure("stage", "no replacement found", old.spec.node_id)
            report = RecoveryReport(
                old.spec.node_id,
                "",
                (old.spec.start, old.spec.end),
                0,
                self.epoch,
                now - rec.started,
                ok=False,
                error=why.message,
            )
            out: list[Command] = [Recovered(report)]
            failure_now = Failure(
                why.kind,
                f"{rec.failure.message}; {why.message}",
                old.spec.node_id,
                replaceable=why.replaceable,
                retry_after_s=why.retry_after_s,
            )
            return out + self._give_up(failure_now, now)
        if spec.recipe_fingerprint != old.spec.recipe_fingerprint:
            return self._give_up(
                Failure(
                    "stage", f"replacement {spec.node_id[:8]} runs another runtime recipe", old.spec.node_id
                ),
                now,
            )
        rec.replacement = spec
        self._retired.append(old)
        self.epoch += 1
        self.base = self._close_id() + 1
        new = self._stage(spec, index)
        self._stages[index] = new
        out = [OpenStream(new.slot, spec)]
        out += self._open_epoch(now, keep=self.committed, fresh=frozenset({index}))
        self._deadline = now + self.config.open_timeout_s
        return out

    def _replay(self, now: float) -> list[Command]:
        """Every stage is open in the new epoch: replay the replacement's inputs up to ``committed``."""
        rec = self._recovery
        assert rec is not None  # _acked calls this in the recovering phase only
        rec.replaying = True
        j = rec.index
        c = self.committed
        if c == 0:
            return self._resume(now)
        out: list[Command] = []
        if j == 0:
            new = self._stages[0]
            for start in range(0, c, self.config.step_tokens):
                end = min(c, start + self.config.step_tokens)
                for frame in codec.step_frames(
                    new.header,
                    frame_pb2.PHASE_PREFILL,
                    step_id=self._data_id(start),
                    start=start,
                    token_ids=self.tokens[start:end],
                    replay=True,
                    max_frame_bytes=self.config.limits.max_frame_bytes,
                ):
                    out.append(SendFrame(new.slot, frame))
        else:
            up = self._stages[j - 1]
            target = up.open_frame.open.downstream if up.open_frame is not None else None
            if target is None:
                return self._give_up(Failure("stage", "no push target for the replay", up.spec.node_id), now)
            out.append(
                SendFrame(
                    up.slot,
                    codec.replay_frame(
                        up.header,
                        step_id=self._close_id(),
                        target=target,
                        end=c,
                        step_tokens=self.config.step_tokens,
                    ),
                )
            )
        steps = math.ceil(c / self.config.step_tokens)
        self._deadline = now + self.config.prefill_step_timeout_s * max(1, steps)
        return out

    def _resume(self, now: float) -> list[Command]:
        rec = self._recovery
        assert rec is not None
        old = self._retired[-1]
        new = self._stages[rec.index]
        report = RecoveryReport(
            old.spec.node_id,
            new.spec.node_id,
            (new.spec.start, new.spec.end),
            self.committed,
            self.epoch,
            now - rec.started,
            ok=True,
        )
        self._recovery = None
        self.phase = _RUNNING
        self._sent_end = self.committed
        self._inflight.clear()
        self._progress_at = now
        self._last_report_at = math.nan
        out: list[Command] = [Recovered(report)]
        if self.committed < self.prompt_len:
            out += self._pump(now)
        else:
            out += self._decode_step(now)
        self._arm(now)
        return out

    # -- time -----------------------------------------------------------------------------------------

    def on_tick(self, now: float) -> list[Command]:
        if now < self._deadline:
            return []
        if self.phase == _CLOSING:
            self._deadline = math.inf
            return self._finish_close()
        if self.phase in (_OPENING, _RECOVERING):
            out: list[Command] = []
            waiting = [k for k, s in enumerate(self._stages) if not s.acked]
            resend = [k for k in waiting if self._stages[k].reopen_at <= now]
            if resend and now < self._progress_at + self.config.open_timeout_s:
                for k in resend:
                    stage = self._stages[k]
                    stage.reopen_at = math.inf
                    if stage.open_frame is not None:
                        out.append(SendFrame(stage.slot, stage.open_frame))
                pending = [s.reopen_at for s in self._stages if s.reopen_at < math.inf]
                self._deadline = min([self._progress_at + self.config.open_timeout_s, *pending])
                return out
            if waiting:
                k = waiting[0]
                stage = self._stages[k]
                return self._stage_failed(
                    k,
                    Failure(
                        "stage",
                        f"node {stage.spec.node_id[:8]} did not answer OPEN within "
                        f"{self.config.open_timeout_s:g} s",
                        stage.spec.node_id,
                    ),
                    now,
                )
            rec = self._recovery
            if rec is not None and rec.replaying:
                new = self._stages[rec.index]
                return self._stage_failed(
                    rec.index,
                    Failure(
                        "stage",
                        f"replacement {new.spec.node_id[:8]} did not finish its replay in time",
                        new.spec.node_id,
                    ),
                    now,
                )
            self._deadline = math.inf
            return []
        if self.phase == _RUNNING:
            k = self._stalled()
            stage = self._stages[k]
            waited = now - self._progress_at
            return self._stage_failed(
                k,
                Failure(
                    "stage",
                    f"node {stage.spec.node_id[:8]} did not report a step within {waited:.1f} s",
                    stage.spec.node_id,
                ),
                now,
            )
        self._deadline = math.inf
        return []

    def _stalled(self) -> int:
        """The first stage that has not reported the oldest step the last stage still owes."""
        if self._inflight:
            step = self._inflight[0].step_id
        else:
            step = self._data_id(self.committed)
        for k, s in enumerate(self._stages):
            if s.reported_step < step:
                return k
        return self.n - 1

    # -- the end --------------------------------------------------------------------------------------

    def stop(self, *, release: bool, now: float) -> list[Command]:
        """The client is done (release) or gone / the request failed (cancel): free every stage."""
        if self.phase in (_CLOSING, _DONE):
            return []
        self._stopped = True
        return self._close_all(release=release, now=now)

    def _close_all(self, *, release: bool, now: float) -> list[Command]:
        self._stopped = True
        self._released = release
        self.phase = _CLOSING
        self._inflight.clear()
        out: list[Command] = []
        for stage in self._stages:
            if stage.closed:
                continue
            frame = (
                codec.release_frame(
                    stage.header,
                    step_id=self._close_id(),
                    expected_kv_len=stage.kv,
                    keep_ms=self.config.keep_ms,
                    keep_positions=self.committed if self.config.keep_ms else 0,
                )
                if release
                else codec.cancel_frame(stage.header, step_id=self._close_id(), reason="session ended")
            )
            out.append(SendFrame(stage.slot, frame))
        self._deadline = now + self.config.close_timeout_s
        out += self._maybe_closed(now)
        return out

    @property
    def aligned_prefix(self) -> int:
        """Positions computed exactly as a cold run of a longer prompt would compute them: whole prefill
        steps from position 0 (or from a reused prefix that was itself aligned). Reusing at most this
        many positions, in a multiple of ``step_tokens``, keeps a warm request bit-exact with a cold one
        (llama.cpp's low-order bits depend on how a prompt is cut into batches)."""
        if self.recoveries or self.prompt_len == 0:
            return 0
        step = self.config.step_tokens
        chunked = min(self.prompt_len, self.config.single_from or self.prompt_len)
        return self.reused + (max(0, chunked - self.reused) // step) * step

    def kept_prefix(self) -> list[int]:
        """After a RELEASE with ``keep_ms`` that every stage confirmed: the tokens of the KV the route
        keeps (the committed positions); empty otherwise."""
        if not (self.done and self._released and self.config.keep_ms and self.recoveries == 0):
            return []
        if not all(s.closed_ok for s in self._stages):
            return []
        return self.tokens[: self.committed]

    def _maybe_closed(self, now: float) -> list[Command]:
        if self.phase == _CLOSING and all(s.closed for s in self._stages):
            return self._finish_close()
        return []

    def _finish_close(self) -> list[Command]:
        self.phase = _DONE
        self._deadline = math.inf
        out: list[Command] = [CloseStream(s.slot) for s in self._stages]
        out.append(Closed(self._released))
        return out
