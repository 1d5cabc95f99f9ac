"""Vocabularies by model fingerprint: fetched once from a node (GetVocab), checked against the model's
own header, cached on disk, loaded vocab-only.

The gateway holds no weights. The first request for a model downloads the
metadata-only GGUF from a node that serves it (``proto.vocab.VocabAssembler``
checks order, size and sha256) and checks it against the model: a node of the
route (or, for a model registered at the tracker, one of its peers) shows the
model's manifest (whose digest must be the fingerprint) and the model file's
header (whose sha256 the manifest holds); every key/value of the vocabulary
must be the header's, and none that shapes tokenizing or prompting may be
missing (``gateway/vocab_check.py``). A vocabulary that fails is refused and
the next node is asked; whichever node served it, the tokenizer and chat
template used are the model's. A registered model whose proof no node can
show is refused; an unregistered one (a private swarm's own file, or fake
nodes in tests) is used unchecked and logged (``vocab_unchecked``).

The checked file is written atomically to
``<data_dir>/vocab/<fingerprint>.checked.gguf`` and loaded with llama.cpp's
``vocab_only`` (``common.vocab.Vocabulary``). A later start finds the file and
skips the download. At most :data:`MAX_LOADED` vocabularies stay loaded.

Tokenizing long prompts runs in a worker thread, one at a time per
vocabulary; the per-token byte table is built once at load so detokenizing
never calls into llama.cpp.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from common import files
from common.logs import event
from common.tracker_client import TrackerClient as Registry
from common.tracker_client import TrackerClientError
from common.vocab import Vocabulary
from gateway.chat_template import TemplateSource, template_source
from gateway.errors import InvalidRequest, UpstreamFailed
from gateway.grpc_bridge import MAX_PROOF_BYTES, NodeChannels, StreamError
from gateway.routes import StageInfo
from gateway.template_sandbox import TemplateSandbox
from gateway.vocab_check import KV, VocabMismatch, check_vocab_against_header, read_kv
from proto.errors import ProtocolError
from proto.manifest import Manifest, ManifestInvalid

MAX_LOADED = 8
MAX_VOCAB_BYTES = 64 * 1024 * 1024
MAX_PROOF_PEERS = 8
# When every node of a route answers UNAVAILABLE (not listening yet, restarting, or an older node
# still writing its vocabulary file), a first request waits for one instead of failing: asked
# again every VOCAB_RETRY_S (doubling to VOCAB_RETRY_MAX_S), at most VOCAB_WAIT_S in all.
VOCAB_WAIT_S = 60.0
VOCAB_RETRY_S = 0.5
VOCAB_RETRY_MAX_S = 4.0
log = logging.getLogger("swarm.gateway.vocab")


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
    architecture: str = ""  # general.architecture (which models batch isolation must cover)

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


def template_of(vocab: Vocabulary) -> TemplateSource:
    """The chat template the gateway renders for this model: the file's own, else its architecture's
    built-in one, with its BOS and EOS texts."""
    n = int(vocab.n_vocab)
    special = {
        t: vocab.token_bytes(t, special=True).decode("utf-8", "replace")
        for t in (vocab.bos, vocab.eos)
        if 0 <= t < n
    }
    source = template_source(vocab.chat_template, vocab.metadata("general.architecture"))
    return TemplateSource(source, special.get(vocab.bos, ""), special.get(vocab.eos, ""))


def _load(path: Path, fingerprint: str) -> LoadedVocab:
    vocab = Vocabulary(path)
    n = int(vocab.n_vocab)
    pieces = tuple(vocab.token_bytes(t) for t in range(n))
    eog = frozenset(t for t in range(n) if vocab.is_eog(t))
    template = template_of(vocab)
    return LoadedVocab(
        fingerprint,
        vocab,
        pieces,
        template,
        n,
        eog,
        trio.CapacityLimiter(1),
        architecture=str(vocab.metadata("general.architecture") or ""),
    )


class VocabStore:
    def __init__(self, cache_dir: Path, channels: NodeChannels, *, timeout_s: float) -> None:
        self._dir = cache_dir
        self._channels = channels
        self._timeout_s = timeout_s
        self._loaded: dict[str, LoadedVocab] = {}
        self._locks: dict[str, trio.Lock] = {}
        self.sandbox = TemplateSandbox()
        # The tracker, when there is one (set by the server): a model registered there needs a proof.
        self.registry: Registry | None = None
        self.refused = 0  # vocabularies refused because they did not match the model's header

    def loaded(self) -> dict[str, LoadedVocab]:
        """The vocabularies loaded now, by model fingerprint."""
        return dict(self._loaded)

    def path(self, fingerprint: str) -> Path:
        # ".checked": written only after the check against the model's header (or for a model
        # nobody could prove, see _proof); files of earlier, unchecked versions are not read.
        return self._dir / f"{fingerprint}.checked.gguf"

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
        """A vocabulary from a stage of the route, checked against the model's own header."""
        peers = await self._registered_peers(fingerprint)
        header = await self._proof(fingerprint, stages, peers)
        sources = [s.address for s in stages if s.serves_vocab] or [s.address for s in stages]
        addresses = list(dict.fromkeys([*sources, *(peers or [])]))
        deadline = trio.current_time() + VOCAB_WAIT_S
        pause = VOCAB_RETRY_S
        while True:
            data, errors, transient = await self._download_once(fingerprint, addresses, header)
            if data is not None:
                return data
            if not transient or trio.current_time() + pause > deadline:
                break
            event(log, "vocab_not_ready", model=fingerprint, retry_in_s=pause, nodes=len(addresses))
            await trio.sleep(pause)
            pause = min(pause * 2, VOCAB_RETRY_MAX_S)
        raise UpstreamFailed(
            f"no node gave the vocabulary of model {fingerprint[:12]}: {'; '.join(errors)}",
            retry_after_s=5 if transient else None,
        )

    async def _download_once(
        self, fingerprint: str, addresses: Sequence[str], header: dict[str, KV] | None
    ) -> tuple[bytes | None, list[str], bool]:
        """One pass over ``addresses``: ``(data, errors, every failure was transient)``."""
        errors: list[str] = []
        transient = True
        for address in addresses:
            try:
                with trio.fail_after(self._timeout_s):
                    data = await self._channels.get_vocab(address, fingerprint, MAX_VOCAB_BYTES)
            except (StreamError, ProtocolError, trio.TooSlowError) as err:
                errors.append(f"{address}: {err!r}")
                transient = transient and isinstance(err, StreamError) and err.transient
                continue
            if header is not None:
                try:
                    compared = check_vocab_against_header(
                        await trio.to_thread.run_sync(read_kv, data), header
                    )
                except VocabMismatch as err:
                    self.refused += 1
                    transient = False
                    errors.append(f"{address}: {err}")
                    event(
                        log,
                        "vocab_refused",
                        level=logging.WARNING,
                        model=fingerprint,
                        address=address,
                        reason=str(err),
                    )
                    continue
                event(log, "vocab_checked", model=fingerprint, address=address, keys=compared)
            return data, errors, transient
        return None, errors, transient and bool(errors)

    async def _registered_peers(self, fingerprint: str) -> list[str] | None:
        """The addresses of nodes serving a registered model (None: not registered, or no tracker)."""
        if self.registry is None:
            return None
        try:
            with trio.fail_after(self._timeout_s):
                entry = await self.registry.registry_model(fingerprint)
        except TrackerClientError as err:
            if err.status == 404:
                return None
            raise UpstreamFailed(f"the tracker's model registry failed: {err}", retry_after_s=5) from err
        except (httpx.HTTPError, trio.TooSlowError) as err:
            raise UpstreamFailed(f"the tracker is unreachable: {err!r}", retry_after_s=5) from err
        return [str(p["address"]) for p in entry.get("peers", []) if p.get("address")][:MAX_PROOF_PEERS]

    async def _proof(
        self, fingerprint: str, stages: Sequence[StageInfo], peers: list[str] | None
    ) -> dict[str, KV] | None:
        """The key/values of the model's header, proven by its manifest; None when no node can show
        them and the model is not registered (a private swarm's own model: used unchecked, logged)."""
        errors: list[str] = []
        for address in dict.fromkeys([*(s.address for s in stages), *(peers or [])]):
            try:
                with trio.fail_after(self._timeout_s):
                    manifest = Manifest.from_bytes(
                        await self._channels.manifest(address, fingerprint), expected_fingerprint=fingerprint
                    )
                    if manifest.header_size > MAX_PROOF_BYTES:
                        raise ManifestInvalid(f"a header of {manifest.header_size} bytes")
                    header = await self._channels.file_bytes(address, fingerprint, 0, manifest.header_size)
            except (StreamError, ProtocolError, ManifestInvalid, trio.TooSlowError) as err:
                errors.append(f"{address}: {err}")
                continue
            if hashlib.sha256(header).hexdigest() != manifest.header_sha256:
                errors.append(f"{address}: header bytes that do not match the manifest")
                continue
            try:
                return await trio.to_thread.run_sync(read_kv, header)
            except VocabMismatch as err:
                errors.append(f"{address}: {err}")
        if peers is not None:
            raise UpstreamFailed(
                f"model {fingerprint[:12]} is registered, but no node showed its manifest and header to "
                f"check its vocabulary against: {'; '.join(errors)[:1000]}"
            )
        event(log, "vocab_unchecked", level=logging.WARNING, model=fingerprint, errors=errors[:4])
        return None

    def close(self) -> None:
        for loaded in self._loaded.values():
            loaded.vocab.close()
        self._loaded.clear()
        self.sandbox.close()
