"""The trio shell around the session machine: connections, outbound queues, effects.

A transport (gRPC, the WebSocket relay) does three things:

    conn = hub.open_connection()           # per stream / socket
    await hub.feed(conn, frame_bytes)      # for every received message, in order
    data = await conn.outbound.receive()   # reply bytes to write, until EndOfChannel
    hub.input_ended(conn)                  # peer half-closed: finish pending replies, then end
    hub.close_connection(conn)             # transport gone

The hub runs the :class:`~node.session_machine.FrameServer` actions: engine
effects go to the :class:`~node.scheduler.Scheduler` in emission order, and a
``Send`` that follows an engine effect waits for it (an OPEN is acknowledged
only once its KV is reserved). Outbound queues are bounded; a peer that stops
reading until its queue is full loses its connection (its sessions then wait
for a re-attach), so a slow gateway never blocks the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from node.push import PushLinks
from node.scheduler import ControlDone, Scheduler
from node.session_machine import Action, Compute, Drop, FrameServer, FreeKv, OpenKv, Push, Send, StepOutcome
from proto import codec
from proto.errors import InternalError, ProtocolError

log = logging.getLogger("swarm.node.hub")

OUTBOUND_FRAMES = 512


class TooManyConnections(RuntimeError):
    """The hub already holds ``max_connections`` connections."""


class _ChannelSink:
    """A connection's replies: a bounded trio memory channel the transport reads as ``conn.outbound``."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[bytes](OUTBOUND_FRAMES)

    def put(self, data: bytes) -> bool:
        """Queue one reply; False when the peer already has ``OUTBOUND_FRAMES`` unread replies."""
        try:
            self.send.send_nowait(data)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def end(self) -> None:
        """No more replies: the transport ends the stream once the queued ones are written."""
        self.send.close()


@dataclass(eq=False)
class Connection:
    conn_id: int
    outbound: trio.MemoryReceiveChannel[bytes]
    sink: _ChannelSink
    input_closed: bool = False
    closed: bool = False
    frames_out: int = 0
    opened_s: float = field(default_factory=time.monotonic)


class Hub:
    def __init__(
        self, server: FrameServer, clock: Callable[[], float] = time.monotonic, *, max_connections: int = 0
    ) -> None:
        self.server = server
        self.clock = clock
        # Streams cost memory before any OPEN: bound them too (default: 4 per session slot, plus room).
        self.max_connections = max_connections or 4 * server.spec.max_sessions + 64
        self.scheduler: Scheduler | None = None
        self.pushes: PushLinks | None = None
        self._conns: dict[int, Connection] = {}
        self.dropped_slow_connections = 0

    def attach(self, scheduler: Scheduler, pushes: PushLinks | None = None) -> None:
        self.scheduler = scheduler
        self.pushes = pushes

    def on_push_failed(self, session_id: str, message: str, epoch: int | None = None) -> None:
        """A push of this session could not be delivered: the machine tells the session's owner."""
        self.execute_nowait(self.server.push_failed(session_id, message, epoch))

    # -- transport API ---------------------------------------------------------------------------

    def open_connection(self) -> Connection:
        if len(self._conns) >= self.max_connections:
            raise TooManyConnections(f"this node holds its maximum of {self.max_connections} connections")
        conn_id = self.server.connect()
        sink = _ChannelSink()
        conn = Connection(conn_id, sink.receive, sink)
        self._conns[conn_id] = conn
        return conn

    async def feed(self, conn: Connection, data: bytes) -> None:
        """Handle one frame: steps and refusals complete at once; a frame whose reply must wait
        for a control effect (OPEN reserving KV, a re-attach truncating it) waits here, so
        replies keep their order."""
        if conn.closed:
            return
        actions = self.server.handle(conn.conn_id, data, self.clock())
        if any(not isinstance(a, Send | Compute | Drop | Push) for a in actions):
            await self.execute(actions)
        else:
            self.execute_nowait(actions)

    def input_ended(self, conn: Connection) -> None:
        conn.input_closed = True
        self._maybe_finish(conn)

    def close_connection(self, conn: Connection) -> None:
        if conn.conn_id not in self._conns:
            return
        del self._conns[conn.conn_id]
        conn.closed = True
        conn.sink.end()
        self.server.disconnect(conn.conn_id, self.clock())

    @property
    def connections(self) -> int:
        return len(self._conns)

    # -- actions ---------------------------------------------------------------------------------

    async def execute(self, actions: list[Action]) -> None:
        waiting: list[ControlDone] = []
        for action in actions:
            if isinstance(action, Push):
                self._push(action)
            elif isinstance(action, Send):
                if waiting:
                    for done in waiting:
                        await done.event.wait()
                    failed = [d for d in waiting if d.error is not None]
                    waiting = []
                    if failed:
                        self._effects_failed(failed, action)
                        continue
                self._deliver(action)
            else:
                submitted = self._submit(action)
                if submitted is not None:
                    waiting.append(submitted)
        for done in waiting:  # effects with no reply after them (cancel of a busy session...)
            await done.event.wait()

    def execute_nowait(self, actions: list[Action]) -> None:
        """For scheduler callbacks and timers: effects are queued, replies delivered at once."""
        for action in actions:
            if isinstance(action, Send):
                self._deliver(action)
            elif isinstance(action, Push):
                self._push(action)
            else:
                self._submit(action)

    def on_outcome(self, outcome: StepOutcome) -> None:
        self.execute_nowait(self.server.complete(outcome, self.clock()))

    def _submit(self, action: Action) -> ControlDone | None:
        if self.scheduler is None:
            raise RuntimeError("hub has no scheduler attached")
        if isinstance(action, FreeKv) and self.pushes is not None:
            self.pushes.close_session(action.session_id)
        return self.scheduler.submit(action)  # type: ignore[arg-type]

    def _push(self, push: Push) -> None:
        if self.pushes is None:
            self.on_push_failed(push.session_id, "this node cannot push to other nodes")
            return
        try:
            data = [codec.serialize_frame(f, self.server.spec.limits) for f in push.frames]
        except ProtocolError as exc:  # a bug: we built a frame the codec refuses
            log.error("push not sent session=%s: %s", push.session_id, exc)
            return
        self.pushes.push(
            push.session_id, push.target, data, int(push.frames[0].route_epoch) if push.frames else 0
        )

    def _effects_failed(self, failed: list[ControlDone], reply: Send) -> None:
        for done in failed:
            effect = done.effect
            if isinstance(effect, OpenKv):
                self.execute_nowait(
                    self.server.fail_session(effect.session_id, done.error or "engine refused")
                )
        request = reply.frames[0] if reply.frames else None
        exc = InternalError(f"the engine refused the session: {failed[0].error}")
        frame = codec.error_frame(exc, request, kv_len=0)
        frame.error.session_closed = True
        self._deliver(Send(reply.conn, (frame,)))

    def _deliver(self, send: Send) -> None:
        conn = self._conns.get(send.conn)
        if conn is None or conn.closed:
            return  # the reply stays cached in the session for a replay after re-attach
        try:
            for frame in send.frames:
                if not conn.sink.put(codec.serialize_frame(frame, self.server.spec.limits)):
                    log.warning("connection dropped conn=%d: peer does not read its replies", conn.conn_id)
                    self.dropped_slow_connections += 1
                    self.close_connection(conn)
                    return
                conn.frames_out += 1
        except ProtocolError as exc:  # a bug: we built a frame the codec refuses
            log.error("reply not sent conn=%d: %s", conn.conn_id, exc)
            return
        self._maybe_finish(conn)

    def _maybe_finish(self, conn: Connection) -> None:
        if conn.input_closed and not conn.closed and self.server.busy_on(conn.conn_id) == 0:
            # Peer sent everything and every reply is out: end the stream (after the queued bytes).
            conn.sink.end()
            conn.closed = True
            self._conns.pop(conn.conn_id, None)
            self.server.disconnect(conn.conn_id, self.clock())

    # -- timers -------------------------------------------------------------------------------------

    async def run_leases(
        self, interval_s: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            await trio.sleep(interval_s)
            self.execute_nowait(self.server.tick(self.clock()))

    async def drain(self) -> None:
        """Shutdown: free every session's KV now and wait until the engine did it."""
        waiting = []
        for action in self.server.drain():
            if isinstance(action, Send):
                self._deliver(action)
            elif isinstance(action, Push):
                continue
            elif (done := self._submit(action)) is not None:
                waiting.append(done)
        for done in waiting:
            await done.event.wait()
        for conn in list(self._conns.values()):
            self.close_connection(conn)
