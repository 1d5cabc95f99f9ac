"""GPU offload (issue 14): a split route with every layer in device memory equals the whole model on the
same device, bit for bit -- the hidden state is captured out of (and, for Gemma 2, injected into) device
memory through ggml's backend API -- and the recipe records the backend.

Runs only where the installed llama.cpp has a device to offload to (a CUDA, Vulkan or Metal build with
a GPU, or a Vulkan build with Mesa's software driver: ``GGML_VK_VISIBLE_DEVICES=0``); skipped, with
the reason, on CPU builds such as CI's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from node.engine import EngineConfig, ShardEngine
from node.llama_runtime import offload_devices
from node.shard import extract_shard
from tests.node.test_architectures import Route
from tests.node.tiny_models import SPECS, build

DEVICES = offload_devices()
pytestmark = [
    pytest.mark.slow,  # loads model weights onto a GPU
    pytest.mark.skipif(
        not DEVICES,
        reason="this llama.cpp build has no GPU to offload to (a CPU build): see README, CMAKE_ARGS",
    ),
]
CPU = EngineConfig(threads=1, max_sessions=2, session_kv_tokens=256, batch_tokens=64)
N_NEW = 12


def _route(path: Path, bounds: list[int], cache: Path, config: EngineConfig) -> Route:
    return Route(
        [
            ShardEngine(extract_shard(path, a, b, cache), config, cache)
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
    )


def _run(path: Path, bounds: list[int], cache: Path, config: EngineConfig, prompt: list[int]) -> tuple:
    route = _route(path, bounds, cache, config)
    try:
        return route.generate("gpu", prompt, N_NEW), [e.backend for e in route.engines]
    finally:
        for e in route.engines:
            e.close()


@pytest.mark.parametrize("bounds", [[0, 15, 30], [0, 7, 23, 30]], ids=["2x15", "7-16-7"])
def test_offloaded_split_equals_the_offloaded_whole_model(
    model_path: Path, node_cache: Path, bounds: list[int]
) -> None:
    gpu = dataclasses.replace(CPU, n_gpu_layers=1000)  # every layer and the output
    prompt = [1, 504, 3458, 282, 4649, 314]
    (whole_tokens, whole_logits), whole_backends = _run(model_path, [0, 30], node_cache, gpu, prompt)
    (tokens, logits), backends = _run(model_path, bounds, node_cache, gpu, prompt)
    assert whole_backends == [DEVICES[0].backend] and set(backends) == {DEVICES[0].backend}
    assert tokens == whole_tokens
    assert logits == whole_logits  # bytes of every step's logits
    # Against the CPU: the same model, other kernels (reported, not required to be equal).
    (cpu_tokens, cpu_logits), cpu_backends = _run(model_path, [0, 30], node_cache, CPU, prompt)
    assert cpu_backends == ["cpu"]
    diff = max(
        float(np.max(np.abs(np.frombuffer(a, np.float32) - np.frombuffer(b, np.float32))))
        for a, b in zip(cpu_logits, whole_logits, strict=True)
    )
    same = cpu_tokens == whole_tokens
    print(f"\n{DEVICES[0].description}: GPU vs CPU tokens equal {same}, max |dlogit| {diff:.3g}")


def test_partial_offload_is_its_own_recipe(model_path: Path, node_cache: Path) -> None:
    files = extract_shard(model_path, 0, 15, node_cache)
    with ShardEngine(files, dataclasses.replace(CPU, n_gpu_layers=5), node_cache) as partial:
        assert partial.backend == f"{DEVICES[0].backend}+cpu"
        with ShardEngine(files, CPU, node_cache) as cpu:
            assert partial.recipe_fingerprint != cpu.recipe_fingerprint


def test_injected_input_lands_in_device_memory(model_path: Path, node_cache: Path, tmp_path: Path) -> None:
    """Gemma 2 stages that are not first overwrite a graph tensor with the incoming hidden state
    (ggml_backend_tensor_set): offloaded, the split still equals the whole model."""
    path = build(SPECS["gemma2"], model_path, tmp_path / "gemma2.gguf")
    gpu = dataclasses.replace(CPU, n_gpu_layers=1000)
    prompt = [2, 17, 99, 5, 31]
    (whole, _), _ = _run(path, [0, 9], node_cache, gpu, prompt)
    (split, _), _ = _run(path, [0, 3, 9], node_cache, gpu, prompt)
    assert split == whole
