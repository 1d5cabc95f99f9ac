"""The node's KV pool: block accounting (pure) and the engine on a pool (real llama.cpp): its default
layout (sparse per-sequence streams) and the opt-in unified stream (compaction)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from node.engine import EngineConfig, ShardEngine, Work
from node.errors import KVBudgetError, KVPoolExhaustedError
from node.kvpool import BLOCK_TOKENS, KvPool, blocks_for
from node.llama_runtime import ContextSettings
from node.reference import ReferenceModel
from node.shard import extract_shard

# --------------------------------------------------------------------------- accounting (pure)


def test_blocks_round_up_to_16_positions() -> None:
    assert [blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_pool_grows_by_blocks_never_overcommits_and_returns_to_empty() -> None:
    pool = KvPool(10 * BLOCK_TOKENS)
    assert pool.resize("a", 17) and pool.used_blocks == 2
    assert pool.resize("a", 32) and pool.used_blocks == 2  # same blocks
    assert pool.resize("b", 8 * BLOCK_TOKENS) and pool.free_blocks == 0
    assert not pool.resize("a", 33)  # one more block: refused whole
    assert pool.positions("a") == 32 and pool.used_blocks == 10
    assert pool.growth_blocks("a", 33) == 1
    assert pool.resize("a", 5) and pool.used_blocks == 9  # truncation gives blocks back
    pool.move("a", "c")
    assert pool.positions("a") == 0 and pool.positions("c") == 5
    assert pool.release("b") == 8 and pool.release("c") == 1 and pool.release("gone") == 0
    assert pool.stats().used_blocks == 0 and pool.stats().sessions == 0
    assert pool.stats().free_tokens == 160


def test_pool_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        KvPool(8)
    with pytest.raises(ValueError):
        KvPool(64).resize("a", -1)


# --------------------------------------------------------------------------- the engine on a pool

POOL = EngineConfig(threads=1, max_sessions=16, session_kv_tokens=8192, batch_tokens=256, kv_pool_tokens=1024)


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 30000, size=n).astype(np.int32)


@pytest.fixture(scope="module")
def pooled(model_path: Path, node_cache: Path) -> Iterator[ShardEngine]:
    with ShardEngine(extract_shard(model_path, 0, 30, node_cache), POOL, node_cache) as engine:
        assert engine.layout_name == "sparse"
        yield engine


@pytest.fixture(scope="module")
def unified(model_path: Path, node_cache: Path) -> Iterator[ShardEngine]:
    config = dataclasses.replace(POOL, kv_pool_layout="unified")
    with ShardEngine(extract_shard(model_path, 0, 30, node_cache), config, node_cache) as engine:
        assert engine.layout_name == "unified"
        yield engine


@pytest.fixture(scope="module")
def solo_reference(model_path: Path) -> Iterator[ReferenceModel]:
    with ReferenceModel(
        model_path, ContextSettings(n_threads=1, n_seq_max=1, n_ctx=4096, n_batch=256)
    ) as ref:
        yield ref


_LAST: dict[str, np.ndarray] = {}  # the logits after each session's last prefill


def _prefill(engine: ShardEngine, sid: str, toks: np.ndarray, start: int = 0) -> np.ndarray:
    logits = None
    for off in range(0, len(toks), 256):
        chunk = toks[off : off + 256]
        r = engine.step([Work(sid, start + off, tokens=chunk, return_logits=True)])[0]
        assert r.ok, r.error
        logits = r.logits
    assert logits is not None
    _LAST[sid] = logits
    return logits


@pytest.mark.slow  # loads model weights into llama.cpp
def test_sessions_open_without_reserving_and_the_pool_empties(pooled: ShardEngine) -> None:
    sids = [f"open-{i}" for i in range(16)]
    for sid in sids:
        assert pooled.open_session(sid) == 1024  # the pool bounds a session (model: 8192, cap: 8192)
    assert pooled.statistics().kv_pool.used_blocks == 0  # nothing reserved at OPEN
    for i, sid in enumerate(sids):
        assert pooled.step([Work(sid, 0, tokens=_tokens(17, i))])[0].ok
    assert pooled.statistics().kv_pool.used_blocks == 32  # 17 positions = 2 blocks each
    for sid in sids:
        pooled.release(sid)
    stats = pooled.statistics().kv_pool
    assert stats.used_blocks == 0 and stats.sessions == 0


@pytest.mark.slow  # loads model weights into llama.cpp
def test_growth_past_the_pool_is_refused_whole_and_fits_after_a_release(
    pooled: ShardEngine, solo_reference: ReferenceModel
) -> None:
    pooled.open_session("big")
    pooled.open_session("late")
    try:
        _prefill(pooled, "big", _tokens(700, 1))
        before = pooled.statistics().kv_pool_refusals
        r = pooled.step([Work("late", 0, tokens=_tokens(400, 2))])[0]
        assert isinstance(r.error, KVPoolExhaustedError) and "free blocks" in str(r.error)
        assert pooled.kv_len("late") == 0 and pooled.kv_len("big") == 700  # nothing touched
        assert pooled.statistics().kv_pool_refusals == before + 1
        assert pooled.statistics().kv_pool.used_blocks == blocks_for(700)
        # A whole step: the piece that fits runs, the one that does not is refused.
        results = pooled.step(
            [Work("big", 700, tokens=_tokens(1, 3)), Work("late", 0, tokens=_tokens(400, 2))]
        )
        assert results[0].ok and isinstance(results[1].error, KVPoolExhaustedError)
        pooled.release("big")
        got = _prefill(pooled, "late", _tokens(400, 2))
        solo_reference.clear()
        want = solo_reference.prefill(_tokens(400, 2).tolist())
        assert got.tobytes() == want.tobytes()
    finally:
        for sid in ("big", "late"):
            if pooled.has_session(sid):
                pooled.release(sid)
    assert pooled.statistics().kv_pool.used_blocks == 0


@pytest.mark.slow  # loads model weights into llama.cpp
def test_a_session_asking_past_its_cap_is_refused(pooled: ShardEngine) -> None:
    with pytest.raises(KVBudgetError):
        pooled.open_session("too-big", kv_budget=1025)


TEXTS = [
    "The history of the city is long and full of change. Merchants came by river and by road, ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived a baker who ",
    "The mitochondria is the powerhouse of the cell. It produces energy through respiration, and ",
]


@pytest.mark.slow  # loads model weights into llama.cpp
def test_sessions_keep_their_text_through_a_fragmented_and_compacted_pool(
    unified: ShardEngine, solo_reference: ReferenceModel, vocab
) -> None:
    """Eight sessions fill the pool, every other one leaves, a long session takes the room (the pool
    is compacted first), and all of them decode together: each gives the greedy tokens it gives
    alone in a fresh context. Low-order bits may differ from a session alone: llama.cpp's CPU
    flash attention reduces KV cells in groups of 64, so a session whose cells do not sit where
    they would alone rounds differently (docs/engine.md, "The KV pool")."""
    sids = [f"frag-{i}" for i in range(8)]
    prompts = {sid: vocab.tokenize(TEXTS[i % 4] * 6)[: 100 + i] for i, sid in enumerate(sids)}
    for sid in sids:
        unified.open_session(sid)
        _prefill(unified, sid, np.array(prompts[sid], dtype=np.int32))
    for sid in sids[::2]:
        unified.release(sid)
    prompts["long"] = vocab.tokenize(" ".join(TEXTS) * 8)[:448]
    live = [*sids[1::2], "long"]
    unified.open_session("long")
    try:
        _prefill(unified, "long", np.array(prompts["long"], dtype=np.int32))
        assert unified.statistics().kv_pool_compactions >= 1
        got = {sid: [int(np.argmax(_LAST[sid]))] for sid in live}
        for _ in range(15):
            works = [
                Work(
                    sid,
                    len(prompts[sid]) + len(got[sid]) - 1,
                    tokens=np.array([got[sid][-1]], dtype=np.int32),
                    return_logits=True,
                )
                for sid in live
            ]
            for w, r in zip(works, unified.step(works), strict=True):
                assert r.ok, r.error
                got[w.session_id].append(int(np.argmax(r.logits)))
        for sid in live:
            solo_reference.clear()
            want, _ = solo_reference.greedy(prompts[sid], 16)
            assert got[sid] == want, sid
    finally:
        for sid in live:
            if unified.has_session(sid):
                unified.release(sid)
    assert unified.statistics().kv_pool.used_blocks == 0


def test_the_session_machine_reports_the_pool_as_its_capacity() -> None:
    from node.session_machine import FrameServer, ServingSpec

    def spec(**kw: object) -> ServingSpec:
        base: dict[str, object] = dict(
            node_id="n" * 64,
            model_fingerprint="ab" * 32,
            recipe_fingerprint="cd" * 32,
            shard_start=0,
            shard_end=30,
            n_embd=576,
            n_vocab=100,
            is_first=True,
            is_last=True,
            max_sessions=8,
            session_kv_tokens=8192,
            n_ctx_train=8192,
        )
        return ServingSpec(**{**base, **kw})  # type: ignore[arg-type]

    def allow(*_: object) -> None:
        return None

    assert FrameServer(spec(kv_pool_tokens=16384), allow).statistics().kv_tokens_capacity == 16384
    # The per-sequence layout: every slot's positions.
    assert FrameServer(spec(session_kv_tokens=2048), allow).statistics().kv_tokens_capacity == 8 * 2048


def test_an_automatic_pool_fills_what_the_span_leaves_of_the_memory_budget(tmp_path: Path) -> None:
    from node.capacity import POOL_MARGIN, MemoryLimit, Sizing, auto_pool_tokens
    from node.config import NodeConfig
    from node.errors import CapacityError
    from node.joining import _Joiner

    # 4 layers of 100 MB weights; KV priced at 1000 positions: 1 MB per layer (1000 bytes/position/layer).
    sizing = Sizing(
        layer_bytes=(100_000_000,) * 4,
        kv_bytes_per_layer=(1_000_000,) * 4,
        first_extra_bytes=10_000_000,
        last_extra_bytes=20_000_000,
        fixed_bytes=50_000_000,
    )
    budget = 1_000_000_000
    tokens = auto_pool_tokens(sizing, 0, 2, budget, sized_positions=1000, n_batch=512)
    room = budget * (1 - POOL_MARGIN) - (50_000_000 + 200_000_000 + 10_000_000)
    per_position = 2 * 1000 + 4 * 512  # the pool (per-sequence layouts: no compaction copy) and the mask row
    assert tokens % 256 == 0 and tokens <= room / per_position < tokens + 256
    # The last stage carries the LM head: less room, a smaller pool; a span that fills memory: none.
    assert auto_pool_tokens(sizing, 2, 4, budget, 1000, 512) < tokens
    assert auto_pool_tokens(sizing, 0, 4, 400_000_000, 1000, 512) == 0
    # The unified layout prices a compaction's transient copy of the KV too.
    unified = auto_pool_tokens(sizing, 0, 2, budget, 1000, 512, copies=2)
    assert unified <= room / (2 * 2 * 1000 + 4 * 512) < unified + 256 and unified < tokens
    cfg = NodeConfig(kv_pool_tokens=-1, cache_dir=str(tmp_path), max_sessions=1, session_kv_tokens=1000)
    joiner = _Joiner(cfg.validate(), None, "")
    limit = MemoryLimit(budget, "memory_limit_mb")
    assert joiner._pool_tokens(sizing, limit, 0, 2) == auto_pool_tokens(sizing, 0, 2, budget, 1024, 512)
    with pytest.raises(CapacityError, match="holds no KV pool"):
        joiner._pool_tokens(sizing, MemoryLimit(400_000_000, "cgroup"), 0, 4)
    fixed = NodeConfig(kv_pool_tokens=4096, cache_dir=str(tmp_path)).validate()
    assert _Joiner(fixed, None, "")._pool_tokens(None, None, 0, 2) == 4096


def test_layers_sized_for_an_automatic_pool_leave_it_room_at_a_tight_memory_limit() -> None:
    """A memory limit that holds k layers with the KV the sizing prices, and no more: with an automatic
    pool the node takes fewer layers (they fit the budget less the pool's margin), and the pool sized
    after them is not empty; a fixed pool or none takes the whole budget for layers."""
    from node.capacity import POOL_MARGIN, Sizing, auto_pool_tokens, span_budget_bytes

    sizing = Sizing(
        layer_bytes=(10_000_000,) * 30,
        kv_bytes_per_layer=(800_000,) * 30,  # 1,024 positions priced: 781 bytes per position per layer
        first_extra_bytes=30_000_000,
        last_extra_bytes=30_000_000,
        fixed_bytes=200_000_000,
    )
    worst_10 = max(sizing.span_bytes(a, a + 10) for a in range(21))
    tight = worst_10  # exactly 10 layers with their priced KV, nothing to spare
    assert sizing.max_layers(span_budget_bytes(tight, auto_pool=False)) == 10
    # Taken whole, the tight budget leaves the automatic pool nothing (the failure this guards).
    assert auto_pool_tokens(sizing, 0, 10, tight, 1024, 256) == 0
    layers = sizing.max_layers(span_budget_bytes(tight, auto_pool=True))
    assert 1 <= layers < 10
    assert all(auto_pool_tokens(sizing, a, a + layers, tight, 1024, 256) >= 256 for a in range(31 - layers))
    roomy = math.ceil(worst_10 / (1 - POOL_MARGIN)) + 1  # what holds 10 layers and their pool
    assert sizing.max_layers(span_budget_bytes(roomy, auto_pool=True)) == 10
    assert auto_pool_tokens(sizing, 0, 10, roomy, 1024, 256) >= 256
