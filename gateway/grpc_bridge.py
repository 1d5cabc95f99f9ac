"""The one adapter between trio and grpcio's blocking client (grpcio has no trio support).

Everything that blocks on gRPC runs in a worker thread started with
``trio.to_thread.run_sync(..., limiter=...)``; the limiter (``grpc_threads``)
bounds how many such threads exist at once. Nothing else in the gateway
touches grpc or threads.

* Unary and server-streaming calls (``Info``, ``GetVocab``) run whole in one
  worker thread; the gRPC deadline is the caller's trio deadline, so a
  ``trio.fail_after`` around the call also stops the thread.
* A Session stream (:func:`open_stage_stream`) is two bounded queues: frames
  to the node go through a ``queue.Queue`` that gRPC's own request iterator
  drains; replies come from one reader thread per stream that hands each
  message to trio through a bounded memory channel (``trio.from_thread.run``:
  the reader waits while the channel is full). Leaving the context manager
  half-closes the request side, cancels the call (which ends the reader
  thread at once) and waits for the reader.

Raw bytes both ways: the Session method is called without serializers
(docs/protocol.md, Transport), so frames are parsed by ``proto.codec``.
"""

from __future__ import annotations

import functools
import math
import queue
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import grpc
import trio

from gateway.groups import single_exception
from proto.swarm.v1 import shard_service_pb2, shard_service_pb2_grpc
from proto.vocab import DEFAULT_VOCAB_CHUNK_BYTES, MAX_VOCAB_CHUNK_BYTES, VocabAssembler

SESSION_METHOD = "/swarm.v1.ShardService/Session"
_SEND_QUEUE_FRAMES = 32
_RECEIVE_BUFFER_FRAMES = 8
_CLOSE = object()


class StreamError(Exception):
    """The stream to a node failed or ended (connection refused, node gone, call cancelled)."""


class StageStream:
    """One bidirectional Session stream to one node: ``send`` bytes, ``receive`` bytes."""

    def __init__(
        self,
        requests: queue.Queue[object],
        replies: trio.MemoryReceiveChannel[bytes | StreamError],
        limiter: trio.CapacityLimiter,
    ) -> None:
        self._requests = requests
        self._replies = replies
        self._limiter = limiter

    async def send(self, data: bytes) -> None:
        try:
            self._requests.put_nowait(data)
        except queue.Full:
            await trio.to_thread.run_sync(
                self._requests.put, data, limiter=self._limiter, abandon_on_cancel=True
            )

    async def receive(self) -> bytes:
        try:
            item = await self._replies.receive()
        except trio.EndOfChannel as err:
            raise StreamError("the node ended the stream") from err
        if isinstance(item, StreamError):
            raise item
        return item


def _request_iterator(requests: queue.Queue[object]) -> Iterator[bytes]:
    while True:
        item = requests.get()
        if item is _CLOSE:
            return
        assert isinstance(item, bytes)  # only StageStream.send puts here
        yield item


def _describe(err: grpc.RpcError) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return f"{code.name if code is not None else 'UNKNOWN'}: {details}"


def _grpc_timeout() -> float | None:
    """The caller's trio deadline as a gRPC timeout (None: no deadline)."""
    deadline = trio.current_effective_deadline()
    if math.isinf(deadline):
        return None
    return max(0.001, deadline - trio.current_time())


class NodeChannels:
    """One gRPC channel per node address, shared by every stream to that node."""

    def __init__(self, *, max_frame_bytes: int, threads: int) -> None:
        self.limiter = trio.CapacityLimiter(threads)
        self._max_frame_bytes = max_frame_bytes
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, address: str) -> grpc.Channel:
        channel = self._channels.get(address)
        if channel is None:
            # Our largest frame or vocabulary chunk, plus gRPC framing; frames are size-checked again by
            # proto.codec.parse_frame against max_frame_bytes.
            room = max(self._max_frame_bytes, MAX_VOCAB_CHUNK_BYTES) + 64 * 1024
            channel = grpc.insecure_channel(
                address,
                options=[
                    ("grpc.max_receive_message_length", room),
                    ("grpc.max_send_message_length", room),
                    ("grpc.enable_retries", 0),
                ],
            )
            self._channels[address] = channel
        return channel

    async def info(self, address: str) -> shard_service_pb2.NodeInfo:
        stub = shard_service_pb2_grpc.ShardServiceStub(self._channel(address))
        timeout = _grpc_timeout()

        def call() -> shard_service_pb2.NodeInfo:
            try:
                return stub.Info(shard_service_pb2.InfoRequest(), timeout=timeout)
            except grpc.RpcError as err:
                raise StreamError(f"Info from {address} failed: {_describe(err)}") from err

        return await trio.to_thread.run_sync(call, limiter=self.limiter, abandon_on_cancel=True)

    async def get_vocab(self, address: str, model_fingerprint: str, max_bytes: int) -> bytes:
        """The metadata-only GGUF of the model, checked by ``proto.vocab.VocabAssembler``."""
        stub = shard_service_pb2_grpc.ShardServiceStub(self._channel(address))
        timeout = _grpc_timeout()

        def call() -> bytes:
            assembler = VocabAssembler(model_fingerprint, max_total_bytes=max_bytes)
            request = shard_service_pb2.VocabRequest(
                model_fingerprint=model_fingerprint, max_chunk_bytes=DEFAULT_VOCAB_CHUNK_BYTES
            )
            try:
                for chunk in stub.GetVocab(request, timeout=timeout):
                    data = assembler.add(chunk)
                    if data is not None:
                        return data
            except grpc.RpcError as err:
                raise StreamError(f"GetVocab from {address} failed: {_describe(err)}") from err
            raise StreamError(f"GetVocab from {address} ended early: missing {assembler.missing()}")

        return await trio.to_thread.run_sync(call, limiter=self.limiter, abandon_on_cancel=True)

    @asynccontextmanager
    async def open_stage_stream(self, address: str) -> AsyncIterator[StageStream]:
        requests: queue.Queue[object] = queue.Queue(maxsize=_SEND_QUEUE_FRAMES)
        call = self._channel(address).stream_stream(SESSION_METHOD)(_request_iterator(requests))
        send, receive = trio.open_memory_channel[bytes | StreamError](_RECEIVE_BUFFER_FRAMES)
        token = trio.lowlevel.current_trio_token()

        def reader() -> None:
            try:
                try:
                    for data in call:
                        trio.from_thread.run(send.send, data, trio_token=token)
                    failure = StreamError(f"{address} ended the stream")
                except grpc.RpcError as err:
                    failure = StreamError(f"stream to {address} failed: {_describe(err)}")
                trio.from_thread.run(send.send, failure, trio_token=token)
            except (
                trio.BrokenResourceError,
                trio.ClosedResourceError,
                trio.RunFinishedError,
                trio.Cancelled,
            ):
                pass  # the session stopped listening; the call is being cancelled

        with single_exception():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(
                        trio.to_thread.run_sync, reader, limiter=self.limiter, abandon_on_cancel=True
                    )
                )
                try:
                    yield StageStream(requests, receive, self.limiter)
                finally:
                    _close_requests(requests)
                    call.cancel()
                    receive.close()

    async def aclose(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await trio.to_thread.run_sync(channel.close, limiter=self.limiter)


def _close_requests(requests: queue.Queue[object]) -> None:
    """Put the end marker even when the queue is full, so gRPC's request thread always ends."""
    while True:
        try:
            requests.put_nowait(_CLOSE)
            return
        except queue.Full:
            try:
                requests.get_nowait()
            except queue.Empty:
                pass
