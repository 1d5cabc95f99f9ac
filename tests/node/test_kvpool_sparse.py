"""The KV pool on sparse per-sequence streams, the pool's default layout (real llama.cpp, SmolLM2).

Exact (several sessions of different lengths decoding together give the logits
of today's per-sequence layout bit for bit, and each session alone in a fresh
context gives the same greedy tokens), a session grows past what a slot of the
same memory allows, truncation and release give the stream's pages back, and
where sparse streams cannot apply the engine says so and runs resident ones.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from node.engine import EngineConfig, ShardEngine, Work
from node.errors import KVBudgetError
from node.kvpool import blocks_for
from node.llama_runtime import ContextSettings
from node.reference import ReferenceModel
from node.shard import extract_shard

pytestmark = pytest.mark.slow  # loads model weights into llama.cpp

# 4 sessions; the pool holds 4,096 positions, the memory of today's 4 x 1,024.
POOL = EngineConfig(
    threads=1, max_sessions=4, session_kv_tokens=1 << 30, batch_tokens=256, kv_pool_tokens=4096
)
TODAY = EngineConfig(threads=1, max_sessions=4, session_kv_tokens=1024, batch_tokens=256)
BYTES_PER_POSITION = 30 * 2 * 3 * 64 * 2  # SmolLM2: 30 layers, K and V, 3 KV heads of 64, f16


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 30000, size=n).astype(np.int32)


@pytest.fixture(scope="module")
def sparse(model_path: Path, node_cache: Path) -> Iterator[ShardEngine]:
    with ShardEngine(extract_shard(model_path, 0, 30, node_cache), POOL, node_cache) as engine:
        yield engine


@pytest.fixture(scope="module")
def today(model_path: Path, node_cache: Path) -> Iterator[ShardEngine]:
    with ShardEngine(extract_shard(model_path, 0, 30, node_cache), TODAY, node_cache) as engine:
        yield engine


@pytest.fixture(scope="module")
def alone(model_path: Path) -> Iterator[ReferenceModel]:
    with ReferenceModel(
        model_path, ContextSettings(n_threads=1, n_seq_max=1, n_ctx=4096, n_batch=256, n_ubatch=256)
    ) as ref:
        yield ref


def _prefill(engine: ShardEngine, sid: str, toks: np.ndarray, start: int = 0) -> np.ndarray:
    logits = None
    for off in range(0, len(toks), 256):
        r = engine.step([Work(sid, start + off, tokens=toks[off : off + 256], return_logits=True)])[0]
        assert r.ok, r.error
        logits = r.logits
    assert logits is not None
    return logits


def _decode_together(
    engine: ShardEngine, prompts: dict[str, np.ndarray], steps: int
) -> dict[str, list[bytes]]:
    """Prefill every session alone, then decode all of them in one batch per step (greedy)."""
    out: dict[str, list[bytes]] = {}
    last: dict[str, int] = {}
    for sid, toks in prompts.items():
        engine.open_session(sid)
        logits = _prefill(engine, sid, toks)
        out[sid] = [logits.tobytes()]
        last[sid] = int(np.argmax(logits))
    for k in range(steps):
        works = [
            Work(sid, len(toks) + k, tokens=np.array([last[sid]], np.int32), return_logits=True)
            for sid, toks in prompts.items()
        ]
        for w, r in zip(works, engine.step(works), strict=True):
            assert r.ok, r.error
            assert r.logits is not None
            out[w.session_id].append(r.logits.tobytes())
            last[w.session_id] = int(np.argmax(r.logits))
    for sid in prompts:
        engine.release(sid)
    return out


def _greedy(logits: list[bytes]) -> list[int]:
    return [int(np.argmax(np.frombuffer(b, dtype=np.float32))) for b in logits]


def test_sessions_of_different_lengths_decoding_together_are_exact(
    sparse: ShardEngine, today: ShardEngine, alone: ReferenceModel
) -> None:
    assert sparse.layout_name == "sparse" and today.layout_name == "per-sequence"
    prompts = {f"s{n}": _tokens(n, n) for n in (37, 180, 333, 700)}
    pooled = _decode_together(sparse, prompts, 8)
    slots = _decode_together(today, prompts, 8)
    for sid, toks in prompts.items():
        # Same batches, same streams from cell 0: the layout changes no bit.
        assert pooled[sid] == slots[sid], sid
        alone.clear()
        want, first = alone.greedy(toks.tolist(), 9)
        assert pooled[sid][0] == first.tobytes(), sid  # the prefill alone: bit-identical
        assert _greedy(pooled[sid]) == want, sid  # decoding in a batch of four: the same tokens
    stats = sparse.statistics()
    assert stats.kv_pool is not None and stats.kv_pool.used_blocks == 0 and stats.kv_pool.sessions == 0


def test_a_session_grows_past_an_equal_memory_slot_and_gives_its_pages_back(
    sparse: ShardEngine, today: ShardEngine, alone: ReferenceModel
) -> None:
    toks = _tokens(1600, 11)
    with pytest.raises(KVBudgetError):  # today's slot of the same memory: 1,024 positions at most
        today.open_session("long", kv_budget=1600)
    before = sparse.kv_resident_bytes()
    assert before is not None
    sparse.open_session("long")
    got = _prefill(sparse, "long", toks)
    alone.clear()
    assert got.tobytes() == alone.prefill(toks.tolist()).tobytes()
    stats = sparse.statistics()
    assert stats.kv_pool is not None and stats.kv_pool.used_blocks == blocks_for(1600)
    written = sparse.kv_resident_bytes()
    assert written is not None and written - before >= 0.95 * 1600 * BYTES_PER_POSITION
    # Truncation drops the stream's tail pages; growing again over them is still exact (against the
    # whole model fed the same pieces: where a piece starts changes llama.cpp's ubatches and bits).
    sparse.truncate("long", 600)
    cut = sparse.kv_resident_bytes()
    assert cut is not None and written - cut >= 0.95 * 1000 * BYTES_PER_POSITION
    again = _prefill(sparse, "long", toks[600:], start=600)
    alone.clear()
    alone.prefill(toks[:600].tolist())
    assert again.tobytes() == alone.prefill(toks[600:].tolist(), start=600).tobytes()
    sparse.release("long")
    after = sparse.kv_resident_bytes()
    stats = sparse.statistics()
    assert stats.kv_pool is not None and stats.kv_pool.used_blocks == 0
    # Back to what it was (page-aligned stream edges stay: at most 2 pages per tensor and stream).
    assert after is not None and after <= before + 4 * 60 * 2 * 4096


def test_a_copied_session_is_exact_and_counted(sparse: ShardEngine, alone: ReferenceModel) -> None:
    toks = _tokens(300, 5)
    sparse.open_session("src")
    _prefill(sparse, "src", toks[:200])
    _prefill(sparse, "src", toks[200:], start=200)
    sparse.open_session("copy", source="src", positions=200)  # through llama.cpp's sequence state
    stats = sparse.statistics()
    assert stats.kv_pool is not None and stats.kv_pool.used_blocks == blocks_for(300) + blocks_for(200)
    sparse.release("src")
    got = _prefill(sparse, "copy", toks[200:], start=200)
    sparse.release("copy")
    alone.clear()
    alone.prefill(toks[:200].tolist())
    assert got.tobytes() == alone.prefill(toks[200:].tolist(), start=200).tobytes()


def test_copies_of_several_sizes_through_the_reused_buffer_stay_exact(
    sparse: ShardEngine, alone: ReferenceModel
) -> None:
    """The copy's buffer is kept from copy to copy (node.engine.SCRATCH_KEEP_BYTES): a short copy, a
    longer one (the buffer grows), a short one again (the buffer holds more than it needs), each cut
    inside a 16-position block (a shared prefix's tail), each continuing as the prompt alone does."""
    for sid, n, cut in (("short", 60, 37), ("long", 260, 213), ("again", 60, 41)):
        toks = _tokens(n + 8, n + cut)
        sparse.open_session(sid)
        _prefill(sparse, sid, toks[:n])
        sparse.open_session(sid + "-copy", source=sid, positions=cut)
        sparse.release(sid)
        got = _prefill(sparse, sid + "-copy", toks[cut : n + 8], start=cut)
        sparse.release(sid + "-copy")
        alone.clear()
        alone.prefill(toks[:cut].tolist())
        assert got.tobytes() == alone.prefill(toks[cut : n + 8].tolist(), start=cut).tobytes(), sid


FALLBACK = """
import json, resource, sys
from pathlib import Path
from node.engine import EngineConfig, ShardEngine
from node.kvsparse import _status_kib
from node.shard import extract_shard
files = extract_shard(Path(sys.argv[1]), 0, 30, Path(sys.argv[2]))
room = 2 << 30  # far less address space than 32 streams of 8,192 positions (5.6 GiB virtual)
resource.setrlimit(resource.RLIMIT_AS, (_status_kib("VmSize") * 1024 + room, resource.RLIM_INFINITY))
config = EngineConfig(max_sessions=32, session_kv_tokens=1 << 30, batch_tokens=256, kv_pool_tokens=8192)
with ShardEngine(files, config, Path(sys.argv[2])) as engine:
    stats = engine.statistics()
    print(json.dumps([stats.kv_layout, stats.kv_layout_reason, engine.session_kv_limit]))
"""


def test_short_of_address_space_the_streams_are_shortened_and_the_engine_says_so(
    model_path: Path, node_cache: Path
) -> None:
    """Under RLIMIT_AS (2 GiB more than the process maps) 32 streams of 8,192 positions (5.6 GiB) do not
    fit: the streams are shortened to what does (node.kvlayout), still longer than the 256 positions
    resident streams would give each session; with even less room the layout is resident (tested
    purely in tests/node/test_kvlayout.py)."""
    run = subprocess.run(
        [sys.executable, "-c", FALLBACK, str(model_path), str(node_cache)],
        capture_output=True,
        text=True,
        timeout=120,  # a few seconds alone
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    layout, reason, limit = json.loads(run.stdout.strip().splitlines()[-1])
    assert layout == "sparse" and "shortened" in reason and "address space" in reason
    assert 256 < limit < 8192


def test_an_explicit_layout_is_honoured(model_path: Path, node_cache: Path) -> None:
    config = dataclasses.replace(POOL, kv_pool_layout="resident")
    with ShardEngine(extract_shard(model_path, 0, 30, node_cache), config, node_cache) as engine:
        assert engine.layout_name == "resident" and engine.session_kv_limit == 1024
        assert engine.kv_resident_bytes() is None
