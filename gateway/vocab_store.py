"""Vocabularies by model fingerprint: fetched once from a node (GetVocab), cached on disk, loaded vocab-only.

The gateway holds no weights. The first request for a model downloads the
metadata-only GGUF from a node that serves it (``proto.vocab.VocabAssembler``
checks order, size and sha256), writes it atomically to
``<data_dir>/vocab/<fingerprint>.gguf`` and loads it with llama.cpp's
``vocab_only`` (``common.vocab.Vocabulary``). A later start finds the file and
skips the download. At most :data:`MAX_LOADED` vocabularies stay loaded.

Tokenizing long prompts runs in a worker thread, one at a time per
vocabulary; the per-token byte table is built once at load so detokenizing
never calls into llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from common import files
from common.vocab import Vocabulary
from gateway.chat_template import TemplateSource, template_source
from gateway.errors import InvalidRequest, UpstreamFailed
from gateway.grpc_bridge import NodeChannels, StreamError
from gateway.routes import StageInfo
from gateway.template_sandbox import TemplateSandbox
from proto.errors import ProtocolError

MAX_LOADED = 8
MAX_VOCAB_BYTES = 64 * 1024 * 1024


@dataclass
class LoadedVocab:
    fingerprint: str
    vocab: Vocabulary
    token_bytes: tuple[bytes, ...]
    template: TemplateSource  # text only: compiled in the sandbox's processes, never here
    n_vocab: int
    eog: frozenset[int]
    limiter: trio.CapacityLimiter
    sandbox: TemplateSandbox | None = None

    async def render_chat(self, messages: Sequence[dict[str, Any]], **extra: Any) -> str:
        """The chat prompt, rendered by the model's template in the sandbox's worker processes
        (time and memory limits, off the event loop); in process only without a sandbox."""
        if self.sandbox is None:
            return self.template.compile().render(messages, **extra)
        return await self.sandbox.render(self.template, messages, **extra)

    async def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return await trio.to_thread.run_sync(
            lambda: self.vocab.tokenize(text, add_special=add_special, parse_special=True),
            limiter=self.limiter,
        )

    def check_ids(self, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.n_vocab]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is outside the vocabulary (size {self.n_vocab})",
                param="prompt",
                code="invalid_value",
            )


def _load(path: Path, fingerprint: str) -> LoadedVocab:
    vocab = Vocabulary(path)
    n = int(vocab.n_vocab)
    pieces = tuple(vocab.token_bytes(t) for t in range(n))
    eog = frozenset(t for t in range(n) if vocab.is_eog(t))
    special = {
        t: vocab.token_bytes(t, special=True).decode("utf-8", "replace")
        for t in (vocab.bos, vocab.eos)
        if 0 <= t < n
    }
    source = template_source(vocab.chat_template, vocab.metadata("general.architecture"))
    template = TemplateSource(source, special.get(vocab.bos, ""), special.get(vocab.eos, ""))
    return LoadedVocab(fingerprint, vocab, pieces, template, n, eog, trio.CapacityLimiter(1))


class VocabStore:
    def __init__(self, cache_dir: Path, channels: NodeChannels, *, timeout_s: float) -> None:
        self._dir = cache_dir
        self._channels = channels
        self._timeout_s = timeout_s
        self._loaded: dict[str, LoadedVocab] = {}
        self._locks: dict[str, trio.Lock] = {}
        self.sandbox = TemplateSandbox()

    def loaded(self) -> dict[str, LoadedVocab]:
        """The vocabularies loaded now, by model fingerprint."""
        return dict(self._loaded)

    def path(self, fingerprint: str) -> Path:
        return self._dir / f"{fingerprint}.gguf"

    async def get(self, fingerprint: str, stages: Sequence[StageInfo]) -> LoadedVocab:
        loaded = self._loaded.get(fingerprint)
        if loaded is not None:
            return loaded
        async with self._locks.setdefault(fingerprint, trio.Lock()):
            loaded = self._loaded.get(fingerprint)
            if loaded is not None:
                return loaded
            path = self.path(fingerprint)
            if not await files.is_file(path):
                data = await self._download(fingerprint, stages)
                await files.write_atomic(path, data)
            loaded = await trio.to_thread.run_sync(_load, path, fingerprint)
            loaded.sandbox = self.sandbox
            await self.sandbox.warm()
            while len(self._loaded) >= MAX_LOADED:
                _, old = self._loaded.popitem()
                old.vocab.close()
            self._loaded[fingerprint] = loaded
            return loaded

    async def _download(self, fingerprint: str, stages: Sequence[StageInfo]) -> bytes:
        sources = [s for s in stages if s.serves_vocab] or list(stages)
        errors: list[str] = []
        for stage in sources:
            try:
                with trio.fail_after(self._timeout_s):
                    return await self._channels.get_vocab(stage.address, fingerprint, MAX_VOCAB_BYTES)
            except (StreamError, ProtocolError, trio.TooSlowError) as err:
                errors.append(f"{stage.node_id[:8]}: {err!r}")
        raise UpstreamFailed(f"no node gave the vocabulary of model {fingerprint[:12]}: {'; '.join(errors)}")

    def close(self) -> None:
        for loaded in self._loaded.values():
            loaded.vocab.close()
        self._loaded.clear()
        self.sandbox.close()
