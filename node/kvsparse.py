"""Sparse per-sequence KV streams: pages of a llama.cpp KV buffer only where sessions wrote (Linux, CPU).

A per-sequence context (``kv_unified = false``) with ``n_seq_max`` streams, each
as long as the model's trained context, has a large *virtual* KV buffer. llama.cpp
allocates it with ``posix_memalign`` (a fresh anonymous mapping for a buffer this
size) and clears it to zero when the context is made, which would make all of it
resident. An untouched or dropped anonymous page reads back as zero -- exactly
what the clear wrote -- so after creation the buffer's pages are dropped
(``madvise(MADV_DONTNEED)``), and when a session is released (or truncated) the
pages of its stream past its length are dropped again. Correctness never depends
on timing: a dropped page and a cleared page hold the same bytes.

Layout (``llama-kv-cache.cpp``, pinned build): for each layer a K tensor then a
V tensor, each ``[row, kv_size, n_stream]`` contiguous, so stream ``s`` of a
tensor is one slice of ``kv_size * row`` bytes. Ranges are page-aligned inward
(a page shared by two streams stays resident: at most two pages per tensor and
stream). The buffer is found as the new anonymous mapping of the expected size
in ``/proc/self/maps`` across context creation (a range that was not mapped before, also
where the kernel merged it with an adjacent older mapping). Where the kernel merged it with
another *new* mapping (an allocation made during creation just before or after it, before the
dropper thread saw it alone: a race a loaded machine loses), the new range is longer than the
buffer; the buffer is then found inside it by glibc's header of an mmapped chunk (the
mapping's length with ``IS_MMAPPED`` in the second word of its first page), read through
``/proc/self/mem`` so that a range unmapped meanwhile is an error, never a crash. If nothing
matches (another build or C library, an SWA model with two caches, GPU offload),
:func:`create_sparse` returns None for the buffer (nothing is dropped) and the caller falls
back.

A fresh mapping is made sure of first (:func:`mapped_allocations`): glibc maps new memory for a
large request only when no free chunk of its heap is big enough, and a long-lived process (a test
run, a node that made and freed contexts) can hold one -- the buffer then lands inside ``[heap]``,
no new mapping shows up, and CI once saw exactly that. Such chunks are taken and held while the
context is made, so that ggml's request finds none.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

PAGE = 4096
MADV_DONTNEED = 4
MADV_NOHUGEPAGE = 15
TENSOR_ALIGN = 32  # ggml's CPU buffer alignment
IS_MMAPPED = 0x2  # glibc's chunk flag (PREV_INUSE 0x1, NON_MAIN_ARENA 0x4: the size word's other low bits)
# At most this many pages of a merged range are read looking for the buffer's chunk header.
SCAN_PAGES = 1 << 16
# The user pointer of an mmapped malloc chunk, and ggml's own alignment of it, sit within the
# mapping's first page: the slices' absolute offsets are known to within that page.
BASE_SLACK = PAGE

log = logging.getLogger("swarm.engine")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.posix_memalign.restype = ctypes.c_int
_libc.free.argtypes = [ctypes.c_void_p]
_libc.free.restype = None
GGML_ALIGN = 64  # ggml_aligned_malloc's posix_memalign alignment
# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): freeing a mapped
# chunk no larger than this raises the threshold to its size (later requests of that size then go
# to the heap); a larger one changes nothing.
MMAP_THRESHOLD_MAX = 32 << 20
# At most this many heap chunks are taken out of malloc's reach while a context is made.
MAX_HELD_CHUNKS = 64


def _pad(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class KvGeometry:
    """What the KV buffer of a per-sequence context holds."""

    n_layer: int
    k_row_bytes: int  # one cell of one layer's K
    v_row_bytes: int
    kv_size: int  # cells per stream
    n_stream: int

    def tensor_bytes(self, row: int) -> int:
        return _pad(row * self.kv_size * self.n_stream, TENSOR_ALIGN)

    @property
    def buffer_bytes(self) -> int:
        return self.n_layer * (self.tensor_bytes(self.k_row_bytes) + self.tensor_bytes(self.v_row_bytes))

    @property
    def bytes_per_position(self) -> int:
        return self.n_layer * (self.k_row_bytes + self.v_row_bytes)

    def stream_ranges(self, stream: int, first_cell: int = 0) -> list[tuple[int, int]]:
        """Byte ranges (offsets from the buffer's start) of cells ``first_cell..kv_size`` of ``stream``."""
        out = []
        off = 0
        for _ in range(self.n_layer):
            for row in (self.k_row_bytes, self.v_row_bytes):
                base = off + stream * self.kv_size * row
                out.append((base + first_cell * row, base + self.kv_size * row))
                off += self.tensor_bytes(row)
        return out


def row_bytes(n_embd_gqa: int, type_size: int, block: int) -> int:
    return n_embd_gqa // block * type_size


def anon_mappings() -> dict[int, int]:
    """Anonymous private read-write mappings of this process: start -> length."""
    out = {}
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) == 5 and parts[1].startswith("rw"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out[lo] = hi - lo
    return out


def _matches(length: int, want: int) -> bool:
    return want <= length <= want + 2 * PAGE


def mmapped_chunk_length(read: Callable[[int, int], bytes], page: int) -> int | None:
    """The length of the mmapped malloc chunk whose mapping starts at ``page`` (glibc keeps it, with
    IS_MMAPPED, in the chunk header's size word), or None when ``page`` does not start one."""
    try:
        head = read(page + 8, 8)
    except OSError:
        return None  # unmapped meanwhile
    if len(head) != 8:
        return None
    (size,) = struct.unpack("<Q", head)
    length = size & ~0x7
    return length if size & 0x7 == IS_MMAPPED and length > 0 and length % PAGE == 0 else None


def locate(lo: int, length: int, want: int, read: Callable[[int, int], bytes]) -> tuple[int, int] | None:
    """Where a buffer of ``want`` bytes lies in the new range ``lo..lo+length``: the whole range when
    its length matches, else the one page (of at most SCAN_PAGES) that starts an mmapped chunk of a
    matching length lying inside the range; None when there is no such page or several."""
    if _matches(length, want):
        return lo, length
    if length < want:
        return None
    hi = lo + length
    hits = []
    for page in range(lo, min(hi - want, lo + SCAN_PAGES * PAGE) + 1, PAGE):
        n = mmapped_chunk_length(read, page)
        if n is not None and _matches(n, want) and page + n <= hi:
            hits.append((page, n))
    return hits[0] if len(hits) == 1 else None


def is_mapped_chunk(ptr: int) -> bool:
    """Whether ``ptr``, a live pointer malloc returned, is an mmapped chunk (glibc's size word, just
    below it, has IS_MMAPPED)."""
    return bool(ctypes.c_uint64.from_address(ptr - 8).value & IS_MMAPPED)


@contextmanager
def mapped_allocations(size: int) -> Iterator[bool]:
    """While inside, an allocation of ``size`` bytes made on this thread (ggml's ``posix_memalign``
    of the KV buffer) is a fresh mapping of its own, not a piece of a free heap chunk.

    glibc serves a large request from a free chunk big enough (or the heap top) before it maps new
    memory. Probes of the same request are made until one comes back mapped: every heap chunk a
    probe got is held (out of reach: it is free memory already, holding it costs nothing resident)
    until the block exits. Yields False when no probe came back mapped (at most
    :data:`MAX_HELD_CHUNKS`, or malloc failed): the caller may still try, and finds no new mapping."""
    held: list[int] = []
    mapped = False
    try:
        for _ in range(MAX_HELD_CHUNKS):
            ptr = ctypes.c_void_p()
            if _libc.posix_memalign(ctypes.byref(ptr), GGML_ALIGN, size) != 0 or not ptr.value:
                break
            if is_mapped_chunk(ptr.value):
                mapped = True
                if size > MMAP_THRESHOLD_MAX:
                    _libc.free(ptr.value)  # no threshold change: no second mapping held meanwhile
                else:
                    held.append(ptr.value)
                break
            held.append(ptr.value)
        yield mapped
    finally:
        for ptr_value in held:
            _libc.free(ptr_value)


class OwnMemory:
    """Reads this process's memory through ``/proc/self/mem``: OSError, not a crash, where nothing is
    mapped (a range may be unmapped by another thread between /proc/self/maps and the read)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/self/mem", os.O_RDONLY)
        except OSError:
            self._fd = None  # no /proc: only a range of the buffer's own length is recognised

    def read(self, addr: int, n: int) -> bytes:
        if self._fd is None:
            raise OSError("/proc/self/mem is not readable")
        return os.pread(self._fd, n, addr)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def new_ranges(before: dict[int, int], now: dict[int, int]) -> list[tuple[int, int]]:
    """Address ranges mapped in ``now`` that were not mapped in ``before`` (start, length).

    The kernel merges a new anonymous mapping with an adjacent one of the same flags, so a new buffer
    may show up as part of a longer mapping that existed before: the old part is subtracted."""
    old = sorted((lo, lo + n) for lo, n in before.items())
    out = []
    for lo, n in now.items():
        if before.get(lo) == n:
            continue  # unchanged
        hi, cur = lo + n, lo
        for blo, bhi in old:
            if bhi <= cur or blo >= hi:
                continue
            if blo > cur:
                out.append((cur, blo - cur))
            cur = max(cur, bhi)
        if cur < hi:
            out.append((cur, hi - cur))
    return out


def madvise(addr: int, length: int, advice: int) -> None:
    if length <= 0:
        return
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice)) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) failed")


class SparseKvBuffer:
    """A found KV buffer: drops the pages of whole streams or of their tails."""

    def __init__(self, start: int, length: int, geometry: KvGeometry) -> None:
        self.start = start
        self.length = length
        self.geometry = geometry

    def drop_all(self) -> None:
        # Never the first page: it holds malloc's chunk header (zeroing it makes free() abort).
        madvise(self.start + PAGE, self.length - PAGE, MADV_DONTNEED)

    def resident_bytes(self) -> int:
        """Bytes of the buffer resident now (the mapping's ``Rss`` in ``/proc/self/smaps``)."""
        head = f"{self.start:x}-"
        with open("/proc/self/smaps") as fh:
            inside = False
            for line in fh:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    inside = line.startswith(head)
                elif inside and line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
        return 0

    def drop_stream(self, stream: int, first_cell: int = 0) -> int:
        """Drop cells ``first_cell..`` of ``stream`` in every layer; returns the bytes dropped."""
        dropped = 0
        for a, b in self.geometry.stream_ranges(stream, first_cell):
            lo = _pad(self.start + BASE_SLACK + a, PAGE)
            hi = (self.start + b) // PAGE * PAGE
            if hi > lo:
                madvise(lo, hi - lo, MADV_DONTNEED)
                dropped += hi - lo
        return dropped


def create_sparse(create: Callable[[], object], geometry: KvGeometry) -> tuple[object, SparseKvBuffer | None]:
    """Run ``create`` (llama.cpp context creation) while a thread keeps dropping the pages of the new
    KV buffer as llama.cpp clears it (zeros either way), so the buffer is never all resident.
    Returns what ``create`` returned and the buffer (None: not found, nothing was dropped)."""
    want = geometry.buffer_bytes
    # Held (see mapped_allocations) until the buffer is located: a held chunk is in ``before``.
    with mapped_allocations(want) as mapped:
        if not mapped:
            log.warning("sparse kv: no fresh mapping could be made sure of for %d bytes", want)
        before = anon_mappings()
        memory = OwnMemory()
        done = threading.Event()
        found: list[tuple[int, int]] = []

        def dropper() -> None:
            while not done.is_set():
                if not found:
                    for lo, n in new_ranges(before, anon_mappings()):
                        hit = locate(lo, n, want, memory.read)
                        if hit is not None:
                            found.append(hit)
                            # Other flags than its neighbours': the kernel splits it off a merged range
                            # and no longer merges it with later ones.
                            madvise(hit[0], hit[1], MADV_NOHUGEPAGE)
                            break
                if found:
                    lo, n = found[0]
                    for off in range(PAGE, n, 64 << 20):  # not the first page: malloc's chunk header
                        madvise(lo + off, min(64 << 20, n - off), MADV_DONTNEED)
                done.wait(0.002)

        thread = threading.Thread(target=dropper, name="kv-page-dropper", daemon=True)
        thread.start()
        try:
            result = create()
        finally:
            done.set()
            thread.join()
        try:
            located = [locate(lo, n, want, memory.read) for lo, n in new_ranges(before, anon_mappings())]
        finally:
            memory.close()
    new = [hit for hit in located if hit is not None]
    if found and found[0] in new:
        new = found[:1]  # seen alone as it was mapped (a later allocation cannot have merged with it)
    if len(new) != 1:
        log.warning(
            "sparse kv: %d candidate buffers of %d bytes among the new mappings %s",
            len(new),
            want,
            [(hex(lo), n) for lo, n in new_ranges(before, anon_mappings()) if n >= want // 2],
        )
        return result, None
    buf = SparseKvBuffer(new[0][0], new[0][1], geometry)
    madvise(buf.start, buf.length, MADV_NOHUGEPAGE)
    buf.drop_all()
    return result, buf


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    vals = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def address_room() -> tuple[int | None, bool]:
    """(address space this process may still map, or None when unbounded; whether the kernel commits
    virtual memory strictly). Bounded by ``RLIMIT_AS`` less what is mapped now, and under the default
    heuristic overcommit by RAM plus swap (the kernel refuses one mapping larger than that)."""
    import resource

    room: int | None = None
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1):
        room = max(0, soft - _status_kib("VmSize") * 1024)
    mode = "0"
    try:
        with open("/proc/sys/vm/overcommit_memory") as fh:
            mode = fh.read().strip()
    except OSError:
        pass
    if mode == "0":
        ram = (_meminfo_kib("MemTotal") + _meminfo_kib("SwapTotal")) * 1024
        if ram > 0:
            room = ram if room is None else min(room, ram)
    return room, mode == "2"


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _meminfo_kib(key: str) -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
