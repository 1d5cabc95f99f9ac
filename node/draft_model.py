"""A draft model for speculative decoding at the last stage (``--draft-model``, issue 24).

A small GGUF whose vocabulary is the target's (checked at start: same token count and, token by
token, the same text and attributes -- :func:`vocab_digest`) runs in its own llama.cpp context
(one thread) beside the shard. Each speculating session that drafts with it holds one of
``slots`` sequences of that context; the sequence's KV holds the session's history (prompt and
accepted tokens) plus the drafts of the last window, and before the next proposal the positions
from the first one that differs from the new history on are dropped (``llama_memory_seq_rm``), so
accepted drafts are not computed again. Drafts are the draft model's greedy tokens.

Bounds: ``slots`` sequences (the node's ``speculate_max_sessions``): a session that needs one
while all are held takes the least recently used (its owner starts again from an empty KV the next
time it drafts); ``context_tokens`` positions per sequence: a session whose history is longer
drafts by n-gram lookup instead (:class:`DraftModelProposer`), as a session does while the model
is not available. The context is created when the first session drafts (a stage that is not the
last never creates it).

Not thread-safe: one thread calls it (the node's event loop, from the session machine). Its time
is part of the pass: a window cannot leave before its drafts exist.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from common.logs import event
from common.speculation import NgramProposer
from node.llama_runtime import (
    BatchBuffer,
    ContextSettings,
    LlamaError,
    free_model,
    load_model,
    new_context,
)

log = logging.getLogger("swarm.node.draft")

DRAFT_CONTEXT_TOKENS = 2048  # positions one session's draft sequence holds (history + drafts)
DRAFT_BATCH = 256  # tokens per llama_decode when a session's history is caught up


class DraftModelError(LlamaError):
    """The draft model cannot serve this node: it does not load, or its vocabulary is not the target's."""


def _vocab_entries(model: ctypes.c_void_p) -> tuple[int, list[tuple[bytes, int]]]:
    vocab = llama_cpp.llama_model_get_vocab(model)
    n = int(llama_cpp.llama_vocab_n_tokens(vocab))
    entries = []
    for t in range(n):
        text = llama_cpp.llama_vocab_get_text(vocab, t) or b""
        entries.append((bytes(text), int(llama_cpp.llama_vocab_get_attr(vocab, t))))
    return n, entries


def vocab_digest(model: ctypes.c_void_p) -> str:
    """sha256 over the token count and every token's text and attributes, in id order."""
    n, entries = _vocab_entries(model)
    h = hashlib.sha256(n.to_bytes(8, "little"))
    for text, attr in entries:
        h.update(len(text).to_bytes(4, "little") + text + attr.to_bytes(4, "little", signed=True))
    return h.hexdigest()


def check_same_vocab(draft: ctypes.c_void_p, target: ctypes.c_void_p, draft_path: Path) -> None:
    """Raise :class:`DraftModelError` naming the first difference unless both vocabularies are equal."""
    if vocab_digest(draft) == vocab_digest(target):
        return
    n_draft, d = _vocab_entries(draft)
    n_target, t = _vocab_entries(target)
    if n_draft != n_target:
        detail = f"{n_draft} tokens, the target has {n_target}"
    else:
        i = next(i for i in range(n_draft) if d[i] != t[i])
        detail = f"token {i} is {d[i][0]!r} (attr {d[i][1]}), the target's is {t[i][0]!r} (attr {t[i][1]})"
    raise DraftModelError(
        f"draft model {draft_path}: its vocabulary is not the target model's ({detail}); "
        "a draft model must share the target's tokenizer (e.g. a lower-bit quantization of it)"
    )


class _Slot:
    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.owner: object | None = None
        self.tokens: list[int] = []  # what the sequence's KV holds, position by position
        self.used = 0  # the model's use counter when last used (least recently used goes first)


class DraftModel:
    """The draft model and its context (see the module docstring)."""

    def __init__(
        self,
        path: str | Path,
        target_vocab: Path,
        *,
        slots: int,
        context_tokens: int = DRAFT_CONTEXT_TOKENS,
        threads: int = 1,
    ) -> None:
        if slots < 1 or context_tokens < 64:
            raise ValueError("a draft model needs slots >= 1 and context_tokens >= 64")
        self.path = Path(path).expanduser()
        self.slots = slots
        self.context_tokens = context_tokens
        self.threads = threads
        try:
            self._model: ctypes.c_void_p | None = load_model(self.path)
        except LlamaError as exc:
            raise DraftModelError(f"draft model {self.path}: {exc}") from exc
        try:
            target = load_model(Path(target_vocab), vocab_only=True)
            try:
                check_same_vocab(self._model, target, self.path)
            finally:
                free_model(target)
        except BaseException:
            free_model(self._model)
            self._model = None
            raise
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self._vocab = vocab
        self._ctx: ctypes.c_void_p | None = None
        self._mem: ctypes.c_void_p | None = None
        self._batch: BatchBuffer | None = None
        self._slots = [_Slot(i) for i in range(slots)]
        self._uses = 0
        self.proposals = 0  # proposals made with the model
        self.drafted = 0  # tokens it drafted
        self.decoded = 0  # positions it computed (history caught up and drafts)
        self.steals = 0  # sequences taken from a less recently used session

    # -- the context, lazily ----------------------------------------------------------------------

    def _ensure_context(self) -> None:
        if self._ctx is not None:
            return
        if self._model is None:
            raise DraftModelError("the draft model is closed")
        settings = ContextSettings(
            n_threads=self.threads,
            n_seq_max=self.slots,
            n_ctx=self.slots * self.context_tokens,
            n_batch=DRAFT_BATCH,
            n_ubatch=DRAFT_BATCH,
            kv_unified=False,
        )
        self._ctx = new_context(self._model, settings)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = BatchBuffer(DRAFT_BATCH, 0)
        event(
            log,
            "draft_context_ready",
            path=str(self.path),
            slots=self.slots,
            context_tokens=self.context_tokens,
        )

    def _slot_for(self, owner: object) -> _Slot:
        self._uses += 1
        for slot in self._slots:
            if slot.owner is owner:
                slot.used = self._uses
                return slot
        slot = min(self._slots, key=lambda s: (s.owner is not None, s.used))
        if slot.owner is not None:
            self.steals += 1
        llama_cpp.llama_memory_seq_rm(self._mem, slot.seq, -1, -1)
        slot.owner, slot.tokens, slot.used = owner, [], self._uses
        return slot

    def release(self, owner: object) -> None:
        """Free the sequence ``owner`` holds, if any."""
        for slot in self._slots:
            if slot.owner is owner:
                if self._mem is not None:
                    llama_cpp.llama_memory_seq_rm(self._mem, slot.seq, -1, -1)
                slot.owner, slot.tokens = None, []

    # -- drafting ---------------------------------------------------------------------------------

    def _decode(self, seq: int, start: int, tokens: Sequence[int]) -> None:
        """Compute ``tokens`` at positions ``start``...; logits for the last one only."""
        b = self._batch
        assert b is not None
        n = len(tokens)
        b.token[:n] = tokens
        b.pos[:n] = np.arange(start, start + n, dtype=np.int32)
        b.seq[:n] = seq
        b.logits[:n] = 0
        b.logits[n - 1] = 1
        b.batch.n_tokens = n
        rc = llama_cpp.llama_decode(self._ctx, b.batch)
        if rc != 0:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, start, -1)
            raise DraftModelError(f"the draft model's llama_decode failed with code {rc}")
        self.decoded += n

    def _greedy(self) -> int:
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, -1)
        if not ptr:
            raise DraftModelError("the draft model returned no logits")
        row = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.n_vocab,))))

    def draft(self, owner: object, history: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` greedy tokens of the draft model after ``history`` (the owner's sequence)."""
        if k <= 0 or not history:
            return ()
        if len(history) + k > self.context_tokens:
            raise ValueError(f"{len(history)} tokens and {k} drafts exceed the draft context")
        self._ensure_context()
        slot = self._slot_for(owner)
        kept = slot.tokens
        same = 0
        limit = min(len(kept), len(history) - 1)  # the last history token is computed again: its logits
        while same < limit and kept[same] == history[same]:
            same += 1
        llama_cpp.llama_memory_seq_rm(self._mem, slot.seq, same, -1)
        slot.tokens = kept[:same]
        for off in range(same, len(history), DRAFT_BATCH):
            piece = history[off : off + DRAFT_BATCH]
            self._decode(slot.seq, off, piece)
            slot.tokens.extend(piece)
        drafts: list[int] = []
        while True:
            token = self._greedy()
            drafts.append(token)
            if len(drafts) == k or llama_cpp.llama_vocab_is_eog(self._vocab, token):
                break
            self._decode(slot.seq, len(slot.tokens), [token])
            slot.tokens.append(token)
        self.proposals += 1
        self.drafted += len(drafts)
        return tuple(drafts)

    def proposer(self, fallback: NgramProposer) -> DraftModelProposer:
        return DraftModelProposer(self, fallback)

    def statistics(self) -> dict[str, int]:
        return {
            "proposals": self.proposals,
            "drafted": self.drafted,
            "decoded": self.decoded,
            "steals": self.steals,
        }

    def close(self) -> None:
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
            self._mem = None
        free_model(self._model)
        self._model = None


class DraftModelProposer:
    """One session's proposer with the draft model (:class:`common.speculation.Proposer`).

    It keeps the session's history while it fits the draft context and feeds the n-gram
    ``fallback`` the same tokens; past the context (or if the model fails) it drafts by n-gram
    lookup instead. (Whether a session drafts with the model or with n-gram lookup at all is the
    session's choice: ``node.drafting.SessionDrafter``.)
    """

    def __init__(self, model: DraftModel, fallback: NgramProposer) -> None:
        self.model = model
        self.fallback = fallback
        self._tokens: list[int] = []  # the history's first ``context_tokens`` tokens
        self._length = 0
        self.fallbacks = 0  # proposals made by n-gram lookup instead

    @property
    def length(self) -> int:
        return self._length

    def extend(self, tokens: Sequence[int]) -> None:
        self.fallback.extend(tokens)
        room = self.model.context_tokens - len(self._tokens)
        if room > 0:
            self._tokens.extend(int(t) for t in tokens[:room])
        self._length += len(tokens)

    def truncate(self, length: int) -> None:
        self.fallback.truncate(length)
        if length < self._length:
            self._length = length
            del self._tokens[length:]

    def propose(self, k: int) -> tuple[int, ...]:
        if k <= 0:
            return ()
        if self._length + k <= self.model.context_tokens and self.model._model is not None:
            try:
                return self.model.draft(self, self._tokens, k)
            except DraftModelError as exc:
                log.warning("draft model failed, drafting by n-gram lookup: %s", exc)
        self.fallbacks += 1
        return self.fallback.propose(k)


QUANT_TYPES = {
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q2_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
    "q3_k_s": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_S,
    "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
}


def quantize(source: Path, dest: Path, kind: str = "q4_0", threads: int = 1) -> Path:
    """A lower-bit copy of ``source`` made with llama.cpp's quantizer: a draft model with the target's
    vocabulary (an already quantized source is quantized again)."""
    if kind not in QUANT_TYPES:
        raise ValueError(f"kind must be one of {sorted(QUANT_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[kind]
    params.nthread = threads
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params))
    if rc != 0:
        raise DraftModelError(f"llama.cpp could not quantize {source} to {kind} (code {rc})")
    return dest
