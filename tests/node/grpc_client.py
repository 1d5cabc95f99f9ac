"""A small blocking Session-stream client for tests and benchmarks (what a gateway does, minus everything else)."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from proto import codec
from proto.swarm.v1 import frame_pb2

_END = object()


class StageStream:
    """One bidirectional Session stream: ``send`` frames, ``recv`` reply frames one at a time."""

    def __init__(self, channel: grpc.Channel, timeout_s: float = 60.0) -> None:
        self._out: queue.Queue[object] = queue.Queue(maxsize=1024)
        call = channel.stream_stream("/swarm.v1.ShardService/Session")
        self._replies = call(self._requests(), timeout=timeout_s)

    def _requests(self) -> Iterator[bytes]:
        while True:
            item = self._out.get()
            if item is _END:
                return
            assert isinstance(item, bytes)
            yield item

    def send_bytes(self, data: bytes) -> None:
        self._out.put(data)

    def send(self, *frames: frame_pb2.Frame) -> None:
        for f in frames:
            self._out.put(codec.serialize_frame(f))

    def recv(self) -> frame_pb2.Frame:
        return codec.parse_frame(next(self._replies), codec.FrameLimits(max_frame_bytes=64 * 1024 * 1024))

    def recv_step(self) -> list[frame_pb2.Frame]:
        """The reply frames of one step: an error, or result chunks up to the last one."""
        frames = [self.recv()]
        while codec.body_kind(frames[-1]) == "result" and frames[-1].HasField("chunk") and (
            frames[-1].chunk.index < frames[-1].chunk.count - 1
        ):
            frames.append(self.recv())
        return frames

    def close(self) -> None:
        self._out.put(_END)

    def rest(self) -> list[frame_pb2.Frame]:
        """Half-close and read every remaining reply."""
        self.close()
        return [codec.parse_frame(r) for r in self._replies]

    def cancel(self) -> None:
        self._replies.cancel()
