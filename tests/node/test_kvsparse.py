"""Sparse per-sequence KV streams (node/kvsparse.py) on real llama.cpp with the bundled SmolLM2."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from node import kvsparse
from node.llama_runtime import BatchBuffer, ContextSettings, free_model, load_model, new_context
from node.testmodel import test_model_path

pytestmark = pytest.mark.slow  # loads model weights into llama.cpp


def _logits(ctx: ctypes.c_void_p, batch: BatchBuffer, seq: int, tokens: list[int], n_vocab: int) -> bytes:
    n = len(tokens)
    batch.token[:n], batch.pos[:n], batch.seq[:n] = tokens, list(range(n)), [seq] * n
    batch.logits[:n] = 0
    batch.logits[n - 1] = 1
    batch.batch.n_tokens = n
    assert llama_cpp.llama_decode(ctx, batch.batch) == 0
    ptr = llama_cpp.llama_get_logits_ith(ctx, n - 1)
    arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
    return arr.tobytes()


def test_sparse_streams_are_exact_and_release_their_pages() -> None:
    model = load_model(test_model_path())
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        n_layer = llama_cpp.llama_model_n_layer(model)
        head = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
        row = llama_cpp.llama_model_n_head_kv(model) * head * 2
        kv_size = int(llama_cpp.llama_model_n_ctx_train(model))
        geo = kvsparse.KvGeometry(n_layer, row, row, kv_size, 4)
        settings = ContextSettings(n_threads=1, n_seq_max=4, n_ctx=4 * kv_size, kv_unified=False)
        holder: list[ctypes.c_void_p] = []
        _, buf = kvsparse.create_sparse(lambda: holder.append(new_context(model, settings)), geo)
        ctx = holder[0]
        assert buf is not None, "the KV buffer was not found among the new mappings"
        rng = np.random.default_rng(3)
        prompts = [rng.integers(100, 20000, size=n).tolist() for n in (70, 130)]
        batch = BatchBuffer(512, 0)
        batch.use_embeddings(False)
        # Sessions in streams 2 and 3 while the others are empty: bit-identical to each alone.
        pooled = [_logits(ctx, batch, 2 + i, p, n_vocab) for i, p in enumerate(prompts)]
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 3, -1, -1)
        dropped = buf.drop_stream(3)
        # Every layer's K and V slice of stream 3, page-aligned inward.
        assert dropped >= 2 * n_layer * (kv_size * row - 3 * kvsparse.PAGE)
        # A new session in the released stream: as exact as in a fresh buffer.
        again = _logits(ctx, batch, 3, prompts[1], n_vocab)
        llama_cpp.llama_free(ctx)
        for i, p in enumerate(prompts):
            alone = new_context(model, ContextSettings(n_threads=1, n_seq_max=1, n_ctx=1024))
            try:
                ref = _logits(alone, batch, 0, p, n_vocab)
            finally:
                llama_cpp.llama_free(alone)
            assert pooled[i] == ref
            if i == 1:
                assert again == ref
    finally:
        free_model(model)


def test_a_new_mapping_merged_with_an_older_neighbour_is_still_found() -> None:
    """The kernel merges adjacent anonymous mappings of the same flags: only the new part counts."""
    before = {100: 50, 300: 100, 1000: 20}
    now = {100: 50, 250: 150, 500: 10, 990: 30}  # [250, 300) grew onto [300, 400); [990, 1000) onto 1000
    assert sorted(kvsparse.new_ranges(before, now)) == [(250, 50), (500, 10), (990, 10)]
    assert kvsparse.new_ranges(before, before) == []
