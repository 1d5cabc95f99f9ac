"""The layer-range engine: one llama.cpp context runs one Shard for many sessions at once.

Each Route Session owns a llama.cpp sequence id and the KV cells of that
sequence (its Hot KV State). One :meth:`ShardEngine.step` takes pieces of work
from any number of sessions -- prefill chunks and decode steps mixed -- and runs
them as one batch (split into several ``llama_decode`` calls only when the
tokens exceed ``n_batch``).

Work in: token ids (first stage, embeddings are looked up here from the source
model's ``token_embd``) or hidden states ``[n, n_embd]`` float32 (other stages).
Work out: the pre-norm residual stream after the shard's last layer for every
token (stages that are not last), or a sampled token with logprobs (last stage).

Invariants
----------
* A session's KV holds exactly positions ``0 .. kv_len-1``; work must start at
  ``kv_len`` (``PositionError`` otherwise) and may not grow past the session's
  budget (``KVBudgetError``).
* A whole step is validated before any KV is touched; a refused item gets an
  error result and the other items run. If llama.cpp fails a decode, every
  session of that step is truncated back to where it was: no partial KV.
* KV layouts. The per-sequence layout (``kv_pool_tokens = 0``): ``max_sessions``
  streams of ``session_kv_tokens`` cells each, all allocated up front. The KV
  pool (``kv_pool_tokens > 0``): sessions hold 16-position blocks of one pool
  (:mod:`node.kvpool`), take them as they grow -- nothing is reserved when a
  session opens -- and a piece of work whose growth does not fit in the free
  blocks is refused (``KVPoolExhaustedError``) before any KV is touched. The
  pool's llama.cpp layout (:mod:`node.kvlayout`): sparse per-sequence streams
  as long as a session may grow, resident only where sessions wrote
  (:mod:`node.kvsparse`; the default where it applies), resident per-sequence
  streams of ``pool / max_sessions`` cells (the fallback), or one unified
  stream (opt-in; compacted after releases). Either way captured rows come
  back in ubatch order and are put back in batch order with
  :func:`node.llama_runtime.ubatch_plan`, whose per-ubatch row counts are
  checked against what the callback saw.
* Not thread-safe: one engine belongs to one thread (the node's compute thread).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from common import architectures
from node import kvsparse
from node.constraints import ConstraintError, GrammarConstraint, LLTokenizer, Pieces, tokenizer_for
from node.errors import (
    DecodeError,
    EngineError,
    InputShapeError,
    KVBudgetError,
    KVPoolExhaustedError,
    PositionError,
    SessionLimitError,
    UnknownSessionError,
)
from node.kvlayout import LAYOUTS, LayoutChoice, LayoutError, LayoutFacts, choose_layout
from node.kvpool import KvPool, PoolStats
from node.llama_runtime import (
    BatchBuffer,
    ContextSettings,
    LlamaError,
    RowDequantizer,
    TensorCapture,
    free_model,
    load_model,
    new_context,
    ubatch_plan,
)
from node.sampling import SamplingParams, sample_choices
from node.shard import ShardFiles
from proto.codec import Sampled
from proto.recipe import Recipe, cpu_features_from_system_info

log = logging.getLogger("swarm.engine")

SCRATCH_KEEP_BYTES = 64 << 20  # the KV copy's buffer is kept between copies up to this size


@dataclass(frozen=True)
class EngineConfig:
    threads: int = 1
    max_sessions: int = 8
    # Per-sequence layout: the KV of one session (llama.cpp rounds up to 256). With a pool: the most
    # positions one session may hold (the operator's cap; the model's trained context bounds it too).
    session_kv_tokens: int = 2048
    # > 0: one KV pool of this many positions shared by all sessions (16-position blocks taken as they
    # grow); 0: the per-sequence layout (max_sessions x session_kv_tokens, reserved up front).
    kv_pool_tokens: int = 0
    # How the pool is laid out in llama.cpp (node.kvlayout): "auto" = sparse per-sequence streams where
    # they apply, else resident per-sequence streams sized from the pool; "sparse", "resident" or
    # "unified" (one shared stream: slower, exact only alone; kept for comparison).
    kv_pool_layout: str = "auto"
    batch_tokens: int = 512  # most tokens one llama_decode takes
    flash_attn: bool = True
    kv_type: str = "f16"
    kv_unified: bool = False
    capture: str = "auto"  # "auto": compiled C callback if possible; "python": ctypes callback
    n_gpu_layers: int = (
        0  # layers offloaded to the GPU, counted from the shard's last (> layers: all + output)
    )
    # "read": weights in llama.cpp's own buffers, no mapping of the shard left resident beside a
    # repacked copy (common.llama.LOAD_MODES); "mmap" shares pages between processes mapping one file.
    load_mode: str = "read"

    def context_settings(self, layout: LayoutChoice | None = None) -> ContextSettings:
        """llama.cpp's settings: the per-sequence layout's, or (``layout``) the pool's chosen layout."""
        base = self._base_settings()
        if layout is None:
            return base
        return dataclasses.replace(
            base, n_seq_max=self.max_sessions, n_ctx=layout.n_ctx, kv_unified=layout.layout == "unified"
        )

    def _base_settings(self) -> ContextSettings:
        if self.max_sessions < 1 or self.max_sessions > llama_cpp.llama_max_parallel_sequences():
            limit = llama_cpp.llama_max_parallel_sequences()
            raise EngineError(f"max_sessions must be in [1, {limit}], got {self.max_sessions}")
        if self.session_kv_tokens < 16:
            raise EngineError(f"session_kv_tokens must be >= 16, got {self.session_kv_tokens}")
        if self.kv_pool_tokens:
            if self.kv_pool_tokens < 256:
                raise EngineError(f"kv_pool_tokens must be 0 or >= 256, got {self.kv_pool_tokens}")
            if self.kv_pool_layout not in LAYOUTS:
                raise EngineError(
                    f"unknown kv_pool_layout {self.kv_pool_layout!r}; choose one of {', '.join(LAYOUTS)}"
                )
        return ContextSettings(
            n_threads=self.threads,
            n_seq_max=self.max_sessions,
            n_ctx=self.max_sessions * self.session_kv_tokens,
            n_batch=self.batch_tokens,
            n_ubatch=self.batch_tokens,
            flash_attn=self.flash_attn,
            kv_type=self.kv_type,
            kv_unified=self.kv_unified,
        )


def runtime_recipe(model_fingerprint: str, config: EngineConfig, backend: str = "cpu") -> Recipe:
    """Everything that changes the numbers a stage computes; every stage of a route must agree."""
    return Recipe(
        llama_cpp_build=f"llama-cpp-python {llama_cpp.__version__}",
        model_fingerprint=model_fingerprint,
        kv_type=config.kv_type,
        flash_attention=config.flash_attn,
        backend=backend,
        # The instruction sets the CPU kernels use (another build or CPU level: other low-order bits).
        cpu_features=cpu_features_from_system_info(
            llama_cpp.llama_print_system_info().decode("utf-8", "replace")
        ),
    )


def offload_backend(n_gpu_layers: int, n_layer: int) -> str:
    """The recipe's backend for a shard of ``n_layer`` layers with ``n_gpu_layers`` offloaded."""
    if n_gpu_layers <= 0:
        return "cpu"
    from node.llama_runtime import offload_devices

    devices = offload_devices()
    if not devices or not llama_cpp.llama_supports_gpu_offload():
        return "cpu"  # llama.cpp offloads nothing without a device
    name = devices[0].backend
    return name if n_gpu_layers > n_layer else f"{name}+cpu"


class TokenEmbeddings:
    """Row lookup in the source ``token_embd.weight`` (mmapped, converted per row by ggml itself).

    The rows are the raw bytes of the source file, converted with the very
    function llama.cpp's ``get_rows`` uses (:class:`node.llama_runtime.RowDequantizer`),
    so they are the floats the whole model starts from, for every quantization
    type. ``scale`` is applied as llama.cpp's ``ggml_scale`` does (one float32
    multiply) for graphs that scale token input only (Gemma 3).
    """

    def __init__(self, path: Path, n_embd: int, *, scale: float | None = None) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        tensor = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if tensor is None:
            raise EngineError(f"{path}: no token_embd.weight")
        self._rows = tensor.data  # raw rows: (n_vocab, bytes_per_row) or (n_vocab, n_embd)
        self.n_vocab = int(tensor.shape[1])
        self.n_embd = n_embd
        if int(tensor.shape[0]) != n_embd:
            raise EngineError(f"{path}: token_embd width {tensor.shape[0]} != model width {n_embd}")
        self._convert = RowDequantizer(int(tensor.tensor_type), n_embd)
        self._scale = np.float32(scale) if scale is not None else None

    def lookup(self, token_ids: np.ndarray) -> np.ndarray:
        """Rows for ``token_ids``; the caller (the engine's step validation) has checked the range."""
        ids = np.asarray(token_ids, dtype=np.int64)
        out = self._convert(np.asarray(self._rows[ids]))
        if self._scale is not None:
            out *= self._scale
        return out


@dataclass
class Work:
    """One session's piece of a step: ``n`` tokens starting at position ``start_pos``."""

    session_id: str
    start_pos: int
    tokens: np.ndarray | None = None  # int32 [n], first stage
    hidden: np.ndarray | None = None  # float32 [n, n_embd], other stages
    sample: bool = False  # last stage: sample a token after this piece's last position
    return_logits: bool = False  # last stage: also return the raw logits of the last position
    history: np.ndarray | None = None  # token ids so far, for penalties and grammars (last stage)
    # Speculative decoding (last stage): also draw a token after every position >= window_from, each
    # with the session's sampler at its own position (history up to that position), so every draw is
    # what a one-position step would have drawn there. None: no window.
    window_from: int | None = None

    @property
    def n_tokens(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        return 0 if data is None else int(len(data))


@dataclass(frozen=True)
class WorkResult:
    session_id: str
    start_pos: int
    n_tokens: int
    kv_len: int  # the session's KV length after this step
    hidden: np.ndarray | None = None
    sampled: Sampled | None = None
    logits: np.ndarray | None = None
    error: EngineError | None = None
    choices: tuple[Sampled, ...] = ()  # n > 1: the other choices' first tokens
    window: tuple[Sampled, ...] = ()  # Work.window_from: the draws after this piece's positions

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Session:
    session_id: str
    seq: int
    budget: int
    sampling: SamplingParams
    kv_len: int = 0
    last_used_s: float = field(default_factory=time.monotonic)
    constraint: GrammarConstraint | None = None


@dataclass(frozen=True)
class EngineStats:
    sessions: int
    max_sessions: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    steps: int
    decodes: int
    tokens_processed: int
    compute_s: float
    capture: str
    kv_pool: PoolStats | None = None  # the pool's blocks (None: per-sequence layout)
    kv_pool_refusals: int = 0  # pieces of work refused because the pool had no room
    kv_pool_compactions: int = 0  # times the pool's cells were re-packed (holes closed)
    kv_layout: str = "per-sequence"  # "per-sequence" (no pool), or the pool's "sparse", "resident", "unified"
    kv_layout_reason: str = ""  # why that layout (a fallback names its obstacle)


class ShardEngine:
    def __init__(self, files: ShardFiles, config: EngineConfig, cache_dir: Path | None = None) -> None:
        self.files = files
        self.config = config
        self.is_first = files.is_first
        self.is_last = files.is_last
        self.n_embd = files.model.n_embd
        settings = config.context_settings()
        self.arch = architectures.spec_for(files.model.architecture)
        # sqrtf(n_embd) in float32, as the graph computes it for token input.
        scale = float(np.sqrt(np.float32(self.n_embd))) if self.arch.scale_stage0 else None
        self._embeddings = (
            TokenEmbeddings(files.embeddings_path, self.n_embd, scale=scale)
            if files.embeddings_path is not None
            else None
        )
        if self.is_first and self._embeddings is None:
            raise EngineError("first-stage shard has no token embeddings file")
        self._model: ctypes.c_void_p | None = load_model(
            files.path, n_gpu_layers=config.n_gpu_layers, load_mode=config.load_mode
        )
        self._ctx: ctypes.c_void_p | None = None
        self._capture: TensorCapture | None = None
        capture_name = ""
        if not self.is_last:
            n_layer = llama_cpp.llama_model_n_layer(self._model)
            capture_name = f"{self.arch.capture_prefix}-{n_layer - 1}"
        inject_name = "" if self.is_first else (self.arch.inject_input or "")
        if capture_name or inject_name:
            self._capture = TensorCapture(
                capture_name,
                self.n_embd,
                settings.n_batch,
                cache_dir if config.capture == "auto" else None,
                inject_name=inject_name,
            )
        # The pool's layout (node.kvlayout): None for the per-sequence layout (no pool).
        self.layout: LayoutChoice | None = None
        self._sparse: kvsparse.SparseKvBuffer | None = None
        self._kv_rows: tuple[int, int] | None = None
        try:
            if config.kv_pool_tokens:
                self._ctx = self._pool_context()
                assert self.layout is not None  # chosen by _pool_context
                settings = config.context_settings(self.layout)
            else:
                self._ctx = self._new_context(settings)
        except Exception:
            free_model(self._model)
            raise
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self._vocab = vocab
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.kv_layout = settings
        self.pool: KvPool | None = None
        if self.layout is not None:
            # Resident streams hold at most n_ctx cells in all (a small pool may get a little more).
            resident = self.layout.layout == "resident"
            self.pool = KvPool(
                min(config.kv_pool_tokens, self.layout.n_ctx) if resident else config.kv_pool_tokens
            )
            self.session_kv_limit: int = self.layout.session_limit
        else:
            self.session_kv_limit = int(llama_cpp.llama_n_ctx_seq(self._ctx))
        self._pool_refusals = 0
        # Released or truncated KV left holes among the pool's cells: llama.cpp would fill them with
        # later positions of other sessions, out of position order (which changes the low-order bits
        # of attention), so the pool is compacted before the next growth (see _compact).
        self._holes = False
        self._compactions = 0
        self._scratch: np.ndarray | None = None  # _copy_kv's buffer, kept up to SCRATCH_KEEP_BYTES
        # Only the unified layout shares cells between sessions; the per-sequence ones never compact.
        self._compacts = self.layout is not None and self.layout.layout == "unified"
        self.n_batch = settings.n_batch
        self._batch = BatchBuffer(settings.n_batch, self.n_embd)
        self._batch.use_embeddings(True)
        self._sessions: dict[str, _Session] = {}
        self._free_seqs = list(range(config.max_sessions))  # kept sorted: lowest id first
        self._choices: dict[int, tuple[Sampled, ...]] = {}
        self._window: dict[int, list[Sampled]] = {}  # work index -> window draws (Work.window_from)
        # llguidance's view of the vocabulary, built once at load on the last stage: 0.4 s for SmolLM2's
        # 49k tokens, 2.1 s for Gemma 3's 262k. Built at the first grammar session's OPEN instead, it held
        # that OPEN past the gateway's open deadline (3 s) on a loaded machine.
        self._pieces: Pieces | None = None
        self._lltokenizer: LLTokenizer | None = None
        if self.is_last:
            eog = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)]
            self._lltokenizer = tokenizer_for(self._vocab, self.n_vocab, eog)
            self._pieces = Pieces(self._lltokenizer, self.n_vocab, eog)
        self.backend = offload_backend(config.n_gpu_layers, files.n_layers)
        self.recipe = runtime_recipe(files.model.fingerprint, config, self.backend)
        self.recipe_fingerprint = self.recipe.fingerprint()
        self._steps = 0
        self._decodes = 0
        self._tokens = 0
        self._compute_s = 0.0
        log.info(
            "engine ready shard=[%d,%d) first=%s last=%s sessions=%d kv_per_session=%d kv_pool=%d "
            "kv_layout=%s (%s) capture=%s backend=%s gpu_layers=%d",
            files.start,
            files.end,
            self.is_first,
            self.is_last,
            config.max_sessions,
            self.session_kv_limit,
            config.kv_pool_tokens,
            self.layout_name,
            self.layout.reason if self.layout is not None else "no pool",
            "none" if self._capture is None else ("c" if self._capture.compiled else "python"),
            self.backend,
            config.n_gpu_layers,
        )

    # -- the KV layout -------------------------------------------------------------------------

    @property
    def layout_name(self) -> str:
        """The KV layout in use: "per-sequence" (no pool), or the pool's "sparse", "resident", "unified"."""
        return "per-sequence" if self.layout is None else self.layout.layout

    def _new_context(self, settings: ContextSettings) -> ctypes.c_void_p:
        assert self._model is not None  # loaded before any context
        return new_context(
            self._model,
            settings,
            cb_eval=self._capture.callback_ptr if self._capture else None,
            cb_user_data=self._capture.user_data if self._capture else None,
        )

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _meta_int(self, key: str) -> int | None:
        value = self._meta(key)
        try:
            return None if value is None else int(value)
        except ValueError:
            return None  # an array (per-layer values) or something else

    def _kv_row_bytes(self) -> tuple[int, int] | None:
        """Bytes of one cell of one layer's K and V (None: not computable, e.g. per-layer KV heads)."""
        arch = self._meta("general.architecture")
        kv_type = {"f16": (2, 1), "f32": (4, 1), "q8_0": (34, 32)}.get(self.config.kv_type)
        n_head = int(llama_cpp.llama_model_n_head(self._model))
        if arch is None or kv_type is None or n_head <= 0:
            return None
        heads_kv = self._meta_int(f"{arch}.attention.head_count_kv")
        if heads_kv is None and self._meta(f"{arch}.attention.head_count_kv") is not None:
            return None  # present but not one number: KV heads differ by layer
        heads_kv = heads_kv or n_head
        default = int(llama_cpp.llama_model_n_embd(self._model)) // n_head
        k_len = self._meta_int(f"{arch}.attention.key_length") or default
        v_len = self._meta_int(f"{arch}.attention.value_length") or default
        if k_len != v_len or (heads_kv * k_len) % kv_type[1]:
            return None
        row = kvsparse.row_bytes(heads_kv * k_len, kv_type[0], kv_type[1])
        return row, row

    def _layout_facts(self) -> LayoutFacts:
        cfg = self.config
        self._kv_rows = self._kv_row_bytes()
        n_layer = int(llama_cpp.llama_model_n_layer(self._model))
        room, strict = kvsparse.address_room()
        return LayoutFacts(
            pool_tokens=cfg.kv_pool_tokens,
            max_sessions=cfg.max_sessions,
            session_cap=cfg.session_kv_tokens,
            n_ctx_train=int(llama_cpp.llama_model_n_ctx_train(self._model)),
            bytes_per_position=n_layer * sum(self._kv_rows) if self._kv_rows else 0,
            linux=sys.platform.startswith("linux"),
            gpu_offload=cfg.n_gpu_layers > 0,
            sliding_window=int(llama_cpp.llama_model_n_swa(self._model)) > 0,
            virtual_room_bytes=room,
            strict_overcommit=strict,
        )

    def _pool_context(self) -> ctypes.c_void_p:
        """The pool's llama.cpp context in the chosen layout; sparse streams fall back to resident ones
        (logged, and named by ``layout_name`` / the statistics) when their buffer cannot be made."""
        cfg = self.config
        facts = self._layout_facts()
        try:
            self.layout = choose_layout(cfg.kv_pool_layout, facts)
        except LayoutError as err:
            raise EngineError(str(err)) from err
        if self.layout.layout != "sparse":
            if self.layout.layout == "resident" and cfg.kv_pool_layout == "auto":
                log.warning("kv pool on resident per-sequence streams: %s", self.layout.reason)
            return self._new_context(cfg.context_settings(self.layout))
        assert self._kv_rows is not None  # sparse_obstacle checked the geometry
        geometry = kvsparse.KvGeometry(
            int(llama_cpp.llama_model_n_layer(self._model)),
            self._kv_rows[0],
            self._kv_rows[1],
            self.layout.stream_cells,
            self.layout.n_streams,
        )
        made: list[ctypes.c_void_p] = []
        settings = cfg.context_settings(self.layout)
        try:
            _, buf = kvsparse.create_sparse(lambda: made.append(self._new_context(settings)), geometry)
            why = "the KV buffer was not found among the new mappings (another llama.cpp build?)"
        except LlamaError:
            buf, why = None, f"llama.cpp could not create {geometry.buffer_bytes / 2**20:.0f} MiB of streams"
        if buf is not None and made:
            self._sparse = buf
            return made[0]
        if made:
            llama_cpp.llama_free(made[0])
        if cfg.kv_pool_layout == "sparse":
            raise EngineError(f"kv_pool_layout = sparse cannot be used here: {why}")
        resident = choose_layout("resident", facts)
        self.layout = dataclasses.replace(resident, reason=f"fallback: {why}")
        log.warning("kv pool on resident per-sequence streams: %s", self.layout.reason)
        return self._new_context(cfg.context_settings(self.layout))

    def kv_resident_bytes(self) -> int | None:
        """Sparse streams: bytes of the KV buffer resident now (what sessions wrote); else None."""
        return None if self._sparse is None else self._sparse.resident_bytes()

    def _drop_pages(self, seq: int, first_cell: int = 0) -> None:
        """Sparse streams: give the pages of ``seq``'s cells from ``first_cell`` on back to the system.
        Without flash attention llama.cpp stores V transposed (cells innermost), so a stream's tail is
        not one range: only whole streams are dropped then."""
        if self._sparse is not None and (first_cell == 0 or self.config.flash_attn):
            self._sparse.drop_stream(seq, first_cell)

    def _copy_kv(self, source_seq: int, seq: int) -> None:
        """Copy a sequence's KV into another stream. Sparse streams: through llama.cpp's sequence state
        (only the cells the source holds are written; llama.cpp's stream copy would write -- and make
        resident -- the whole target stream)."""
        if self._sparse is None:
            llama_cpp.llama_memory_seq_cp(self._mem, source_seq, seq, -1, -1)
            return
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, source_seq))
        # One buffer reused from copy to copy (np.empty: not zeroed): a fresh zeroed one of a ~1,400-
        # position prefix (16 MB of SmolLM2's half) cost a third of the copy, on a shared prefix's
        # first step; kept only up to SCRATCH_KEEP_BYTES, a larger copy gets its own.
        scratch = self._scratch
        if scratch is None or len(scratch) < size:
            scratch = np.empty(size, dtype=np.uint8)
            self._scratch = scratch if size <= SCRATCH_KEEP_BYTES else None
        buf = scratch.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, source_seq)) != size:
            raise DecodeError("could not copy out the source session's KV")
        if int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, size, seq)) == 0:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._drop_pages(seq)
            raise DecodeError("could not copy the source session's KV")

    # -- sessions ----------------------------------------------------------------------------

    def open_session(
        self,
        session_id: str,
        *,
        sampling: SamplingParams | None = None,
        kv_budget: int | None = None,
        source: str = "",
        positions: int = 0,
        move: bool = False,
    ) -> int:
        """Give ``session_id`` a sequence; returns its KV budget in tokens (the most it may grow to).

        With the pool nothing is reserved: the session takes blocks as its work arrives.
        With ``source``, the session starts with the first ``positions`` positions of that session's
        KV: ``move`` takes the source's sequence over (a kept session; the source is gone afterwards,
        nothing is copied), else the KV is copied (llama.cpp's sequence copy: with per-sequence KV
        streams the whole sequence is copied, then the copy is cut at ``positions``).
        """
        if session_id in self._sessions:
            raise EngineError(f"session {session_id!r} is already open")
        src = self._session(source) if source else None
        if not self._free_seqs and not (src is not None and move):
            raise SessionLimitError(f"all {self.config.max_sessions} session slots are in use")
        budget = self.session_kv_limit if kv_budget is None else int(kv_budget)
        if budget < 1 or budget > self.session_kv_limit:
            raise KVBudgetError(
                f"requested KV budget {budget} tokens; "
                f"this node allows 1..{self.session_kv_limit} per session"
            )
        if src is not None and not (1 <= positions <= min(src.kv_len, budget)):
            raise PositionError(
                f"cannot start {session_id!r} from {positions} positions of {source!r} "
                f"(it holds {src.kv_len}; budget {budget})"
            )
        params = (sampling or SamplingParams()).validate()
        constraint = self._constraint(params)
        if src is not None and not move and self.pool is not None:
            # A copy shares the source's cells in llama.cpp; the pool still counts them twice (never under).
            if not self.pool.resize(session_id, positions):
                raise KVPoolExhaustedError(
                    f"the KV pool has {self.pool.free_blocks * 16} free positions; copying {positions} "
                    f"positions of {source!r} needs more"
                )
        if src is not None and move:
            del self._sessions[source]
            seq = src.seq
            if self.pool is not None:
                self.pool.move(source, session_id)
                self.pool.resize(session_id, positions)  # shrinks: always fits
        else:
            seq = self._free_seqs[0]
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
            if src is not None:
                try:
                    self._copy_kv(src.seq, seq)
                except DecodeError:
                    if self.pool is not None:
                        self.pool.release(session_id)
                    raise
            self._free_seqs.pop(0)
        sess = _Session(session_id, seq, budget, params, constraint=constraint)
        if src is not None:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, positions, -1)
            self._drop_pages(seq, positions)
            sess.kv_len = positions
        self._sessions[session_id] = sess
        return budget

    def _constraint(self, params: SamplingParams) -> GrammarConstraint | None:
        """The session's grammar (last stage), on the vocabulary's llguidance tokenizer built at load."""
        if not params.grammar or not self.is_last:
            return None
        assert self._lltokenizer is not None and self._pieces is not None  # built at load (last stage)
        try:
            return GrammarConstraint(self._lltokenizer, params.grammar, self.n_vocab, self._pieces)
        except ConstraintError as err:
            raise EngineError(str(err)) from err

    def release(self, session_id: str) -> None:
        sess = self._sessions.pop(session_id, None)
        if sess is None:
            raise UnknownSessionError(f"unknown session {session_id!r}")
        llama_cpp.llama_memory_seq_rm(self._mem, sess.seq, -1, -1)
        self._drop_pages(sess.seq)
        if self.pool is not None:
            self._holes |= self.pool.release(session_id) > 0 and self._compacts
        self._free_seqs.append(sess.seq)
        self._free_seqs.sort()

    def truncate(self, session_id: str, position: int) -> None:
        """Forget KV at positions >= ``position`` (recovery replays from there)."""
        sess = self._session(session_id)
        if position < 0 or position > sess.kv_len:
            raise PositionError(
                f"cannot truncate session {session_id!r} of KV length {sess.kv_len} to {position}"
            )
        self._holes |= position < sess.kv_len and self._compacts
        llama_cpp.llama_memory_seq_rm(self._mem, sess.seq, position, -1)
        self._drop_pages(sess.seq, position)
        sess.kv_len = position
        if self.pool is not None:
            self.pool.resize(session_id, position)  # shrinks: always fits

    def kv_len(self, session_id: str) -> int:
        return self._session(session_id).kv_len

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (last stage; other stages have a 1-token dummy vocabulary)."""
        return self.is_last and bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def set_sampling(self, session_id: str, sampling: SamplingParams) -> None:
        self._session(session_id).sampling = sampling.validate()

    def _session(self, session_id: str) -> _Session:
        sess = self._sessions.get(session_id)
        if sess is None:
            raise UnknownSessionError(f"unknown session {session_id!r}")
        return sess

    # -- the batch step ----------------------------------------------------------------------

    def _validate(self, work: Work, seen: set[str]) -> EngineError | None:
        sess = self._sessions.get(work.session_id)
        if sess is None:
            return UnknownSessionError(f"unknown session {work.session_id!r}")
        if work.session_id in seen:
            return EngineError(f"session {work.session_id!r} appears twice in one step")
        if (work.tokens is None) == (work.hidden is None):
            return InputShapeError("work must carry exactly one of token ids or hidden states")
        if self.is_first and work.tokens is None:
            return InputShapeError("the first stage takes token ids, not hidden states")
        if not self.is_first and work.hidden is None:
            return InputShapeError("this stage takes hidden states, not token ids")
        if work.tokens is not None:
            t = work.tokens
            if t.ndim != 1 or t.size == 0 or t.dtype.kind not in "iu":
                return InputShapeError(
                    f"token ids must be a non-empty 1-D integer array, got {t.dtype} {t.shape}"
                )
            if t.min() < 0 or t.max() >= self._embeddings.n_vocab:  # type: ignore[union-attr]
                return InputShapeError(f"token id outside the vocabulary [0, {self._embeddings.n_vocab})")  # type: ignore[union-attr]
        else:
            h = work.hidden
            assert h is not None
            if h.ndim != 2 or h.shape[0] == 0 or h.shape[1] != self.n_embd or h.dtype != np.float32:
                return InputShapeError(
                    f"hidden states must be float32 [n>0, {self.n_embd}], got {h.dtype} {list(h.shape)}"
                )
            if not np.isfinite(h).all():
                return InputShapeError("hidden states contain NaN or infinity")
        if work.start_pos != sess.kv_len:
            return PositionError(
                f"session {work.session_id!r}: work starts at position {work.start_pos} "
                f"but its KV holds {sess.kv_len} positions"
            )
        if sess.kv_len + work.n_tokens > sess.budget:
            return KVBudgetError(
                f"session {work.session_id!r}: {sess.kv_len} + {work.n_tokens} tokens exceed its KV budget "
                f"of {sess.budget}"
            )
        if (work.sample or work.return_logits or work.window_from is not None) and not self.is_last:
            return InputShapeError("only the last stage samples or returns logits")
        return None

    def step(self, works: list[Work]) -> list[WorkResult]:
        """Run one batch made of every session's piece; results come back in the same order."""
        self._steps += 1
        errors: list[EngineError | None] = []
        seen: set[str] = set()
        for w in works:
            err = self._validate(w, seen)
            errors.append(err)
            if err is None:
                seen.add(w.session_id)
        if self.pool is not None:
            self._take_blocks(works, errors)
        accepted = [i for i, e in enumerate(errors) if e is None]
        if accepted and self._holes:
            self._compact()
        hidden_out: dict[int, np.ndarray] = {}
        sampled: dict[int, Sampled] = {}
        logits_out: dict[int, np.ndarray] = {}
        self._choices = {}
        self._window = {}
        if accepted:
            try:
                self._run(works, accepted, hidden_out, sampled, logits_out)
            except EngineError as failure:
                for i in accepted:
                    w = works[i]
                    sess = self._sessions[w.session_id]
                    llama_cpp.llama_memory_seq_rm(self._mem, sess.seq, w.start_pos, -1)
                    self._drop_pages(sess.seq, w.start_pos)
                    sess.kv_len = w.start_pos
                    if self.pool is not None:
                        self.pool.resize(w.session_id, w.start_pos)
                        self._holes = self._compacts
                    errors[i] = failure
        results = []
        now = time.monotonic()
        for i, w in enumerate(works):
            error = errors[i]
            owner = self._sessions.get(w.session_id)
            if error is None and owner is not None:
                owner.last_used_s = now
            results.append(
                WorkResult(
                    session_id=w.session_id,
                    start_pos=w.start_pos,
                    n_tokens=w.n_tokens,
                    kv_len=owner.kv_len if owner is not None else 0,
                    hidden=hidden_out.get(i),
                    sampled=sampled.get(i),
                    logits=logits_out.get(i),
                    choices=self._choices.get(i, ()),
                    window=tuple(self._window.get(i, ())) if error is None else (),
                    error=error,
                )
            )
        return results

    def _compact(self) -> None:
        """Re-pack the pool's cells: every session's KV is copied out (llama.cpp's sequence state),
        the cache cleared, and the sessions restored one after another, each into contiguous cells in
        position order from cell 0. A session's attention then reads its cells in position order, as
        the whole model alone does, so its numbers stay bit-identical; the free cells are all after
        the used ones. Costs one copy of the used KV (transient host memory of that size)."""
        self._holes = False
        held = sorted((s for s in self._sessions.values() if s.kv_len), key=lambda s: s.seq)
        if not held:
            llama_cpp.llama_memory_clear(self._mem, False)
            return
        t0 = time.perf_counter()
        states: list[tuple[_Session, ctypes.Array[ctypes.c_uint8]]] = []
        for sess in held:
            size = int(llama_cpp.llama_state_seq_get_size(self._ctx, sess.seq))
            buf = (ctypes.c_uint8 * size)()
            if int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, sess.seq)) != size:
                raise DecodeError(f"could not copy out the KV of session {sess.session_id!r}")
            states.append((sess, buf))
        llama_cpp.llama_memory_clear(self._mem, False)
        for sess, buf in states:
            if int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(buf), sess.seq)) == 0:
                raise DecodeError(f"could not restore the KV of session {sess.session_id!r}")
        self._compactions += 1
        log.debug("kv pool compacted sessions=%d in %.1f ms", len(held), 1000 * (time.perf_counter() - t0))

    def _take_blocks(self, works: list[Work], errors: list[EngineError | None]) -> None:
        """Grow every valid piece's session in the pool, in step order; a piece that does not fit is
        refused whole (its session keeps what it holds) and the pieces after it may still fit."""
        assert self.pool is not None
        for i, w in enumerate(works):
            if errors[i] is not None:
                continue
            end = w.start_pos + w.n_tokens
            if not self.pool.resize(w.session_id, end):
                self._pool_refusals += 1
                need = self.pool.growth_blocks(w.session_id, end)
                errors[i] = KVPoolExhaustedError(
                    f"session {w.session_id!r}: the KV pool has {self.pool.free_blocks} free blocks of 16 "
                    f"positions; {w.n_tokens} more positions need {need}"
                )

    def _run(
        self,
        works: list[Work],
        accepted: list[int],
        hidden_out: dict[int, np.ndarray],
        sampled: dict[int, Sampled],
        logits_out: dict[int, np.ndarray],
    ) -> None:
        # Sessions in ascending sequence id: llama.cpp puts consecutive sequence ids in one ubatch.
        order = sorted(accepted, key=lambda i: self._sessions[works[i].session_id].seq)
        if not self.is_last:
            for i in order:
                hidden_out[i] = np.empty((works[i].n_tokens, self.n_embd), dtype=np.float32)
        # Cut the step into decodes of at most n_batch tokens: (work index, offset, count) segments.
        decodes: list[list[tuple[int, int, int]]] = [[]]
        room = self.n_batch
        for i in order:
            off, n = 0, works[i].n_tokens
            while off < n:
                if room == 0:
                    decodes.append([])
                    room = self.n_batch
                take = min(room, n - off)
                decodes[-1].append((i, off, take))
                off += take
                room -= take
        for segments in decodes:
            self._decode(works, segments, hidden_out, sampled, logits_out)

    def _decode(
        self,
        works: list[Work],
        segments: list[tuple[int, int, int]],
        hidden_out: dict[int, np.ndarray],
        sampled: dict[int, Sampled],
        logits_out: dict[int, np.ndarray],
    ) -> None:
        b = self._batch
        embd = b.embd
        assert embd is not None  # the engine's batch always carries embeddings
        n = 0
        outputs: list[tuple[int, int]] = []  # (work index, batch row) for last-stage outputs
        drawn_rows: list[tuple[int, int, int]] = []  # (work index, batch row, position): window draws
        for i, off, take in segments:
            w = works[i]
            sess = self._sessions[w.session_id]
            rows = slice(n, n + take)
            if w.tokens is not None:
                embd[rows] = self._embeddings.lookup(w.tokens[off : off + take])  # type: ignore[union-attr]
            else:
                embd[rows] = w.hidden[off : off + take]  # type: ignore[index]
            b.pos[rows] = np.arange(w.start_pos + off, w.start_pos + off + take, dtype=np.int32)
            b.seq[rows] = sess.seq
            if self.is_last:
                b.logits[rows] = 0
                if w.window_from is not None:
                    for r in range(max(off, w.window_from - w.start_pos), off + take):
                        b.logits[n + r - off] = 1
                        drawn_rows.append((i, n + r - off, w.start_pos + r))
                if off + take == w.n_tokens and (w.sample or w.return_logits):
                    b.logits[n + take - 1] = 1
                    outputs.append((i, n + take - 1))
            else:
                b.logits[rows] = 1  # every row must be an output or llama.cpp drops it in the last layer
            n += take
        b.batch.n_tokens = n
        plan: list[np.ndarray] | None = None
        if self._capture is not None:
            self._capture.reset()
            plan = ubatch_plan(b.seq[:n], self.n_batch, self.kv_layout.kv_unified)
            if self._capture.injects:
                # The graph transforms its input before the first layer: hand it the exact rows instead.
                self._capture.set_inject_rows(embd[np.concatenate(plan)])
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self._ctx, b.batch)
        self._compute_s += time.perf_counter() - t0
        self._decodes += 1
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc}; the step was rolled back")
        self._tokens += n
        for i, _off, take in segments:
            self._sessions[works[i].session_id].kv_len += take
        if self._capture is not None and plan is not None:
            err = self._capture.error()
            if err:
                raise DecodeError(f"hidden-state capture failed: {err}")
            planned = [len(p) for p in plan]
            if self._capture.injects and self._capture.injected_rows() != planned:
                raise DecodeError(
                    f"llama.cpp took input rows as {self._capture.injected_rows()}, "
                    f"not as planned {planned}; "
                    "the pinned llama.cpp changed its batch splitting or graph"
                )
        if self._capture is not None and plan is not None and self._capture.captures:
            seen_rows = self._capture.ubatch_rows()
            if seen_rows != [len(p) for p in plan]:
                raise DecodeError(
                    f"llama.cpp split the batch as {seen_rows}, not as planned {[len(p) for p in plan]}; "
                    "the pinned llama.cpp changed its batch splitting"
                )
            captured = self._capture.rows()
            in_batch_order = np.empty((n, self.n_embd), dtype=np.float32)
            in_batch_order[np.concatenate(plan)] = captured
            pos = 0
            for i, off, take in segments:
                hidden_out[i][off : off + take] = in_batch_order[pos : pos + take]
                pos += take
        for i, row, pos in drawn_rows:
            w = works[i]
            sess = self._sessions[w.session_id]
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
            if not ptr:
                raise DecodeError(f"llama.cpp returned no logits for batch row {row}")
            row_logits = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
            )
            history = None if w.history is None else w.history[: pos + 1]
            token = sample_choices(row_logits, sess.sampling, pos + 1, history, None, sess.budget - pos)[0]
            self._window.setdefault(i, []).append(token)
        for i, row in outputs:
            w = works[i]
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
            if not ptr:
                raise DecodeError(f"llama.cpp returned no logits for batch row {row}")
            logits = np.ctypeslib.as_array(
                ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
            )
            if w.return_logits:
                logits_out[i] = logits.copy()
            if w.sample:
                sess = self._sessions[w.session_id]
                position = w.start_pos + w.n_tokens
                drawn = sample_choices(
                    logits, sess.sampling, position, w.history, sess.constraint, sess.budget - position + 1
                )
                sampled[i] = drawn[0]
                if len(drawn) > 1:
                    self._choices[i] = tuple(drawn[1:])

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def pool_refusals(self) -> int:
        return self._pool_refusals

    @property
    def pool_compactions(self) -> int:
        return self._compactions

    def statistics(self) -> EngineStats:
        return EngineStats(
            sessions=len(self._sessions),
            max_sessions=self.config.max_sessions,
            kv_tokens_used=sum(s.kv_len for s in self._sessions.values()),
            kv_tokens_capacity=(
                self.pool.total_blocks * 16
                if self.pool is not None
                else self.session_kv_limit * self.config.max_sessions
            ),
            kv_pool=self.pool.stats() if self.pool is not None else None,
            kv_pool_refusals=self._pool_refusals,
            kv_pool_compactions=self._compactions,
            kv_layout=self.layout_name,
            kv_layout_reason=self.layout.reason if self.layout is not None else "",
            steps=self._steps,
            decodes=self._decodes,
            tokens_processed=self._tokens,
            compute_s=self._compute_s,
            capture="none" if self._capture is None else ("c" if self._capture.compiled else "python"),
        )

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            free_model(self._model)
            self._model = None

    def __enter__(self) -> ShardEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
