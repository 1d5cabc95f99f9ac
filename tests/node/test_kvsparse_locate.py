"""Finding the sparse KV buffer (node/kvsparse.py) when the kernel merged its mapping with another new one.

llama.cpp's KV buffer is an mmapped malloc chunk; an allocation made during context creation
right before or after it can be placed next to it and merged into one longer mapping before the
page dropper sees it alone (a race a loaded machine loses: CI once did, and the node fell back to
resident streams). These tests run on real memory: glibc's own mmapped chunk, and mappings made
here, read back through /proc/self/mem.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from node import kvsparse
from node.kvsparse import PAGE, OwnMemory, locate, mmapped_chunk_length, new_ranges

WANT = 24 * PAGE + 96  # an odd length, as the buffer's is: the chunk covers it and rounds up to a page


@pytest.fixture()
def memory():
    mem = OwnMemory()
    yield mem
    mem.close()


def _region(n_pages: int) -> tuple[mmap.mmap, int]:
    region = mmap.mmap(-1, n_pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    return region, addr


def _fake_chunk(region: mmap.mmap, page_index: int, length: int) -> None:
    region[page_index * PAGE + 8 : page_index * PAGE + 16] = struct.pack("<Q", length | kvsparse.IS_MMAPPED)


def test_glibc_marks_a_large_aligned_allocation_as_an_mmapped_chunk_of_its_mapping(memory: OwnMemory) -> None:
    libc = ctypes.CDLL(None)
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 20  # above glibc's largest mmap threshold: a mapping of its own where no free chunk fits
    ptr = ctypes.c_void_p()
    with kvsparse.mapped_allocations(size) as made_sure:
        assert made_sure
        before = kvsparse.anon_mappings()
        assert libc.posix_memalign(ctypes.byref(ptr), 64, size) == 0
    try:
        assert kvsparse.is_mapped_chunk(ptr.value or 0)
        page = (ptr.value or 0) // PAGE * PAGE
        length = mmapped_chunk_length(memory.read, page)
        assert length is not None and size <= length <= size + 2 * PAGE
        hits = [locate(lo, n, size, memory.read) for lo, n in new_ranges(before, kvsparse.anon_mappings())]
        assert [h for h in hits if h is not None] == [(page, length)]
    finally:
        libc.free(ptr)


@pytest.mark.parametrize("where", ["bottom", "middle", "top"])
def test_the_buffer_is_found_inside_a_longer_new_range(memory: OwnMemory, where: str) -> None:
    chunk = WANT // PAGE + 1  # pages of the chunk
    first = {"bottom": 0, "middle": 7, "top": 14}[where]
    region, addr = _region(14 + chunk)
    try:
        _fake_chunk(region, first, chunk * PAGE)
        assert locate(addr, len(region), WANT, memory.read) == (addr + first * PAGE, chunk * PAGE)
    finally:
        del addr
        region.close()


def test_no_header_two_headers_or_a_chunk_running_past_the_range_find_nothing(memory: OwnMemory) -> None:
    chunk = WANT // PAGE + 1
    region, addr = _region(10 + chunk)
    try:
        assert locate(addr, len(region), WANT, memory.read) is None  # zeros only
        _fake_chunk(region, 2, chunk * PAGE)
        _fake_chunk(region, 5, chunk * PAGE)
        assert locate(addr, len(region), WANT, memory.read) is None  # ambiguous: never guess
        region[5 * PAGE + 8 : 5 * PAGE + 16] = bytes(8)
        _fake_chunk(region, 9, (chunk + 3) * PAGE)  # too long for the request, and past the range's end
        assert locate(addr, len(region), WANT, memory.read) == (addr + 2 * PAGE, chunk * PAGE)
        region[2 * PAGE + 8 : 2 * PAGE + 16] = struct.pack("<Q", chunk * PAGE | 0x1)  # not IS_MMAPPED
        assert locate(addr, len(region), WANT, memory.read) is None
    finally:
        del addr
        region.close()


def test_a_range_unmapped_meanwhile_reads_as_no_chunk() -> None:
    def gone(addr: int, n: int) -> bytes:
        raise OSError(5, "Input/output error")

    assert mmapped_chunk_length(gone, 0x7F0000000000) is None
    assert locate(0x7F0000000000, WANT + 20 * PAGE, WANT, gone) is None
    assert locate(0x7F0000000000, WANT + PAGE, WANT, gone) == (0x7F0000000000, WANT + PAGE)  # its own length


# A long-lived process's heap with a free chunk big enough for the request (CI's test process had
# one: the KV buffer landed inside [heap] and no new mapping showed up). mallopt is process-wide, so
# this runs in a child of its own.
_FRAGMENTED_HEAP = """
import ctypes, json
from node import kvsparse
libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
M_MMAP_THRESHOLD = -3
SIZE = 64 << 20
def alloc(n):
    p = ctypes.c_void_p()
    assert libc.posix_memalign(ctypes.byref(p), 64, n) == 0
    return p.value
libc.mallopt(M_MMAP_THRESHOLD, 256 << 20)  # large requests from the heap for a moment
big = alloc(2 * SIZE)
guard = alloc(SIZE)  # cut from the heap top right above: freed, the big chunk stays in malloc's bins
libc.free(big)
libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's usual largest threshold again
p = alloc(SIZE)
plain = kvsparse.is_mapped_chunk(p)
libc.free(p)
with kvsparse.mapped_allocations(SIZE) as made_sure:
    q = alloc(SIZE)
    guarded = kvsparse.is_mapped_chunk(q)
    libc.free(q)
print(json.dumps({"plain": plain, "made_sure": made_sure, "guarded": guarded}))
"""


@pytest.mark.slow  # a child process (mallopt would change this one for good)
def test_a_free_heap_chunk_big_enough_is_held_so_the_allocation_is_a_fresh_mapping() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _FRAGMENTED_HEAP], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # without the guard the request is served from the free chunk; inside it, by a new mapping
    assert json.loads(done.stdout) == {"plain": False, "made_sure": True, "guarded": True}
