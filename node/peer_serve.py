"""Serving the bytes of this node's span to nodes that join: the logic behind ``GetTensorBytes``.

A node holds, in its shard files, the exact bytes of the source tensors of
its span (blocks ``start..end-1``, the output norm, the token embeddings for
a first stage, the LM head for a last one), and a copy of the model's header.
:class:`SpanBytes` maps ranges of the *model file* to where those bytes are
on this disk; it is derived from the shard files' own headers and the
model's manifest (a tensor whose size differs from the manifest's, such as a
middle stage's one-row dummy vocabulary, is not served).
:class:`TensorServer` answers requests for such ranges.

Bounds
    One request is at most :data:`MAX_REQUEST_BYTES` (it is read whole and
    sent in chunks of at most :data:`MAX_CHUNK_BYTES`); at most
    ``max_streams`` requests are served at once (more get ``busy``); and the
    bytes sent per second are held under ``bytes_per_s`` by a token bucket
    (0 = no limit). A joining node verifies every tensor against the manifest,
    so a peer is a source like any other, not a trusted one.

Refusals are :class:`PeerRefused` with a gRPC status name; ``node.grpc_server``
maps them to statuses.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from common.files import run_sync
from common.logs import event
from node.manifest import Manifest, read_header_bytes, scan_header
from node.shard import ShardFiles

log = logging.getLogger("swarm.node.peer")
MAX_REQUEST_BYTES = 8 * 1024 * 1024
MAX_CHUNK_BYTES = 1024 * 1024
DEFAULT_CHUNK_BYTES = 1024 * 1024
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class PeerRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # a grpc.StatusCode name


@dataclass(frozen=True)
class Extent:
    source_offset: int  # in the model file
    size: int
    path: Path
    local_offset: int


class SpanBytes:
    """Model-file ranges this node can read from its own files."""

    def __init__(self, extents: list[Extent]) -> None:
        self.extents = sorted(extents, key=lambda e: e.source_offset)
        self._starts = [e.source_offset for e in self.extents]

    @classmethod
    def from_shard(cls, manifest: Manifest, files: ShardFiles, header_file: Path) -> SpanBytes:
        """Blocking: reads the shard files' headers."""
        by_name = manifest.by_name()
        extents = [Extent(0, manifest.header_size, header_file, 0)]
        outputs: list[tuple[Path, bool]] = [(files.path, True)]
        if files.embeddings_path is not None:
            outputs.append((files.embeddings_path, False))
        for path, renumbered in outputs:
            layout = scan_header(read_header_bytes(path))
            for t in layout.tensors:
                name = t.name
                block = _BLOCK_RE.match(name)
                if block and renumbered:
                    name = f"blk.{int(block.group(1)) + files.start}.{block.group(2)}"
                entry = by_name.get(name)
                if entry is None or entry.size != t.size:
                    continue  # e.g. the dummy one-row vocabulary of a middle stage
                extents.append(Extent(entry.offset, entry.size, path, t.offset))
        return cls(extents)

    def locate(self, offset: int, length: int) -> tuple[Path, int] | None:
        """Where ``[offset, offset + length)`` is on this disk, if it lies inside one extent."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return None
        e = self.extents[i]
        if offset + length > e.source_offset + e.size:
            return None
        return e.path, e.local_offset + (offset - e.source_offset)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.extents)


class TokenBucket:
    """At most ``rate`` bytes per second on average, bursts up to ``burst`` bytes."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.clock = clock
        self.stamp = clock()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        while True:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= n or self.tokens >= self.burst:
                self.tokens -= n  # may go negative for n > burst: the next take waits it off
                return
            await trio.sleep((min(n, self.burst) - self.tokens) / self.rate)


@dataclass(frozen=True)
class TensorServerStatistics:
    requests: int
    refused: int
    busy: int
    bytes_sent: int


class TensorServer:
    """Answers ``GetManifest`` and ``GetTensorBytes`` for one model."""

    def __init__(
        self,
        fingerprint: str,
        manifest: Manifest,
        span: SpanBytes,
        *,
        max_streams: int = 4,
        bytes_per_s: float = 0.0,
    ) -> None:
        self.fingerprint = fingerprint
        self.manifest_json = manifest.canonical_bytes()
        self.span = span
        self._slots = trio.Semaphore(max(1, max_streams))
        self._bucket = TokenBucket(bytes_per_s, float(MAX_REQUEST_BYTES))
        self.requests = 0
        self.refused = 0
        self.busy = 0
        self.bytes_sent = 0

    def statistics(self) -> TensorServerStatistics:
        return TensorServerStatistics(self.requests, self.refused, self.busy, self.bytes_sent)

    def _check_model(self, fingerprint: str) -> None:
        if fingerprint != self.fingerprint:
            self.refused += 1
            raise PeerRefused("NOT_FOUND", f"this node serves model {self.fingerprint}, not {fingerprint}")

    def manifest(self, fingerprint: str) -> bytes:
        self._check_model(fingerprint)
        return self.manifest_json

    async def tensor_bytes(self, fingerprint: str, offset: int, length: int, chunk_bytes: int) -> list[bytes]:
        """The chunks (``(offset, data)`` pairs are made by the caller) of one request, in order."""
        self.requests += 1
        self._check_model(fingerprint)
        if not 0 < length <= MAX_REQUEST_BYTES:
            self.refused += 1
            raise PeerRefused(
                "INVALID_ARGUMENT", f"length must be in 1..{MAX_REQUEST_BYTES} bytes, got {length}"
            )
        where = self.span.locate(offset, length)
        if where is None:
            self.refused += 1
            raise PeerRefused(
                "NOT_FOUND", f"bytes {offset}..{offset + length - 1} are not inside a tensor this node holds"
            )
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            self.busy += 1
            raise PeerRefused(
                "RESOURCE_EXHAUSTED", "this node is serving as many fetches as it allows; retry"
            ) from None
        try:
            step = min(MAX_CHUNK_BYTES, chunk_bytes or DEFAULT_CHUNK_BYTES)
            path, local = where
            await self._bucket.take(length)
            data = await run_sync(_pread, path, local, length)
            self.bytes_sent += len(data)
            return [data[i : i + step] for i in range(0, len(data), step)]
        finally:
            self._slots.release()


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < length:
            got = os.pread(fd, length - len(out), offset + len(out))
            if not got:
                raise PeerRefused("DATA_LOSS", f"{path} ended before byte {offset + length}")
            out += got
        return bytes(out)
    finally:
        os.close(fd)


async def build_tensor_server(
    fingerprint: str,
    manifest: Manifest,
    files: ShardFiles,
    header_file: Path,
    *,
    max_streams: int,
    bytes_per_s: float,
) -> TensorServer:
    span = await run_sync(SpanBytes.from_shard, manifest, files, header_file)
    event(
        log, "serving_span_bytes", extents=len(span.extents), bytes=span.total_bytes, bytes_per_s=bytes_per_s
    )
    return TensorServer(fingerprint, manifest, span, max_streams=max_streams, bytes_per_s=bytes_per_s)
