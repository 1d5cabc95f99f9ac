"""The process-wide part of llama.cpp (through llama-cpp-python's ctypes layer) that every service shares.

Starting the backend once per process, routing llama.cpp's own log lines into
``logging`` (logger ``llama.cpp``, whole lines, llama.cpp's level), and loading
or freeing a model. Nodes load whole models or shards; gateways load only
vocabularies (``vocab_only``). Contexts, batches and the capture callback are
the node's business (``node.llama_runtime``).

Invariant: the log callback object lives for the life of the process (llama.cpp
keeps its pointer). No call here is thread-safe against itself; callers run
them on one thread at a time (a worker thread behind a limiter in trio code).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import llama_cpp

llama_log = logging.getLogger("llama.cpp")

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
_LLAMA_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

_backend_ready = False
_log_callback: object = None  # keeps the ctypes callback alive for the life of the process
_log_pending: list[str] = []
_log_level = [logging.INFO]


class LlamaError(RuntimeError):
    """llama.cpp refused a call (a model it cannot load, a tokenization that failed)."""


def _route_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp sends partial lines (continuations have level 5 / CONT); join until a newline.
    try:
        piece = text.decode("utf-8", errors="replace")
    except Exception:  # never let an exception cross back into C
        return
    if level != 5 or not _log_pending:
        _log_level[0] = _LLAMA_LEVELS.get(level, _log_level[0])
    _log_pending.append(piece)
    if not piece.endswith("\n"):
        return
    line = "".join(_log_pending).rstrip()
    _log_pending.clear()
    if line:
        llama_log.log(_log_level[0], line)


def init_backend() -> None:
    """Start llama.cpp's backend once per process and route its output into ``logging``."""
    global _backend_ready, _log_callback
    if _backend_ready:
        return
    _log_callback = llama_cpp.llama_log_callback(_route_log)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _backend_ready = True


def llama_build_info() -> str:
    """What identifies the compute: package version and llama.cpp's system info string."""
    init_backend()
    info = llama_cpp.llama_print_system_info()
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    return f"llama-cpp-python {llama_cpp.__version__}; {text.strip()}"


# How llama.cpp brings a file's weights into memory (``llama_model_params.load_mode``):
# "mmap": map the file (pages shared with the page cache and other processes mapping it);
# "read": read the weights into llama.cpp's own buffers; "direct": the same with O_DIRECT, past the
# page cache. A CPU build repacks some quantized weights (Q4_0, IQ4_NL...) into its own buffers for
# faster kernels: mapped, the file's pages then stay resident beside the repacked copy (measured on a
# Q4_0 shard of 869 MiB: 1 856 MiB resident mapped, 1 010 MiB read).
LOAD_MODES = {
    "mmap": llama_cpp.LLAMA_LOAD_MODE_MMAP,
    "read": llama_cpp.LLAMA_LOAD_MODE_NONE,
    "direct": llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO,
}


def load_model(
    path: Path, *, vocab_only: bool = False, n_gpu_layers: int = 0, load_mode: str = "mmap"
) -> ctypes.c_void_p:
    """Load a GGUF; ``vocab_only`` reads the tokenizer and metadata, no weights; ``load_mode`` one of
    :data:`LOAD_MODES`."""
    if load_mode not in LOAD_MODES:
        raise LlamaError(f"load_mode must be one of {sorted(LOAD_MODES)}, got {load_mode!r}")
    init_backend()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = vocab_only
    params.n_gpu_layers = n_gpu_layers
    params.load_mode = LOAD_MODES[load_mode]
    model: ctypes.c_void_p = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise LlamaError(f"llama.cpp could not load {path} (see the llama.cpp log lines above)")
    return model


def free_model(model: ctypes.c_void_p | None) -> None:
    if model:
        llama_cpp.llama_model_free(model)
