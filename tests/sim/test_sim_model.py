"""The service-time model reproduces the engine measurements it was fitted to."""

from __future__ import annotations

import pytest

from sim.des.config import ModelConfig
from sim.des.hardware import PROFILES, capacity_layers, step_cost

TEST_MODEL = ModelConfig()  # SmolLM2-135M: 30 layers, 3.54 M weights per layer, K/V width 192


@pytest.mark.parametrize(
    "batch, context, measured_tok_s",
    [
        (1, 70, 56.0),
        (8, 512, 43.7),
        (16, 512, 51.3),
        (8, 1536, 24.2),
    ],
)
def test_calibration_points(batch: int, context: int, measured_tok_s: float) -> None:
    cost = step_cost(PROFILES["cpu-1t"], TEST_MODEL, 30)
    step_ms = cost.step_ms(batch, 0, float(batch * context), 0.0)
    assert batch * 1000.0 / step_ms == pytest.approx(measured_tok_s, rel=0.1)


def test_big_model_on_gpu_is_sane() -> None:
    model = ModelConfig(name="70b", n_layers=80, n_embd=8192, n_embd_kv=1024, params_per_layer_m=856)
    gpu = PROFILES["gpu-8gb"]
    assert capacity_layers(gpu, model) == 14
    cost = step_cost(gpu, model, 14)
    assert 10.0 < cost.single_token_ms < 40.0
    # Batching is nearly free on a memory-bound GPU.
    assert cost.step_ms(16, 0, 0.0, 0.0) < 4 * cost.step_ms(1, 0, 0.0, 0.0)
