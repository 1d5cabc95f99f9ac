"""File I/O for trio code: the one place where services hand blocking file work to a thread.

Reading or writing a file blocks the calling thread, and a service's trio
thread must not block, so every such call goes through here and runs in one
of trio's worker threads, at most :data:`MAX_FILE_THREADS` at once per
``trio.run``. Writes are atomic: the data goes to a temporary file in the same
directory (unique per process and call), which is then renamed over the
target, so a reader sees the old file or the new one, never half of one.
A port file (``--port-file``) is written this way once a service listens:
supervisors (sim/procs.py) poll for it, and a partly written port is never
read.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import trio

MAX_FILE_THREADS = 4
T = TypeVar("T")

_limiter: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("swarm_file_limiter")
_serial = itertools.count()


def _file_limiter() -> trio.CapacityLimiter:
    try:
        return _limiter.get()
    except LookupError:
        limiter = trio.CapacityLimiter(MAX_FILE_THREADS)
        _limiter.set(limiter)
        return limiter


async def run_sync(fn: Callable[..., T], *args: object) -> T:
    """Run blocking file work (``fn(*args)``) in a worker thread; cancelling waits for it to finish."""
    return await trio.to_thread.run_sync(fn, *args, limiter=_file_limiter())


def write_atomic_sync(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically (blocking; creates the parent directory)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_serial)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


async def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """:func:`write_atomic_sync` in a worker thread."""
    await run_sync(lambda: write_atomic_sync(path, data, mode=mode))


async def write_port_file(path: str | Path, port: int) -> None:
    """Write ``<port>\\n`` to ``path`` atomically (the readiness signal for supervisors)."""
    await write_atomic(Path(path), f"{port}\n".encode())


async def read_bytes(path: Path) -> bytes:
    return await run_sync(Path(path).read_bytes)


async def is_file(path: Path) -> bool:
    return await run_sync(Path(path).is_file)
