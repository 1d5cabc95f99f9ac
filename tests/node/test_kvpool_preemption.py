"""Preemption at the node: the real session machine, hub, scheduler and engine on a small sparse pool.

Two gateways' sessions (SmolLM2, whole model as one shard) share a pool of 512
positions. The older session decodes until the pool is full: the younger one
gets an unsolicited STATUS_PREEMPTED error (retry RESUME, session closed), its
KV is freed on the engine, and the older one completes with exactly the greedy
tokens of the whole model alone. After the release nothing is left in the pool.
No gRPC (frames go through the hub in memory, as a transport hands them over).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

from node.backend import EngineBackend
from node.engine import EngineConfig, ShardEngine
from node.hub import Hub
from node.kvpool import blocks_for
from node.llama_runtime import ContextSettings
from node.reference import ReferenceModel
from node.scheduler import Scheduler
from node.session_machine import FrameServer, FreeKv, ServingSpec
from node.shard import extract_shard
from proto import codec
from proto.swarm.v1 import frame_pb2, status_pb2

pytestmark = pytest.mark.slow  # loads model weights into llama.cpp

CONFIG = EngineConfig(
    threads=1, max_sessions=4, session_kv_tokens=1 << 30, batch_tokens=256, kv_pool_tokens=512
)


@pytest.fixture(scope="module")
def engine(model_path: Path, node_cache: Path) -> Iterator[ShardEngine]:
    with ShardEngine(extract_shard(model_path, 0, 30, node_cache), CONFIG, node_cache) as e:
        assert e.layout_name == "sparse" and e.pool is not None and e.pool.total_blocks == 32
        yield e


def _spec(engine: ShardEngine) -> ServingSpec:
    assert engine.pool is not None
    return ServingSpec(
        node_id="n" * 64,
        model_fingerprint=engine.files.model.fingerprint,
        recipe_fingerprint=engine.recipe_fingerprint,
        shard_start=0,
        shard_end=30,
        n_embd=engine.n_embd,
        n_vocab=engine.n_vocab,
        is_first=True,
        is_last=True,
        max_sessions=CONFIG.max_sessions,
        session_kv_tokens=engine.session_kv_limit,
        n_ctx_train=8192,
        kv_pool_tokens=engine.pool.total_blocks * 16,
    )


class _Client:
    """One gateway's stream: OPEN, then prefill and greedy decode steps, one at a time."""

    def __init__(self, hub: Hub, spec: ServingSpec, sid: str) -> None:
        self.hub, self.sid, self.conn = hub, sid, hub.open_connection()
        self.header = codec.SessionHeader(sid, 1, spec.model_fingerprint, spec.recipe_fingerprint, 0, 30)
        self.pos = 0

    async def open(self) -> None:
        frame = codec.open_frame(
            self.header,
            step_id=1,
            route_ticket=b"t",
            kv_budget_tokens=512,
            sampling=codec.SamplingSettings(temperature=0.0),  # greedy
        )
        await self.hub.feed(self.conn, codec.serialize_frame(frame))
        assert codec.body_kind(await self.recv()) == "open_ack"

    async def recv(self) -> frame_pb2.Frame:
        with trio.fail_after(60):
            return codec.parse_frame(await self.conn.outbound.receive())

    async def step(self, tokens: list[int]) -> frame_pb2.Frame:
        """Send one step (ids follow positions: B + start + 1) and return its reply."""
        phase = frame_pb2.PHASE_PREFILL if len(tokens) > 1 else frame_pb2.PHASE_DECODE
        for frame in codec.step_frames(
            self.header, phase, step_id=2 + self.pos, start=self.pos, token_ids=tokens, sample=True
        ):
            await self.hub.feed(self.conn, codec.serialize_frame(frame))
        reply = await self.recv()
        if codec.body_kind(reply) == "result":
            self.pos += len(tokens)
        return reply


def _token(reply: frame_pb2.Frame) -> int:
    assert codec.body_kind(reply) == "result", reply
    return int(reply.result.sampled[0].token_id)


async def test_the_younger_session_is_preempted_and_the_older_completes_exactly(
    engine: ShardEngine, model_path: Path
) -> None:
    rng = np.random.default_rng(4)
    old_prompt = rng.integers(100, 30000, size=240).tolist()  # 15 blocks
    young_prompt = rng.integers(100, 30000, size=256).tolist()  # 16 blocks: 31 of 32 in use
    spec = _spec(engine)
    machine = FrameServer(spec, lambda *_: None)
    hub = Hub(machine)
    scheduler = Scheduler(
        EngineBackend(engine), hub.on_outcome, max_batch_tokens=256, prefill_chunk_tokens=256
    )
    hub.attach(scheduler)
    assert engine.pool is not None
    old_tokens: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        old, young = _Client(hub, spec, "old"), _Client(hub, spec, "young")
        await old.open()
        await young.open()
        old_tokens.append(_token(await old.step(old_prompt)))
        assert _token(await young.step(young_prompt)) >= 0
        assert engine.pool.used_blocks == 31
        # Positions 240..255 fill old's 16th block; position 256 needs a 33rd block: young goes.
        while len(old_tokens) < 24:
            old_tokens.append(_token(await old.step([old_tokens[-1]])))
        notice = await young.recv()
        assert codec.body_kind(notice) == "error" and notice.session_id == "young"
        assert notice.error.status == status_pb2.STATUS_PREEMPTED
        assert notice.error.retry == status_pb2.RETRY_RESUME and notice.error.session_closed
        assert not engine.has_session("young")
        assert engine.pool.used_blocks == blocks_for(old.pos) and old.pos == 240 + 23
        stats = machine.statistics()
        assert stats.preemptions == 1 and stats.sessions == 1
        # The preempted session is closed here: a late step is refused as the notice was (PREEMPTED, so
        # its owner resumes it rather than taking this node for failed), nothing reaches the engine.
        late = await young.step([1])
        assert late.error.status == status_pb2.STATUS_PREEMPTED
        assert late.error.retry == status_pb2.RETRY_RESUME and late.error.session_closed
        release = codec.release_frame(old.header, step_id=2 + old.pos, expected_kv_len=old.pos)
        await hub.feed(old.conn, codec.serialize_frame(release))
        assert codec.body_kind(await old.recv()) == "closed"
        await scheduler.run_control(FreeKv("nobody"))  # returns once every earlier effect ran
        nursery.cancel_scope.cancel()
    assert engine.pool.used_blocks == 0 and engine.session_ids() == []
    assert machine.statistics().kv_blocks_reserved == 0
    with ReferenceModel(
        model_path, ContextSettings(n_threads=1, n_seq_max=1, n_ctx=1024, n_batch=256, n_ubatch=256)
    ) as alone:
        want, _ = alone.greedy(old_prompt, 24)
    assert old_tokens == want
