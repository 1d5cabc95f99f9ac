"""Tiny random-weight GGUF models, one per supported architecture, for split-parity tests.

No small real GGUF of most architectures is reachable here, so these are
built: a few layers, width 128-256, weights drawn from a seeded generator and
quantized by ggml itself (``ggml_quantize_chunk`` in the installed
llama.cpp), the tokenizer metadata of the SmolLM2 test model (so prompts
tokenize), and exactly the tensor names, shapes and metadata keys the pinned
llama.cpp loads for the architecture (``src/models/<arch>.cpp``). Random
weights prove that a split computes what the whole model computes; they say
nothing about quality (the real-weight models are SmolLM2 and Gemma 3).

The token-embedding types differ between fixtures on purpose, so stage 0's
lookup is checked against llama.cpp's for Q4_K, Q6_K, Q8_0, Q5_0, Q4_0, F16,
BF16 and F32 (the real models add Q4_1 and Q8_0). The Gemma widths (192,
512) have irrational ``sqrt(n_embd)``, so the input scaling is really tested.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from node.llama_runtime import _ggml_base_lib

N_LAYERS = 9


@dataclass(frozen=True)
class TinySpec:
    key: str  # fixture id
    arch: str
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    embd_type: Q
    weight_type: Q
    head_dim: int | None = None  # explicit attention.key_length/value_length
    tied: bool = True
    n_layers: int = N_LAYERS
    extra_kv: dict[str, Any] = field(default_factory=dict)
    n_expert: int = 0
    n_expert_used: int | list[int] = 0
    n_ff_exp: int = 0
    rope_freqs: bool = False

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SPECS: dict[str, TinySpec] = {
    s.key: s
    for s in (
        # SmolLM-style llama: tied head, grouped-query attention, K-quant embeddings.
        TinySpec("llama", "llama", 256, 4, 2, 512, Q.Q4_K, Q.Q4_0),
        # Mistral-style llama: separate LM head, llama3 rope factors, 8 query / 2 KV heads.
        TinySpec("mistral", "llama", 256, 8, 2, 512, Q.Q6_K, Q.Q8_0, tied=False, rope_freqs=True),
        # Qwen2: attention biases, separate head.
        TinySpec("qwen2", "qwen2", 128, 4, 2, 256, Q.F16, Q.Q8_0, tied=False),
        # Qwen3: QK-norm, head size not n_embd / n_head.
        TinySpec("qwen3", "qwen3", 128, 4, 2, 256, Q.BF16, Q.F16, head_dim=64),
        # Qwen3 MoE: 4 experts, 2 routed per token.
        TinySpec(
            "qwen3moe", "qwen3moe", 128, 4, 2, 256, Q.Q8_0, Q.Q8_0, head_dim=32, n_expert=4, n_expert_used=2,
            n_ff_exp=64,
        ),
        # Qwen3 MoE whose layers route different numbers of experts (a per-layer array).
        TinySpec(
            "qwen3moe-varied", "qwen3moe", 128, 4, 2, 256, Q.Q8_0, Q.Q8_0, head_dim=32, n_expert=4,
            n_expert_used=[2, 2, 2, 1, 1, 2, 1, 2, 2], n_ff_exp=64,
        ),
        # Gemma 2: sliding window on even layers, attention and final soft-capping, sqrt(n_embd) scaling.
        TinySpec(
            "gemma2", "gemma2", 192, 4, 2, 384, Q.Q5_0, Q.Q8_0, head_dim=64,
            extra_kv={
                "attention.sliding_window": 32,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
            },
        ),
        # Gemma 3: 5 of 6 layers sliding window, QK-norm, final soft-capping, token-only scaling.
        TinySpec(
            "gemma3", "gemma3", 512, 4, 1, 512, Q.Q4_0, Q.Q4_K, head_dim=64,
            extra_kv={
                "attention.sliding_window": 32,
                "final_logit_softcapping": 30.0,
                "rope.freq_base_swa": 10000.0,
                "rope.freq_base": 1000000.0,
            },
        ),
        # Phi-3: fused QKV and gate/up, separate head.
        TinySpec("phi3", "phi3", 128, 4, 4, 256, Q.F32, Q.Q8_0, tied=False),
    )
}  # fmt: skip


def _quantize(data: np.ndarray, qtype: Q) -> np.ndarray:
    """``data`` float32 [..., n_per_row] -> what GGUFWriter takes for ``qtype``."""
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F32:
        return data
    if qtype == Q.F16:
        return data.astype(np.float16)
    lib = _ggml_base_lib()
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p,
    ]  # fmt: skip
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    n_per_row = data.shape[-1]
    n_rows = data.size // n_per_row
    row_bytes = int(lib.ggml_row_size(int(qtype), n_per_row))
    out = np.zeros((n_rows, row_bytes), dtype=np.uint8)
    lib.ggml_quantize_chunk(int(qtype), data.ctypes.data, out.ctypes.data, 0, n_rows, n_per_row, None)
    return out.reshape(*data.shape[:-1], row_bytes)


class _Builder:
    def __init__(self, spec: TinySpec, seed: int) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(seed)
        self.tensors: list[tuple[str, np.ndarray, Q]] = []

    def add(
        self, name: str, shape: tuple[int, ...], qtype: Q, *, scale: float | None = None, norm: bool = False
    ) -> None:
        """``shape`` in numpy order (outermost first); the last dimension is ggml's ne0."""
        if norm:
            data = (1.0 + 0.1 * self.rng.standard_normal(shape)).astype(np.float32)
        else:
            std = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
            data = (std * self.rng.standard_normal(shape)).astype(np.float32)
        self.tensors.append((name, _quantize(data, qtype), qtype))


def build(spec: TinySpec, vocab_source: Path, path: Path, *, seed: int = 1234) -> Path:
    """Write the tiny model ``spec`` to ``path`` (tokenizer metadata copied from ``vocab_source``)."""
    src = GGUFReader(vocab_source)
    n_vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    a, s = spec.arch, spec
    b = _Builder(s, seed)
    wt, f32 = s.weight_type, Q.F32
    n_q, n_kv = s.n_head * s.hd, s.n_head_kv * s.hd
    b.add("token_embd.weight", (n_vocab, s.n_embd), s.embd_type, scale=0.5 if a.startswith("gemma") else 1.0)
    b.add("output_norm.weight", (s.n_embd,), f32, norm=True)
    if not s.tied:
        b.add("output.weight", (n_vocab, s.n_embd), wt)
    if s.rope_freqs:
        b.add("rope_freqs.weight", (s.hd // 2,), f32, norm=True)
    for i in range(s.n_layers):
        p = f"blk.{i}."
        b.add(p + "attn_norm.weight", (s.n_embd,), f32, norm=True)
        if a == "phi3":
            b.add(p + "attn_qkv.weight", (n_q + 2 * n_kv, s.n_embd), wt)
        else:
            b.add(p + "attn_q.weight", (n_q, s.n_embd), wt)
            b.add(p + "attn_k.weight", (n_kv, s.n_embd), wt)
            b.add(p + "attn_v.weight", (n_kv, s.n_embd), wt)
        if a == "qwen2":
            for t, n in (("q", n_q), ("k", n_kv), ("v", n_kv)):
                b.add(p + f"attn_{t}.bias", (n,), f32, scale=0.1)
        if a in ("qwen3", "qwen3moe", "gemma3"):
            b.add(p + "attn_q_norm.weight", (s.hd,), f32, norm=True)
            b.add(p + "attn_k_norm.weight", (s.hd,), f32, norm=True)
        b.add(p + "attn_output.weight", (s.n_embd, n_q), wt)
        if a in ("gemma2", "gemma3"):
            b.add(p + "post_attention_norm.weight", (s.n_embd,), f32, norm=True)
            b.add(p + "post_ffw_norm.weight", (s.n_embd,), f32, norm=True)
        b.add(p + "ffn_norm.weight", (s.n_embd,), f32, norm=True)
        if s.n_expert:
            b.add(p + "ffn_gate_inp.weight", (s.n_expert, s.n_embd), f32)
            b.add(p + "ffn_gate_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd), wt)
            b.add(p + "ffn_up_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd), wt)
            b.add(p + "ffn_down_exps.weight", (s.n_expert, s.n_embd, s.n_ff_exp), wt)
        elif a == "phi3":
            b.add(p + "ffn_up.weight", (2 * s.n_ff, s.n_embd), wt)
            b.add(p + "ffn_down.weight", (s.n_embd, s.n_ff), wt)
        else:
            b.add(p + "ffn_gate.weight", (s.n_ff, s.n_embd), wt)
            b.add(p + "ffn_up.weight", (s.n_ff, s.n_embd), wt)
            b.add(p + "ffn_down.weight", (s.n_embd, s.n_ff), wt)

    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(tmp, a)
    # Not "tiny-phi3": llama.cpp changes special-token attributes for model names containing "phi3".
    w.add_string("general.name", f"tiny random {spec.key.replace('phi3', 'phi-three')}")
    w.add_uint32(f"{a}.context_length", 4096)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.block_count", s.n_layers)
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    if s.head_dim:
        w.add_uint32(f"{a}.attention.key_length", s.hd)
        w.add_uint32(f"{a}.attention.value_length", s.hd)
    if a != "gemma3":
        w.add_float32(f"{a}.rope.freq_base", 10000.0)
    if s.n_expert:
        w.add_uint32(f"{a}.expert_count", s.n_expert)
        w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
        if isinstance(s.n_expert_used, list):
            w.add_array(f"{a}.expert_used_count", s.n_expert_used)
        else:
            w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    if a == "phi3":
        w.add_uint32(f"{a}.rope.dimension_count", s.hd)
    for k, v in s.extra_kv.items():
        if isinstance(v, float):
            w.add_float32(f"{a}.{k}", v)
        else:
            w.add_uint32(f"{a}.{k}", v)
    for key, fld in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = fld.types[0]
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(key, fld.contents(), vtype, sub_type=fld.types[-1])
        else:
            w.add_key_value(key, fld.contents(), vtype)
    for name, data, qtype in b.tensors:
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path
