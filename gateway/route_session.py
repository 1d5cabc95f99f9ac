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

Not done here (yet): replacing a failed stage and replaying its span
(docs/gateway.md, Limits). A failure mid-stream ends the request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio

from gateway.errors import ContextLengthExceeded, GatewayError, StageBusy, StageFailed, UpstreamFailed
from gateway.grpc_bridge import NodeChannels, StageStream, StreamError
from gateway.routes import Route, StageInfo
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
    ) -> None:
        self.route = route
        self._stages = stages
        self._step_tokens = step_tokens
        self._limits = limits
        self._reply_timeout_s = reply_timeout_s
        self._step_id = 1  # OPEN was step 1
        self._history: list[int] = []
        self.finished = False

    @property
    def kv_len(self) -> int:
        return self._stages[-1].kv_len

    def usage(self) -> SessionUsage:
        return SessionUsage([(s.info.node_id, s.tokens, s.steps) for s in self._stages])

    def _next_step(self) -> int:
        self._step_id += 1
        return self._step_id

    async def _receive(self, stage: _Stage) -> frame_pb2.Frame:
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
            frame = codec.parse_frame(data, self._limits)
        except ProtocolError as err:
            raise StageFailed(
                f"node {stage.info.node_id[:8]} sent an unreadable frame: {err}", node_id=stage.info.node_id
            ) from err
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
        await stage.stream.send(data)

    async def _run_step(self, phase: frame_pb2.Phase, tokens: Sequence[int], sample: bool) -> Sampled | None:
        """One step through every stage; returns the sampled token when ``sample``."""
        step_id = self._next_step()
        start = self._stages[0].kv_len
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
                    a, b = reply.positions.start - start, reply.positions.end - start
                    relay = codec.relay_frame(
                        reply,
                        nxt.header,
                        step_id=step_id,
                        token_ids=tokens[a:b] if nxt is last else (),
                        sample=sample and nxt is last,
                    )
                    await self._send(nxt, relay)
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
            stream = await stack.enter_async_context(channels.open_stage_stream(hop.address))
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
            route, built, step_tokens=step_tokens, limits=limits, reply_timeout_s=reply_timeout_s
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
