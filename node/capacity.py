"""How many layers this node can hold: its memory, the model's per-layer bytes, the KV budget, an overhead.

Pure arithmetic (:class:`Sizing`) plus small probes of the limits the
operating system puts on the process (:func:`memory_limits`).

A span ``[a, b)`` costs, in bytes::

    sum(layer_bytes[a:b])            weights (from the manifest; read into memory, all used every token)
  + sum(kv_bytes_per_layer[a:b])     KV cache: max_sessions x session_kv_tokens positions per layer
  + first_extra_bytes   if a == 0    the token-embedding table (the first stage looks rows up)
  + last_extra_bytes    if b == n    the LM head (output or tied token_embd) and the logits buffer
  + fixed_bytes                      the process (Python, llama.cpp, gRPC: ``overhead_bytes``) and
                                     llama.cpp's compute buffer for one batch

and fits when that is at most the node's memory budget: the smallest of the
configured ``memory_limit_mb``, the cgroup's memory limit (v2 ``memory.max``
or v1 ``memory.limit_in_bytes``), ``RLIMIT_AS`` and the RAM available now
(free plus reclaimable, plus what the process already holds).
:meth:`Sizing.max_layers` -- the node's announced capacity -- is the longest
run of consecutive layers that fits *wherever* it lies, first and last stages
included, so any span of that length the tracker recommends fits and nodes of
equal memory tile the model. ``--layers auto`` asks the tracker for at most
that many (with the bytes it has, so a tracker that knows the model's
per-layer bytes checks spans exactly) and checks the span it gets with
:meth:`Sizing.fits` before fetching anything.

With GPU offload, offloaded layers live in device memory: their weights and
KV count against the device's free memory (less :data:`GPU_MARGIN_BYTES`)
instead of the budget above (see :meth:`Sizing.split_gpu`).
"""

from __future__ import annotations

import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}
DEFAULT_OVERHEAD_BYTES = 200 * 1024 * 1024
GPU_MARGIN_BYTES = 256 * 1024 * 1024
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the compute buffer of a model depend on (from GGUF metadata)."""

    n_layers: int
    n_embd: int
    n_ff: int
    n_vocab: int
    kv_width_per_layer: tuple[int, ...]  # key + value elements per position, per layer

    @classmethod
    def from_fields(cls, arch: str, fields: Mapping[str, Any], n_vocab: int) -> ModelShape:
        n_layers = int(fields[f"{arch}.block_count"])
        n_embd = int(fields[f"{arch}.embedding_length"])
        n_ff_raw = fields.get(f"{arch}.feed_forward_length", 4 * n_embd)
        n_ff = int(max(n_ff_raw) if isinstance(n_ff_raw, Sequence) else n_ff_raw)
        heads = _per_layer(fields.get(f"{arch}.attention.head_count", 1), n_layers)
        kv_heads = _per_layer(fields.get(f"{arch}.attention.head_count_kv", heads), n_layers)
        widths = []
        for il in range(n_layers):
            head_dim = n_embd // max(1, heads[il] or heads[0])
            k = int(fields.get(f"{arch}.attention.key_length", head_dim))
            v = int(fields.get(f"{arch}.attention.value_length", head_dim))
            widths.append(kv_heads[il] * (k + v))
        return cls(n_layers, n_embd, n_ff, n_vocab, tuple(widths))


def _per_layer(value: Any, n_layers: int) -> list[int]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [int(v) for v in value]
    return [int(value)] * n_layers


@dataclass(frozen=True)
class Sizing:
    layer_bytes: tuple[int, ...]
    kv_bytes_per_layer: tuple[int, ...]
    first_extra_bytes: int
    last_extra_bytes: int
    fixed_bytes: int

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    def span_bytes(self, start: int, end: int) -> int:
        total = self.fixed_bytes + sum(self.layer_bytes[start:end]) + sum(self.kv_bytes_per_layer[start:end])
        if start == 0:
            total += self.first_extra_bytes
        if end == self.n_layers:
            total += self.last_extra_bytes
        return total

    def fits(self, start: int, end: int, budget_bytes: int) -> bool:
        return self.span_bytes(start, end) <= budget_bytes

    def max_layers(self, budget_bytes: int) -> int:
        """The most consecutive layers that fit wherever they lie (first and last stages included)."""
        n = self.n_layers
        best = 0
        for k in range(1, n + 1):
            if max(self.span_bytes(a, a + k) for a in range(0, n - k + 1)) > budget_bytes:
                break
            best = k
        return best

    def split_gpu(self, start: int, end: int, gpu_free_bytes: int) -> int:
        """How many of the span's layers (from its end, as llama.cpp offloads) fit in device memory."""
        room = gpu_free_bytes - GPU_MARGIN_BYTES
        count = 0
        for il in range(end - 1, start - 1, -1):
            need = self.layer_bytes[il] + self.kv_bytes_per_layer[il]
            if need > room:
                break
            room -= need
            count += 1
        return count

    def to_json(self) -> dict[str, Any]:
        return {
            "layer_bytes": list(self.layer_bytes),
            "kv_bytes_per_layer": list(self.kv_bytes_per_layer),
            "first_extra_bytes": self.first_extra_bytes,
            "last_extra_bytes": self.last_extra_bytes,
            "fixed_bytes": self.fixed_bytes,
        }


POOL_MARGIN = 0.05  # of the budget, left free when a KV pool is sized automatically


def span_budget_bytes(budget_bytes: int, *, auto_pool: bool) -> int:
    """What a span, with the KV positions its sizing prices, may take of ``budget_bytes``: all of it,
    or with an automatic KV pool the budget less :data:`POOL_MARGIN` (the share the pool leaves free),
    so that the pool sized after the span (:func:`auto_pool_tokens`) holds about those positions rather
    than nothing at a tight memory limit."""
    return int(budget_bytes * (1 - POOL_MARGIN)) if auto_pool else budget_bytes


def auto_pool_tokens(
    sizing: Sizing,
    start: int,
    end: int,
    budget_bytes: int,
    sized_positions: int,
    n_batch: int,
    *,
    copies: int = 1,
) -> int:
    """Positions of a KV pool that fills what the span ``[start, end)`` leaves of ``budget_bytes``.

    ``sizing`` prices ``sized_positions`` KV positions per layer (the per-sequence layout it was made
    for); the pool takes the budget less :data:`POOL_MARGIN`, less the span's bytes without KV, at
    ``copies`` times the span's KV bytes per position (1: the per-sequence layouts, sparse or
    resident; 2: the unified layout, whose compaction makes a transient copy of the used KV:
    node.engine) plus llama.cpp's attention mask (f32, ``n_batch`` rows, one per position). A
    multiple of 256 (llama.cpp's padding); 0 when nothing is left.
    """
    kv = sum(sizing.kv_bytes_per_layer[start:end])
    if kv <= 0 or sized_positions <= 0:
        return 0
    per_position = copies * kv / sized_positions + 4 * n_batch
    room = budget_bytes * (1 - POOL_MARGIN) - (sizing.span_bytes(start, end) - kv)
    return max(0, int(room / per_position) // 256 * 256)


def compute_buffer_bytes(shape: ModelShape, n_batch: int, *, is_last: bool = True) -> int:
    """A bound on llama.cpp's compute buffer for one batch of ``n_batch`` positions (f32 activations:
    the residual, norms, attention projections and the feed-forward's widest tensors, plus logits)."""
    per_position = 8 * shape.n_embd + 3 * shape.n_ff
    logits = shape.n_vocab * n_batch if is_last else 0
    return 4 * (n_batch * per_position + logits)


def sizing_for(
    shape: ModelShape,
    layer_bytes: Sequence[int],
    globals_bytes: Mapping[str, int],
    *,
    max_sessions: int,
    session_kv_tokens: int,
    n_batch: int,
    kv_type: str = "f16",
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
) -> Sizing:
    """The sizing of a model for a node with these settings (``globals_bytes``: non-block tensors)."""
    # llama.cpp pads each sequence's context to a multiple of 256 positions.
    n_ctx = max_sessions * (-(-session_kv_tokens // 256) * 256)
    per_elem = KV_TYPE_BYTES.get(kv_type, 2.0)
    kv = tuple(int(n_ctx * w * per_elem) for w in shape.kv_width_per_layer)
    embd = int(globals_bytes.get("token_embd.weight", 0))
    head = int(globals_bytes.get("output.weight", embd))  # tied: the token table is the LM head
    norm = sum(v for k, v in globals_bytes.items() if k not in ("token_embd.weight", "output.weight"))
    logits = 4 * shape.n_vocab * max_sessions
    return Sizing(
        layer_bytes=tuple(int(b) for b in layer_bytes),
        kv_bytes_per_layer=kv,
        first_extra_bytes=embd,
        last_extra_bytes=head + logits,
        fixed_bytes=overhead_bytes + norm + compute_buffer_bytes(shape, n_batch, is_last=False),
    )


# ------------------------------------------------------------------------------ the machine's limits


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int  # what the node's process may use in all
    source: str  # where the limit comes from


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < _UNLIMITED else None


def cgroup_limit(
    proc_cgroup: str | None = None, root: Path = Path("/sys/fs/cgroup")
) -> tuple[int, int, str] | None:
    """This process's cgroup memory ``(limit, usage, version)``, or None when unlimited or unknown."""
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2 (possibly mounted at .../unified in hybrid setups)
            for base in (root, root / "unified"):
                limit = _read_int(base / rel / "memory.max")
                if limit is not None:
                    usage = _read_int(base / rel / "memory.current") or 0
                    return limit, usage, "cgroup v2 memory.max"
        elif "memory" in controllers.split(","):
            limit = _read_int(root / "memory" / rel / "memory.limit_in_bytes")
            if limit is not None:
                usage = _read_int(root / "memory" / rel / "memory.usage_in_bytes") or 0
                return limit, usage, "cgroup v1 memory.limit_in_bytes"
    return None


def memory_limits(configured_bytes: int = 0) -> list[MemoryLimit]:
    """Every limit on the memory this process may use in all (its overhead included), largest first.

    The last one binds. Available RAM counts what the process holds already; a
    cgroup limit counts the whole group (this node alone in it, as a container
    or ``systemd-run -p MemoryMax=`` gives); ``RLIMIT_AS`` limits address space,
    of which the part reserved but not resident (thread stacks, allocator
    arenas) is already lost to the model.
    """
    import psutil

    info = psutil.Process().memory_info()
    rss, vms = int(info.rss), int(info.vms)
    found = [MemoryLimit(int(psutil.virtual_memory().available) + rss, "available RAM")]
    cg = cgroup_limit()
    if cg is not None:
        limit, _usage, what = cg
        found.append(MemoryLimit(limit, f"{what} ({limit // 2**20} MiB)"))
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1) and soft < _UNLIMITED:
        found.append(MemoryLimit(max(0, soft - max(0, vms - rss)), f"RLIMIT_AS ({soft // 2**20} MiB)"))
    if configured_bytes > 0:
        found.append(MemoryLimit(configured_bytes, f"memory_limit_mb ({configured_bytes // 2**20} MiB)"))
    return sorted(found, key=lambda m: -m.bytes)
