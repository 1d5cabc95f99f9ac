"""The KV pool's automatic size against RAM and device memory (node.capacity.pool_size), and the start-up
check of a configured pool (node.joining).

No GPU is lent to these tests: the device path runs with an injected device (a fake free-bytes source);
the CPU path runs on the real test model and this machine's memory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.capacity import (
    GPU_MARGIN_BYTES,
    POOL_MARGIN,
    DeviceRoom,
    MemoryLimit,
    Sizing,
    offload_plan,
    pool_size,
)
from node.config import NodeConfig
from node.errors import CapacityError
from node.hardware import llama_offload_targets, offload_rooms
from node.joining import _Joiner
from node.llama_runtime import Device

MIB = 2**20


def _today(sizing: Sizing, start: int, end: int, budget: int, sized: int, n_batch: int, copies: int) -> int:
    """The RAM-only pool as node.capacity computed it before device memory was counted (kept verbatim)."""
    kv = sum(sizing.kv_bytes_per_layer[start:end])
    if kv <= 0 or sized <= 0:
        return 0
    per_position = copies * kv / sized + 4 * n_batch
    room = budget * (1 - POOL_MARGIN) - (sizing.span_bytes(start, end) - kv)
    return max(0, int(room / per_position) // 256 * 256)


def _llama_device_of_layer(il: int, n_layers: int, n_gpu_layers: int, free: list[int]) -> int | None:
    """llama.cpp's rule (llama_model::load_tensors, tensor_split unset), written out independently."""
    i_gpu_start = max(n_layers - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layers + 1)
    if il < i_gpu_start or il - i_gpu_start >= act:
        return None
    total = sum(free)
    cumulative = [sum(free[: i + 1]) / total for i in range(len(free))]
    point = (il - i_gpu_start) / act
    return min(sum(1 for c in cumulative if c <= point), len(free) - 1)


@st.composite
def _cases(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 10))
    layer = draw(st.lists(st.integers(1, 400 * MIB), min_size=n, max_size=n))
    kv = draw(st.lists(st.integers(0, 40 * MIB), min_size=n, max_size=n))
    start = draw(st.integers(0, n - 1))
    end = draw(st.integers(start + 1, n))
    n_dev = draw(st.integers(0, 3))
    return {
        "sizing": Sizing(
            tuple(layer),
            tuple(kv),
            draw(st.integers(0, 300 * MIB)),
            draw(st.integers(0, 300 * MIB)),
            draw(st.integers(0, 500 * MIB)),
        ),
        "start": start,
        "end": end,
        "budget": draw(st.integers(0, 16 * 1024 * MIB)),
        "sized": draw(st.sampled_from([256, 1024, 8 * 2048, 32768])),
        "n_batch": draw(st.sampled_from([1, 64, 512])),
        "copies": draw(st.sampled_from([1, 2])),
        "gpu_layers": draw(st.integers(0, end - start + 1)) if n_dev else 0,
        "devices": [DeviceRoom(f"GPU{i}", draw(st.integers(0, 24 * 1024 * MIB))) for i in range(n_dev)],
    }


def _size(c: dict, **over: object) -> int:
    args = {**c, **over}
    return pool_size(
        args["sizing"], args["start"], args["end"], args["budget"], args["sized"], args["n_batch"],
        copies=args["copies"], gpu_layers=args["gpu_layers"], devices=args["devices"],
    ).tokens  # fmt: skip


def _used(c: dict, tokens: int) -> tuple[float, list[float]]:
    """RAM and each device's bytes for a pool of ``tokens`` positions, counted layer by layer."""
    s, start, end = c["sizing"], c["start"], c["end"]
    n = end - start
    free = [d.free_bytes for d in c["devices"]]
    if free and sum(free) == 0:
        free = [1] * len(free)  # no free memory anywhere: an even split (offload_plan's choice)
    where = [_llama_device_of_layer(i, n, c["gpu_layers"], free) if free else None for i in range(n + 1)]
    per = [kv / c["sized"] for kv in s.kv_bytes_per_layer]
    ram = (
        s.fixed_bytes
        + (s.first_extra_bytes if start == 0 else 0)
        + (s.last_extra_bytes if end == s.n_layers else 0)
    )
    ram += tokens * 4 * c["n_batch"] + (c["copies"] - 1) * tokens * sum(per[start:end])
    dev = [0.0] * len(free)
    for i in range(n):
        d = where[i]
        if d is None:
            ram += s.layer_bytes[start + i] + tokens * per[start + i]
        else:
            dev[d] += s.layer_bytes[start + i] + tokens * per[start + i]
    for d in range(len(free)):
        held = any(w == d for w in where[:n]) or (where[n] == d and end == s.n_layers)
        if held:
            dev[d] += tokens * 4 * c["n_batch"] + (
                s.last_extra_bytes if where[n] == d and end == s.n_layers else 0
            )
    return ram, dev


@settings(max_examples=400, deadline=None)
@given(_cases())
def test_the_pool_never_exceeds_ram_or_any_device(c: dict) -> None:
    tokens = _size(c)
    assert tokens % 256 == 0 and tokens >= 0
    if tokens == 0:
        return
    ram, dev = _used(c, tokens)
    assert ram <= c["budget"] * (1 - POOL_MARGIN) + 1e-3 * tokens
    for used, device in zip(dev, c["devices"], strict=True):
        assert used <= device.free_bytes - GPU_MARGIN_BYTES + 1e-3 * tokens or used == 0


@settings(max_examples=300, deadline=None)
@given(_cases(), st.integers(0, 8 * 1024 * MIB), st.integers(0, 8 * 1024 * MIB))
def test_the_pool_is_monotone_in_free_memory(c: dict, more_ram: int, more_gpu: int) -> None:
    base = _size(c)
    assert _size(c, budget=c["budget"] + more_ram) >= base
    if c["devices"]:
        # More free memory on every device keeps llama.cpp's proportional split the same when the
        # devices grow in proportion; one device alone growing may move layers (not monotone by design).
        scale = 1 + more_gpu / (24 * 1024 * MIB)
        grown = [DeviceRoom(d.name, int(d.free_bytes * scale)) for d in c["devices"]]
        same_plan = offload_plan(c["end"] - c["start"], c["gpu_layers"], [d.free_bytes for d in grown]) == (
            offload_plan(c["end"] - c["start"], c["gpu_layers"], [d.free_bytes for d in c["devices"]])
        )
        if same_plan:
            assert _size(c, devices=grown) >= base


@settings(max_examples=400, deadline=None)
@given(_cases())
def test_with_nothing_offloaded_the_pool_is_the_ram_only_size(c: dict) -> None:
    today = _today(c["sizing"], c["start"], c["end"], c["budget"], c["sized"], c["n_batch"], c["copies"])
    assert _size(c, gpu_layers=0) == today
    assert _size(c, devices=[]) == today


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(0, 45), st.lists(st.integers(0, 10**11), min_size=1, max_size=4))
def test_offload_plan_is_llama_cpps_layer_split(n: int, gpu_layers: int, free: list[int]) -> None:
    if sum(free) == 0:
        free = [1] * len(free)
    plan = offload_plan(n, gpu_layers, free)
    assert plan == [_llama_device_of_layer(i, n, gpu_layers, free) for i in range(n + 1)]
    assert sum(p is not None for p in plan) == min(gpu_layers, n + 1)


def test_the_binding_memory_is_the_one_that_holds_less() -> None:
    # 4 layers of 100 MiB, KV priced at 1024 positions: 1 MiB per layer (1 KiB per position per layer).
    sizing = Sizing((100 * MIB,) * 4, (MIB,) * 4, 10 * MIB, 20 * MIB, 50 * MIB)
    roomy_gpu = [DeviceRoom("CUDA0", 8 * 1024 * MIB)]
    size = pool_size(
        sizing, 0, 2, 2048 * MIB, 1024, 512, gpu_layers=1, devices=roomy_gpu, budget_source="cgroup"
    )
    assert [b.memory for b in size.bounds] == ["RAM (cgroup)", "GPU CUDA0"]
    assert size.binding.memory == "RAM (cgroup)"
    # The GPU's room: free - margin - the offloaded layer's weights, at 1 KiB KV + the mask per position.
    gpu = size.bounds[1]
    assert gpu.room_bytes == 8 * 1024 * MIB - GPU_MARGIN_BYTES - 100 * MIB
    assert gpu.bytes_per_position == 1024 + 4 * 512
    small_gpu = [DeviceRoom("CUDA0", GPU_MARGIN_BYTES + 100 * MIB + 30 * MIB)]
    tight = pool_size(sizing, 0, 2, 2048 * MIB, 1024, 512, gpu_layers=1, devices=small_gpu)
    assert tight.binding.memory == "GPU CUDA0"
    assert tight.tokens == int(30 * MIB / (1024 + 4 * 512)) // 256 * 256
    # Offloading moves the layer's weights and KV out of RAM: RAM alone holds more than without offload.
    assert tight.bounds[0].tokens > pool_size(sizing, 0, 2, 2048 * MIB, 1024, 512).tokens


def test_offload_rooms_use_llama_cpps_figure_and_fall_back_to_the_vendor_tool() -> None:
    cuda0 = Device("CUDA0", "H100", "cuda", "gpu", 70 * 1024 * MIB, 80 * 1024 * MIB)
    cuda1 = Device("CUDA1", "H100", "cuda", "gpu", 0, 0)  # llama.cpp reports no memory
    igpu = Device("Vulkan0", "Intel", "vulkan", "igpu", 4 * 1024 * MIB, 8 * 1024 * MIB)
    calls: list[int] = []

    def vendor() -> list[int]:
        calls.append(1)
        return [1, 60 * 1024 * MIB]

    assert llama_offload_targets([igpu, cuda0]) == [cuda0]  # an integrated GPU only without a dedicated one
    assert llama_offload_targets([igpu]) == [igpu]
    rooms = offload_rooms([cuda0, cuda1, igpu], vendor)
    assert rooms == [DeviceRoom("CUDA0 (H100)", 70 * 1024 * MIB), DeviceRoom("CUDA1 (H100)", 60 * 1024 * MIB)]
    assert len(calls) == 1
    assert offload_rooms([cuda0], vendor) == [DeviceRoom("CUDA0 (H100)", 70 * 1024 * MIB)] and len(calls) == 1


# ------------------------------------------------------------------ the joiner, with an injected device

SIZING = Sizing((100 * MIB,) * 4, (MIB,) * 4, 10 * MIB, 20 * MIB, 50 * MIB)  # KV priced at 1024 positions


def _joiner(tmp_path: Path, **cfg: object) -> _Joiner:
    base: dict = {"cache_dir": str(tmp_path), "max_sessions": 1, "session_kv_tokens": 1024}
    return _Joiner(NodeConfig(**{**base, **cfg}).validate(), None, "")


def test_an_automatic_pool_is_bound_by_the_device_its_layers_are_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    joiner = _joiner(tmp_path, kv_pool_tokens=-1)
    budget = MemoryLimit(4096 * MIB, "cgroup v2 memory.max (4096 MiB)")
    ram_only = joiner._pool_tokens(SIZING, budget, 0, 2)
    gpu = [DeviceRoom("CUDA0 (fake)", GPU_MARGIN_BYTES + 2 * 100 * MIB + 64 * MIB)]
    with caplog.at_level(logging.INFO, logger="swarm.node.join"):
        tokens = joiner._pool_tokens(SIZING, budget, 0, 2, gpu_layers=3, devices=gpu)
    assert tokens == int(64 * MIB / (2 * 1024 + 4 * 512)) // 256 * 256 < ram_only
    sized = [r.swarm_fields for r in caplog.records if r.getMessage() == "kv_pool_sized"]  # type: ignore[attr-defined]
    assert sized and sized[-1]["bound_by"] == "GPU CUDA0 (fake)"
    assert set(sized[-1]["bounds"]) == {"RAM (cgroup v2 memory.max (4096 MiB))", "GPU CUDA0 (fake)"}
    assert joiner.pool_bound_by == "GPU CUDA0 (fake)"
    # A device too small for even 256 positions beside its layers: a start-up error naming it.
    full = [DeviceRoom("CUDA0 (fake)", GPU_MARGIN_BYTES + 2 * 100 * MIB)]
    with pytest.raises(CapacityError, match="holds no KV pool: GPU CUDA0 \\(fake\\)"):
        joiner._pool_tokens(SIZING, budget, 0, 2, gpu_layers=3, devices=full)


def _priced_at(positions: int) -> Sizing:
    """SIZING with its KV priced at an explicit pool's positions (as the node prices it): 1 KiB a layer."""
    return Sizing((100 * MIB,) * 4, (positions * 1024,) * 4, 10 * MIB, 20 * MIB, 50 * MIB)


def test_a_configured_pool_that_does_not_fit_is_refused_at_start(tmp_path: Path) -> None:
    budget = MemoryLimit(400 * MIB, "memory_limit_mb (400 MiB)")
    # RAM: 400 MiB - (50 fixed + 10 embeddings + 200 weights) = 140 MiB at 2 x 1 KiB + 2 KiB (mask) a
    # position: at most 35,840 positions.
    assert _joiner(tmp_path, kv_pool_tokens=32768)._pool_tokens(_priced_at(32768), budget, 0, 2) == 32768
    with pytest.raises(
        CapacityError,
        match=r"kv_pool_tokens = 65536 does not fit RAM \(memory_limit_mb \(400 MiB\)\): its KV there needs "
        r"256 MiB and layers \[0, 2\) leave 140 MiB \(at most 35840 positions\)",
    ):
        _joiner(tmp_path, kv_pool_tokens=65536)._pool_tokens(_priced_at(65536), budget, 0, 2)
    # The device: 64 MiB left beside both layers (all offloaded) at 4 KiB a position: 16,384 positions.
    gpu = [DeviceRoom("CUDA0 (fake)", GPU_MARGIN_BYTES + 2 * 100 * MIB + 64 * MIB)]
    roomy = MemoryLimit(8192 * MIB, "available RAM")
    with pytest.raises(CapacityError, match=r"does not fit GPU CUDA0 \(fake\).*at most 16384 positions"):
        _joiner(tmp_path, kv_pool_tokens=32768)._pool_tokens(_priced_at(32768), roomy, 0, 2, 3, gpu)
    assert (
        _joiner(tmp_path, kv_pool_tokens=16384)._pool_tokens(_priced_at(16384), roomy, 0, 2, 3, gpu) == 16384
    )
    # No pool: nothing to check.
    assert _joiner(tmp_path, kv_pool_tokens=0)._pool_tokens(SIZING, budget, 0, 4) == 0


# ------------------------------------------------------------------ the real model on this machine


@pytest.mark.slow  # reads and cuts the real model file
@pytest.mark.parametrize("gpu_layers", ["0", "auto"])
def test_an_automatic_pool_on_this_cpu_machine_is_todays_size(
    model_path: Path, node_cache: Path, gpu_layers: str
) -> None:
    """``kv_pool_tokens = -1`` on the CPU (this machine's llama.cpp build has no device, or offloading is
    off): the pool is the RAM-only size the node computed before device memory was counted."""
    import trio

    cfg = NodeConfig(
        model=str(model_path), cache_dir=str(node_cache), layers="0:15", gpu_layers=gpu_layers,
        max_sessions=2, session_kv_tokens=512, batch_tokens=256, kv_pool_tokens=-1,
    ).validate()  # fmt: skip
    joined = trio.run(_Joiner(cfg, None, "").run)
    assert joined.sizing is not None and joined.budget is not None
    assert joined.gpu_layers == 0
    today = _today(joined.sizing, 0, 15, joined.budget.bytes, 2 * 512, 256, 1)
    assert joined.kv_pool_tokens == today >= 256


@pytest.mark.slow  # reads and cuts the real model file
def test_the_real_model_with_an_injected_device_is_bound_by_it(model_path: Path, node_cache: Path) -> None:
    """The whole start-up path with a fake device (no GPU here): gpu_layers = auto offloads what fits its
    free memory, and the pool is the least of what RAM and the device leave."""
    import trio

    cfg = NodeConfig(
        model=str(model_path), cache_dir=str(node_cache), layers="0:15", gpu_layers="auto",
        max_sessions=2, session_kv_tokens=512, batch_tokens=256, kv_pool_tokens=-1,
    ).validate()  # fmt: skip
    base = trio.run(_Joiner(cfg, None, "").run)
    assert base.sizing is not None
    layer = base.sizing.layer_bytes[14] + base.sizing.kv_bytes_per_layer[14]
    mask = 4 * 256 * 1024
    free = GPU_MARGIN_BYTES + mask + 3 * layer + layer // 2  # three of the span's layers, and a little KV

    def fake() -> list[Device]:
        return [Device("CUDA0", "fake", "cuda", "gpu", free, 2 * free)]

    joined = trio.run(_Joiner(cfg, None, "", devices=fake).run)
    assert joined.gpu_layers == 3
    gpu_kv = sum(base.sizing.kv_bytes_per_layer[12:15]) / 1024 + 4 * 256
    room = free - GPU_MARGIN_BYTES - sum(base.sizing.layer_bytes[12:15])
    assert joined.kv_pool_tokens == int(room / gpu_kv) // 256 * 256 < base.kv_pool_tokens


def test_the_pool_bounds_are_on_metrics() -> None:
    """``swarm_node_kv_pool_bound_tokens{memory, bound}``: each memory's room at start, the binding one
    marked (the daemon's scrape on a stand-in for its engine, machine and join; the node's own Metrics)."""
    from types import SimpleNamespace

    from node.daemon import NodeDaemon
    from node.kvpool import KvPool
    from node.metrics import Metrics

    joined = SimpleNamespace(
        kv_pool_bounds={"RAM (cgroup v2 memory.max (4096 MiB))": 929536, "GPU CUDA0 (fake)": 16384},
        kv_pool_bound_by="GPU CUDA0 (fake)",
    )
    stats = SimpleNamespace(kv_blocks_reserved=0, kv_refusals=0, preemptions=0)
    engine = SimpleNamespace(pool=KvPool(16384), layout_name="resident", pool_refusals=0, pool_compactions=0)
    daemon = SimpleNamespace(engine=engine, machine=SimpleNamespace(statistics=lambda: stats), joined=joined)

    def one(value: float) -> dict[tuple[tuple[str, str], ...], float]:
        return {(): float(value)}

    text = Metrics().render(NodeDaemon._pool_metrics(daemon, one))  # type: ignore[arg-type]
    assert 'swarm_node_kv_pool_bound_tokens{bound="1",memory="GPU CUDA0 (fake)"} 16384.0' in text
    assert (
        'swarm_node_kv_pool_bound_tokens{bound="0",memory="RAM (cgroup v2 memory.max (4096 MiB))"} 929536.0'
        in text
    )
    assert "swarm_node_kv_pool_free_blocks 1024.0" in text
