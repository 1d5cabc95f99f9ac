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
instead of the budget above (see :meth:`Sizing.split_gpu`). The KV pool
(:func:`pool_size`) is bounded by both: what the span leaves of the budget for
the CPU layers' KV, and what each device leaves for its layers' KV.
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

    def split_gpu(self, start: int, end: int, gpu_free_bytes: int, reserve_bytes: int = 0) -> int:
        """How many of the span's layers (from its end, as llama.cpp offloads) fit in device memory
        (less :data:`GPU_MARGIN_BYTES` and ``reserve_bytes``: the KV pool's attention mask)."""
        room = gpu_free_bytes - GPU_MARGIN_BYTES - reserve_bytes
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
    multiple of 256 (llama.cpp's padding); 0 when nothing is left. The RAM-only case of
    :func:`pool_size` (no layer offloaded).
    """
    return pool_size(sizing, start, end, budget_bytes, sized_positions, n_batch, copies=copies).tokens


# ------------------------------------------------------------------ the pool against RAM and devices


@dataclass(frozen=True)
class DeviceRoom:
    """A device llama.cpp offloads to, as the pool sizing sees it: its name and its free bytes now
    (before this node's weights are loaded: ``ggml_backend_dev_memory``, else the vendor's tool)."""

    name: str
    free_bytes: int


@dataclass(frozen=True)
class PoolBound:
    """One memory's limit on the KV pool: what it has left for KV after what it holds besides, and
    what one pool position costs in it."""

    memory: str  # "RAM (<the binding limit>)" or "GPU <device>"
    room_bytes: float  # after the weights, the fixed overhead and the margin (< 0: nothing left)
    bytes_per_position: float  # KV (and copies, and the attention mask's row) of one position here

    @property
    def tokens(self) -> int:
        """Positions that fit, a multiple of 256 (llama.cpp's padding); 0 when nothing is left."""
        if self.room_bytes < 0:
            return 0
        if self.bytes_per_position <= 0:
            return 1 << 40  # this memory holds none of the pool's KV: no limit from it
        return max(0, int(self.room_bytes / self.bytes_per_position) // 256 * 256)

    def holds(self, tokens: int) -> bool:
        return tokens * self.bytes_per_position <= self.room_bytes


@dataclass(frozen=True)
class PoolSize:
    """The pool's positions: the least that any memory holding part of its KV allows."""

    bounds: tuple[PoolBound, ...]  # RAM first, then each device that holds offloaded layers

    @property
    def binding(self) -> PoolBound:
        return min(self.bounds, key=lambda b: b.tokens)  # the first (RAM) on a tie

    @property
    def tokens(self) -> int:
        return self.binding.tokens


def offload_plan(n_layers: int, n_gpu_layers: int, device_free: Sequence[int]) -> list[int | None]:
    """Where llama.cpp puts each of a shard's ``n_layers`` layers and its output (index ``n_layers``):
    a device's index, or None for the CPU. The last ``n_gpu_layers`` go to the devices (more than
    ``n_layers``: the output too), spread over them in proportion to their free memory, in device
    order (llama.cpp's default layer split, ``tensor_split`` unset)."""
    if n_gpu_layers <= 0 or not device_free:
        return [None] * (n_layers + 1)
    first = max(n_layers - n_gpu_layers, 0)
    active = min(n_gpu_layers, n_layers + 1)
    free = [max(0, f) for f in device_free]
    if sum(free) == 0:
        free = [1] * len(free)  # no device reports free memory: an even split
    # The split points, cumulative shares of the free memory (exact here; llama.cpp sums floats, so a
    # layer exactly on a split point may land on the other device there).
    splits = [sum(free[: i + 1]) / sum(free) for i in range(len(free))]
    plan: list[int | None] = []
    for il in range(n_layers + 1):
        if il < first or il - first >= active:
            plan.append(None)
            continue
        point = (il - first) / active
        plan.append(
            min(next((i for i, s in enumerate(splits) if s > point), len(splits) - 1), len(splits) - 1)
        )
    return plan


def pool_size(
    sizing: Sizing,
    start: int,
    end: int,
    budget_bytes: int,
    sized_positions: int,
    n_batch: int,
    *,
    copies: int = 1,
    gpu_layers: int = 0,
    devices: Sequence[DeviceRoom] = (),
    budget_source: str = "budget",
    ram_margin: float = POOL_MARGIN,
) -> PoolSize:
    """The KV pool the span ``[start, end)`` leaves room for, bounded by RAM and by every device.

    ``sizing`` prices ``sized_positions`` KV positions per layer. llama.cpp keeps each layer's KV on
    that layer's device (``offload_kqv``, its default), so of the shard's layers (llama.cpp's plan:
    :func:`offload_plan` with ``gpu_layers`` over ``devices``) those on the CPU take their weights and
    KV from ``budget_bytes`` less ``ram_margin`` of it, and those offloaded take theirs from their
    device's free bytes less :data:`GPU_MARGIN_BYTES` (its compute buffer and driver). RAM also holds
    the fixed overhead, the token table (first stage), the LM head (last stage: counted in RAM even
    when offloaded, a conservative bound), the unified layout's compaction copy of *all* the KV
    (``copies`` = 2: a host copy) and the attention mask's row (f32, ``n_batch`` per position); a
    device holding layers holds a copy of the mask too, and the LM head when the output is offloaded.

    With nothing offloaded, only RAM bounds it (:func:`auto_pool_tokens`).
    """
    end = min(end, sizing.n_layers)
    span = list(range(start, end))
    plan = offload_plan(len(span), gpu_layers, [d.free_bytes for d in devices])
    kv_all = sum(sizing.kv_bytes_per_layer[start:end])
    on_cpu = [il for il, where in zip(span, plan, strict=False) if where is None]
    ram_weights = sizing.span_bytes(start, end) - kv_all
    ram_weights -= sum(sizing.layer_bytes[il] for il in span if il not in on_cpu)
    ram_kv = sum(sizing.kv_bytes_per_layer[il] for il in on_cpu) + (copies - 1) * kv_all
    mask = 4.0 * n_batch
    bounds = [
        PoolBound(
            f"RAM ({budget_source})",
            budget_bytes * (1 - ram_margin) - ram_weights,
            ram_kv / sized_positions + mask if kv_all > 0 and sized_positions > 0 else 0.0,
        )
    ]
    for index, device in enumerate(devices):
        layers = [il for il, where in zip(span, plan, strict=False) if where == index]
        output_here = plan[-1] == index and end == sizing.n_layers
        if not layers and not output_here:
            continue
        weights = sum(sizing.layer_bytes[il] for il in layers)
        weights += sizing.last_extra_bytes if output_here else 0
        kv = sum(sizing.kv_bytes_per_layer[il] for il in layers)
        bounds.append(
            PoolBound(
                f"GPU {device.name}",
                float(device.free_bytes - GPU_MARGIN_BYTES - weights),
                kv / sized_positions + mask if sized_positions > 0 else 0.0,
            )
        )
    if kv_all <= 0 or sized_positions <= 0:  # nothing to price positions by: no pool
        bounds[0] = PoolBound(bounds[0].memory, 0.0, 1.0)
    return PoolSize(tuple(bounds))


def compute_buffer_bytes(shape: ModelShape, n_batch: int, *, is_last: bool = True) -> int:
    """A bound on llama.cpp's compute buffer for one batch of ``n_batch`` positions (f32 activations:
    the residual, norms, attention projections and the feed-forward's widest tensors, plus logits)."""
    per_position = 8 * shape.n_embd + 3 * shape.n_ff
    logits = shape.n_vocab * n_batch if is_last else 0
    return 4 * (n_batch * per_position + logits)


def priced_positions(max_sessions: int, session_kv_tokens: int, kv_pool_tokens: int = 0) -> int:
    """The KV positions a node's sizing prices: an explicit pool's (``kv_pool_tokens`` > 0), else
    ``max_sessions`` sequences of ``session_kv_tokens`` each, padded (as llama.cpp pads a sequence's
    context) to a multiple of 256 -- what the automatic pool's layers are sized with."""
    if kv_pool_tokens > 0:
        return kv_pool_tokens
    return max_sessions * (-(-session_kv_tokens // 256) * 256)


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
    kv_positions: int = 0,
) -> Sizing:
    """The sizing of a model for a node with these settings (``globals_bytes``: non-block tensors);
    its KV priced at ``kv_positions`` (an explicit pool's), else ``max_sessions`` sequences of
    ``session_kv_tokens`` (:func:`priced_positions`)."""
    n_ctx = kv_positions or priced_positions(max_sessions, session_kv_tokens)
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
