"""The grpcio adapter: real gRPC on loopback, trio on both ends, one process."""

from __future__ import annotations

import time

import pytest
import trio

from common import grpc_adapter
from common.grpc_adapter import (
    UNPINNED,
    CallInfo,
    MessageStream,
    RpcAbort,
    RpcError,
    Service,
    StreamClosed,
    open_grpc,
)


async def echo(stream: MessageStream, info: CallInfo) -> None:
    while True:
        try:
            data = await stream.receive()
        except StreamClosed:
            return
        if data == b"abort":
            raise RpcAbort("PERMISSION_DENIED", "not you")
        await stream.send(data[::-1])


async def hello(request: bytes, info: CallInfo) -> bytes:
    if request == b"boom":
        raise RpcAbort("NOT_FOUND", "no such thing")
    return b"hello " + request


async def chunks(request: bytes, info: CallInfo):  # type: ignore[no-untyped-def]
    for i in range(int(request)):
        yield str(i).encode()


SERVICE = Service("test.Echo", {"Session": echo}, {"Hello": hello}, {"Chunks": chunks})


async def test_stream_unary_and_server_stream_round_trip() -> None:
    async with open_grpc() as server_rt, trio.open_nursery() as nursery:
        client_rt = server_rt  # one grpc.aio runtime per process: grpcio's completion queue is global
        port = await nursery.start(server_rt.serve, "127.0.0.1", 0, [SERVICE])
        address = f"127.0.0.1:{port}"
        async with client_rt.open_stream(address, "/test.Echo/Session") as stream:
            for i in range(50):
                await stream.send(f"frame {i}".encode())
                assert await stream.receive() == f"frame {i}".encode()[::-1]
            stats = stream.statistics()
            assert stats.messages_in == stats.messages_out == 50
        with trio.fail_after(10):
            assert await client_rt.unary(address, "/test.Echo/Hello", b"you") == b"hello you"
            with pytest.raises(RpcError) as err:
                await client_rt.unary(address, "/test.Echo/Hello", b"boom")
            assert err.value.code == "NOT_FOUND"
            got = await client_rt.server_stream(address, "/test.Echo/Chunks", b"5", max_messages=10)
            assert got == [b"0", b"1", b"2", b"3", b"4"]
            with pytest.raises(RpcError):
                await client_rt.server_stream(address, "/test.Echo/Chunks", b"50", max_messages=10)
        nursery.cancel_scope.cancel()


async def test_handler_abort_and_peer_gone_surface_as_stream_closed() -> None:
    async with open_grpc() as server_rt, trio.open_nursery() as nursery:
        client_rt = server_rt  # one grpc.aio runtime per process: grpcio's completion queue is global
        port = await nursery.start(server_rt.serve, "127.0.0.1", 0, [SERVICE])
        async with client_rt.open_stream(f"127.0.0.1:{port}", "/test.Echo/Session") as stream:
            await stream.send(b"abort")
            with trio.fail_after(10), pytest.raises(StreamClosed) as closed:
                await stream.receive()
            assert closed.value.code == "PERMISSION_DENIED"
        nursery.cancel_scope.cancel()
    async with open_grpc() as client_rt:  # a second runtime after the first closed
        async with client_rt.open_stream("127.0.0.1:1", "/test.Echo/Session") as stream:
            with trio.fail_after(20), pytest.raises(StreamClosed) as closed:
                await stream.send(b"x")
                await stream.receive()
            assert closed.value.code == "UNAVAILABLE"


async def test_send_waits_while_the_outgoing_buffer_is_full() -> None:
    got: list[bytes] = []
    release, last = trio.Event(), trio.Event()

    async def slow(stream: MessageStream, info: CallInfo) -> None:
        await release.wait()
        while True:
            try:
                got.append(await stream.receive())
            except StreamClosed:
                return
            if got[-1] == b"last":
                last.set()

    service = Service("test.Slow", {"Session": slow}, {}, {})
    async with open_grpc() as server_rt, trio.open_nursery() as nursery:
        client_rt = server_rt  # one grpc.aio runtime per process: grpcio's completion queue is global
        port = await nursery.start(server_rt.serve, "127.0.0.1", 0, [service])
        async with client_rt.open_stream(
            f"127.0.0.1:{port}", "/test.Slow/Session", max_buffered_bytes=64 * 1024, max_buffered_messages=4
        ) as stream:
            accepted = 0
            while stream.try_send(b"x" * 16 * 1024):
                accepted += 1
                if accepted > 1000:
                    break
            # HTTP/2 windows (~64 KiB here) plus the server's own buffer plus ours: bounded, not 1000.
            assert accepted < 200
            release.set()
            with trio.fail_after(10):
                await stream.send(b"last")
                stream.close_sending()
                await last.wait()
        nursery.cancel_scope.cancel()


def test_no_thread_is_started_by_the_adapter() -> None:
    import threading

    before = {t.ident for t in threading.enumerate()}

    async def main() -> None:
        async with open_grpc() as rt, trio.open_nursery() as nursery:
            port = await nursery.start(rt.serve, "127.0.0.1", 0, [SERVICE])
            async with rt.open_stream(f"127.0.0.1:{port}", "/test.Echo/Session") as stream:
                t0 = time.monotonic()
                for _ in range(20):
                    await stream.send(b"ab")
                    assert await stream.receive() == b"ba"
                assert time.monotonic() - t0 < 30
            nursery.cancel_scope.cancel()

    trio.run(main)
    new = [t for t in threading.enumerate() if t.ident not in before]
    # grpcio's own completion-queue poller and executor threads are grpc's, not ours: they are named by grpc.
    assert all(t.daemon for t in new), [t.name for t in new]


async def test_a_channel_dropped_after_its_peer_went_away_is_closed_not_left_to_the_collector() -> None:
    """An unpinned address that stops answering is read afresh next time, on a new channel; the old
    channel is closed with a grace period, and at the latest with the runtime (a channel collected
    after its loop closed delivered its last events to that closed loop)."""
    async with open_grpc() as rt:
        async with trio.open_nursery() as servers:
            port = await servers.start(rt.serve, "127.0.0.1", 0, [SERVICE])
            address = f"127.0.0.1:{port}"
            with trio.fail_after(10):
                assert await rt.unary(address, "/test.Echo/Hello", b"a", pin=UNPINNED) == b"hello a"
            servers.cancel_scope.cancel()
        with trio.fail_after(20), pytest.raises(RpcError) as err:
            await rt.unary(address, "/test.Echo/Hello", b"b", pin=UNPINNED)
        assert err.value.code == "UNAVAILABLE"
        retired = set(rt._retired)
        assert len(retired) == 1 and not rt._channels
    assert [channel.get_state().name for channel in retired] == ["SHUTDOWN"]


def test_an_event_for_an_ended_runtimes_loop_is_dropped_and_every_other_error_raised() -> None:
    class Loop:
        def __init__(self) -> None:
            self.raised: list[dict] = []

        def default_exception_handler(self, context: dict) -> None:
            self.raised.append(context)

    loop = Loop()
    stale = {
        "exception": RuntimeError("Event loop is closed"),
        "handle": "<Handle PollerCompletionQueue._handle_events(<TrioEventLoop>)()>",
    }
    grpc_adapter._exception_handler(loop, stale)  # type: ignore[arg-type]
    assert loop.raised == []
    other = [
        {"exception": RuntimeError("Event loop is closed"), "handle": "<Handle some_task()>"},
        {"exception": ValueError("boom"), "handle": stale["handle"]},
        {"message": "no exception at all"},
    ]
    for context in other:
        grpc_adapter._exception_handler(loop, context)  # type: ignore[arg-type]
    assert loop.raised == other
