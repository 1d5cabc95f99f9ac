"""A minimal blocking Route Session client over gRPC for the node tests: hand-made frames, no gateway.

For tests, benchmarks (``sim/bench_hop.py``) and operators poking at a node.
:class:`StageStream` is one bidirectional ``Session`` stream (frames out, reply
frames in); :class:`RouteSession` opens one per stage, relays each stage's
hidden states to the next unchanged (:func:`relay_frame`) and returns the
last stage's sampled tokens. Not a gateway: no recovery, no retries.
"""

from __future__ import annotations

import queue
import secrets
import ssl
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import nacl.signing

from common.tls import TLS_SERVER_NAME
from proto import codec
from proto.signing import route_ticket_bytes, sign_open_proof
from proto.swarm.v1 import frame_pb2, shard_service_pb2

_END = object()


def relay_frame(
    result: frame_pb2.Frame,
    next_header: codec.SessionHeader,
    *,
    step_id: int,
    token_ids: Sequence[int] = (),
    sample: bool = False,
) -> frame_pb2.Frame:
    """One result chunk of a stage as the matching activation chunk of the next stage.

    The tensors move over untouched (checksums included): this client relays
    without decoding. ``token_ids`` are the tokens of this chunk's positions
    (sent to the last stage for its penalties); ``sample`` is only honoured on
    the last chunk. (Moved here from ``proto.codec``: the product never relays
    this way, only this client does.)
    """
    frame = next_header.frame(
        result.phase,
        step_id=step_id,
        expected_kv_len=result.expected_kv_len,
        positions=(result.positions.start, result.positions.end),
    )
    if result.HasField("chunk"):
        frame.chunk.CopyFrom(result.chunk)
    frame.activation.tensors.extend(result.result.tensors)
    frame.activation.token_ids.extend(int(t) for t in token_ids)
    last_chunk = not result.HasField("chunk") or result.chunk.index == result.chunk.count - 1
    frame.activation.sample = sample and last_chunk
    return frame


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
        while (
            codec.body_kind(frames[-1]) == "result"
            and frames[-1].HasField("chunk")
            and (frames[-1].chunk.index < frames[-1].chunk.count - 1)
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


GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


@dataclass(frozen=True)
class Stage:
    address: str
    info: shard_service_pb2.NodeInfo

    @property
    def start(self) -> int:
        return self.info.shard.start

    @property
    def end(self) -> int:
        return self.info.shard.end


def node_channel(address: str, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A channel to a node of this test: TLS trusting whatever certificate it shows (a test looks at
    the node it started), or plaintext when it serves no TLS (insecure_plaintext)."""
    host, _, port = address.rpartition(":")
    try:
        pem = ssl.get_server_certificate((host.strip("[]"), int(port)), timeout=10)
    except (ssl.SSLError, OSError):
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode("ascii"))
    return grpc.secure_channel(
        address, credentials, options=[*(options or []), ("grpc.ssl_target_name_override", TLS_SERVER_NAME)]
    )


def node_info(address: str) -> shard_service_pb2.NodeInfo:
    with node_channel(address) as channel:
        info = channel.unary_unary(
            "/swarm.v1.ShardService/Info",
            request_serializer=shard_service_pb2.InfoRequest.SerializeToString,
            response_deserializer=shard_service_pb2.NodeInfo.FromString,
        )(shard_service_pb2.InfoRequest(), timeout=10)
    if not isinstance(info, shard_service_pb2.NodeInfo):
        raise TypeError("Info answered something else than a NodeInfo")
    return info


def ticket_bytes(ticket: dict[str, str]) -> bytes:
    return route_ticket_bytes(ticket)


def open_proof(key: nacl.signing.SigningKey, node_id: str, frame: frame_pb2.Frame) -> bytes:
    """``OpenSession.gateway_proof`` for this OPEN to ``node_id``, signed with ``key``."""
    return sign_open_proof(
        key,
        session_id=frame.session_id,
        node_id=node_id,
        route_epoch=frame.route_epoch,
        step_id=frame.step_id,
        ticket=bytes(frame.open.route_ticket),
        now_s=time.time(),
    )


class RouteSession:
    """One Route Session over a chain of stages: greedy/sampled generation with f32 hidden states."""

    def __init__(
        self,
        stages: list[Stage],
        ticket: bytes,
        *,
        budget: int = 256,
        sampling: codec.SamplingSettings | None = None,
        session_id: str | None = None,
        timeout_s: float = 120.0,
        gateway_key: nacl.signing.SigningKey | None = None,
    ) -> None:
        self.stages = stages
        self.session_id = session_id or secrets.token_hex(16)
        self.channels = [node_channel(s.address, options=GRPC_OPTIONS) for s in stages]
        self.streams = [StageStream(c, timeout_s) for c in self.channels]
        self.headers = [
            codec.SessionHeader(
                self.session_id,
                1,
                s.info.model.fingerprint,
                s.info.recipe.fingerprint,
                s.start,
                s.end,
                request_id="test",
            )
            for s in stages
        ]
        self.step_id = 1
        self.kv = 0
        for stage, stream, header in zip(stages, self.streams, self.headers, strict=True):
            frame = codec.open_frame(
                header,
                step_id=self.step_id,
                route_ticket=ticket,
                kv_budget_tokens=budget,
                sampling=sampling or codec.SamplingSettings(temperature=0.0),
            )
            if gateway_key is not None:  # the ticket names this gateway: prove it is us
                frame.open.gateway_proof = open_proof(gateway_key, stage.info.node_id, frame)
            stream.send(frame)
        for stream in self.streams:
            ack = stream.recv()
            if codec.body_kind(ack) != "open_ack":
                raise RuntimeError(f"OPEN refused: {ack.error}")

    def step(self, tokens: list[int], *, sample: bool = True) -> frame_pb2.SampledToken | None:
        """One step (prefill of ``tokens`` or one decode) through every stage; returns the sampled token."""
        self.step_id += 1
        phase = frame_pb2.PHASE_DECODE if len(tokens) == 1 and self.kv > 0 else frame_pb2.PHASE_PREFILL
        frames = codec.step_frames(
            self.headers[0],
            phase,
            step_id=self.step_id,
            start=self.kv,
            token_ids=tokens,
            sample=sample and len(self.stages) == 1,
        )
        for k, stream in enumerate(self.streams):
            stream.send(*frames)
            replies = stream.recv_step()
            if codec.body_kind(replies[0]) == "error":
                raise RuntimeError(f"stage {k} refused step {self.step_id}: {replies[0].error}")
            if k + 1 < len(self.streams):
                last_next = k + 1 == len(self.streams) - 1
                frames = [
                    relay_frame(
                        r,
                        self.headers[k + 1],
                        step_id=self.step_id,
                        token_ids=tokens[r.positions.start - self.kv : r.positions.end - self.kv]
                        if last_next
                        else (),
                        sample=sample and last_next,
                    )
                    for r in replies
                ]
        self.kv += len(tokens)
        sampled = replies[-1].result.sampled
        return sampled[0] if sampled else None

    def generate(self, prompt: list[int], n_new: int) -> list[int]:
        out = [self.step(prompt).token_id]  # type: ignore[union-attr]
        while len(out) < n_new:
            out.append(self.step([out[-1]]).token_id)  # type: ignore[union-attr]
        return out

    def release(self) -> list[frame_pb2.Frame]:
        self.step_id += 1
        for stream, header in zip(self.streams, self.headers, strict=True):
            stream.send(codec.release_frame(header, step_id=self.step_id, expected_kv_len=self.kv))
        return [s.recv() for s in self.streams]

    def close(self) -> None:
        for s in self.streams:
            s.close()
        for c in self.channels:
            c.close()
