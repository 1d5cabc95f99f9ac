"""The gRPC adapter: ``swarm.v1.ShardService`` on grpc's asyncio server, in its own thread.

grpcio has no trio support, so this module is the one place where the two
event loops meet. The grpc ``aio`` server runs in an asyncio loop on a thread
started with ``trio.to_thread.run_sync``; each call into trio goes through
:class:`TrioBridge` (``TrioToken.run_sync_soon`` to start a trio task, and
``loop.call_soon_threadsafe`` to hand the result back), so neither loop ever
blocks on the other. Frames stay bytes here: ``Session`` is registered with no
(de)serializer (docs/protocol.md, Transport) and every message goes to
:meth:`node.hub.Hub.feed`; replies come from the connection's bounded outbound
queue. ``Info``/``Health`` ask the trio side for a fresh snapshot; ``GetVocab``
streams the metadata-only GGUF held in memory.

The Session path is kept to one thread crossing each way per frame (each one
measured at 0.3-0.5 ms with a trio task in it on the 2-core test VM): a
received frame is handled by ``Hub.feed_nowait`` in a ``run_sync_soon``
callback (a trio task only when its reply must wait for an engine effect), and
replies are pushed into the stream's asyncio queue by :class:`AioReplySink`
with ``call_soon_threadsafe``.

Flow control: a stream reads its next message only after the hub accepted the
previous one, and writes as fast as the peer reads; a peer with
``OUTBOUND_FRAMES`` replies unwritten loses its stream (``node.hub``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio
import trio

from common.logs import event
from node.hub import OUTBOUND_FRAMES, Connection, Hub, TooManyConnections
from proto.swarm.v1 import shard_service_pb2
from proto.vocab import vocab_chunks

log = logging.getLogger("swarm.node.grpc")
T = TypeVar("T")
SERVICE = "swarm.v1.ShardService"


class TrioBridge:
    """Call trio code from the asyncio thread without blocking either loop."""

    def __init__(self, token: trio.lowlevel.TrioToken, nursery: trio.Nursery) -> None:
        self.token = token
        self.nursery = nursery

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def resolve(ok: bool, value: Any) -> None:
            if not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

        async def runner() -> None:
            try:
                value = await fn(*args)
            except trio.Cancelled:
                loop.call_soon_threadsafe(resolve, False, ConnectionAbortedError("node shutting down"))
                raise
            except BaseException as err:  # handed to the asyncio side, which owns the call
                if not isinstance(err, trio.EndOfChannel | trio.ClosedResourceError):
                    log.exception("trio side of a gRPC call failed")
                loop.call_soon_threadsafe(resolve, False, err)
            else:
                loop.call_soon_threadsafe(resolve, True, value)

        try:
            self.token.run_sync_soon(self.nursery.start_soon, runner)
        except trio.RunFinishedError as err:
            raise ConnectionAbortedError("node stopped") from err
        return await fut

    def call_sync(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        async def wrapper() -> T:
            return fn(*args)

        return self.call(wrapper)

    def fire(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a sync trio-side function soon; never waits (used from finally blocks)."""
        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(fn, *args)

    async def feed(self, hub: Hub, conn: Connection, data: bytes) -> None:
        """``hub.feed`` with no trio task unless the frame's reply waits for an engine effect."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def resolve(err: BaseException | None) -> None:
            if not fut.done():
                if err is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(err)

        def answer(err: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the asyncio loop is closing
                loop.call_soon_threadsafe(resolve, err)

        async def rest(waiting: list[Any]) -> None:
            try:
                await hub.execute(waiting)
            except trio.Cancelled:
                answer(ConnectionAbortedError("node shutting down"))
                raise
            except BaseException as err:  # handed to the asyncio side, which owns the call
                log.exception("trio side of a gRPC frame failed")
                answer(err)
            else:
                answer(None)

        def on_trio() -> None:
            try:
                waiting = hub.feed_nowait(conn, data)
            except BaseException as err:  # a bug in the machine: end this stream with it
                log.exception("trio side of a gRPC frame failed")
                answer(err)
                return
            if waiting:
                self.nursery.start_soon(rest, waiting)
            else:
                answer(None)

        try:
            self.token.run_sync_soon(on_trio)
        except trio.RunFinishedError as err:
            raise ConnectionAbortedError("node stopped") from err
        await fut


class AioReplySink:
    """A Session stream's replies, pushed from the trio thread into the stream's asyncio loop.

    ``put`` runs on the trio thread (``node.hub.ReplySink``); the stream's writer
    task awaits :meth:`get` and calls :meth:`written` after each write, so at most
    ``limit`` replies are ever queued for a peer.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = OUTBOUND_FRAMES) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._limit = limit

    def put(self, data: bytes) -> bool:
        with self._lock:
            if self._pending >= self._limit:
                return False
            self._pending += 1
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, data)
        except RuntimeError:  # the loop is closed: the stream is gone
            return False
        return True

    def end(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    async def get(self) -> bytes | None:
        """The next reply, or None once the hub ended the stream."""
        return await self._queue.get()

    def written(self) -> None:
        with self._lock:
            self._pending -= 1


@dataclass(frozen=True)
class GrpcSettings:
    host: str
    port: int
    max_frame_bytes: int
    vocab_bytes: Callable[[], bytes | None]  # None while the file is still being written
    model_fingerprint: str
    shutdown_grace_s: float = 5.0


class ShardServiceAdapter:
    """Runs the grpc server; :meth:`serve` is started with ``nursery.start`` and reports the port."""

    def __init__(
        self,
        hub: Hub,
        settings: GrpcSettings,
        info: Callable[[], shard_service_pb2.NodeInfo],
        health: Callable[[], shard_service_pb2.HealthResponse],
    ) -> None:
        self.hub = hub
        self.settings = settings
        self._info = info
        self._health = health
        self._bridge: TrioBridge | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.streams_opened = 0

    # -- trio side -------------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        token = trio.lowlevel.current_trio_token()
        bound: list[int] = []
        failed: list[BaseException] = []
        ready = trio.Event()

        def report(port: int | None, err: BaseException | None) -> None:
            if port is not None:
                bound.append(port)
            if err is not None:
                failed.append(err)
            ready.set()

        async with trio.open_nursery() as bridge_nursery:
            self._bridge = TrioBridge(token, bridge_nursery)

            async def thread() -> None:
                try:
                    await trio.to_thread.run_sync(self._thread_main, token, report)
                finally:
                    if not ready.is_set():
                        report(None, RuntimeError("gRPC thread ended before serving"))

            async with trio.open_nursery() as thread_nursery:
                thread_nursery.start_soon(thread)
                await ready.wait()
                if failed:
                    raise failed[0]
                event(log, "grpc_listening", host=self.settings.host, port=bound[0])
                task_status.started(bound[0])
                try:
                    await trio.sleep_forever()
                finally:
                    self._request_stop()
            bridge_nursery.cancel_scope.cancel()

    async def stop(self) -> None:
        """Stop accepting streams and let open ones drain for ``shutdown_grace_s``."""
        self._request_stop()

    def _request_stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stop.set)

    # -- asyncio thread ------------------------------------------------------------------------------

    def _thread_main(self, token: trio.lowlevel.TrioToken, report: Callable[..., None]) -> None:
        asyncio.run(self._aio_main(token, report))

    async def _aio_main(self, token: trio.lowlevel.TrioToken, report: Callable[..., None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        limit = (
            self.settings.max_frame_bytes + 1024 * 1024
        )  # so an oversized frame gets TOO_LARGE, not a reset
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
                # Find dead gateways on long-lived streams (their sessions then wait for a re-attach),
                # and tolerate client keepalive pings every 10 s or slower.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                ("grpc.http2.max_ping_strikes", 0),
            ]
        )
        handlers = {
            "Session": grpc.stream_stream_rpc_method_handler(self._session),
            "Info": grpc.unary_unary_rpc_method_handler(
                self._info_rpc,
                request_deserializer=shard_service_pb2.InfoRequest.FromString,
                response_serializer=shard_service_pb2.NodeInfo.SerializeToString,
            ),
            "Health": grpc.unary_unary_rpc_method_handler(
                self._health_rpc,
                request_deserializer=shard_service_pb2.HealthRequest.FromString,
                response_serializer=shard_service_pb2.HealthResponse.SerializeToString,
            ),
            "GetVocab": grpc.unary_stream_rpc_method_handler(
                self._vocab_rpc,
                request_deserializer=shard_service_pb2.VocabRequest.FromString,
                response_serializer=shard_service_pb2.VocabChunk.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            where = f"{self.settings.host}:{self.settings.port}"
            try:
                port = server.add_insecure_port(where)
            except RuntimeError as err:  # grpc raises RuntimeError("Failed to bind ...")
                raise OSError(f"gRPC cannot listen on {where}: {err}") from err
            if port == 0:
                raise OSError(f"gRPC cannot listen on {where}")
            await server.start()
        except BaseException as err:
            token.run_sync_soon(report, None, err)
            return
        token.run_sync_soon(report, port, None)
        await self._stop.wait()
        await server.stop(self.settings.shutdown_grace_s)

    async def _session(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        bridge = self._bridge
        assert bridge is not None
        self.streams_opened += 1
        sink = AioReplySink(asyncio.get_running_loop())
        try:
            conn: Connection = await bridge.call_sync(self.hub.open_connection, sink)
        except TooManyConnections as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            return

        async def writer() -> None:
            while (data := await sink.get()) is not None:
                await context.write(data)
                sink.written()

        async def reader() -> None:
            async for data in requests:
                await bridge.feed(self.hub, conn, data)
            bridge.fire(self.hub.input_ended, conn)  # replies still pending go out, then the stream ends

        write_task = asyncio.create_task(writer())
        read_task = asyncio.create_task(reader())
        try:
            done, _ = await asyncio.wait({read_task, write_task}, return_when=asyncio.FIRST_COMPLETED)
            if write_task in done:
                read_task.cancel()  # the node ended the connection (shutdown, slow reader)
            else:
                read_task.result()  # a failed feed ends the stream with its error
                await write_task
        finally:
            read_task.cancel()
            write_task.cancel()
            bridge.fire(self.hub.close_connection, conn)

    async def _info_rpc(
        self, request: shard_service_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> shard_service_pb2.NodeInfo:
        assert self._bridge is not None
        return await self._bridge.call_sync(self._info)

    async def _health_rpc(
        self, request: shard_service_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> shard_service_pb2.HealthResponse:
        assert self._bridge is not None
        return await self._bridge.call_sync(self._health)

    async def _vocab_rpc(
        self, request: shard_service_pb2.VocabRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[shard_service_pb2.VocabChunk]:
        if request.model_fingerprint and request.model_fingerprint != self.settings.model_fingerprint:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this node serves model {self.settings.model_fingerprint}, not {request.model_fingerprint}",
            )
        data = self.settings.vocab_bytes()
        if data is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the vocabulary file is still being prepared; retry"
            )
            return
        for chunk in vocab_chunks(
            data,
            model_fingerprint=self.settings.model_fingerprint,
            chunk_bytes=request.max_chunk_bytes,
        ):
            yield chunk
