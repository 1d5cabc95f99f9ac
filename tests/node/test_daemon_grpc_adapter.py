"""The gRPC adapter, hub and scheduler over real gRPC on loopback, with a fake engine (no llama.cpp).

Checks the transport plumbing: raw-bytes Session streams, replies in order,
half-close after the last step still delivers its reply, unreadable bytes get
a BAD_FRAME error on the same stream, Info/Health/GetVocab answer.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import trio

from common.grpc_adapter import Grpc, StreamClosed, open_grpc
from node.grpc_server import GrpcSettings, ShardService
from node.hub import Hub
from node.scheduler import Scheduler
from node.session_machine import FrameServer, ServingSpec
from proto import codec
from proto.swarm.v1 import frame_pb2, shard_service_pb2, status_pb2
from proto.vocab import VocabAssembler
from tests.node.fakes import MODEL_FP, N_EMBD, RECIPE_FP, FakeBackend

VOCAB = bytes(range(256)) * 50


def _spec() -> ServingSpec:
    return ServingSpec(
        node_id="n" * 64,
        model_fingerprint=MODEL_FP,
        recipe_fingerprint=RECIPE_FP,
        shard_start=0,
        shard_end=4,
        n_embd=N_EMBD,
        n_vocab=1000,
        is_first=True,
        is_last=False,
        max_sessions=4,
        session_kv_tokens=256,
        n_ctx_train=2048,
    )


def _header(sid: str, epoch: int = 1) -> codec.SessionHeader:
    return codec.SessionHeader(sid, epoch, MODEL_FP, RECIPE_FP, 0, 4)


async def _client_session(rt: Grpc, port: int, frames: list[bytes]) -> list[frame_pb2.Frame]:
    """Send each frame, wait for its reply, like a gateway; the last one half-closes first."""
    replies = []
    async with rt.open_stream(f"127.0.0.1:{port}", "/swarm.v1.ShardService/Session") as stream:
        for data in frames[:-1]:
            await stream.send(data)
            replies.append(codec.parse_frame(await stream.receive()))
        await stream.send(frames[-1])
        stream.close_sending()  # half-close right after the last step: its reply still comes
        while True:
            try:
                replies.append(codec.parse_frame(await stream.receive()))
            except StreamClosed:
                break
    return replies


async def _client_unary(
    rt: Grpc, port: int
) -> tuple[shard_service_pb2.NodeInfo, shard_service_pb2.HealthResponse, bytes]:
    address = f"127.0.0.1:{port}"
    info = shard_service_pb2.NodeInfo.FromString(await rt.unary(address, "/swarm.v1.ShardService/Info", b""))
    health = shard_service_pb2.HealthResponse.FromString(
        await rt.unary(address, "/swarm.v1.ShardService/Health", b"")
    )
    assembler = VocabAssembler(MODEL_FP)
    data = None
    request = shard_service_pb2.VocabRequest(model_fingerprint=MODEL_FP, max_chunk_bytes=3000)
    for raw in await rt.server_stream(
        address, "/swarm.v1.ShardService/GetVocab", request.SerializeToString(), max_messages=100
    ):
        data = assembler.add(shard_service_pb2.VocabChunk.FromString(raw))
    assert data is not None
    return info, health, data


async def test_grpc_session_round_trip_with_fake_engine() -> None:
    machine = FrameServer(_spec(), lambda *_: None)
    hub = Hub(machine)
    backend = FakeBackend()
    scheduler = Scheduler(backend, hub.on_outcome, max_batch_tokens=64, prefill_chunk_tokens=16)
    hub.attach(scheduler)
    adapter = ShardService(
        hub,
        GrpcSettings("127.0.0.1", 0, codec.DEFAULT_MAX_FRAME_BYTES, lambda: VOCAB, MODEL_FP, 1.0),
        lambda: shard_service_pb2.NodeInfo(node_id="n" * 64),
        lambda: shard_service_pb2.HealthResponse(status=shard_service_pb2.SERVING_STATUS_SERVING),
    )
    async with open_grpc() as rt, trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        port = await nursery.start(adapter.serve, rt)
        h = _header("s1")
        frames = [
            codec.serialize_frame(codec.open_frame(h, step_id=1, route_ticket=b"t", kv_budget_tokens=100)),
            b"\xff\x00garbage",
            *(
                codec.serialize_frame(f)
                for f in codec.step_frames(
                    h, frame_pb2.PHASE_PREFILL, step_id=2, start=0, token_ids=list(range(40))
                )
            ),
            codec.serialize_frame(
                codec.step_frames(h, frame_pb2.PHASE_DECODE, step_id=3, start=40, token_ids=[7])[0]
            ),
        ]
        with trio.fail_after(20):
            replies = await _client_session(rt, port, frames)
        kinds = [codec.body_kind(r) for r in replies]
        assert kinds == ["open_ack", "error", "result", "result"], kinds
        assert replies[1].error.status == status_pb2.STATUS_BAD_FRAME
        hidden = codec.reassemble([replies[2]]).tensors[codec.HIDDEN]
        assert hidden.shape == (40, N_EMBD)
        assert np.array_equal(hidden[:, 0], np.arange(40) * 2.0)  # token id + position
        assert replies[3].kv_len == 41
        # the prefill of 40 went through in slices of at most 16 positions
        assert all(count <= 16 for batch in backend.batches for _, _, count in batch)
        with trio.fail_after(20):
            info, health, vocab = await _client_unary(rt, port)
        assert info.node_id == "n" * 64 and health.status == shard_service_pb2.SERVING_STATUS_SERVING
        assert vocab == VOCAB
        nursery.cancel_scope.cancel()


async def test_a_stream_refused_at_the_limit_is_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    hub = Hub(FrameServer(_spec(), lambda *_: None), max_connections=1)
    hub.open_connection(trusted=True)  # the node's only slot, held by a proven connection
    adapter = ShardService(
        hub,
        GrpcSettings("127.0.0.1", 0, codec.DEFAULT_MAX_FRAME_BYTES, lambda: VOCAB, MODEL_FP, 1.0),
        lambda: shard_service_pb2.NodeInfo(node_id="n" * 64),
        lambda: shard_service_pb2.HealthResponse(status=shard_service_pb2.SERVING_STATUS_SERVING),
    )
    caplog.set_level(logging.DEBUG)
    async with open_grpc() as rt, trio.open_nursery() as nursery:
        port = await nursery.start(adapter.serve, rt)
        with trio.fail_after(20):
            async with rt.open_stream(f"127.0.0.1:{port}", "/swarm.v1.ShardService/Session") as stream:
                await stream.send(b"\x00")
                with pytest.raises(StreamClosed) as closed:
                    await stream.receive()
        assert closed.value.code == "RESOURCE_EXHAUSTED"
        assert adapter.streams_refused == 1
        nursery.cancel_scope.cancel()
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and "peer=127.0.0.1" in refusals[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
