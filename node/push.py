"""Direct push: the streams a node opens to the next stages of its sessions.

The session machine emits ``Push(session, target, frames)`` when a step's
output (or the next decode step, on the last stage) goes to another node
(docs/protocol.md, Direct push). :class:`PushLinks` keeps one Session stream
per (session, target address), opened on the first push and closed when the
session is freed, when its target changes (the stream idles out) or when it
fails. Pushed frames are fire-and-forget: the receiving node reports to the
gateway itself; what comes back on a push stream are only its refusals, and
those, like a stream that cannot be opened or breaks, become a
``DOWNSTREAM_FAILED`` notice to the session's owner (``on_failure``), so the
gateway replaces the next stage.

TLS: a link dials its target over TLS pinned to the target's
``tls_fingerprint`` (from the target's signed announcement, passed on by the
gateway); a target without one is dialled in plaintext only when this node
itself runs ``insecure_plaintext`` (``allow_plaintext``), else the push fails.

Bounds: at most ``max_links`` links, each with at most ``queue_frames``
frames and ``queue_bytes`` bytes waiting (a step's frames always fit an empty
queue; a next stage that does not keep up fails its link rather than grow
memory); a link unused for ``idle_s`` closes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

import trio

from common.logs import event
from proto import codec
from proto.errors import ProtocolError
from proto.swarm.v1 import frame_pb2, status_pb2

log = logging.getLogger("swarm.node.push")


class PushStream(Protocol):
    async def send(self, data: bytes) -> None: ...

    async def receive(self) -> bytes: ...


class PushOpener(Protocol):
    """Opens a Session stream to ``address``; ``pin``: the TLS certificate's sha256, None = plaintext."""

    def __call__(self, address: str, *, pin: str | None) -> AbstractAsyncContextManager[PushStream]: ...


FailureCallback = Callable[[str, str, int | None], None]  # (session_id, message, epoch of the push)
# Refusals that only say a push came too late (the session moved to a new epoch or ended): not failures.
# PREEMPTED among them: the preempting node tells the session's owner itself (its notice, and its answer
# to the owner's own late frames), so the owner resumes the session rather than replacing this stage.
STALE = frozenset(
    {
        status_pb2.STATUS_ROUTE_EPOCH,
        status_pb2.STATUS_SESSION_CLOSED,
        status_pb2.STATUS_UNKNOWN_SESSION,
        status_pb2.STATUS_PREEMPTED,
    }
)


@dataclass(eq=False)
class _Link:
    session_id: str
    target: frame_pb2.PushTarget
    send: trio.MemorySendChannel[bytes]
    receive: trio.MemoryReceiveChannel[bytes]
    epoch: int = 0  # the route epoch of the session when the link was made (hop tokens are per epoch)
    last_used: float = 0.0
    pushed: int = 0
    queued_bytes: int = 0
    done: bool = False


@dataclass(frozen=True)
class PushStats:
    links: int
    frames_pushed: int
    link_failures: int


@dataclass
class PushLinks:
    opener: PushOpener
    on_failure: FailureCallback
    allow_plaintext: bool = False  # push to targets that announce no TLS certificate
    max_links: int = 256
    queue_frames: int = 64
    queue_bytes: int = 64 * 1024 * 1024
    idle_s: float = 60.0
    _links: dict[tuple[str, str], _Link] = field(default_factory=dict)
    _nursery: trio.Nursery | None = None
    _frames: int = 0
    _failures: int = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the link tasks; closes idle links. Started once, in the node's nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await trio.sleep(min(5.0, self.idle_s / 2))
                now = trio.current_time()
                for link in list(self._links.values()):
                    if now - link.last_used > self.idle_s:
                        self._close(link)

    def push(
        self, session_id: str, target: frame_pb2.PushTarget, frames: list[bytes], epoch: int = 0
    ) -> None:
        """Queue ``frames`` (of route ``epoch``) for ``target`` on this session's link (made on first use)."""
        key = (session_id, target.address)
        link = self._links.get(key)
        if link is None or link.target.hop_token != target.hop_token:
            if link is not None:
                self._close(link)  # a new epoch: the old stream goes
            if self._nursery is None:
                self._fail(session_id, "the node is not ready to push")
                return
            if len(self._links) >= self.max_links:
                self._fail(session_id, f"this node already holds {self.max_links} push streams")
                return
            send, receive = trio.open_memory_channel[bytes](self.queue_frames)
            link = _Link(session_id, target, send, receive, epoch)
            self._links[key] = link
            self._nursery.start_soon(self._run_link, link)
        link.last_used = trio.current_time()
        nbytes = sum(len(d) for d in frames)
        if link.queued_bytes and link.queued_bytes + nbytes > self.queue_bytes:
            self._close(link)
            self._fail(session_id, f"node {_who(target)} does not take pushed steps fast enough", epoch)
            return
        for data in frames:
            try:
                link.send.send_nowait(data)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                self._close(link)
                self._fail(session_id, f"node {_who(target)} does not take pushed steps fast enough", epoch)
                return
            link.queued_bytes += len(data)
            link.pushed += 1
            self._frames += 1

    def close_session(self, session_id: str) -> None:
        """The session was freed: its links end once their queued frames are written."""
        for link in [link for link in self._links.values() if link.session_id == session_id]:
            self._close(link)

    def statistics(self) -> PushStats:
        return PushStats(len(self._links), self._frames, self._failures)

    # -- internals ------------------------------------------------------------------------------------

    def _close(self, link: _Link) -> None:
        if self._links.get((link.session_id, link.target.address)) is link:
            del self._links[(link.session_id, link.target.address)]
        link.done = True
        link.send.close()

    def _fail(self, session_id: str, message: str, epoch: int | None = None) -> None:
        self._failures += 1
        event(log, "push_failed", level=logging.WARNING, session_id=session_id, message=message)
        self.on_failure(session_id, message, epoch)

    async def _run_link(self, link: _Link) -> None:
        target = link.target
        if not target.tls_fingerprint and not self.allow_plaintext:
            self._close(link)
            self._fail(
                link.session_id,
                f"node {_who(target)} has no TLS certificate to pin; this node pushes only over TLS",
                link.epoch,
            )
            return
        try:
            pin = target.tls_fingerprint or None
            async with self.opener(target.address, pin=pin) as stream, trio.open_nursery() as nursery:
                nursery.start_soon(self._read_refusals, link, stream)
                async for data in link.receive:
                    link.queued_bytes -= len(data)
                    await stream.send(data)
                nursery.cancel_scope.cancel()
        except Exception as err:  # any transport failure: the owner replaces the next stage
            if not link.done:
                self._fail(link.session_id, f"push to node {_who(target)} failed: {err}", link.epoch)
        finally:
            self._close(link)

    async def _read_refusals(self, link: _Link, stream: PushStream) -> None:
        """Replies on a push stream are refusals of pushed steps: the next stage cannot go on."""
        async for data in _messages(stream):
            try:
                frame = codec.parse_frame(data)
            except ProtocolError as err:
                self._fail(link.session_id, f"node {_who(link.target)} sent an unreadable reply: {err}")
                return
            if codec.body_kind(frame) != "error" or link.done or frame.error.status in STALE:
                continue
            status = status_pb2.Status.Name(frame.error.status)
            self._fail(
                link.session_id,
                f"node {_who(link.target)} refused a pushed step {frame.step_id}: {status}: "
                f"{frame.error.message}",
                int(frame.route_epoch) or None,
            )


async def _messages(stream: PushStream) -> AsyncIterator[bytes]:
    while True:
        try:
            yield await stream.receive()
        except Exception:  # the stream ended or broke: nothing more to read
            return


def _who(target: frame_pb2.PushTarget) -> str:
    return f"{target.node_id[:8]} ({target.address})" if target.node_id else target.address
