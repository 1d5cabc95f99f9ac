"""Chunking and reassembly of the metadata-only GGUF served by ``ShardService.GetVocab`` (pure).

The node cuts the file into :class:`VocabChunk` messages that tile
``[0, total_size)`` in offset order; every chunk repeats the total size, the
sha256 of the whole file and the model fingerprint. :class:`VocabAssembler`
accepts chunks only in that order, bounds the total size before buffering
anything, and checks the sha256 at the end.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from proto.errors import (
    BadFrameError,
    ChecksumError,
    ChunkSequenceError,
    FingerprintMismatchError,
    TooLargeError,
)
from proto.swarm.v1 import shard_service_pb2

DEFAULT_VOCAB_CHUNK_BYTES = 1024 * 1024
MAX_VOCAB_CHUNK_BYTES = 3 * 1024 * 1024  # stays under gRPC's 4 MiB default message limit
DEFAULT_MAX_VOCAB_BYTES = 64 * 1024 * 1024  # the test model's file is 1.7 MB; big vocabularies ~10 MB


def vocab_chunks(
    data: bytes, *, model_fingerprint: str, chunk_bytes: int = DEFAULT_VOCAB_CHUNK_BYTES
) -> Iterator[shard_service_pb2.VocabChunk]:
    """The chunks of ``data`` (``chunk_bytes`` is capped to :data:`MAX_VOCAB_CHUNK_BYTES`)."""
    size = min(max(chunk_bytes, 1), MAX_VOCAB_CHUNK_BYTES) if chunk_bytes else DEFAULT_VOCAB_CHUNK_BYTES
    digest = hashlib.sha256(data).hexdigest()
    for offset in range(0, max(len(data), 1), size):
        yield shard_service_pb2.VocabChunk(
            offset=offset,
            data=data[offset : offset + size],
            total_size=len(data),
            sha256=digest,
            model_fingerprint=model_fingerprint,
        )


@dataclass
class VocabAssembler:
    """Receives chunks in order; :meth:`add` returns the verified file after the last one."""

    model_fingerprint: str
    max_total_bytes: int = DEFAULT_MAX_VOCAB_BYTES
    _buffer: bytearray = field(default_factory=bytearray)
    _total: int | None = None
    _sha256: str = ""
    _done: bool = False

    def add(self, chunk: shard_service_pb2.VocabChunk) -> bytes | None:
        if self._done:
            raise ChunkSequenceError("vocabulary chunk after the last one")
        if chunk.model_fingerprint != self.model_fingerprint:
            raise FingerprintMismatchError("vocabulary chunk of another model")
        if self._total is None:
            if chunk.total_size > self.max_total_bytes:
                raise TooLargeError(f"vocabulary of {chunk.total_size} bytes (limit {self.max_total_bytes})")
            if len(chunk.sha256) != 64:
                raise BadFrameError("vocabulary chunk without a sha256")
            self._total, self._sha256 = chunk.total_size, chunk.sha256
        elif (chunk.total_size, chunk.sha256) != (self._total, self._sha256):
            raise ChunkSequenceError("vocabulary chunks disagree on size or sha256")
        if chunk.offset != len(self._buffer):
            raise ChunkSequenceError(
                f"vocabulary chunk at offset {chunk.offset}, expected {len(self._buffer)}"
            )
        if not chunk.data and self._total > 0:
            raise ChunkSequenceError("empty vocabulary chunk")
        if len(self._buffer) + len(chunk.data) > self._total:
            raise ChunkSequenceError("vocabulary chunks pass the announced size")
        self._buffer.extend(chunk.data)
        if len(self._buffer) < self._total:
            return None
        self._done = True
        data = bytes(self._buffer)
        if hashlib.sha256(data).hexdigest() != self._sha256:
            raise ChecksumError("vocabulary sha256 does not match")
        return data

    def missing(self) -> str:
        if self._total is None:
            return "no chunk yet"
        return f"bytes {len(self._buffer)}..{self._total}"
