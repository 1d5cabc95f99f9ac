"""Which llama.cpp KV layout carries a node's KV pool (pure).

A pool of ``pool_tokens`` positions (node/kvpool.py does the block accounting)
is laid out in one of three ways (docs/engine.md, "The KV pool"):

``sparse`` (the default where it applies)
    Per-sequence streams (``kv_unified = false``), ``max_sessions`` of them,
    each as long as one session may grow (``min(session cap, trained
    context)``): a large *virtual* buffer whose pages become resident only
    where sessions wrote (node/kvsparse.py drops the rest). Exact (each
    session in its own stream from cell 0, as in the per-sequence layout) and
    as fast as it. Needs Linux, the KV in host memory (no GPU offload), one KV
    buffer (no sliding-window cache beside the full one), a KV geometry we can
    compute, and room for the virtual size (``RLIMIT_AS``, the kernel's
    overcommit policy): where the address space is short the streams are
    shortened to fit, as long as they stay longer than resident ones.
``resident`` (the fallback)
    The same per-sequence streams, all resident: the pool divided evenly, so
    a session may grow to ``pool_tokens / max_sessions`` positions at most
    (and a stream is never longer than a session may grow: the pool is then
    ``max_sessions`` such streams, not more).
    Exact and fast; only the longest sessions lose.
``unified`` (opt-in only)
    One unified stream of ``pool_tokens`` cells: any session may grow to the
    whole pool, but attention spans every session's cells (0.50-0.78 of the
    per-sequence decode speed at 4-16 sessions, measured) and a session's bits
    equal the whole model only while it is alone. Kept for comparison.

Invariants: the chosen layout's cells never hold less than the pool promises
a session (``session_limit <= stream_cells``); ``resident`` never has
streams shorter than 256 cells; an explicit request that cannot be met is an
error, never a silent other layout.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("auto", "sparse", "resident", "unified")
PAD = 256  # llama.cpp pads a stream to a multiple of 256 cells
# Of the address-space room, what the sparse buffer may take (the rest: thread stacks, arenas, mappings).
VIRTUAL_SHARE = 0.8


class LayoutError(ValueError):
    """The layout asked for cannot carry this pool here."""


@dataclass(frozen=True)
class LayoutFacts:
    """What the choice depends on (gathered by the engine's shell)."""

    pool_tokens: int
    max_sessions: int
    session_cap: int  # the operator's cap on one session's positions
    n_ctx_train: int  # the model's trained context (0: unknown)
    bytes_per_position: int  # KV bytes of one position over the shard's layers (0: geometry unknown)
    linux: bool = True
    gpu_offload: bool = False
    sliding_window: bool = False  # the model keeps a sliding-window cache beside the full one
    virtual_room_bytes: int | None = None  # address space the process may still map (None: no limit)
    strict_overcommit: bool = False  # vm.overcommit_memory = 2: virtual memory is committed memory


@dataclass(frozen=True)
class LayoutChoice:
    layout: str  # "sparse", "resident" or "unified"
    n_streams: int  # llama.cpp sequence streams (1 for unified)
    stream_cells: int  # cells of one stream (n_ctx = n_streams * stream_cells)
    session_limit: int  # the most positions one session may hold
    reason: str  # why this layout (for the log and /metrics)

    @property
    def n_ctx(self) -> int:
        return self.n_streams * self.stream_cells


def _pad(n: int) -> int:
    return -(-n // PAD) * PAD


def sparse_obstacle(facts: LayoutFacts) -> str | None:
    """Why sparse streams cannot carry this pool here; None when they can."""
    if not facts.linux:
        return "sparse streams need Linux (madvise on the KV buffer's pages)"
    if facts.gpu_offload:
        return "the KV lives in device memory (GPU offload), where pages cannot be dropped"
    if facts.sliding_window:
        return "the model keeps a sliding-window KV cache beside the full one (two buffers)"
    if facts.bytes_per_position <= 0:
        return "the KV geometry of this model is not known (per-layer KV heads?)"
    if facts.strict_overcommit:
        return "vm.overcommit_memory = 2 commits the whole virtual buffer"
    fitting = _fitting_cells(facts)
    if fitting < _pad(_session_cells(facts)) and fitting <= _resident_cells(facts):
        virtual = facts.max_sessions * _pad(_session_cells(facts)) * facts.bytes_per_position
        return (
            f"the virtual KV buffer ({virtual / 2**20:.0f} MiB for {facts.max_sessions} streams) does not "
            f"fit the address space left ({(facts.virtual_room_bytes or 0) / 2**20:.0f} MiB), not even with "
            "streams shortened to the length of resident ones"
        )
    return None


def _resident_cells(facts: LayoutFacts) -> int:
    """Cells of a resident stream: the pool divided evenly, never longer than one session may grow
    (a pool sized from a large memory budget would otherwise make every cell resident for nothing)."""
    even = max(PAD, facts.pool_tokens // facts.max_sessions // PAD * PAD)
    return min(even, _pad(_session_cells(facts)))


def _fitting_cells(facts: LayoutFacts) -> int:
    """Cells of a sparse stream: as long as a session may grow, shortened (to a multiple of 256) until
    ``max_sessions`` of them fit the address space left."""
    cells = _pad(_session_cells(facts))
    if facts.virtual_room_bytes is None or facts.bytes_per_position <= 0:
        return cells
    fit = int(facts.virtual_room_bytes * VIRTUAL_SHARE) // (facts.max_sessions * facts.bytes_per_position)
    return min(cells, fit // PAD * PAD)


def _session_cells(facts: LayoutFacts) -> int:
    """Positions one session may grow to in a stream of its own: the cap, the trained context, the pool."""
    limit = min(facts.session_cap, facts.pool_tokens)
    if facts.n_ctx_train > 0:
        limit = min(limit, facts.n_ctx_train)
    return max(1, limit)


def choose_layout(requested: str, facts: LayoutFacts) -> LayoutChoice:
    """The layout for a pool of ``facts.pool_tokens`` positions (``requested``: one of :data:`LAYOUTS`)."""
    if requested not in LAYOUTS:
        raise LayoutError(f"unknown KV pool layout {requested!r}; choose one of {', '.join(LAYOUTS)}")
    if facts.pool_tokens < PAD or facts.max_sessions < 1 or facts.session_cap < 1:
        raise LayoutError(
            f"a KV pool needs >= {PAD} positions, >= 1 session and a session cap >= 1 "
            f"(got {facts.pool_tokens}, {facts.max_sessions}, {facts.session_cap})"
        )
    if requested == "unified":
        limit = _session_cells(facts)
        return LayoutChoice(
            "unified", 1, _pad(facts.pool_tokens), limit, "asked for (kv_pool_layout = unified)"
        )
    if requested in ("auto", "sparse"):
        obstacle = sparse_obstacle(facts)
        if obstacle is None:
            cells = _fitting_cells(facts)
            limit = min(_session_cells(facts), cells)
            reason = "asked for" if requested == "sparse" else "sparse streams apply here"
            if limit < _session_cells(facts):
                reason += f"; streams shortened to {cells} cells to fit the address space left"
            return LayoutChoice("sparse", facts.max_sessions, cells, limit, reason)
        if requested == "sparse":
            raise LayoutError(f"kv_pool_layout = sparse cannot be used here: {obstacle}")
        reason = f"fallback: {obstacle}"
    else:
        reason = "asked for (kv_pool_layout = resident)"
    cells = _resident_cells(facts)
    limit = min(_session_cells(facts), cells)
    return LayoutChoice("resident", facts.max_sessions, cells, limit, reason)
