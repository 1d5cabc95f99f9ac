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

Bounds, against peers that hold resources without using them (docs/node.md,
Connections):

* **Reply bytes.** A connection's queue of unread replies holds at most
  ``reply_buffer_bytes`` (one step's replies are always taken into an empty
  queue, so no legitimate reply is ever too large) and ``OUTBOUND_FRAMES``
  frames; past either the peer loses its connection.
* **Replays.** A step re-sent under the id of the last applied one is answered
  from the session's cache (the machine's ``Send(replay=True)``) only when the
  previous cached answer on that connection has been read: re-sending one
  large prefill step without reading grows nothing.
* **Unproven streams.** A connection becomes *proven* once the machine accepts
  an OPEN from it (ticket and, for bound tickets, the gateway's proof) or a
  step pushed with a hop token. Until then it is closed after
  ``stream_idle_timeout_s``, at most ``max_idle_streams_per_address`` of them are held
  per source address (one more closes that address's oldest), and when the
  node holds ``max_connections`` a new connection closes the oldest unproven
  one instead of being refused: idle streams cannot take a node's slots.
  Transports that the node opened itself (the relay) are trusted from the start.
* **Silent proven streams.** A proven connection that owns no session and
  sent nothing for the machine's ``idle_lease_s`` (a push stream whose session
  ended, a gateway's stream kept after RELEASE) is closed too, so proven
  streams cannot pile up either.
"""

from __future__ import annotations

import logging
import math
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

OUTBOUND_FRAMES = 4096  # frames waiting per connection (bytes are the real bound: reply_buffer_bytes)
REPLY_BUFFER_BYTES = 32 * 1024 * 1024
IDLE_STREAM_TIMEOUT_S = 10.0
MAX_IDLE_PER_ADDRESS = 16


class LogBudget:
    """At most ``lines`` log lines per ``window_s`` for one kind of event (an attacker's streams must
    not fill the disk with our logs); ``take`` says whether to log and how many were held back."""

    def __init__(self, clock: Callable[[], float], lines: int = 10, window_s: float = 10.0) -> None:
        self.clock = clock
        self.lines = lines
        self.window_s = window_s
        self._window_start = -math.inf
        self._used = 0
        self._held = 0

    def take(self) -> int | None:
        """None: do not log this one; else log it, noting the returned number of lines held back."""
        now = self.clock()
        if now - self._window_start >= self.window_s:
            self._window_start, self._used = now, 0
        if self._used >= self.lines:
            self._held += 1
            return None
        self._used += 1
        held, self._held = self._held, 0
        return held


def held_back(held: int) -> str:
    return f" ({held} similar lines held back)" if held else ""


class TooManyConnections(RuntimeError):
    """The hub already holds ``max_connections`` connections, all of them proven."""


class _ChannelSink:
    """A connection's replies: a trio memory channel bounded in frames and in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.send, self._receive = trio.open_memory_channel[bytes](OUTBOUND_FRAMES)
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.put_count = 0  # frames queued so far
        self.taken_count = 0  # frames the transport has taken so far

    def fits(self, nbytes: int) -> bool:
        """Room for ``nbytes`` more; an empty queue takes anything (one step's replies always fit)."""
        return self.queued_bytes == 0 or self.queued_bytes + nbytes <= self.max_bytes

    def put(self, data: bytes) -> bool:
        """Queue one reply; False when the queue is full (frames) or closed."""
        try:
            self.send.send_nowait(data)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self.queued_bytes += len(data)
        self.put_count += 1
        return True

    def taken(self, data: bytes) -> None:
        self.queued_bytes -= len(data)
        self.taken_count += 1

    def end(self) -> None:
        """No more replies: the transport ends the stream once the queued ones are written."""
        self.send.close()


class Outbound:
    """What a transport reads a connection's replies from (``receive``, ``async for``); every read
    frees its bytes in the connection's bound."""

    def __init__(self, sink: _ChannelSink) -> None:
        self._sink = sink

    async def receive(self) -> bytes:
        data = await self._sink._receive.receive()
        self._sink.taken(data)
        return data

    def receive_nowait(self) -> bytes:
        data = self._sink._receive.receive_nowait()
        self._sink.taken(data)
        return data

    def __aiter__(self) -> Outbound:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


@dataclass(eq=False)
class Connection:
    conn_id: int
    outbound: Outbound
    sink: _ChannelSink
    peer: str = ""  # the source address (no port), for the per-address bound on unproven streams
    trusted: bool = False  # opened by this node (relay) or proven by the machine (see the docstring)
    own: bool = False  # opened by this node itself (the relay socket): never closed for being idle
    input_closed: bool = False
    closed: bool = False
    frames_out: int = 0
    replay_until: int = 0  # the sink's put_count after the last cached reply queued here
    opened_s: float = field(default_factory=time.monotonic)
    last_frame_s: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class HubStats:
    connections: int
    unproven_connections: int
    dropped_slow_connections: int
    idle_streams_closed: int
    replays_suppressed: int
    reply_bytes_queued: int


class Hub:
    def __init__(
        self,
        server: FrameServer,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_connections: int = 0,
        reply_buffer_bytes: int = REPLY_BUFFER_BYTES,
        stream_idle_timeout_s: float = IDLE_STREAM_TIMEOUT_S,
        max_idle_streams_per_address: int = MAX_IDLE_PER_ADDRESS,
    ) -> None:
        self.server = server
        self.clock = clock
        # Streams cost memory before any OPEN: bound them too (default: 4 per session slot, plus room).
        self.max_connections = max_connections or 4 * server.spec.max_sessions + 64
        self.reply_buffer_bytes = reply_buffer_bytes
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.max_idle_streams_per_address = max_idle_streams_per_address
        self.scheduler: Scheduler | None = None
        self.pushes: PushLinks | None = None
        self._conns: dict[int, Connection] = {}
        self.dropped_slow_connections = 0
        self.idle_streams_closed = 0
        self.replays_suppressed = 0
        self.log_budget = LogBudget(clock)  # stream closes and refusals: one line each, within bounds

    def attach(self, scheduler: Scheduler, pushes: PushLinks | None = None) -> None:
        self.scheduler = scheduler
        self.pushes = pushes

    def on_push_failed(self, session_id: str, message: str, epoch: int | None = None) -> None:
        """A push of this session could not be delivered: the machine tells the session's owner."""
        self.execute_nowait(self.server.push_failed(session_id, message, epoch))

    # -- transport API ---------------------------------------------------------------------------

    def open_connection(self, peer: str = "", *, trusted: bool = False) -> Connection:
        """A new connection from source address ``peer``; ``trusted``: one this node opened itself.

        Makes room by closing the oldest unproven connection (of ``peer``, past
        ``max_idle_streams_per_address``; of anyone, at ``max_connections``); raises
        :class:`TooManyConnections` only when every connection held is proven.
        """
        if not trusted:
            mine = [c for c in self._unproven() if c.peer == peer]
            if len(mine) >= self.max_idle_streams_per_address:
                self._close_idle(mine[0], "too many unproven streams from this address")
        if len(self._conns) >= self.max_connections:
            unproven = self._unproven()
            if not unproven:
                raise TooManyConnections(f"this node holds its maximum of {self.max_connections} connections")
            self._close_idle(unproven[0], "the node is at its connection limit")
        conn_id = self.server.connect()
        sink = _ChannelSink(self.reply_buffer_bytes)
        now = self.clock()
        conn = Connection(
            conn_id,
            Outbound(sink),
            sink,
            peer=peer,
            trusted=trusted,
            own=trusted,
            opened_s=now,
            last_frame_s=now,
        )
        self._conns[conn_id] = conn
        return conn

    def _unproven(self) -> list[Connection]:
        """Connections not (yet) proven, oldest first (refreshing ``trusted`` from the machine)."""
        out = []
        for conn in self._conns.values():  # insertion order: oldest first
            if not conn.trusted and self.server.is_proven(conn.conn_id):
                conn.trusted = True
            if not conn.trusted:
                out.append(conn)
        return out

    def _close_idle(self, conn: Connection, why: str) -> None:
        self.idle_streams_closed += 1
        if (held := self.log_budget.take()) is not None:
            log.info(
                "stream closed conn=%d peer=%s: %s (opened %.1f s ago, no session opened, no step pushed)%s",
                conn.conn_id,
                conn.peer or "?",
                why,
                self.clock() - conn.opened_s,
                held_back(held),
            )
        self.close_connection(conn)

    async def feed(self, conn: Connection, data: bytes) -> None:
        """Handle one frame: steps and refusals complete at once; a frame whose reply must wait
        for a control effect (OPEN reserving KV, a re-attach truncating it) waits here, so
        replies keep their order."""
        if conn.closed:
            return
        conn.last_frame_s = self.clock()
        actions = self.server.handle(conn.conn_id, data, conn.last_frame_s)
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
        if send.replay and conn.sink.taken_count < conn.replay_until:
            # The previous answer from the cache is still unread: the peer will read that one.
            self.replays_suppressed += 1
            return
        try:
            data = [codec.serialize_frame(frame, self.server.spec.limits) for frame in send.frames]
        except ProtocolError as exc:  # a bug: we built a frame the codec refuses
            log.error("reply not sent conn=%d: %s", conn.conn_id, exc)
            return
        if not conn.sink.fits(sum(len(d) for d in data)) or not all(conn.sink.put(d) for d in data):
            if (held := self.log_budget.take()) is not None:
                log.warning(
                    "connection dropped conn=%d peer=%s: it leaves over %d bytes of replies unread%s",
                    conn.conn_id,
                    conn.peer or "?",
                    conn.sink.max_bytes,
                    held_back(held),
                )
            self.dropped_slow_connections += 1
            self.close_connection(conn)
            return
        conn.frames_out += len(data)
        if send.replay:
            conn.replay_until = conn.sink.put_count
        self._maybe_finish(conn)

    def statistics(self) -> HubStats:
        return HubStats(
            connections=len(self._conns),
            unproven_connections=len(self._unproven()),
            dropped_slow_connections=self.dropped_slow_connections,
            idle_streams_closed=self.idle_streams_closed,
            replays_suppressed=self.replays_suppressed,
            reply_bytes_queued=sum(c.sink.queued_bytes for c in self._conns.values()),
        )

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
            now = self.clock()
            self.execute_nowait(self.server.tick(now))
            self.close_idle_streams(now)

    def close_idle_streams(self, now: float) -> None:
        """Close unproven connections older than ``stream_idle_timeout_s``, and proven ones that own
        no session and were silent for the machine's ``idle_lease_s``."""
        for conn in self._unproven():
            if now - conn.opened_s >= self.stream_idle_timeout_s:
                self._close_idle(conn, f"no session opened within {self.stream_idle_timeout_s:g} s")
        silent_s = self.server.spec.idle_lease_s
        for conn in [c for c in self._conns.values() if c.trusted and not c.own]:
            if now - conn.last_frame_s >= silent_s and not self.server.owns_sessions(conn.conn_id):
                self.idle_streams_closed += 1
                if (held := self.log_budget.take()) is not None:
                    log.info(
                        "stream closed conn=%d peer=%s: silent for %.0f s and owning no session%s",
                        conn.conn_id,
                        conn.peer,
                        now - conn.last_frame_s,
                        held_back(held),
                    )
                self.close_connection(conn)

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
