"""Direct push links are bounded in bytes: a next stage that stops taking pushed steps fails its link."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from node.push import PushLinks
from proto.swarm.v1 import frame_pb2


class _Stuck:
    """A push stream whose peer never reads: every send blocks."""

    async def send(self, data: bytes) -> None:
        await trio.sleep_forever()

    async def receive(self) -> bytes:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


PIN = "ab" * 32  # the target's announced TLS certificate fingerprint: links push only over TLS


@asynccontextmanager
async def _open(address: str, *, pin: str | None) -> AsyncIterator[_Stuck]:
    assert pin == PIN  # the link dials its target pinned to the certificate it announced
    yield _Stuck()


async def test_a_link_whose_peer_does_not_read_fails_past_its_byte_bound() -> None:
    failures: list[tuple[str, str, int | None]] = []
    links = PushLinks(_open, lambda *f: failures.append(f), queue_frames=64, queue_bytes=1_000_000)
    target = frame_pb2.PushTarget(
        node_id="n" * 64, address="127.0.0.1:1", hop_token=b"t" * 16, tls_fingerprint=PIN
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(links.run)
        links.push("s", target, [b"x" * 300_000], 1)
        await trio.testing.wait_all_tasks_blocked()  # taken by the link: in flight, stuck
        assert links.statistics().links == 1 and not failures
        links.push("s", target, [b"x" * 600_000, b"x" * 600_000], 1)  # one step always fits an empty queue
        assert not failures
        links.push("s", target, [b"x" * 100], 1)  # 1.2 MB waiting: past the bound
        assert [f[0] for f in failures] == ["s"] and "fast enough" in failures[0][1]
        assert links.statistics().links == 0
        nursery.cancel_scope.cancel()


class _Refusing:
    """A push stream whose peer takes every step and answers with the given refusals, then waits."""

    def __init__(self, replies: list[bytes]) -> None:
        self._replies = list(replies)

    async def send(self, data: bytes) -> None:
        return None

    async def receive(self) -> bytes:
        if self._replies:
            return self._replies.pop(0)
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_preempted_or_closed_next_stage_is_not_reported_failed_but_a_real_refusal_is() -> None:
    # A next stage that preempted the session tells the session's owner itself (and answers the owner's
    # own late frames PREEMPTED), so the owner resumes it; reporting the stage failed as well would make
    # the owner replace a healthy node. A refusal of another kind is a failure of the next stage.
    from proto import codec
    from proto.errors import BadFrameError, PreemptedError, SessionClosedError

    replies = [
        codec.serialize_frame(codec.error_frame(PreemptedError("freed for an older session"))),
        codec.serialize_frame(codec.error_frame(SessionClosedError("was released"))),
        codec.serialize_frame(codec.error_frame(BadFrameError("positions out of order"))),
    ]

    @asynccontextmanager
    async def _open_refusing(address: str, *, pin: str | None) -> AsyncIterator[_Refusing]:
        yield _Refusing(replies)

    failures: list[tuple[str, str, int | None]] = []
    failed = trio.Event()

    def on_failure(*f: object) -> None:
        failures.append(f)  # type: ignore[arg-type]
        failed.set()

    links = PushLinks(_open_refusing, on_failure, queue_frames=64, queue_bytes=1_000_000)
    target = frame_pb2.PushTarget(
        node_id="n" * 64, address="127.0.0.1:1", hop_token=b"t" * 16, tls_fingerprint=PIN
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(links.run)
        links.push("s", target, [b"x" * 100], 1)
        with trio.fail_after(5):
            await failed.wait()
        await trio.testing.wait_all_tasks_blocked()  # every reply read
        nursery.cancel_scope.cancel()
    assert len(failures) == 1 and "BAD_FRAME" in failures[0][1], failures
