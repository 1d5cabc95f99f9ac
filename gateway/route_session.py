"""A Route Session: the trio shell around :class:`gateway.session_machine.RouteMachine`.

One driver task per session owns the machine: it takes events (messages from
the stages' streams, stream failures, replacement look-ups, the caller's
prompt and stop) from one bounded channel, feeds them to the machine, and
carries out the commands (open/close streams, send frames, forward bytes,
look up replacements, hand tokens to the caller). Each stage stream has a
reader task that puts what arrives into that channel. The machine holds every
decision (docs/protocol.md, Direct push and Recovery); this module only moves
bytes and time.

Lifecycle::

    async with open_route_session(...) as session:   # streams opened, OPEN acknowledged everywhere
        await session.begin(prompt)
        while ...: sampled = await session.next_token()
        session.finished = True                      # leaving: RELEASE (else CANCEL) on every stage

A failure the machine cannot repair in place (no replacement, a second
failure while replacing, a refusal no other node can fix) surfaces from
:meth:`RouteSession.next_token` as a :class:`gateway.errors.GatewayError`; the
service then re-runs the request's token history on another route.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import trio

from gateway.encodings import stage_encodings
from gateway.errors import ContextLengthExceeded, GatewayError, NoRoute, Preempted, StageBusy, StageFailed
from gateway.groups import single_exception
from gateway.grpc_bridge import NodeChannels, StageStream, StreamError
from gateway.recovery import NoSameSpan, RecoveryPolicy
from gateway.routes import Hop, Route, StageInfo
from gateway.session_machine import (
    Closed,
    CloseStream,
    Command,
    EmitToken,
    Failure,
    FindReplacement,
    ForwardBytes,
    HopTimed,
    OpenStream,
    Recovered,
    RouteConfig,
    RouteMachine,
    SendFrame,
    SessionFailed,
    StageSpec,
    StepReport,
    StepTimed,
)
from proto import codec
from proto.codec import Sampled
from proto.errors import ProtocolError, RemoteError
from proto.swarm.v1 import frame_pb2, status_pb2

log = logging.getLogger("swarm.gateway")

EVENT_QUEUE = 64  # messages waiting for the driver; readers wait when it is full (flow control)
LOOKUP_TIMEOUT_S = 20.0  # one replacement look-up at the tracker, Info calls included

__all__ = [
    "DataPlane",
    "OpenProver",
    "RouteSession",
    "Run",
    "Sampled",
    "open_hop_stream",
    "open_route_session",
]


@dataclass(frozen=True)
class DataPlane:
    """How sessions use the swarm's data plane (gateway config)."""

    push: bool = True
    encoding: frame_pb2.Encoding = frame_pb2.ENCODING_F32  # every hop's, unless encoding_mode is auto
    encoding_mode: str = ""  # "auto": per hop by the sender's uplink (gateway.encodings)
    auto_f32_min_mbit_s: float = 400.0
    auto_int8_below_mbit_s: float = 0.0
    prefill_pipeline_steps: int = 4
    recovery_history_bytes: int = 64 * 1024 * 1024
    open_timeout_s: float = 30.0
    prefill_step_timeout_s: float = 120.0
    decode_step_timeout_s: float = 30.0
    decode_timeout_floor_s: float = 3.0
    close_timeout_s: float = 5.0

    def encodings(self, route: Route) -> tuple[frame_pb2.Encoding, ...]:
        """What each stage of ``route`` sends its hidden states in."""
        if self.encoding_mode != "auto":
            return (self.encoding,) * len(route.hops)
        return stage_encodings(
            "auto",
            [h.bandwidth_mbit_s for h in route.hops],
            f32_min_mbit_s=self.auto_f32_min_mbit_s,
            int8_below_mbit_s=self.auto_int8_below_mbit_s,
        )


# (node id, OPEN frame) -> OpenSession.gateway_proof: this gateway's signature over that OPEN
# (proto.signing.sign_open_proof), for tickets that name the gateway.
OpenProver = Callable[[str, frame_pb2.Frame], bytes]


class Run(Protocol):
    """What the service needs of a request's run: a Route Session, or a checked pair of them."""

    finished: bool

    @property
    def relays(self) -> int: ...

    @property
    def recoveries(self) -> int: ...

    @property
    def reused(self) -> int: ...

    def usage(self) -> list[tuple[str, int, int]]: ...

    async def begin(self, prompt: Sequence[int]) -> None: ...

    async def begin_choice(self, prompt: Sequence[int], first: Sampled) -> None: ...

    async def next_token(self) -> Sampled: ...


def open_hop_stream(channels: NodeChannels, hop: Hop) -> AbstractAsyncContextManager[StageStream]:
    """A Session stream to the hop's node: gRPC, or the node's WebSocket when it is relayed through us."""
    relay = getattr(channels, "open_relay_stream", None)
    if hop.relay and relay is not None:
        return relay(hop)
    return channels.open_stage_stream(hop.address, hop.tls_fingerprint)


def _gateway_error(failure: Failure) -> GatewayError:
    if failure.kind == "context":
        return ContextLengthExceeded(failure.message, param="messages")
    retry_s = int(failure.retry_after_s) if failure.retry_after_s else None
    remote = None
    if failure.status:
        remote = RemoteError(failure.status, failure.message, retry=failure.retry or status_pb2.RETRY_NONE)
    if failure.kind == "busy":
        busy = StageBusy(failure.message, node_id=failure.node_id, remote=remote, retry_after_s=retry_s or 2)
        busy.kv_short = failure.kv_short
        return busy
    if failure.kind == "preempted":
        return Preempted(failure.message, node_id=failure.node_id, remote=remote, retry_after_s=retry_s)
    if not failure.replaceable and remote is None:
        remote = RemoteError(status_pb2.STATUS_INTERNAL, failure.message, retry=status_pb2.RETRY_NONE)
    if failure.kind == "no_route":
        return NoRoute(failure.message, retry_after_s=retry_s)
    return StageFailed(
        failure.message,
        node_id=failure.node_id,
        remote=remote,
        retry_after_s=retry_s,
        failed_nodes=failure.failed_nodes,
    )


class RouteSession:
    """One request on one route (see the module docstring)."""

    def __init__(
        self,
        machine: RouteMachine,
        channels: NodeChannels,
        hops: dict[str, Hop],
        recovery: RecoveryPolicy | None,
        limits: codec.FrameLimits,
        prove_open: OpenProver | None = None,
    ) -> None:
        self.machine = machine
        self._prove_open = prove_open
        self._slot_nodes: dict[int, str] = {}  # slot -> node id, for the OPEN proofs
        self.route_epoch = 1
        self.finished = False
        self._channels = channels
        self._hops = hops  # node id -> hop (relay flag, address), for streams opened later
        self._recovery = recovery
        self._limits = limits
        self._events_send, self._events = trio.open_memory_channel[tuple[object, ...]](EVENT_QUEUE)
        budget = machine.config.kv_budget + 2
        self._tokens_send, self._tokens = trio.open_memory_channel[Sampled | GatewayError](budget)
        self._streams: dict[int, StageStream] = {}
        self._scopes: dict[int, trio.CancelScope] = {}
        self._local: list[tuple[object, ...]] = []  # events raised while executing commands
        self._opened = trio.Event()
        self._closed = trio.Event()
        self._failure: GatewayError | None = None
        self._nursery: trio.Nursery | None = None
        self._scope: trio.CancelScope | None = None
        self.on_step: Callable[[StepReport], None] | None = None  # with report_steps (spot checks)
        self.on_timing: Callable[[StepTimed | HopTimed], None] | None = None  # decode timings (metrics)

    # -- what callers use ------------------------------------------------------------------------------

    @property
    def recoveries(self) -> int:
        return self.machine.recoveries

    @property
    def relays(self) -> int:
        """Frames (hidden states, ring steps, replays) this gateway forwarded between stages."""
        return self.machine.statistics().forwarded_frames

    @property
    def node_ids(self) -> list[str]:
        return [s.node_id for s in self.machine.stages]

    def usage(self) -> list[tuple[str, int, int]]:
        return self.machine.usage()

    async def begin(self, prompt: Sequence[int]) -> None:
        await self._events_send.send(("begin", list(prompt)))

    async def begin_choice(self, prompt: Sequence[int], first: Sampled) -> None:
        """n > 1: continue another choice of ``prompt`` from its first token (see the machine)."""
        await self._events_send.send(("begin_choice", list(prompt), first))

    @property
    def reused(self) -> int:
        """Prompt positions taken from the KV source (not prefilled)."""
        return self.machine.reused

    def kept_prefix(self) -> list[int]:
        return self.machine.kept_prefix()

    async def next_token(self) -> Sampled:
        """The next generated token; raises the session's failure once it cannot go on."""
        item = await self._tokens.receive()
        if isinstance(item, GatewayError):
            raise item
        return item

    # -- the driver ----------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The driver. Shielded: a request cancelled mid-way still gets its RELEASE/CANCEL out and
        read; :meth:`abort` (after :meth:`close`, which is bounded) ends it."""
        with trio.CancelScope(shield=True) as scope:
            self._scope = scope
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self._execute(self.machine.open(trio.current_time()))
                while not self.machine.done:
                    await self._step()
                nursery.cancel_scope.cancel()

    def abort(self) -> None:
        """Stop the driver and every stream now (after :meth:`close`)."""
        if self._scope is not None:
            self._scope.cancel()

    async def _step(self) -> None:
        machine = self.machine
        if self._local:
            event = self._local.pop(0)
        else:
            event = None
            with trio.move_on_at(machine.deadline):
                event = await self._events.receive()
        now = trio.current_time()
        if event is None:
            commands = machine.on_tick(now)
        else:
            commands = self._dispatch(event, now)
        await self._execute(commands)

    def _dispatch(self, event: tuple[object, ...], now: float) -> list[Command]:
        kind = event[0]
        m = self.machine
        if kind == "bytes":
            return m.on_bytes(event[1], event[2], now)  # type: ignore[arg-type]
        if kind == "failed":
            return m.on_stream_failed(event[1], event[2], now)  # type: ignore[arg-type]
        if kind == "replacement":
            return m.on_replacement(event[1], event[2], event[3], now)  # type: ignore[arg-type]
        if kind == "begin":
            if m.phase != "ready":
                return []  # the session already failed; next_token() raises it
            return m.begin(event[1], now)  # type: ignore[arg-type]
        if kind == "begin_choice":
            if m.phase != "ready":
                return []
            return m.begin_choice(event[1], event[2], now)  # type: ignore[arg-type]
        if kind == "stop":
            return m.stop(release=bool(event[1]), now=now)
        raise AssertionError(f"unknown event {kind!r}")

    async def _execute(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, SendFrame):
                frame = command.frame
                if self._prove_open is not None and frame.WhichOneof("body") == "open":
                    # Every OPEN sent (re-sends too) carries a fresh proof that this gateway, the one
                    # the route ticket names, sent it (docs/protocol.md, Bodies: OpenSession).
                    frame = frame_pb2.Frame()
                    frame.CopyFrom(command.frame)
                    frame.open.gateway_proof = self._prove_open(self._slot_nodes.get(command.slot, ""), frame)
                try:
                    data = codec.serialize_frame(frame, self._limits)
                except ProtocolError as err:  # a bug: we built a frame the codec refuses
                    log.error("frame not sent: %s", err)
                    continue
                await self._send(command.slot, data)
            elif isinstance(command, ForwardBytes):
                await self._send(command.slot, command.data)
            elif isinstance(command, OpenStream):
                self._slot_nodes[command.slot] = command.stage.node_id
                assert self._nursery is not None
                await self._nursery.start(self._stream, command.slot, command.stage)
            elif isinstance(command, CloseStream):
                # Half-close, so what was queued (a CANCEL to a replaced stage) still goes out; the
                # node then ends the stream, or the stream is cut after the close timeout.
                stream = self._streams.get(command.slot)
                scope = self._scopes.pop(command.slot, None)
                if stream is not None:
                    stream.close_sending()
                if scope is not None:
                    scope.deadline = min(
                        scope.deadline, trio.current_time() + self.machine.config.close_timeout_s
                    )
            elif isinstance(command, EmitToken):
                self._tokens_send.send_nowait(command.sampled)  # bounded by the KV budget
            elif isinstance(command, FindReplacement):
                assert self._nursery is not None
                self._nursery.start_soon(self._find, command)
            elif isinstance(command, StepReport):
                if self.on_step is not None:
                    self.on_step(command)
            elif isinstance(command, StepTimed | HopTimed):
                if self.on_timing is not None:
                    self.on_timing(command)
            elif isinstance(command, Recovered):
                self.route_epoch = self.machine.epoch
                if self._recovery is not None:
                    self._recovery.on_report(command.report)
            elif isinstance(command, SessionFailed):
                if self._failure is None:
                    self._failure = _gateway_error(command.failure)
                    self._opened.set()
                    self._tokens_send.send_nowait(self._failure)
            elif isinstance(command, Closed):
                self._closed.set()
        if self.machine.phase not in ("opening",):
            self._opened.set()

    async def _send(self, slot: int, data: bytes) -> None:
        stream = self._streams.get(slot)
        if stream is None:
            return  # closed meanwhile
        try:
            await stream.send(data)
        except StreamError as err:
            self._local.append(("failed", slot, str(err)))

    async def _stream(self, slot: int, spec: StageSpec, *, task_status: trio.TaskStatus[None]) -> None:
        """Open the stage's stream, then hand everything it receives to the driver until closed."""
        hop = self._hops.get(spec.node_id) or Hop(
            spec.node_id,
            spec.start,
            spec.end,
            spec.address,
            spec.relayed,
            tls_fingerprint=spec.tls_fingerprint,
        )
        started = False
        with trio.CancelScope() as scope:
            self._scopes[slot] = scope
            try:
                async with open_hop_stream(self._channels, hop) as stream:
                    self._streams[slot] = stream
                    task_status.started()
                    started = True
                    while True:
                        data = await stream.receive()
                        await self._events_send.send(("bytes", slot, data))
            except (StreamError, OSError) as err:
                if slot in self._scopes:  # not closed by the machine: a failure to report
                    if started:
                        await self._events_send.send(("failed", slot, str(err)))
                    else:
                        self._local.append(("failed", slot, str(err)))  # the driver is waiting for us
            finally:
                self._streams.pop(slot, None)
                self._scopes.pop(slot, None)
        if not started:
            task_status.started()

    async def _find(self, command: FindReplacement) -> None:
        policy = self._recovery
        spec: StageSpec | None = None
        failure: Failure | None = None
        if policy is None:
            failure = Failure("stage", "this gateway does not replace failed stages", replaceable=True)
        else:
            try:
                with trio.fail_after(LOOKUP_TIMEOUT_S):
                    found = await policy.find(command.start, command.end, command.exclude)
                hop: Hop = found.hop  # type: ignore[assignment]
                info: StageInfo = found.info  # type: ignore[assignment]
                self._hops[hop.node_id] = hop
                spec = StageSpec(
                    hop.node_id,
                    "" if hop.relay else hop.address,
                    hop.start,
                    hop.end,
                    info.recipe_fingerprint,
                    found.ticket,
                    relayed=hop.relay,
                    tls_fingerprint=hop.tls_fingerprint,
                )
            except NoRoute as err:
                failure = Failure(
                    "no_route",
                    f"no live node can take over layers [{command.start}, {command.end}): {err.message}",
                    retry_after_s=err.retry_after_s,
                )
            except NoSameSpan as err:
                failure = Failure("stage", str(err))
            except trio.TooSlowError:
                failure = Failure("stage", f"no replacement found within {LOOKUP_TIMEOUT_S:g} s")
            except GatewayError as err:
                failure = Failure("stage", err.message)
            except Exception as err:  # a bug in the look-up must not take the whole request down
                log.exception("replacement look-up for layers [%d, %d) failed", command.start, command.end)
                failure = Failure("stage", f"replacement look-up failed: {type(err).__name__}")
        await self._events_send.send(("replacement", command.index, spec, failure))

    async def close(self, *, release: bool) -> None:
        """RELEASE (finished) or CANCEL (abandoned) every stage; wait until they answered (bounded)."""
        with trio.CancelScope(shield=True):
            if not self.machine.done:
                await self._events_send.send(("stop", release))
                with trio.move_on_after(self.machine.config.close_timeout_s + 1):
                    await self._closed.wait()


@asynccontextmanager
async def open_route_session(
    channels: NodeChannels,
    route: Route,
    stages: Sequence[StageInfo],
    *,
    session_id: str,
    request_id: str,
    sampling: codec.SamplingSettings,
    kv_budget_tokens: int,
    step_tokens: int,
    max_frame_bytes: int,
    plane: DataPlane = DataPlane(),
    recovery: RecoveryPolicy | None = None,
    kv_source: tuple[str, int] | None = None,
    keep_ms: int = 0,
    single_from: int = 0,
    report_steps: bool = False,
    isolated: bool = False,
    kv_copy: bool = False,
    prove_open: OpenProver | None = None,
    on_timing: Callable[[StepTimed | HopTimed], None] | None = None,
    encodings: Sequence[frame_pb2.Encoding] | None = None,
    max_drafts: int = 0,
    busy_sessions: int = 1,
) -> AsyncIterator[RouteSession]:
    """Open the session on every stage of ``route`` and yield it; close it on the way out.

    Leaving after :attr:`RouteSession.finished` was set sends RELEASE; any
    other exit (an error, the client going away) sends CANCEL. Either way every
    stage frees its KV. Raises the open failure (a :class:`GatewayError`) when a
    stage cannot open the session.

    ``encodings`` (per stage, what it sends on) defaults to the data plane's
    choice for ``route``; the runs of a spot check pass the primary's. ``max_drafts`` > 0 turns
    speculative decoding on (RouteConfig.max_drafts).
    """
    recipe = {s.recipe_fingerprint for s in stages}
    if len(recipe) != 1:
        raise StageFailed(
            f"the stages of route {route.route_id} disagree on the runtime recipe",
            node_id=stages[0].node_id,
            remote=RemoteError(
                status_pb2.STATUS_FINGERPRINT_MISMATCH, "recipes differ", retry=status_pb2.RETRY_NONE
            ),
        )
    # Room for the token ids a stage adds when it pushes to the next one.
    node_frame_bytes = max(64 * 1024, max_frame_bytes - 64 * 1024)
    config = RouteConfig(
        session_id=session_id,
        request_id=request_id,
        model_fingerprint=route.model_fingerprint,
        sampling=sampling,
        kv_budget=kv_budget_tokens,
        step_tokens=step_tokens,
        node_frame_bytes=node_frame_bytes,
        limits=codec.FrameLimits(max_frame_bytes=max_frame_bytes),
        push=plane.push,
        encoding=plane.encoding,
        encodings=tuple(encodings) if encodings is not None else plane.encodings(route),
        recovery_history_bytes=plane.recovery_history_bytes if recovery is not None else 0,
        prefill_pipeline_steps=plane.prefill_pipeline_steps,
        max_recoveries=recovery.max_recoveries if recovery is not None else 0,
        open_timeout_s=plane.open_timeout_s,
        prefill_step_timeout_s=plane.prefill_step_timeout_s,
        decode_step_timeout_s=plane.decode_step_timeout_s,
        decode_timeout_floor_s=plane.decode_timeout_floor_s,
        close_timeout_s=plane.close_timeout_s,
        expected_step_s=route.expected_ms_per_token / 1000 if route.expected_ms_per_token > 0 else math.nan,
        busy_sessions=busy_sessions,
        kv_source=kv_source,
        kv_copy=kv_copy,
        keep_ms=keep_ms,
        single_from=single_from,
        report_steps=report_steps,
        isolated=isolated,
        max_drafts=max_drafts,
    )
    specs = [
        StageSpec(
            hop.node_id,
            "" if hop.relay else hop.address,
            hop.start,
            hop.end,
            info.recipe_fingerprint,
            route.ticket,
            relayed=hop.relay,
            tls_fingerprint=hop.tls_fingerprint,
        )
        for hop, info in zip(route.hops, stages, strict=True)
    ]
    machine = RouteMachine(config, specs, new_token=lambda: secrets.token_bytes(16))
    session = RouteSession(
        machine, channels, {h.node_id: h for h in route.hops}, recovery, config.limits, prove_open
    )
    session.on_timing = on_timing
    with single_exception():  # the body's own exception leaves as itself, not in a group
        async with trio.open_nursery() as nursery:
            await nursery.start(session.run)
            try:
                await session._opened.wait()
                if session._failure is not None:
                    raise session._failure
                yield session
            finally:
                await session.close(release=session.finished)
                session.abort()
