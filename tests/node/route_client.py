"""Drive a Route Session through real nodes over gRPC, like a gateway does (tests and sim/bench_hop.py)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import grpc

from proto import codec
from proto.signing import route_ticket_bytes
from proto.swarm.v1 import frame_pb2, shard_service_pb2, shard_service_pb2_grpc
from tests.node.grpc_client import StageStream

GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024)]


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


def node_info(address: str) -> shard_service_pb2.NodeInfo:
    with grpc.insecure_channel(address) as channel:
        return shard_service_pb2_grpc.ShardServiceStub(channel).Info(shard_service_pb2.InfoRequest(), timeout=10)


def ticket_bytes(ticket: dict[str, str]) -> bytes:
    return route_ticket_bytes(ticket)


class RouteSession:
    """One Route Session over a chain of stages: greedy/sampled generation with f32 hidden states."""

    def __init__(self, stages: list[Stage], ticket: bytes, *, budget: int = 256,
                 sampling: codec.SamplingSettings | None = None, session_id: str | None = None,
                 timeout_s: float = 120.0) -> None:
        self.stages = stages
        self.session_id = session_id or secrets.token_hex(16)
        self.channels = [grpc.insecure_channel(s.address, options=GRPC_OPTIONS) for s in stages]
        self.streams = [StageStream(c, timeout_s) for c in self.channels]
        self.headers = [
            codec.SessionHeader(self.session_id, 1, s.info.model.fingerprint, s.info.recipe.fingerprint,
                                s.start, s.end, request_id="test")
            for s in stages
        ]
        self.step_id = 1
        self.kv = 0
        for stream, header in zip(self.streams, self.headers, strict=True):
            stream.send(codec.open_frame(header, step_id=self.step_id, route_ticket=ticket, kv_budget_tokens=budget,
                                         sampling=sampling or codec.SamplingSettings(temperature=0.0)))
        for stream in self.streams:
            ack = stream.recv()
            if codec.body_kind(ack) != "open_ack":
                raise RuntimeError(f"OPEN refused: {ack.error}")

    def step(self, tokens: list[int], *, sample: bool = True) -> frame_pb2.SampledToken | None:
        """One step (prefill of ``tokens`` or one decode) through every stage; returns the sampled token."""
        self.step_id += 1
        phase = frame_pb2.PHASE_DECODE if len(tokens) == 1 and self.kv > 0 else frame_pb2.PHASE_PREFILL
        frames = codec.step_frames(self.headers[0], phase, step_id=self.step_id, start=self.kv, token_ids=tokens,
                                   sample=sample and len(self.stages) == 1)
        for k, stream in enumerate(self.streams):
            stream.send(*frames)
            replies = stream.recv_step()
            if codec.body_kind(replies[0]) == "error":
                raise RuntimeError(f"stage {k} refused step {self.step_id}: {replies[0].error}")
            if k + 1 < len(self.streams):
                last_next = k + 1 == len(self.streams) - 1
                frames = [codec.relay_frame(r, self.headers[k + 1], step_id=self.step_id,
                                            token_ids=tokens[r.positions.start - self.kv: r.positions.end - self.kv]
                                            if last_next else (),
                                            sample=sample and last_next)
                          for r in replies]
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
