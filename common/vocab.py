"""Tokenizer and detokenizer from a model's vocabulary, without weights.

Loads a GGUF with ``vocab_only=True`` -- the whole model, or the metadata-only
file a node extracts for gateways (``node.shard.extract_vocab``) -- and
tokenizes exactly like the full model. Used by the gateway (prompts in, text
out) and by tests and benchmarks; the node itself never tokenizes.

Not thread-safe: one thread at a time per :class:`Vocabulary` (the gateway
calls it from a worker thread behind a limiter of one).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp

from common.llama import LlamaError, free_model, load_model


class Vocabulary:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._model: ctypes.c_void_p | None = load_model(self.path, vocab_only=True)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self._vocab))

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise LlamaError("tokenization failed")
        return [int(t) for t in buf[:n]]

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a multi-byte UTF-8 character)."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text (``general.architecture``, ``tokenizer.chat_template``), or None."""
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def chat_template(self) -> str | None:
        return self.metadata("tokenizer.chat_template")

    def close(self) -> None:
        if self._model:
            free_model(self._model)
            self._model = None

    def __enter__(self) -> Vocabulary:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
