"""The whole model in one plain llama.cpp context: the parity reference and the speed baseline.

No shards, no capture, token ids in, logits out -- what llama.cpp does on its
own. Parity tests compare the swarm's stages with it; benchmarks compare the
engine's speed with it. Its context settings must equal the engine's (flash
attention and KV type change low-order bits).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np

from node.llama_runtime import BatchBuffer, ContextSettings, LlamaError, free_model, load_model, new_context


class ReferenceModel:
    def __init__(self, model_path: Path, settings: ContextSettings) -> None:
        self.settings = settings
        self._model: ctypes.c_void_p | None = load_model(model_path)
        self._ctx: ctypes.c_void_p | None = new_context(self._model, settings)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model))
        self._batch = BatchBuffer(settings.n_batch, 0)
        self._batch.use_embeddings(False)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)

    def decode(self, seqs: list[int], positions: list[int], tokens: list[int], outputs: list[bool]) -> None:
        b = self._batch
        n = len(tokens)
        if n > b.capacity:
            raise LlamaError(f"batch of {n} tokens exceeds n_batch {b.capacity}")
        b.token[:n] = tokens
        b.pos[:n] = positions
        b.seq[:n] = seqs
        b.logits[:n] = outputs
        b.batch.n_tokens = n
        rc = llama_cpp.llama_decode(self._ctx, b.batch)
        if rc != 0:
            raise LlamaError(f"llama_decode failed with code {rc}")

    def logits(self, row: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
        return np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        ).copy()

    def prefill(self, tokens: list[int], seq: int = 0, start: int = 0) -> np.ndarray:
        """Feed ``tokens`` (in chunks of n_batch) and return the logits after the last one."""
        step = self._batch.capacity
        for off in range(0, len(tokens), step):
            chunk = tokens[off : off + step]
            last = off + len(chunk) == len(tokens)
            outputs = [False] * len(chunk)
            outputs[-1] = last
            self.decode(
                [seq] * len(chunk), list(range(start + off, start + off + len(chunk))), chunk, outputs
            )
        return self.logits(len(tokens) - 1 - (len(tokens) - 1) // step * step)

    def greedy(self, prompt: list[int], n_new: int, seq: int = 0) -> tuple[list[int], np.ndarray]:
        """Greedy continuation of ``prompt``; also returns the logits after the prompt."""
        first_logits = self.prefill(prompt, seq)
        out = [int(np.argmax(first_logits))]
        pos = len(prompt)
        while len(out) < n_new:
            self.decode([seq], [pos], [out[-1]], [True])
            out.append(int(np.argmax(self.logits(0))))
            pos += 1
        return out, first_logits

    def close(self) -> None:
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            free_model(self._model)
            self._model = None

    def __enter__(self) -> ReferenceModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
