"""GetVocab chunking and the runtime-recipe fingerprint."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import errors
from proto.recipe import Recipe
from proto.swarm.v1 import shard_service_pb2
from proto.vocab import VocabAssembler, vocab_chunks

MODEL = "f" * 64


def _assemble(chunks: list[shard_service_pb2.VocabChunk], limit: int = 1 << 20) -> bytes:
    assembler = VocabAssembler(MODEL, max_total_bytes=limit)
    result = None
    for chunk in chunks:
        if result is not None:
            raise AssertionError("chunk after completion accepted")
        result = assembler.add(chunk)
    if result is None:
        raise errors.ChunkSequenceError(f"incomplete: {assembler.missing()}")
    return result


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=3000), chunk_bytes=st.integers(1, 700))
def test_vocab_round_trip(data: bytes, chunk_bytes: int) -> None:
    chunks = list(vocab_chunks(data, model_fingerprint=MODEL, chunk_bytes=chunk_bytes))
    assert all(c.sha256 == hashlib.sha256(data).hexdigest() and c.total_size == len(data) for c in chunks)
    assert _assemble(chunks) == data


def test_vocab_rejections() -> None:
    data = bytes(range(256)) * 8
    chunks = list(vocab_chunks(data, model_fingerprint=MODEL, chunk_bytes=300))
    with pytest.raises(errors.ChunkSequenceError):
        _assemble([chunks[0], *chunks[2:]])
    with pytest.raises(errors.ChunkSequenceError):
        _assemble([chunks[1], chunks[0], *chunks[2:]])
    with pytest.raises(errors.ChunkSequenceError):
        _assemble(chunks[:-1])
    with pytest.raises(errors.TooLargeError):
        _assemble(chunks, limit=len(data) - 1)
    corrupted = [shard_service_pb2.VocabChunk() for _ in chunks]
    for copy, chunk in zip(corrupted, chunks, strict=True):
        copy.CopyFrom(chunk)
    corrupted[2].data = b"\x00" + corrupted[2].data[1:]
    with pytest.raises(errors.ChecksumError):
        _assemble(corrupted)
    with pytest.raises(errors.FingerprintMismatchError):
        VocabAssembler("0" * 64).add(chunks[0])


def test_recipe_fingerprint_is_canonical_and_sensitive() -> None:
    base = Recipe("llama-cpp-python 0.3.36", "A" * 64, "F16", flash_attention=False)
    assert base.fingerprint() == Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", False).fingerprint()
    assert len(base.fingerprint()) == 64
    assert Recipe.from_wire(base.to_wire()) == base and base.to_wire().fingerprint == base.fingerprint()
    variants = [
        Recipe("llama-cpp-python 0.3.37", "a" * 64, "f16", False),
        Recipe("llama-cpp-python 0.3.36", "b" * 64, "f16", False),
        Recipe("llama-cpp-python 0.3.36", "a" * 64, "q8_0", False),
        Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", True),
    ]
    assert len({base.fingerprint(), *(v.fingerprint() for v in variants)}) == 5


def test_the_recipe_names_the_cpu_features_and_keeps_old_fingerprints_without_them() -> None:
    """Another CPU level or build is another recipe (issue 27): compared bit for bit only within one."""
    from proto.recipe import cpu_features_from_system_info

    info = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 0 | FMA = 1 | REPACK = 1 | "
    assert cpu_features_from_system_info(info) == "avx,avx2,fma,repack,sse3,ssse3"
    assert cpu_features_from_system_info("no cpu line") == ""
    base = Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", True)
    avx2 = Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", True, cpu_features="avx,avx2,fma")
    no_avx2 = Recipe("llama-cpp-python 0.3.36", "a" * 64, "f16", True, cpu_features="avx,fma")
    # They compose one route (frames carry one fingerprint) but are compared bit for bit only alike.
    assert base.fingerprint() == avx2.fingerprint() == no_avx2.fingerprint()
    assert len({base.check_fingerprint(), avx2.check_fingerprint(), no_avx2.check_fingerprint()}) == 3
    assert base.check_fingerprint() == base.fingerprint()  # nodes that do not report it: unchanged
    assert Recipe.from_wire(avx2.to_wire()) == avx2 and avx2.to_wire().fingerprint == avx2.fingerprint()
