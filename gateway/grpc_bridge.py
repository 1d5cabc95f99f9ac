"""The one adapter between trio and grpcio's blocking client (grpcio has no trio support).

Everything that blocks on gRPC runs in a worker thread started with
``trio.to_thread.run_sync(..., limiter=...)``; the limiter (``grpc_threads``)
bounds how many such threads exist at once. Nothing else in the gateway
touches grpc or threads.

* Unary and server-streaming calls (``Info``, ``GetVocab``) run whole in one
  worker thread; the gRPC deadline is the caller's trio deadline, so a
  ``trio.fail_after`` around the call also stops the thread.
* A Session stream (:func:`open_stage_stream`) is two bounded queues: frames
  to the node go through a ``queue.SimpleQueue`` (bounded by a semaphore) that
  gRPC's own request iterator drains; replies come from one reader thread per
  stream that hands each message to trio through a bounded memory channel
  (``trio.from_thread.run_sync(send_nowait)``, no trio task per message; only
  when the channel is full does the reader wait with ``trio.from_thread.run``).
  Each crossing costs a thread wake-up, measured at 0.2-0.4 ms on the 2-core
  test VM, so a frame crosses once each way. Leaving the context manager
  half-closes the request side, cancels the call (which ends the reader thread
  at once) and waits for the reader.
* Forwarding: a stream may carry a :data:`ForwardRule` (set by the Route
  Session for the current step). The reader thread then parses each reply and,
  when the rule accepts it, puts the relayed frame straight into the next
  stage's request queue, so hidden states go from one node to the next without
  waiting for the trio thread; the trio side still gets every reply (parsed,
  with what was sent on) for its checks and bookkeeping.

Raw bytes both ways: the Session method is called without serializers
(docs/protocol.md, Transport), so frames are parsed by ``proto.codec``.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import trio

from gateway.groups import single_exception
from proto.swarm.v1 import frame_pb2, shard_service_pb2, shard_service_pb2_grpc
from proto.vocab import DEFAULT_VOCAB_CHUNK_BYTES, MAX_VOCAB_CHUNK_BYTES, VocabAssembler

SESSION_METHOD = "/swarm.v1.ShardService/Session"
_SEND_QUEUE_FRAMES = 32
_RECEIVE_BUFFER_FRAMES = 8
_CLOSE = object()


log = logging.getLogger("swarm.gateway.grpc")


class StreamError(Exception):
    """The stream to a node failed or ended (connection refused, node gone, call cancelled)."""


@dataclass(frozen=True)
class Forwarded:
    """A reply a forward rule parsed on the reader thread, and the frame it sent on (None: not sent)."""

    frame: frame_pb2.Frame
    relayed: frame_pb2.Frame | None


# Runs on a reader thread: must only use its arguments, immutable data and StageStream.try_send_nowait.
# None: the rule could not read the reply (the trio side parses it and reports the error).
ForwardRule = Callable[[bytes], Forwarded | None]
_Item = tuple[bytes, Forwarded | None] | StreamError


class _Requests:
    """Frames for gRPC's request iterator: a C-level ``SimpleQueue`` bounded by a semaphore."""

    def __init__(self, bound: int) -> None:
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.room = threading.Semaphore(bound)

    def put_nowait(self, item: bytes) -> bool:
        if not self.room.acquire(blocking=False):
            return False
        self.queue.put(item)
        return True

    def put(self, item: bytes) -> None:
        """Blocking (worker thread): waits for room."""
        self.room.acquire()
        self.queue.put(item)

    def close(self) -> None:
        """The end marker goes in whatever the room: gRPC's request thread must always end."""
        self.queue.put(_CLOSE)

    def iterate(self) -> Iterator[bytes]:
        while True:
            item = self.queue.get()
            if item is _CLOSE:
                return
            self.room.release()
            assert isinstance(item, bytes)  # only StageStream.send puts here
            yield item


class StageStream:
    """One bidirectional Session stream to one node: ``send`` bytes, ``receive`` bytes."""

    def __init__(
        self,
        requests: _Requests,
        replies: trio.MemoryReceiveChannel[_Item],
        limiter: trio.CapacityLimiter,
    ) -> None:
        self._requests = requests
        self._replies = replies
        self._limiter = limiter
        self.forward: ForwardRule | None = None  # read by the reader thread for every reply

    def try_send_nowait(self, data: bytes) -> bool:
        """Queue a frame from any thread; False when the queue is full (then send it with :meth:`send`)."""
        return self._requests.put_nowait(data)

    async def send(self, data: bytes) -> None:
        if not self._requests.put_nowait(data):
            await trio.to_thread.run_sync(
                self._requests.put, data, limiter=self._limiter, abandon_on_cancel=True
            )

    async def receive(self) -> bytes:
        data, _ = await self.receive_forwarded()
        return data

    async def receive_forwarded(self) -> tuple[bytes, Forwarded | None]:
        """The next reply, with what the forward rule made of it (None when no rule ran or it failed)."""
        try:
            item = await self._replies.receive()
        except trio.EndOfChannel as err:
            raise StreamError("the node ended the stream") from err
        if isinstance(item, StreamError):
            raise item
        return item


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
        requests = _Requests(_SEND_QUEUE_FRAMES)
        call = self._channel(address).stream_stream(SESSION_METHOD)(requests.iterate())
        send, receive = trio.open_memory_channel[_Item](_RECEIVE_BUFFER_FRAMES)
        token = trio.lowlevel.current_trio_token()
        stream = StageStream(requests, receive, self.limiter)

        def offer(item: _Item) -> bool:
            try:
                send.send_nowait(item)
            except trio.WouldBlock:
                return False
            return True

        def hand_over(item: _Item) -> None:
            if not trio.from_thread.run_sync(offer, item, trio_token=token):
                trio.from_thread.run(send.send, item, trio_token=token)  # full: wait for room

        def forwarded(data: bytes) -> Forwarded | None:
            rule = stream.forward
            if rule is None:
                return None
            try:
                return rule(data)
            except Exception:  # a bug in a rule must not kill the stream: the trio side takes over
                log.exception("forward rule failed on a reply from %s", address)
                return None

        def reader() -> None:
            try:
                try:
                    for data in call:
                        hand_over((data, forwarded(data)))
                    failure = StreamError(f"{address} ended the stream")
                except grpc.RpcError as err:
                    failure = StreamError(f"stream to {address} failed: {_describe(err)}")
                hand_over(failure)
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
                    yield stream
                finally:
                    requests.close()
                    call.cancel()
                    receive.close()

    async def aclose(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await trio.to_thread.run_sync(channel.close, limiter=self.limiter)
