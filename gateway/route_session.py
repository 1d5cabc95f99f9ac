"""A Route Session: one client request computed by a chain of stages, one gRPC stream per stage.

Lifecycle (docs/protocol.md, Session lifecycle)::

    open_route_session()  -> streams to every stage, OPEN to all at once, check every open_ack
    prefill(prompt)       -> steps of <= step_tokens positions; stage 0 gets token ids, each
                             result chunk of stage k is relayed untouched (codec.relay_frame) to
                             stage k+1; the last stage gets token ids too and samples after the
                             final prefill step
    decode(token)         -> one position through every stage, the last one samples
    (leaving the context) -> RELEASE to every stage at once if finished, else CANCEL; both free
                             the KV on every node; replies are awaited at most close_timeout_s

Invariants: one step in flight per session; step ids strictly increase and
are shared by all stages and chunks of a step; every stage's KV length is
tracked from its replies and must equal the next step's ``expected_kv_len``
(a node that disagrees is an upstream failure, never silently fixed); replies
are checked for session, step and phase before use.

Recovery (``gateway/recovery.py``): with a :class:`RecoveryPolicy`, a step
that fails on one stage replaces that stage with a same-span node, re-opens the
survivors with the next route epoch (they keep their KV), replays the span's
input history into the replacement and runs the step again; the caller never
sees the failure unless recovery itself is impossible.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace

import trio

from gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    NoRoute,
    StageBusy,
    StageFailed,
    UpstreamFailed,
)
from gateway.grpc_bridge import NodeChannels, StageStream, StreamError
from gateway.recovery import (
    NoReplacement,
    NoSameSpan,
    RecoveryPolicy,
    RecoveryReport,
    SpanHistory,
    SpanRecoveryImpossible,
    replay_frames,
)
from gateway.routes import Hop, Route, StageInfo
from proto import codec
from proto.errors import ProtocolError, RemoteError, error_from_body
from proto.swarm.v1 import frame_pb2, status_pb2

log = logging.getLogger("swarm.gateway")


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    end_of_generation: bool


@dataclass
class _Stage:
    info: StageInfo
    header: codec.SessionHeader
    stream: StageStream
    kv_len: int = 0
    tokens: int = 0  # positions computed, for usage attribution
    steps: int = 0
    granted: int = 0


@dataclass
class _Reopen:
    """What re-opening a stage needs: where streams come from and the session's OPEN settings."""

    channels: NodeChannels
    stack: AsyncExitStack
    tickets: list[bytes]  # per stage: the ticket that names that stage's node for its layers
    sampling: codec.SamplingSettings
    kv_budget_tokens: int
    node_frame_bytes: int


@dataclass
class SessionUsage:
    """Per node: positions computed and steps run (sent to the tracker after the request)."""

    entries: list[tuple[str, int, int]] = field(default_factory=list)


class RouteSession:
    def __init__(
        self,
        route: Route,
        stages: list[_Stage],
        *,
        step_tokens: int,
        limits: codec.FrameLimits,
        reply_timeout_s: float,
        recovery: RecoveryPolicy | None = None,
        reopen: _Reopen | None = None,
    ) -> None:
        self.route = route
        self._stages = stages
        self._step_tokens = step_tokens
        self._limits = limits
        self._reply_timeout_s = reply_timeout_s
        self._step_id = 1  # OPEN was step 1
        self._history: list[int] = []
        self.finished = False
        self._recovery = recovery if reopen is not None else None
        self._reopen = reopen
        self._span_history = SpanHistory(
            len(stages), recovery.max_history_bytes if recovery is not None else 0
        )
        if self._recovery is None:
            self._span_history.hidden_kept = False
        self._epoch = 1
        self._retired: list[_Stage] = []  # replaced stages (usage still counts their work)
        self._failed_nodes: set[str] = set()
        self.recoveries = 0
        self.relays = 0  # hidden-state frames this gateway relayed from one stage to the next

    @property
    def kv_len(self) -> int:
        return self._stages[-1].kv_len

    def usage(self) -> SessionUsage:
        return SessionUsage([(s.info.node_id, s.tokens, s.steps) for s in [*self._retired, *self._stages]])

    @property
    def route_epoch(self) -> int:
        return self._epoch

    @property
    def node_ids(self) -> list[str]:
        return [s.info.node_id for s in self._stages]

    def _next_step(self) -> int:
        self._step_id += 1
        return self._step_id

    async def _next_reply(self, stage: _Stage) -> frame_pb2.Frame:
        """The next reply of ``stage``, parsed, within the reply timeout."""
        try:
            with trio.fail_after(self._reply_timeout_s):
                data = await stage.stream.receive()
        except trio.TooSlowError as err:
            raise StageFailed(
                f"node {stage.info.node_id[:8]} did not reply within {self._reply_timeout_s:g} s",
                node_id=stage.info.node_id,
            ) from err
        except StreamError as err:
            raise StageFailed(f"node {stage.info.node_id[:8]}: {err}", node_id=stage.info.node_id) from err
        try:
            return codec.parse_frame(data, self._limits)
        except ProtocolError as err:
            raise StageFailed(
                f"node {stage.info.node_id[:8]} sent an unreadable frame: {err}", node_id=stage.info.node_id
            ) from err

    async def _receive(self, stage: _Stage) -> frame_pb2.Frame:
        """The next reply of ``stage``, checked: an error reply raises, another session's is refused."""
        frame = await self._next_reply(stage)
        if codec.body_kind(frame) == "error":
            remote = error_from_body(frame.error)
            raise _remote_failure(stage, remote)
        if frame.session_id != stage.header.session_id:
            raise StageFailed(
                f"node {stage.info.node_id[:8]} answered for another session", node_id=stage.info.node_id
            )
        return frame

    async def _send(self, stage: _Stage, frame: frame_pb2.Frame) -> None:
        try:
            data = codec.serialize_frame(frame, self._limits)
        except ProtocolError as err:
            raise UpstreamFailed(f"cannot build a frame for node {stage.info.node_id[:8]}: {err}") from err
        try:
            await stage.stream.send(data)
        except StreamError as err:
            raise StageFailed(f"node {stage.info.node_id[:8]}: {err}", node_id=stage.info.node_id) from err

    async def _run_step(self, phase: frame_pb2.Phase, tokens: Sequence[int], sample: bool) -> Sampled | None:
        """One step through every stage; a failed stage is replaced and the step run again (recovery)."""
        while True:
            self._span_history.begin_step()
            try:
                sampled = await self._run_step_once(phase, tokens, sample)
            except StageFailed as err:
                if self._recovery is None or not _replaceable(err):
                    raise
                await self._recover(err)
                continue
            self._span_history.commit(tokens)
            return sampled

    async def _run_step_once(
        self, phase: frame_pb2.Phase, tokens: Sequence[int], sample: bool
    ) -> Sampled | None:
        """One step through every stage; returns the sampled token when ``sample``."""
        start = self._stages[0].kv_len
        return await self._step_through(self._next_step(), phase, start, tokens, sample)

    async def _step_through(
        self,
        step_id: int,
        phase: frame_pb2.Phase,
        start: int,
        tokens: Sequence[int],
        sample: bool,
    ) -> Sampled | None:
        n = len(tokens)
        first, last = self._stages[0], self._stages[-1]
        for frame in codec.step_frames(
            first.header,
            phase,
            step_id=step_id,
            start=start,
            token_ids=tokens,
            sample=sample and first is last,
            max_frame_bytes=self._limits.max_frame_bytes,
        ):
            await self._send(first, frame)
        sampled: Sampled | None = None
        for k, stage in enumerate(self._stages):
            nxt = self._stages[k + 1] if k + 1 < len(self._stages) else None
            if stage.kv_len != start:
                raise StageFailed(
                    f"node {stage.info.node_id[:8]} holds {stage.kv_len} positions, expected {start}",
                    node_id=stage.info.node_id,
                )
            while True:
                reply = await self._receive(stage)
                if codec.body_kind(reply) != "result" or reply.step_id != step_id or reply.phase != phase:
                    raise StageFailed(
                        f"node {stage.info.node_id[:8]} answered step {reply.step_id} "
                        f"({codec.body_kind(reply)}) while step {step_id} was expected",
                        node_id=stage.info.node_id,
                    )
                done = not reply.HasField("chunk") or reply.chunk.index == reply.chunk.count - 1
                if nxt is not None:
                    relayed = _relay(reply, nxt.header, step_id, start, tokens, sample, nxt is last)
                    await self._send(nxt, relayed)
                    self.relays += 1
                    self._span_history.record(k + 1, relayed)
                elif sample and done:
                    if len(reply.result.sampled) != 1:
                        raise StageFailed(
                            f"last stage {stage.info.node_id[:8]} sent no sampled token",
                            node_id=stage.info.node_id,
                        )
                    t = reply.result.sampled[0]
                    sampled = Sampled(
                        int(t.token_id),
                        float(t.logprob),
                        tuple((int(p.token_id), float(p.logprob)) for p in t.top_logprobs),
                        bool(t.end_of_generation),
                    )
                if done:
                    if reply.kv_len != start + n:
                        raise StageFailed(
                            f"node {stage.info.node_id[:8]} reports kv_len {reply.kv_len} after a "
                            f"step ending at {start + n}",
                            node_id=stage.info.node_id,
                        )
                    stage.kv_len = int(reply.kv_len)
                    stage.tokens += n
                    stage.steps += 1
                    break
        return sampled

    async def prefill(self, prompt: Sequence[int]) -> Sampled:
        if not prompt:
            raise UpstreamFailed("empty prompt")  # callers refuse it earlier
        sampled: Sampled | None = None
        for a in range(0, len(prompt), self._step_tokens):
            chunk = list(prompt[a : a + self._step_tokens])
            final = a + len(chunk) == len(prompt)
            sampled = await self._run_step(frame_pb2.PHASE_PREFILL, chunk, sample=final)
        self._history.extend(prompt)
        assert sampled is not None  # the final step samples
        return sampled

    async def decode(self, token: int) -> Sampled:
        sampled = await self._run_step(frame_pb2.PHASE_DECODE, [token], sample=True)
        assert sampled is not None
        self._history.append(token)
        return sampled

    # ------------------------------------------------------------------ recovery

    def _stage_index(self, node_id: str) -> int | None:
        for i, stage in enumerate(self._stages):
            if stage.info.node_id == node_id:
                return i
        return None

    async def _recover(self, err: StageFailed) -> None:
        """Replace the failed stage (and any that fail while doing so), bounded; raises if impossible."""
        assert self._recovery is not None and self._reopen is not None
        policy = self._recovery
        failure: StageFailed = err
        while True:
            index = self._stage_index(failure.node_id)
            if index is None:
                raise failure
            if self.recoveries >= policy.max_recoveries:
                raise StageFailed(
                    f"{failure.message} (gave up after {self.recoveries} stage replacements)",
                    node_id=failure.node_id,
                    remote=None,
                ) from failure
            self.recoveries += 1
            self._failed_nodes.add(failure.node_id)
            stage = self._stages[index]
            span = (stage.header.shard_start, stage.header.shard_end)
            started = trio.current_time()
            if not self._span_history.can_replay(index):
                raise SpanRecoveryImpossible(
                    f"{failure.message}; the hidden-state history of layers [{span[0]}, {span[1]}) "
                    "was not kept (over the per-session bound)",
                    node_id=failure.node_id,
                ) from failure
            log.info(
                "replacing stage %s [%d, %d) of session %s: %s",
                failure.node_id[:8],
                span[0],
                span[1],
                stage.header.session_id[:8],
                failure.message,
            )
            try:
                replacement = await policy.find(span[0], span[1], frozenset(self._failed_nodes))
            except NoRoute as err:
                self._report_recovery(failure, "", span, started, ok=False, error=err.message)
                raise NoReplacement(
                    f"{failure.message}; no live node can take over layers [{span[0]}, {span[1]}): "
                    f"{err.message}",
                    retry_after_s=err.retry_after_s,
                ) from failure
            except NoSameSpan as err:
                raise SpanRecoveryImpossible(
                    f"{failure.message}; {err}", node_id=failure.node_id
                ) from failure
            new_node = getattr(replacement.info, "node_id", "?")
            try:
                await self._replace(index, replacement)
            except StageFailed as again:
                self._report_recovery(failure, new_node, span, started, ok=False, error=again.message)
                failure = again
                continue
            self._report_recovery(failure, new_node, span, started, ok=True)
            return

    def _report_recovery(
        self,
        failure: StageFailed,
        new_node: str,
        span: tuple[int, int],
        started: float,
        *,
        ok: bool,
        error: str = "",
    ) -> None:
        assert self._recovery is not None
        self._recovery.on_report(
            RecoveryReport(
                failure.node_id,
                new_node,
                span,
                self._span_history.committed,
                self._epoch,
                trio.current_time() - started,
                ok=ok,
                error=error,
            )
        )

    async def _receive_step(self, stage: _Stage, step_id: int) -> frame_pb2.Frame:
        """The reply to ``step_id``, skipping late replies to the abandoned step (bounded)."""
        for _skip in range(64):
            frame = await self._next_reply(stage)
            if frame.step_id != step_id:
                continue
            if codec.body_kind(frame) == "error":
                raise _remote_failure(stage, error_from_body(frame.error))
            return frame
        raise StageFailed(
            f"node {stage.info.node_id[:8]} sent too many replies to abandoned steps",
            node_id=stage.info.node_id,
        )

    async def _replace(self, index: int, replacement: object) -> None:
        """Next epoch: re-attach the survivors at the committed length, open and replay the new stage."""
        assert self._reopen is not None
        reopen = self._reopen
        hop: Hop = replacement.hop  # type: ignore[attr-defined]
        info: StageInfo = replacement.info  # type: ignore[attr-defined]
        ticket: bytes = replacement.ticket  # type: ignore[attr-defined]
        old = self._stages[index]
        if info.recipe_fingerprint != old.header.recipe_fingerprint:
            raise SpanRecoveryImpossible(
                f"replacement {info.node_id[:8]} runs another runtime recipe", node_id=old.info.node_id
            )
        committed = self._span_history.committed
        epoch = self._epoch + 1
        # Stop the failed stage's session if it is still there (best effort, no reply awaited).
        with trio.move_on_after(0.5):
            try:
                await self._send(
                    old, codec.cancel_frame(old.header, step_id=self._next_step(), reason="replaced")
                )
            except (StreamError, GatewayError):
                pass
        stream = await reopen.stack.enter_async_context(open_hop_stream(reopen.channels, hop))
        new = _Stage(
            info=info,
            header=replace(old.header, route_epoch=epoch, recipe_fingerprint=info.recipe_fingerprint),
            stream=stream,
        )
        stages = list(self._stages)
        stages[index] = new
        for stage in stages:
            stage.header = replace(stage.header, route_epoch=epoch)
        tickets = list(reopen.tickets)
        tickets[index] = ticket
        step_id = self._next_step()
        last = len(stages) - 1
        errors: list[StageFailed] = []

        async def open_one(i: int, stage: _Stage) -> None:
            frame = codec.open_frame(
                stage.header,
                step_id=step_id,
                route_ticket=tickets[i],
                kv_budget_tokens=reopen.kv_budget_tokens,
                sampling=reopen.sampling if i == last else None,
                output_encoding=frame_pb2.ENCODING_F32,
                max_frame_bytes=reopen.node_frame_bytes,
                keep_kv_len=committed if stage is not new else 0,
            )
            try:
                busy_until = trio.current_time() + self._reply_timeout_s
                while True:
                    await self._send(stage, frame)
                    try:
                        ack = await self._receive_step(stage, step_id)
                    except StageBusy as busy:
                        # A survivor still computing the abandoned step refuses the re-attach until done.
                        remote = busy.remote
                        if getattr(remote, "retry", None) != status_pb2.RETRY_SAME:
                            raise
                        if trio.current_time() > busy_until:
                            raise StageFailed(
                                f"node {stage.info.node_id[:8]} stayed busy", node_id=stage.info.node_id
                            ) from busy
                        await trio.sleep(max(0.05, getattr(remote, "retry_after_ms", 50) / 1000))
                        continue
                    break
                want = 0 if stage is new else committed
                if codec.body_kind(ack) != "open_ack" or ack.kv_len != want:
                    raise StageFailed(
                        f"node {stage.info.node_id[:8]} answered the epoch {epoch} OPEN with "
                        f"{codec.body_kind(ack)} kv_len={ack.kv_len}, expected {want}",
                        node_id=stage.info.node_id,
                    )
                stage.kv_len = want
                stage.granted = int(ack.open_ack.kv_tokens_granted)
            except StageFailed as failure:
                errors.append(failure)

        async with trio.open_nursery() as nursery:
            for i, stage in enumerate(stages):
                nursery.start_soon(open_one, i, stage)
        self._stages = stages
        self._epoch = epoch
        reopen.tickets[:] = tickets
        self._retired.append(old)
        if errors:
            raise errors[0]
        # Replay the span's inputs into the new stage; its outputs are not needed (the next stage has them).
        try:
            steps = replay_frames(
                self._span_history,
                index,
                is_last=index == last,
                header=new.header,
                first_step_id=self._step_id + 1,
                step_tokens=self._step_tokens,
                max_frame_bytes=max(64 * 1024, self._limits.max_frame_bytes - 64 * 1024),
                limits=self._limits,
            )
        except (ValueError, ProtocolError) as err:
            raise SpanRecoveryImpossible(
                f"cannot rebuild the input history of layers [{new.header.shard_start}, "
                f"{new.header.shard_end}): {err}",
                node_id=old.info.node_id,
            ) from err
        for frames in steps:
            step_id = self._next_step()
            start = frames[0].positions.start
            end = frames[-1].positions.end
            for frame in frames:
                await self._send(new, frame)
            while True:
                reply = await self._receive(new)
                if codec.body_kind(reply) != "result" or reply.step_id != step_id:
                    raise StageFailed(
                        f"replacement {new.info.node_id[:8]} answered step {reply.step_id} "
                        f"({codec.body_kind(reply)}) during replay, step {step_id} expected",
                        node_id=new.info.node_id,
                    )
                if not reply.HasField("chunk") or reply.chunk.index == reply.chunk.count - 1:
                    break
            if reply.kv_len != end:
                raise StageFailed(
                    f"replacement {new.info.node_id[:8]} holds {reply.kv_len} positions after replaying "
                    f"up to {end}",
                    node_id=new.info.node_id,
                )
            new.kv_len = end
            new.tokens += end - start
            new.steps += 1

    async def close(self, *, release: bool, reason: str, timeout_s: float) -> None:
        """RELEASE (finished) or CANCEL (abandoned) on every stage at once; wait for ``closed`` replies."""
        step_id = self._next_step()

        async def close_one(stage: _Stage) -> None:
            frame = (
                codec.release_frame(stage.header, step_id=step_id, expected_kv_len=stage.kv_len)
                if release
                else codec.cancel_frame(stage.header, step_id=step_id, reason=reason[:200])
            )
            with trio.move_on_after(timeout_s):
                try:
                    await self._send(stage, frame)
                    # A step may still be in flight (cancelled mid-step): skip its replies.
                    while True:
                        data = await stage.stream.receive()
                        reply = codec.parse_frame(data, self._limits)
                        if reply.phase in (frame_pb2.PHASE_RELEASE, frame_pb2.PHASE_CANCEL):
                            return
                except (StreamError, ProtocolError, GatewayError) as err:
                    log.debug("close of stage %s failed: %s", stage.info.node_id[:8], err)

        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for stage in self._stages:
                    nursery.start_soon(close_one, stage)


def _relay(
    reply: frame_pb2.Frame,
    header: codec.SessionHeader,
    step_id: int,
    start: int,
    tokens: Sequence[int],
    sample: bool,
    to_last: bool,
) -> frame_pb2.Frame:
    """A stage's result chunk as the next stage's input; the last stage also gets its token ids."""
    a, b = reply.positions.start - start, reply.positions.end - start
    return codec.relay_frame(
        reply, header, step_id=step_id, token_ids=tokens[a:b] if to_last else (), sample=sample and to_last
    )


def _replaceable(err: StageFailed) -> bool:
    """A failure another node for the same span can fix: a broken or silent stream, or a hint not NONE."""
    if isinstance(err, SpanRecoveryImpossible):
        return False
    remote = err.remote
    if remote is None:
        return True
    return getattr(remote, "retry", status_pb2.RETRY_NONE) != status_pb2.RETRY_NONE


def open_hop_stream(channels: NodeChannels, hop: Hop) -> AbstractAsyncContextManager[StageStream]:
    """A Session stream to the hop's node: gRPC, or the node's WebSocket when it is relayed through us."""
    relay = getattr(channels, "open_relay_stream", None)
    if hop.relay and relay is not None:
        return relay(hop)  # type: ignore[no-any-return]
    return channels.open_stage_stream(hop.address)


def _remote_failure(stage: _Stage, remote: RemoteError) -> GatewayError:
    who = f"node {stage.info.node_id[:8]} ({stage.info.address})"
    retry_s = max(1, math.ceil(remote.retry_after_ms / 1000)) if remote.retry_after_ms else None
    if remote.status == status_pb2.STATUS_CONTEXT_EXCEEDED:
        return ContextLengthExceeded(f"{who}: {remote.message}", param="messages")
    if remote.status in (status_pb2.STATUS_RESOURCE_EXHAUSTED, status_pb2.STATUS_UNAVAILABLE):
        return StageBusy(
            f"{who} is full or draining: {remote.message}",
            node_id=stage.info.node_id,
            remote=remote,
            retry_after_s=retry_s or 2,
        )
    return StageFailed(
        f"{who} failed: {remote}", node_id=stage.info.node_id, remote=remote, retry_after_s=retry_s
    )


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
    reply_timeout_s: float,
    close_timeout_s: float,
    recovery: RecoveryPolicy | None = None,
) -> AsyncIterator[RouteSession]:
    """Open every stage's stream, OPEN the session on all of them, yield it; close it on the way out.

    Leaving normally after :attr:`RouteSession.finished` was set sends RELEASE;
    any other exit (error, cancellation because the client went away) sends
    CANCEL. Either way every stage frees its KV.
    """
    recipe = {s.recipe_fingerprint for s in stages}
    if len(recipe) != 1:
        raise UpstreamFailed(f"the stages of route {route.route_id} disagree on the runtime recipe")
    limits = codec.FrameLimits(max_frame_bytes=max_frame_bytes)
    # Room for the token ids the gateway adds when relaying a result chunk to the last stage.
    node_frame_bytes = max(64 * 1024, max_frame_bytes - 64 * 1024)
    async with AsyncExitStack() as stack:
        built: list[_Stage] = []
        for hop, info in zip(route.hops, stages, strict=True):
            stream = await stack.enter_async_context(open_hop_stream(channels, hop))
            header = codec.SessionHeader(
                session_id=session_id,
                route_epoch=1,
                model_fingerprint=route.model_fingerprint,
                recipe_fingerprint=info.recipe_fingerprint,
                shard_start=hop.start,
                shard_end=hop.end,
                request_id=request_id,
            )
            built.append(_Stage(info=info, header=header, stream=stream))
        session = RouteSession(
            route,
            built,
            step_tokens=step_tokens,
            limits=limits,
            reply_timeout_s=reply_timeout_s,
            recovery=recovery,
            reopen=_Reopen(
                channels=channels,
                stack=stack,
                tickets=[route.ticket] * len(built),
                sampling=sampling,
                kv_budget_tokens=kv_budget_tokens,
                node_frame_bytes=node_frame_bytes,
            ),
        )
        failures: list[GatewayError] = []
        opened: list[_Stage] = []

        async def open_one(stage: _Stage, is_last: bool) -> None:
            frame = codec.open_frame(
                stage.header,
                step_id=1,
                route_ticket=route.ticket,
                kv_budget_tokens=kv_budget_tokens,
                sampling=sampling if is_last else None,
                output_encoding=frame_pb2.ENCODING_F32,
                max_frame_bytes=node_frame_bytes,
            )
            try:
                await session._send(stage, frame)
                ack = await session._receive(stage)
            except GatewayError as err:
                failures.append(err)
                return
            if codec.body_kind(ack) != "open_ack" or ack.kv_len != 0:
                failures.append(
                    StageFailed(
                        f"node {stage.info.node_id[:8]} answered OPEN with "
                        f"{codec.body_kind(ack)} kv_len={ack.kv_len}",
                        node_id=stage.info.node_id,
                    )
                )
                opened.append(stage)
                return
            stage.granted = int(ack.open_ack.kv_tokens_granted)
            opened.append(stage)
            if stage.granted < kv_budget_tokens:
                failures.append(
                    StageBusy(
                        f"node {stage.info.node_id[:8]} granted {stage.granted} KV positions, "
                        f"{kv_budget_tokens} were asked",
                        node_id=stage.info.node_id,
                        retry_after_s=2,
                    )
                )

        async with trio.open_nursery() as nursery:
            for i, stage in enumerate(built):
                nursery.start_soon(open_one, stage, i == len(built) - 1)
        if failures:
            if opened:
                await RouteSession(
                    route, opened, step_tokens=step_tokens, limits=limits, reply_timeout_s=reply_timeout_s
                ).close(release=False, reason="open failed on another stage", timeout_s=close_timeout_s)
            raise failures[0]
        try:
            yield session
        finally:
            await session.close(
                release=session.finished,
                reason="finished" if session.finished else "client went away or request failed",
                timeout_s=close_timeout_s,
            )
