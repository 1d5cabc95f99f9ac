"""Hardware profiles and the batch service-time model of one node.

Calibration (the only measured part; see docs/simulation.md)
    Raw llama.cpp running SmolLM2-135M Q4_1 (30 layers, 3.54 M weights per
    layer, K/V width 192), measured on one thread of the 2-core development
    machine, per-sequence KV:

    ======  =========  ==================  =================
    batch   context    aggregate tok/s     step time (30 L)
    ======  =========  ==================  =================
    1       ~70        56                  17.9 ms
    8       512        43.7                183 ms
    16      512        51.3                312 ms
    8       1536       24.2                331 ms
    ======  =========  ==================  =================

    A step of ``b`` sequences with contexts ``c_i`` through ``n`` layers is
    modelled as ``n * (t1 * (a + (1 - a) * b) + k * sum(c_i))``. A least-squares
    fit on relative error gives ``t1 = 0.551 ms``, ``a = 0.39`` and
    ``k = 0.664 us`` per context token per layer; it reproduces the four points
    within 8 %. This is profile ``cpu-1t`` (speed 1.0).

Other models
    ``t1`` scales with the weights per layer (``params_m / 3.54``) and ``k``
    with the K/V width (``n_embd_kv / 192``): decode on these machines is bound
    by reading weights and KV.

Other hardware
    ``speed`` divides both terms; ``a`` (the part of a step that does not grow
    with the batch) is larger on GPUs, whose decode is memory-bound, so
    batching is nearly free there. These profiles are assumptions, stated as
    such, not measurements: a consumer GPU with ~360 GB/s reads a 70B-class
    Q4 layer (~480 MB) in ~1.3 ms, which is ~110x the calibrated CPU thread.
    Prefill tokens cost ``1 / prefill_speedup`` of a decode token's
    batch-proportional part (matrix-matrix products are more efficient than
    matrix-vector ones); that factor is also an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.des.config import ModelConfig

# --- calibration (cpu-1t, SmolLM2-135M, llama.cpp, 1 thread) -----------------
CAL_T1_MS_PER_LAYER = 0.551  # one sequence, zero context, one layer
CAL_FIXED_FRACTION = 0.39  # a: share of a step that does not grow with the batch
CAL_ATTN_MS_PER_CTX_TOKEN_LAYER = 0.000664  # k: per context token of each sequence, per layer
CAL_PARAMS_M_PER_LAYER = 3.54
CAL_N_EMBD_KV = 192


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    speed: float  # compute speed relative to one thread of the calibration machine
    fixed_fraction: float  # a in t1 * (a + (1 - a) * b)
    prefill_speedup: float  # a prefill token costs 1/this of a decode token's per-token part
    memory_gb: float  # memory available for shard weights
    uplink_mbps: float
    max_sessions: int  # KV room: concurrent Route Sessions a node accepts


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("cpu-1t", 1.0, CAL_FIXED_FRACTION, 3.0, 1.0, 100.0, 16),
        HardwareProfile("cpu-laptop", 3.0, 0.45, 3.0, 6.0, 20.0, 16),
        HardwareProfile("cpu-server", 12.0, 0.5, 4.0, 48.0, 500.0, 32),
        HardwareProfile("gpu-8gb", 100.0, 0.85, 8.0, 7.0, 40.0, 16),
        HardwareProfile("gpu-24gb", 250.0, 0.85, 8.0, 22.0, 100.0, 32),
        HardwareProfile("gpu-80gb", 600.0, 0.9, 10.0, 76.0, 1000.0, 64),
    )
}


@dataclass(frozen=True)
class StepCost:
    """Service time of one batch step of a node holding ``n_layers`` layers of ``model``."""

    fixed_ms: float
    per_decode_token_ms: float
    per_prefill_token_ms: float
    per_ctx_token_ms: float
    per_prefill_ctx_token_ms: float

    def step_ms(
        self, decode_tokens: int, prefill_tokens: int, decode_ctx: float, prefill_ctx: float
    ) -> float:
        """``*_ctx``: attention work, context length summed over the step's tokens."""
        return (
            self.fixed_ms
            + self.per_decode_token_ms * decode_tokens
            + self.per_prefill_token_ms * prefill_tokens
            + self.per_ctx_token_ms * decode_ctx
            + self.per_prefill_ctx_token_ms * prefill_ctx
        )

    @property
    def single_token_ms(self) -> float:
        """What the node would report at start-up: one sequence, one token, short context."""
        return self.fixed_ms + self.per_decode_token_ms

    @property
    def prefill_tokens_per_s(self) -> float:
        return 256_000.0 / self.step_ms(0, 256, 0.0, 256 * 128.0)


def step_cost(profile: HardwareProfile, model: ModelConfig, n_layers: int) -> StepCost:
    t1 = CAL_T1_MS_PER_LAYER * (model.params_m / CAL_PARAMS_M_PER_LAYER) * n_layers / profile.speed
    a = profile.fixed_fraction
    k = CAL_ATTN_MS_PER_CTX_TOKEN_LAYER * (model.n_embd_kv / CAL_N_EMBD_KV) * n_layers / profile.speed
    return StepCost(
        fixed_ms=t1 * a,
        per_decode_token_ms=t1 * (1.0 - a),
        per_prefill_token_ms=t1 * (1.0 - a) / profile.prefill_speedup,
        per_ctx_token_ms=k,
        per_prefill_ctx_token_ms=k / profile.prefill_speedup,
    )


def capacity_layers(profile: HardwareProfile, model: ModelConfig, max_layers: int = 0) -> int:
    """How many layers of ``model`` fit this node's memory (at least 1, at most the model)."""
    n = int(profile.memory_gb * 1e9 // model.layer_bytes)
    n = max(1, min(n, model.n_layers))
    if max_layers:
        n = min(n, max_layers)
    return n
