"""Memory sizing (node/capacity.py), the recipe's backend, and the span-byte server's bounds (pure parts)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
import trio.testing

from node.capacity import ModelShape, Sizing, cgroup_limit, sizing_for
from node.config import NodeConfig
from node.fingerprint import local_manifest
from node.joining import gpu_layer_count, model_sizing
from node.llama_runtime import Device
from node.peer_serve import MAX_REQUEST_BYTES, PeerRefused, SpanBytes, TensorServer, TokenBucket
from node.shard import extract_shard, read_model_meta
from proto.recipe import Recipe


@pytest.mark.slow  # reads the real model file
def test_sizing_of_the_test_model(model_path: Path) -> None:
    cfg = NodeConfig(max_sessions=2, session_kv_tokens=512, batch_tokens=256)
    meta = read_model_meta(model_path, None)
    manifest = local_manifest(model_path, None)
    s = model_sizing(meta, manifest, model_path, cfg)
    assert s.layer_bytes == tuple(manifest.layer_bytes(30))
    # SmolLM2: 3 KV heads of 64, keys and values, f16, 2 x 512 positions.
    assert s.kv_bytes_per_layer == (3 * 64 * 2 * 2 * 1024,) * 30
    assert s.first_extra_bytes == manifest.tensor("token_embd.weight").size  # tied: the table is the head
    assert s.last_extra_bytes == s.first_extra_bytes + 4 * 49152 * 2
    assert s.fixed_bytes > 200 * 2**20
    budget = s.span_bytes(20, 30)  # the last stage (LM head and logits) is the dearest 10-layer window
    assert budget == max(s.span_bytes(a, a + 10) for a in range(21)) > s.span_bytes(0, 10)
    assert s.max_layers(budget) == 10 and s.max_layers(budget - 1) < 10
    assert s.fits(10, 20, budget) and not s.fits(19, 30, budget)


def test_max_layers_counts_the_first_and_last_stages() -> None:
    s = Sizing((10,) * 6, (1,) * 6, first_extra_bytes=20, last_extra_bytes=5, fixed_bytes=100)
    assert s.span_bytes(0, 2) == 100 + 22 + 20 and s.span_bytes(2, 4) == 122 and s.span_bytes(4, 6) == 127
    assert s.max_layers(142) == 2
    assert s.max_layers(141) == 1  # 2 layers fit in the middle, not at the start
    assert s.max_layers(100) == 0
    assert s.max_layers(10**9) == 6
    # GPU: layers come off the span's end while they fit in device memory (less the margin).
    from node.capacity import GPU_MARGIN_BYTES

    assert s.split_gpu(0, 6, GPU_MARGIN_BYTES + 25) == 2


def test_shape_from_per_layer_arrays() -> None:
    fields = {
        "x.block_count": 3,
        "x.embedding_length": 64,
        "x.feed_forward_length": [128, 256, 128],
        "x.attention.head_count": [4, 4, 8],
        "x.attention.head_count_kv": [2, 1, 2],
    }
    shape = ModelShape.from_fields("x", fields, 100)
    assert shape.n_ff == 256
    assert shape.kv_width_per_layer == (2 * 32, 1 * 32, 2 * 16)
    s = sizing_for(
        shape, [1, 2, 3], {"token_embd.weight": 7}, max_sessions=1, session_kv_tokens=100, n_batch=8
    )
    assert s.kv_bytes_per_layer == (256 * 64 * 2, 256 * 32 * 2, 256 * 32 * 2)  # padded to 256 positions
    assert s.first_extra_bytes == 7 and s.last_extra_bytes == 7 + 4 * 100


def test_cgroup_files_are_read(tmp_path: Path) -> None:
    (tmp_path / "memory" / "g").mkdir(parents=True)
    (tmp_path / "memory" / "g" / "memory.limit_in_bytes").write_text("536870912\n")
    (tmp_path / "memory" / "g" / "memory.usage_in_bytes").write_text("1000\n")
    assert cgroup_limit("5:memory:/g\n", tmp_path) == (536870912, 1000, "cgroup v1 memory.limit_in_bytes")
    (tmp_path / "unified" / "h").mkdir(parents=True)
    (tmp_path / "unified" / "h" / "memory.max").write_text("max\n")
    assert cgroup_limit("0::/h\n", tmp_path) is None
    (tmp_path / "unified" / "h" / "memory.max").write_text("1048576\n")
    assert cgroup_limit("0::/h\n", tmp_path) == (1048576, 0, "cgroup v2 memory.max")


@pytest.mark.parametrize(
    ("setting", "free", "expected"),
    [("0", 10**12, 0), ("all", 0, 11), ("4", 0, 4), ("99", 0, 11), ("auto", 10**12, 11), ("auto", 0, 0)],
)
def test_gpu_layer_count(setting: str, free: int, expected: int) -> None:
    s = Sizing((100,) * 30, (10,) * 30, 0, 0, 0)
    device = Device("Vulkan0", "llvmpipe", "vulkan", "gpu", free, free)
    assert gpu_layer_count(NodeConfig(gpu_layers=setting), s, 10, 20, device) == expected
    assert gpu_layer_count(NodeConfig(gpu_layers=setting), s, 10, 20, None) == 0


def test_recipe_records_the_backend_and_cpu_recipes_keep_their_fingerprint() -> None:
    base = Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", True)
    assert (
        Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", True, backend="cpu").fingerprint()
        == base.fingerprint()
    )
    assert b"backend" not in base.canonical_json()
    gpu = Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", True, backend="vulkan")
    partial = Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", True, backend="vulkan+cpu")
    assert len({base.fingerprint(), gpu.fingerprint(), partial.fingerprint()}) == 3
    assert Recipe.from_wire(gpu.to_wire()) == gpu
    assert Recipe.from_wire(base.to_wire()).fingerprint() == base.fingerprint()


def test_span_bytes_map_model_offsets_to_the_shard_files(model_path: Path, node_cache: Path) -> None:
    files = extract_shard(model_path, 10, 20, node_cache)
    manifest = local_manifest(model_path, node_cache)
    span = SpanBytes.from_shard(manifest, files, model_path)
    t = manifest.tensor("blk.12.attn_q.weight")
    path, local = span.locate(t.offset + 5, 100)  # type: ignore[misc]
    with open(path, "rb") as a, open(model_path, "rb") as b:
        a.seek(local)
        b.seek(t.offset + 5)
        assert a.read(100) == b.read(100)
    assert span.locate(manifest.tensor("blk.3.attn_q.weight").offset, 10) is None  # not this span
    assert span.locate(manifest.tensor("token_embd.weight").offset, 10) is None  # a middle stage's dummy
    assert span.locate(t.offset + t.size - 5, 10) is None  # runs out of the tensor
    assert span.locate(0, manifest.header_size) is not None  # the header


async def test_tensor_server_bounds(model_path: Path, node_cache: Path) -> None:
    files = extract_shard(model_path, 10, 20, node_cache)
    manifest = local_manifest(model_path, node_cache)
    fp = manifest.fingerprint()
    server = TensorServer(fp, manifest, SpanBytes.from_shard(manifest, files, model_path), max_streams=1)
    t = manifest.tensor("blk.12.ffn_up.weight")
    chunks = await server.tensor_bytes(fp, t.offset, 300_000, 100_000)
    assert [len(c) for c in chunks] == [100_000, 100_000, 100_000]
    for code, call in (
        ("NOT_FOUND", server.tensor_bytes("0" * 64, t.offset, 10, 0)),
        ("INVALID_ARGUMENT", server.tensor_bytes(fp, t.offset, MAX_REQUEST_BYTES + 1, 0)),
        ("NOT_FOUND", server.tensor_bytes(fp, manifest.tensor("blk.2.ffn_up.weight").offset, 10, 0)),
    ):
        with pytest.raises(PeerRefused) as refused:
            await call
        assert refused.value.code == code
    # One request at a time here: a second concurrent one is told the node is busy.
    await server._slots.acquire()
    with pytest.raises(PeerRefused) as busy:
        await server.tensor_bytes(fp, t.offset, 10, 0)
    assert busy.value.code == "RESOURCE_EXHAUSTED"
    server._slots.release()
    assert server.statistics().bytes_sent == 300_000


async def test_token_bucket_holds_the_rate(autojump_clock: trio.testing.MockClock) -> None:
    bucket = TokenBucket(1_000_000, 1_000_000, clock=trio.current_time)
    t0 = trio.current_time()
    for _ in range(10):
        await bucket.take(500_000)
    elapsed = trio.current_time() - t0
    # 5 MB at 1 MB/s with a 1 MB burst: 4 s.
    assert math.isclose(elapsed, 4.0, abs_tol=0.01)
