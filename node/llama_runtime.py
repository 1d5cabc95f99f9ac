"""The node's adapter to llama.cpp (through llama-cpp-python's ctypes layer).

Everything of the node that touches llama.cpp pointers lives here or in
``node.engine``: context creation, batch buffers, the compiled capture callback
and row conversion. Backend start-up, log routing and model load/free are
process-wide and shared with the gateway (``common.llama``, re-exported here).
Nothing here is thread-safe: a context belongs to the one thread that runs its
engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import llama_cpp
import numpy as np

# The process-wide part (backend start-up, log routing, model load/free) lives in common.llama,
# shared with the gateway's vocabularies; re-exported here for the node's modules.
from common.llama import LlamaError as LlamaError
from common.llama import free_model as free_model
from common.llama import init_backend as init_backend
from common.llama import llama_build_info as llama_build_info
from common.llama import load_model as load_model

log = logging.getLogger("swarm.llama")
KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}


@dataclass(frozen=True)
class ContextSettings:
    """llama.cpp context parameters that matter to us. Attention and KV settings are part of the
    runtime recipe: every stage of a route (and any parity reference) must use the same."""

    n_threads: int = 1
    n_seq_max: int = 8
    n_ctx: int = 8 * 2048
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = True
    kv_type: str = "f16"
    kv_unified: bool = False
    # Full-size sliding-window KV (llama.cpp's default): a session can be truncated to any
    # position and cells keep position order, so results do not depend on cache reuse.
    swa_full: bool = True


def new_context(
    model: ctypes.c_void_p,
    settings: ContextSettings,
    *,
    cb_eval: int | None = None,
    cb_user_data: int | None = None,
) -> ctypes.c_void_p:
    if settings.kv_type not in KV_TYPES:
        raise LlamaError(f"unknown KV type {settings.kv_type!r}; choose one of {', '.join(KV_TYPES)}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = settings.n_ctx
    params.n_batch = settings.n_batch
    params.n_ubatch = settings.n_ubatch
    params.n_seq_max = settings.n_seq_max
    params.n_threads = settings.n_threads
    params.n_threads_batch = settings.n_threads
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if settings.flash_attn
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    params.type_k = KV_TYPES[settings.kv_type]
    params.type_v = KV_TYPES[settings.kv_type]
    params.kv_unified = settings.kv_unified
    params.swa_full = settings.swa_full
    params.embeddings = False
    params.no_perf = True
    if cb_eval is not None:
        params.cb_eval = ctypes.cast(ctypes.c_void_p(cb_eval), llama_cpp.ggml_backend_sched_eval_callback)
        params.cb_eval_user_data = ctypes.c_void_p(cb_user_data)
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise LlamaError("llama.cpp could not create a context (see the llama.cpp log lines above)")
    return ctx


class BatchBuffer:
    """A ``llama_batch`` whose arrays are numpy buffers we own, so filling it is vectorised.

    Every token belongs to exactly one sequence (``n_seq_id = 1``); ``seq_id[i]``
    points at ``seq[i]``.
    """

    def __init__(self, capacity: int, n_embd: int) -> None:
        self.capacity = capacity
        self.n_embd = n_embd
        self.token = np.zeros(capacity, dtype=np.int32)
        self.embd = np.zeros((capacity, n_embd), dtype=np.float32) if n_embd else None
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base = self.seq.ctypes.data
        self._seq_ptrs = np.array([base + 4 * i for i in range(capacity)], dtype=np.uintp)
        self.batch = llama_cpp.llama_batch()
        i32p = ctypes.POINTER(ctypes.c_int32)
        # The struct's pointer fields take pointers (llama-cpp-python's stubs call them arrays).
        _set_field(self.batch, "token", self.token.ctypes.data_as(i32p))
        _set_field(self.batch, "pos", self.pos.ctypes.data_as(i32p))
        _set_field(self.batch, "n_seq_id", self.n_seq_id.ctypes.data_as(i32p))
        _set_field(self.batch, "seq_id", ctypes.cast(self._seq_ptrs.ctypes.data, ctypes.POINTER(i32p)))
        _set_field(self.batch, "logits", self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))
        self._embd_ptr = (
            self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if self.embd is not None else None
        )
        self._null_i32 = i32p()  # NULL
        self._null_f32 = ctypes.POINTER(ctypes.c_float)()  # NULL

    def use_embeddings(self, yes: bool) -> None:
        if yes:
            if self._embd_ptr is None:
                raise LlamaError("this batch buffer has no embedding storage")
            _set_field(self.batch, "embd", self._embd_ptr)
            _set_field(self.batch, "token", self._null_i32)
        else:
            _set_field(self.batch, "embd", self._null_f32)
            _set_field(self.batch, "token", self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))


def _set_field(struct: ctypes.Structure, name: str, value: object) -> None:
    setattr(struct, name, value)


# ---------------------------------------------------------------------------------------------
# The compiled capture callback (node/capture.c)
# ---------------------------------------------------------------------------------------------


def _llama_lib_dir() -> Path:
    """Where the loaded libllama and its ggml libraries live: llama-cpp-python 0.3.36 loads
    ``$LLAMA_CPP_LIB_PATH/libllama.so`` when that is set (another build of the same release, e.g.
    scripts/build-alt-llama's), else its package's ``lib``; ggml-base must come from the same
    folder, or two copies of ggml would be loaded side by side."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    return Path(llama_cpp.__file__).parent / "lib"


def _include_dirs() -> list[Path]:
    """Where llama-cpp-python installed ggml's headers (they vary by build layout)."""
    roots = [
        Path(llama_cpp.__file__).parent,
        Path(sysconfig.get_paths()["purelib"]),
        Path(sysconfig.get_paths()["data"]),
    ]
    found: list[Path] = []
    for root in roots:
        for candidate in (root / "include", root / "lib" / "include", root):
            if (candidate / "ggml.h").is_file() and candidate not in found:
                found.append(candidate)
    return found


class CaptureUnavailable(RuntimeError):
    pass


class CaptureStruct(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * 64),
        ("buf", ctypes.POINTER(ctypes.c_float)),
        ("capacity", ctypes.c_int64),
        ("used", ctypes.c_int64),
        ("width", ctypes.c_int64),
        ("n_ubatches", ctypes.c_int32),
        ("error", ctypes.c_int32),
        ("rows", ctypes.c_int32 * 1024),
        ("inject_name", ctypes.c_char * 64),
        ("inject_buf", ctypes.POINTER(ctypes.c_float)),
        ("inject_capacity", ctypes.c_int64),
        ("inject_used", ctypes.c_int64),
        ("n_injected", ctypes.c_int32),
        ("inject_pad", ctypes.c_int32),
        ("inject_rows", ctypes.c_int32 * 1024),
    ]


CAPTURE_ERRORS = {
    1: "captured tensor is not f32",
    2: "captured tensor is not contiguous",
    3: "capture buffer overflow",
    4: "captured tensor has the wrong width",
    5: "too many ubatches in one decode",
    6: "the graph asked for more input rows than were given",
}


def compile_capture_library(cache_dir: Path) -> Path:
    """Compile node/capture.c against the installed ggml headers, once per source+build.

    The result is cached under ``cache_dir/capture`` keyed by the source, the
    llama-cpp-python version and the compiler, so nodes start in milliseconds
    after the first time. Raises :class:`CaptureUnavailable` when no compiler or
    headers are present; the engine then falls back to a Python callback.
    """
    source = resources.files("node").joinpath("capture.c").read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CaptureUnavailable("no C compiler (cc/gcc) on PATH")
    includes = _include_dirs()
    if not includes:
        raise CaptureUnavailable("llama-cpp-python did not install ggml.h")
    lib_dir = _llama_lib_dir()
    key = hashlib.sha256(
        source + llama_cpp.__version__.encode() + cc.encode() + str(lib_dir).encode()
    ).hexdigest()[:16]
    out_dir = Path(cache_dir) / "capture"
    out = out_dir / f"swarm_capture-{key}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "capture.c"
        src.write_bytes(source)
        obj = Path(tmp) / "capture.so"
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(obj), str(src)]
        cmd += [f"-I{d}" for d in includes]
        cmd += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-lggml-base"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CaptureUnavailable(f"compiling capture.c failed: {proc.stderr.strip()[:2000]}")
        os.replace(obj, out)
    log.info("compiled capture callback %s", out)
    return out


class TensorCapture:
    """Owns a capture struct and its float buffers; hands llama.cpp a callback pointer.

    ``name``: the graph tensor copied out after every ubatch ("" for none).
    ``inject_name``: the graph tensor overwritten with caller rows (see
    :meth:`set_inject_rows`) after every ubatch ("" for none).
    """

    def __init__(
        self, name: str, width: int, capacity_rows: int, cache_dir: Path | None, *, inject_name: str = ""
    ) -> None:
        self.width = width
        self.buffer = np.zeros(capacity_rows * width, dtype=np.float32)
        self.inject_buffer = np.zeros(capacity_rows * width if inject_name else 1, dtype=np.float32)
        self.struct = CaptureStruct()
        self.struct.name = name.encode()
        self.struct.buf = self.buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self.struct.capacity = self.buffer.size
        self.struct.width = width
        self.struct.inject_name = inject_name.encode()
        self.struct.inject_buf = self.inject_buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self.struct.inject_capacity = 0
        self.captures = bool(name)
        self.injects = bool(inject_name)
        self.compiled = False
        self._lib = None
        self._py_cb = None
        if cache_dir is not None:
            try:
                self._lib = ctypes.CDLL(str(compile_capture_library(cache_dir)))
                self.compiled = True
            except (CaptureUnavailable, OSError) as err:
                log.warning("C capture callback unavailable, using the slower Python one: %s", err)
        if self._lib is not None:
            self._lib.swarm_capture_sizeof.restype = ctypes.c_size_t
            if self._lib.swarm_capture_sizeof() != ctypes.sizeof(CaptureStruct):
                raise CaptureUnavailable("capture struct layout mismatch between C and Python")
            self.callback_ptr = ctypes.cast(self._lib.swarm_capture_cb, ctypes.c_void_p).value
        else:
            self._py_cb = llama_cpp.ggml_backend_sched_eval_callback(self._python_callback)
            self.callback_ptr = ctypes.cast(self._py_cb, ctypes.c_void_p).value
        self.user_data = ctypes.addressof(self.struct)

    def _python_callback(self, tensor_p: int, ask: bool, _user: int) -> bool:
        # Same contract as swarm_capture_cb, for machines without a compiler.
        t = ctypes.cast(tensor_p, ctypes.POINTER(_GgmlTensorHead)).contents
        s = self.struct
        capture = bool(s.name) and t.name == s.name
        inject = not capture and bool(s.inject_name) and t.name == s.inject_name
        if not capture and not inject:
            return not ask
        if ask:
            return True
        n_rows = int(t.ne[1]) * int(t.ne[2]) * int(t.ne[3])
        n = n_rows * int(t.ne[0])
        if s.error:
            return True
        if t.type != 0:
            s.error = 1
            return True
        if int(t.ne[0]) != self.width:
            s.error = 4
            return True
        if inject:
            if s.inject_used + n > s.inject_capacity:
                s.error = 6
                return True
            src = ctypes.c_void_p(self.inject_buffer.ctypes.data + 4 * s.inject_used)
            _ggml_backend_tensor_set()(tensor_p, src, 0, 4 * n)
            s.inject_rows[s.n_injected] = n_rows
            s.n_injected += 1
            s.inject_used += n
            return True
        if s.used + n > s.capacity:
            s.error = 3
            return True
        _ggml_backend_tensor_get()(tensor_p, ctypes.c_void_p(self.buffer.ctypes.data + 4 * s.used), 0, 4 * n)
        s.rows[s.n_ubatches] = n_rows
        s.n_ubatches += 1
        s.used += n
        return True

    def reset(self) -> None:
        self.struct.used = 0
        self.struct.n_ubatches = 0
        self.struct.error = 0
        self.struct.inject_used = 0
        self.struct.n_injected = 0
        self.struct.inject_capacity = 0

    def set_inject_rows(self, rows: np.ndarray) -> None:
        """Rows ``[n, width]`` (in ubatch order) the next decode writes over the inject tensor."""
        n = rows.size
        if n > self.inject_buffer.size:
            raise LlamaError(f"{rows.shape[0]} inject rows exceed the capture capacity")
        self.inject_buffer[:n] = rows.reshape(-1)
        self.struct.inject_used = 0
        self.struct.n_injected = 0
        self.struct.inject_capacity = n

    def injected_rows(self) -> list[int]:
        return [int(self.struct.inject_rows[i]) for i in range(int(self.struct.n_injected))]

    def rows(self) -> np.ndarray:
        """Captured rows so far, in ubatch order (a view; copy before the next decode)."""
        n = int(self.struct.used) // self.width
        return self.buffer[: n * self.width].reshape(n, self.width)

    def ubatch_rows(self) -> list[int]:
        return [int(self.struct.rows[i]) for i in range(int(self.struct.n_ubatches))]

    def error(self) -> str | None:
        code = int(self.struct.error)
        return CAPTURE_ERRORS.get(code, f"capture error {code}") if code else None


class _GgmlTensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (for the Python fallback only)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


_ggml_base: ctypes.CDLL | None = None
_tensor_get = None
_tensor_set = None


def _ggml_base_lib() -> ctypes.CDLL:
    global _ggml_base
    if _ggml_base is None:
        _ggml_base = ctypes.CDLL(str(_llama_lib_dir() / "libggml-base.so"))
    return _ggml_base


def _ggml_backend_tensor_get():  # pragma: no cover - only without a C compiler
    global _tensor_get
    if _tensor_get is None:
        fn = _ggml_base_lib().ggml_backend_tensor_get
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        fn.restype = None
        _tensor_get = fn
    return _tensor_get


def _ggml_backend_tensor_set():  # pragma: no cover - only without a C compiler
    global _tensor_set
    if _tensor_set is None:
        fn = _ggml_base_lib().ggml_backend_tensor_set
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        fn.restype = None
        _tensor_set = fn
    return _tensor_set


# ---------------------------------------------------------------------------------------------
# Dequantizing token-embedding rows with ggml's own row converters
# ---------------------------------------------------------------------------------------------


class _GgmlTypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml.h of the pinned build)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)
GGML_TYPE_F32 = 0


class RowDequantizer:
    """Turns raw rows of one ggml type into float32 with the function llama.cpp's ``get_rows`` uses.

    The CPU backend's ``GET_ROWS`` (how a whole model looks up token embeddings)
    converts each row with ``ggml_get_type_traits(type)->to_float``; calling the
    same function on the same bytes gives the same floats for every type
    (K-quants, legacy quants, Q8_0, F16, BF16), by construction.
    """

    def __init__(self, ggml_type: int, n_per_row: int) -> None:
        self.ggml_type = int(ggml_type)
        self.n_per_row = int(n_per_row)
        self._fn = None
        if self.ggml_type == GGML_TYPE_F32:
            return
        lib = _ggml_base_lib()
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        lib.ggml_get_type_traits.restype = ctypes.POINTER(_GgmlTypeTraits)
        traits = lib.ggml_get_type_traits(self.ggml_type).contents
        if not traits.to_float:
            raise LlamaError(f"ggml type {self.ggml_type} has no row converter")
        if self.n_per_row % int(traits.blck_size):
            raise LlamaError(
                f"row width {self.n_per_row} is not a multiple of the block size {traits.blck_size}"
            )
        self.type_name = (traits.type_name or b"?").decode()
        self._fn = _TO_FLOAT(traits.to_float)

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        """``raw``: ``[n, bytes_per_row]`` raw rows (``[n, n_per_row]`` float32 for F32) -> float32 rows."""
        n = int(raw.shape[0])
        if self._fn is None:
            return np.array(raw, dtype=np.float32, copy=True).reshape(n, self.n_per_row)
        src = np.ascontiguousarray(raw)
        out = np.empty((n, self.n_per_row), dtype=np.float32)
        self._fn(
            ctypes.c_void_p(src.ctypes.data),
            out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            n * self.n_per_row,
        )
        return out


# ---------------------------------------------------------------------------------------------
# How llama.cpp splits a batch into ubatches (pinned llama.cpp; checked at run time)
# ---------------------------------------------------------------------------------------------


def ubatch_plan(seq_ids: np.ndarray, n_ubatch: int, kv_unified: bool) -> list[np.ndarray]:
    """The batch indices of each ubatch, in the order llama.cpp computes them.

    Mirrors ``llama_batch_allocr::split_simple`` (unified KV: one stream) and
    ``split_equal(n_ubatch, sequential=true)`` (per-sequence KV streams) of the
    pinned llama.cpp. The engine needs it because a graph callback sees rows in
    ubatch order; it verifies the per-ubatch row counts after every decode, so
    a llama.cpp change that breaks this mirror fails loudly, never silently.
    """
    n = len(seq_ids)
    if kv_unified:
        return [np.arange(s, min(s + n_ubatch, n)) for s in range(0, n, n_ubatch)]
    per_seq: dict[int, list[int]] = {}
    for i, s in enumerate(seq_ids.tolist()):
        per_seq.setdefault(s, []).append(i)
    cursor = {s: 0 for s in per_seq}  # tokens of each sequence are consumed in batch order
    used = np.zeros(n, dtype=bool)
    plan: list[np.ndarray] = []
    while not used.all():
        chosen: list[int] = []
        last = -1
        for i in np.flatnonzero(~used).tolist():
            s = int(seq_ids[i])
            if s in chosen:
                continue
            if chosen and s != last + 1:
                continue
            chosen.append(s)
            last = s
            if len(chosen) > n_ubatch:
                break
        idxs: list[list[int]] = [[] for _ in chosen]
        while True:
            if any(cursor[s] >= len(per_seq[s]) for s in chosen):
                break
            for k, s in enumerate(chosen):
                idx = per_seq[s][cursor[s]]
                idxs[k].append(idx)
                used[idx] = True
                cursor[s] += 1
            if (len(idxs[0]) + 1) * len(chosen) > n_ubatch:
                break
        plan.append(np.array([i for group in idxs for i in group], dtype=np.int64))
    return plan


# ---------------------------------------------------------------------------------------------
# Devices llama.cpp can offload to (ggml's backend registry)
# ---------------------------------------------------------------------------------------------

_DEVICE_KINDS = {1: "gpu", 2: "igpu"}  # enum ggml_backend_dev_type: CPU 0, GPU 1, IGPU 2, ACCEL 3


@dataclass(frozen=True)
class Device:
    """A device the loaded llama.cpp build can offload layers to."""

    name: str  # ggml's device name, e.g. "Vulkan0", "CUDA0", "Metal"
    description: str  # e.g. "NVIDIA GeForce RTX 3060", "llvmpipe (LLVM 15.0.6, 256 bits)"
    backend: str  # the backend, lower case: "vulkan", "cuda", "metal", "rocm" ...
    kind: str  # "gpu" (own memory) or "igpu" (shares host memory)
    free_bytes: int
    total_bytes: int


def offload_devices() -> list[Device]:
    """GPUs (dedicated or integrated) in ggml's registry, with their free memory now; [] on a CPU build."""
    init_backend()
    ggml = ctypes.CDLL(str(_llama_lib_dir() / "libggml.so"))
    base = _ggml_base_lib()
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    for fn in (base.ggml_backend_dev_name, base.ggml_backend_dev_description):
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_char_p
    base.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_memory.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    base.ggml_backend_dev_memory.restype = None
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_name.restype = ctypes.c_char_p
    found = []
    for i in range(int(ggml.ggml_backend_dev_count())):
        dev = ggml.ggml_backend_dev_get(i)
        kind = _DEVICE_KINDS.get(int(base.ggml_backend_dev_type(dev)))
        if dev is None or kind is None:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = base.ggml_backend_dev_backend_reg(dev)
        backend = (base.ggml_backend_reg_name(reg) or b"?").decode().lower() if reg else "?"
        found.append(
            Device(
                name=(base.ggml_backend_dev_name(dev) or b"?").decode(),
                description=(base.ggml_backend_dev_description(dev) or b"").decode(errors="replace")[:200],
                backend=backend,
                kind=kind,
                free_bytes=int(free.value),
                total_bytes=int(total.value),
            )
        )
    return found
