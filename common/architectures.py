"""What each llama.cpp decoder architecture needs so a layer range computes exactly what the whole model does.

Pure data and pure functions over GGUF metadata (no llama.cpp, no I/O): shard
extraction (``node.shard``) and the engine (``node.engine``) read it; the
tracker's placement reads the published split points it derives.

What was checked, per architecture, in the pinned llama.cpp (llama-cpp-python
0.3.36; ``src/models/<arch>.cpp``, ``llama-model.cpp``, ``llama-graph.cpp``):

* **Residual stream.** Every supported graph names the residual stream after
  layer ``il`` ``l_out-<il>`` (after the control-vector hook) and feeds it to
  the next layer unchanged; a stage that is not last captures
  ``l_out-<n-1>`` before the final norm.
* **Embedding scaling** happens inside the graph for the Gemma family:
  ``gemma`` and ``gemma2`` multiply *any* input (token rows or
  ``llama_batch.embd``) by ``sqrtf(n_embd)`` (node ``inp_scaled``); ``gemma3``
  only token input. So a ``gemma3`` first stage scales the rows it looks up
  itself (:attr:`ArchSpec.scale_stage0`), and a ``gemma``/``gemma2`` stage that
  is not first overwrites ``inp_scaled`` with the exact incoming hidden state
  (:attr:`ArchSpec.inject_input`): ``h / s * s`` is not ``h`` in float32.
* **Per-layer arrays.** ``<arch>.attention.head_count``, ``head_count_kv``,
  ``feed_forward_length``, ``expert_used_count`` and
  ``expert_feed_forward_length`` may be arrays with one entry per layer; they
  are sliced to the range. llama.cpp also reads entry 0 of some of them as a
  model-wide value (head size ``n_embd / n_head(0)``; ``n_ff()`` and
  ``n_ff_exp()`` for tensor shapes; ``n_expert_used()`` for the MoE top-k), so
  a cut is only allowed where every such array has the same value as at layer
  0 (:func:`split_points`).
* **Sliding-window layers** are chosen by *absolute* layer index
  (``il % period``): ``gemma2`` period 2 (every even layer), ``gemma3`` period 6
  (5 of every 6), unless the file has an explicit per-layer bool array. Every
  shard of a sliding-window architecture is written with the explicit array
  ``<arch>.attention.sliding_window_pattern`` for its absolute layers, which
  llama.cpp reads in preference to the period; RoPE base per layer follows it.
* **Layer count as model type.** ``gemma2`` with 46 layers and ``gemma3``
  with 62 (the 27B models) get a different attention scale from llama.cpp
  because of their layer count; a partial file has another count, so those
  models can only be served whole (split points ``{0, n}``).
* Soft-capping (``gemma2`` attention and final logits, ``gemma3`` final),
  QK-norm (``qwen3``, ``qwen3moe``, ``gemma3``), attention biases (``qwen2``),
  fused QKV (``phi3``), tied vs separate output weights: read from per-layer
  tensors or model-wide keys that every shard copies unchanged, so nothing
  depends on the cut.

Refused (with the list of supported architectures): recurrent and hybrid
models (their state is not per-position KV), diffusion models,
encoder-decoder and encoder-only models, vision/audio towers, and every
decoder not listed here until a parity test covers it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchSpec:
    name: str
    examples: str  # model families converted to this architecture (for messages and docs)
    capture_prefix: str = "l_out"  # graph tensor "<prefix>-<il>": the residual stream after layer il
    scale_stage0: bool = False  # the graph scales token input only: stage 0 multiplies by sqrtf(n_embd)
    inject_input: str | None = (
        None  # graph node to overwrite with the incoming hidden state (not first stage)
    )
    swa_period: int = 0  # llama.cpp's default sliding-window period (0: no sliding-window layers)
    swa_dense_first: bool = False  # period counted with the dense layer first (il % p == 0 is dense)
    swa_needs_window_key: bool = False  # sliding layers exist only when <arch>.attention.sliding_window > 0
    whole_only_layer_counts: frozenset[int] = (
        frozenset()
    )  # llama.cpp keys a graph constant on the layer count


SUPPORTED: dict[str, ArchSpec] = {
    s.name: s
    for s in (
        ArchSpec("llama", "Llama 1-3, Mistral 7B / Mistral-style, SmolLM/SmolLM2, TinyLlama, Mixtral"),
        ArchSpec("qwen2", "Qwen2, Qwen2.5 (attention biases)"),
        ArchSpec("qwen3", "Qwen3 dense (QK-norm)"),
        ArchSpec("qwen3moe", "Qwen3 MoE, e.g. Qwen3-30B-A3B (mixture of experts)"),
        ArchSpec(
            "gemma2",
            "Gemma 2 (sliding window on even layers, soft-capping)",
            inject_input="inp_scaled",
            swa_period=2,
            whole_only_layer_counts=frozenset({46}),
        ),
        ArchSpec(
            "gemma3",
            "Gemma 3 text (5 of 6 layers sliding window, QK-norm)",
            scale_stage0=True,
            swa_period=6,
            swa_needs_window_key=True,
            whole_only_layer_counts=frozenset({62}),
        ),
        ArchSpec("phi3", "Phi-3, Phi-3.5, Phi-4 (fused QKV)"),
    )
}

# Architectures llama.cpp runs but this engine cannot split, by kind (names as in llama-arch.cpp).
RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID = frozenset(
    {
        "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
        "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
        "deepseek4", "minimax-01",
    }
)  # fmt: skip
DIFFUSION = frozenset({"dream", "llada", "llada-moe", "rnd1"})
ENCODER = frozenset(
    {
        "t5", "t5encoder", "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2",
        "jina-bert-v3", "eurobert", "gemma-embedding", "llama-embed", "pangu-embedded",
    }
)  # fmt: skip
VISION_AUDIO = frozenset(
    {
        "clip", "qwen2vl", "qwen3vl", "qwen3vlmoe", "deepseek2-ocr", "hunyuan_vl", "cogvlm", "paddleocr",
        "wavtokenizer-dec", "qwen3tts", "pockettts",
    }
)  # fmt: skip

# Keys (after "<arch>.") that llama.cpp reads as one value per layer when they are arrays.
PER_LAYER_KEYS = (
    "attention.head_count",
    "attention.head_count_kv",
    "feed_forward_length",
    "expert_used_count",
    "expert_feed_forward_length",
)
# Of those, the ones whose entry 0 llama.cpp also uses as a model-wide value.
INDEX0_GLOBAL_KEYS = (
    "attention.head_count",
    "attention.head_count_kv",
    "feed_forward_length",
    "expert_used_count",
    "expert_feed_forward_length",
)
SWA_PATTERN_KEY = "attention.sliding_window_pattern"


class ArchitectureRefused(ValueError):
    """The architecture cannot be served as layer ranges; the message says why and lists what can."""


def supported_list() -> str:
    return ", ".join(SUPPORTED)


def spec_for(arch: str) -> ArchSpec:
    """The spec of a supported architecture, or :class:`ArchitectureRefused` with the reason."""
    spec = SUPPORTED.get(arch)
    if spec is not None:
        return spec
    if arch in RECURRENT:
        why = "a recurrent model (its state is a running summary, not per-position KV a stage can hold)"
    elif arch in HYBRID:
        why = "a hybrid recurrent/attention model (recurrent state cannot be split into layer ranges here)"
    elif arch in DIFFUSION:
        why = "a diffusion language model (not autoregressive decoding)"
    elif arch in ENCODER:
        why = "an encoder or encoder-decoder model (not a decoder-only transformer)"
    elif arch in VISION_AUDIO:
        why = "a vision/audio model or tower (only text decoders are served)"
    else:
        why = "a decoder no parity test covers yet"
    raise ArchitectureRefused(f"architecture {arch!r} is not supported: {why}; supported: {supported_list()}")


def swa_layers(spec: ArchSpec, arch: str, fields: Mapping[str, Any], n_layers: int) -> list[bool] | None:
    """Which absolute layers use sliding-window attention, computed as the pinned llama.cpp does.

    ``None`` when the architecture has no per-layer sliding-window choice.
    ``fields`` maps GGUF keys to decoded values (lists for arrays).
    """
    if spec.swa_period == 0:
        return None
    if spec.swa_needs_window_key and not (fields.get(f"{arch}.attention.sliding_window") or 0) > 0:
        return None
    pattern = fields.get(f"{arch}.{SWA_PATTERN_KEY}")
    if isinstance(pattern, Sequence) and not isinstance(pattern, str):
        if len(pattern) < n_layers:
            raise ValueError(f"{arch}.{SWA_PATTERN_KEY} has {len(pattern)} entries for {n_layers} layers")
        return [bool(v) for v in pattern[:n_layers]]
    period = int(pattern) if isinstance(pattern, int) else spec.swa_period
    if spec.swa_dense_first:
        return [period == 0 or il % period != 0 for il in range(n_layers)]
    return [period == 0 or il % period < period - 1 for il in range(n_layers)]


def per_layer_arrays(arch: str, fields: Mapping[str, Any], n_layers: int) -> dict[str, list[Any]]:
    """The per-layer metadata arrays of the file (key -> values), checked to have one entry per layer."""
    out: dict[str, list[Any]] = {}
    for suffix in PER_LAYER_KEYS:
        key = f"{arch}.{suffix}"
        value = fields.get(key)
        if isinstance(value, Sequence) and not isinstance(value, str):
            if len(value) != n_layers:
                raise ValueError(f"{key} has {len(value)} entries for {n_layers} layers")
            out[key] = list(value)
    return out


def split_points(
    spec: ArchSpec, arch: str, fields: Mapping[str, Any], n_layers: int
) -> tuple[int, ...] | None:
    """Layer boundaries a shard may start or end at; ``None`` means every boundary ``0..n_layers``.

    Sliding-window patterns never restrict (shards carry explicit arrays). A
    per-layer array that llama.cpp also reads at index 0 as a model-wide value
    allows a cut at ``s`` only where its entry ``s`` equals entry 0. A model
    whose layer count selects a graph constant is served whole.
    """
    if n_layers in spec.whole_only_layer_counts:
        return (0, n_layers)
    arrays = per_layer_arrays(arch, fields, n_layers)
    fixed = [v for k, v in arrays.items() if k.removeprefix(f"{arch}.") in INDEX0_GLOBAL_KEYS]
    if not fixed or all(len(set(v)) == 1 for v in fixed):
        return None
    cuts = [0] + [s for s in range(1, n_layers) if all(v[s] == v[0] for v in fixed)] + [n_layers]
    return tuple(cuts)


def split_refusal(start: int, end: int, n_layers: int, points: Sequence[int] | None) -> str | None:
    """Why ``[start, end)`` cannot be cut from this model, or ``None`` when it can."""
    if points is None:
        return None
    allowed = set(points)
    bad = [b for b in (start, end) if b not in allowed]
    if not bad:
        return None
    shown = ", ".join(str(p) for p in points)
    if tuple(points) == (0, n_layers):
        return (
            f"layer range [{start}, {end}) cannot be cut from this model: "
            f"it can only be served whole [0, {n_layers})"
        )
    return (
        f"layer range [{start}, {end}) cannot be cut from this model at layer {bad[0]}; "
        f"allowed boundaries: {shown}"
    )
