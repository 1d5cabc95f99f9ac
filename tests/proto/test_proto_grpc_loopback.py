"""The schema works over real gRPC on loopback, with the node reading raw frame bytes.

A node registers ``Session`` without a deserializer so that it parses each
message itself with :func:`proto.codec.parse_frame`: unreadable bytes then get
a ``BAD_FRAME`` error frame on the same stream instead of a gRPC failure that
would end the session (docs/protocol.md, Transport).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from proto import codec, errors
from proto.swarm.v1 import frame_pb2, shard_service_pb2, shard_service_pb2_grpc, status_pb2
from proto.vocab import VocabAssembler, vocab_chunks

HEADER = codec.SessionHeader("s-loop", 1, "c" * 64, "d" * 64, 0, 30)
VOCAB = bytes(range(256)) * 40


def _session(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    for data in requests:
        try:
            frame = codec.parse_frame(data)
        except errors.ProtocolError as exc:
            yield codec.serialize_frame(codec.error_frame(exc))
            continue
        if codec.body_kind(frame) == "open":
            yield codec.serialize_frame(
                codec.open_ack_frame(
                    frame,
                    kv_len=0,
                    node_id="node-a",
                    kv_tokens_granted=frame.open.kv_budget.max_tokens,
                    max_frame_bytes=codec.DEFAULT_MAX_FRAME_BYTES,
                    max_step_tokens=4096,
                )
            )
        else:
            step = codec.reassemble([frame])
            for reply in codec.result_frames(step, kv_len=step.end, hidden=step.tensors[codec.HIDDEN] * 2):
                yield codec.serialize_frame(reply)


class _Info(shard_service_pb2_grpc.ShardServiceServicer):
    def Info(  # noqa: N802 - gRPC method name
        self, request: shard_service_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> shard_service_pb2.NodeInfo:
        return shard_service_pb2.NodeInfo(node_id="node-a", shard=frame_pb2.LayerRange(start=0, end=30))

    def GetVocab(  # noqa: N802 - gRPC method name
        self, request: shard_service_pb2.VocabRequest, context: grpc.ServicerContext
    ) -> Iterator[shard_service_pb2.VocabChunk]:
        yield from vocab_chunks(VOCAB, model_fingerprint=request.model_fingerprint, chunk_bytes=1000)


@pytest.fixture
def channel() -> Iterator[grpc.Channel]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _Info()
    handlers = {
        # No (de)serializers: the handler sees and returns the raw frame bytes.
        "Session": grpc.stream_stream_rpc_method_handler(_session),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info,
            request_deserializer=shard_service_pb2.InfoRequest.FromString,
            response_serializer=shard_service_pb2.NodeInfo.SerializeToString,
        ),
        "GetVocab": grpc.unary_stream_rpc_method_handler(
            servicer.GetVocab,
            request_deserializer=shard_service_pb2.VocabRequest.FromString,
            response_serializer=shard_service_pb2.VocabChunk.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarm.v1.ShardService", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
            yield chan
    finally:
        server.stop(grace=None)


def test_session_stream_round_trip(channel: grpc.Channel) -> None:
    x = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    outgoing = [
        codec.serialize_frame(codec.open_frame(HEADER, step_id=1, route_ticket=b"t", kv_budget_tokens=64)),
        b"\xff\x00garbage",
        *(
            codec.serialize_frame(f)
            for f in codec.step_frames(HEADER, frame_pb2.PHASE_PREFILL, step_id=2, start=0, hidden=x)
        ),
    ]
    session = channel.stream_stream("/swarm.v1.ShardService/Session")
    replies = [codec.parse_frame(r) for r in session(iter(outgoing), timeout=10)]
    assert [codec.body_kind(r) for r in replies] == ["open_ack", "error", "result"]
    assert replies[1].error.status == status_pb2.STATUS_BAD_FRAME
    assert np.array_equal(codec.reassemble(replies[2:]).tensors[codec.HIDDEN], x * 2)


def test_generated_stub_unary_and_server_streaming(channel: grpc.Channel) -> None:
    stub = shard_service_pb2_grpc.ShardServiceStub(channel)
    assert stub.Info(shard_service_pb2.InfoRequest(), timeout=10).node_id == "node-a"
    assembler = VocabAssembler("e" * 64)
    results = [
        assembler.add(c)
        for c in stub.GetVocab(shard_service_pb2.VocabRequest(model_fingerprint="e" * 64), timeout=10)
    ]
    assert results[-1] == VOCAB and all(r is None for r in results[:-1])
