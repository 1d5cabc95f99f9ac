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

Threads: the draft context is used by one thread only, the model's drafting thread (started with
the first proposal, one per node), fed by a bounded queue (``QUEUE_JOBS``); the node's event loop
only hands it jobs and waits for their tokens, so llama.cpp's passes run beside the loop (they
release the GIL) and the loop's other sessions and I/O go on meanwhile. Look-ahead: when a proposer
has proposed drafts for a window, it at once queues the drafts that would follow them -- the draft
model's guess of the target's next token and ``k + 1`` more -- which the thread computes while the
window travels round the ring. The next proposal takes them where the history turned out as guessed
(every draft accepted and the correction the guessed token: the next head; or a window in flight
drafted after the last one), and otherwise drops them and drafts after the real history (the wait
for those ``k`` passes is still on the ring's path). Drafts never change the text, only how much of
it a window carries (the target verifies every one).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import queue
import threading
import time
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
QUEUE_JOBS = 64  # jobs waiting for the drafting thread (look-aheads past it are not made)
DRAFT_WAIT_S = 30.0  # the longest a proposal waits for the drafting thread


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


class _Job:
    """One request to the drafting thread: up to ``k`` drafts after ``history`` in ``owner``'s sequence
    (``k`` = 0: free the sequence). ``tokens`` grows as the thread drafts them."""

    def __init__(self, owner: object, history: tuple[int, ...], k: int) -> None:
        self.owner = owner
        self.history = history
        self.k = k
        self.tokens: list[int] = []
        self.finished = False
        self.cancelled = False
        self.error: BaseException | None = None


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
        self.lookahead_hits = 0  # proposals taken from a look-ahead
        self.lookahead_misses = 0  # look-aheads dropped (the history went another way)
        self.waited_s = 0.0  # time proposals waited for the drafting thread
        self._queue: queue.Queue[_Job | None] = queue.Queue(QUEUE_JOBS)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

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
        """Free the sequence ``owner`` holds, if any (by the drafting thread)."""
        if self._thread is not None:
            self._put(_Job(owner, (), 0), DRAFT_WAIT_S)

    def _release_now(self, owner: object) -> None:
        for slot in self._slots:
            if slot.owner is owner:
                if self._mem is not None:
                    llama_cpp.llama_memory_seq_rm(self._mem, slot.seq, -1, -1)
                slot.owner, slot.tokens = None, []

    # -- the drafting thread ----------------------------------------------------------------------

    def _put(self, job: _Job, timeout: float | None) -> bool:
        """Queue ``job`` for the drafting thread (started the first time); False if the queue stays full."""
        if self._model is None or self._closing:
            raise DraftModelError("the draft model is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="draft-model", daemon=True)
            self._thread.start()
        try:
            if timeout is None:
                self._queue.put_nowait(job)
            else:
                self._queue.put(job, timeout=timeout)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.k == 0:
                    self._release_now(job.owner)
                elif not job.cancelled:
                    self._draft_now(job)
            except BaseException as exc:  # handed to the waiting proposal
                job.error = exc
            with self._cond:
                job.finished = True
                self._cond.notify_all()

    def _wait(self, job: _Job, count: int) -> None:
        """Wait until ``job`` has ``count`` tokens or has finished (at most ``DRAFT_WAIT_S``)."""
        t0 = time.monotonic()
        deadline = t0 + DRAFT_WAIT_S
        with self._cond:
            while not job.finished and len(job.tokens) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    job.cancelled = True
                    raise DraftModelError(f"the drafting thread gave no drafts within {DRAFT_WAIT_S:.0f} s")
                self._cond.wait(left)
        self.waited_s += time.monotonic() - t0
        if job.error is not None:
            if isinstance(job.error, DraftModelError):
                raise job.error
            raise DraftModelError(f"the drafting thread failed: {job.error}") from job.error

    def settle(self) -> None:
        """Wait until the drafting thread has done every job queued before (look-aheads included)."""
        if self._thread is not None:
            job = _Job(object(), (), 0)
            if not self._put(job, DRAFT_WAIT_S):
                raise DraftModelError("the drafting thread's queue stayed full")
            self._wait(job, 1)  # a job that drafts nothing: until it is done

    def submit(self, owner: object, history: Sequence[int], k: int) -> _Job | None:
        """Queue a look-ahead: up to ``k`` drafts after ``history``; None if the queue is full."""
        if k <= 0 or not history or len(history) + k > self.context_tokens:
            return None
        job = _Job(owner, tuple(history), k)
        return job if self._put(job, None) else None

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
        """Up to ``k`` greedy tokens of the draft model after ``history`` (the owner's sequence),
        drafted by the drafting thread while this one waits."""
        if k <= 0 or not history:
            return ()
        if len(history) + k > self.context_tokens:
            raise ValueError(f"{len(history)} tokens and {k} drafts exceed the draft context")
        job = _Job(owner, tuple(history), k)
        if not self._put(job, DRAFT_WAIT_S):
            raise DraftModelError("the drafting thread's queue stayed full")
        self._wait(job, k)
        return tuple(job.tokens)

    def _draft_now(self, job: _Job) -> None:
        """The drafting thread: draft ``job`` (its tokens published one by one; stops when cancelled)."""
        owner, history, k = job.owner, job.history, job.k
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
        drafts = job.tokens
        while not job.cancelled:
            token = self._greedy()
            with self._cond:
                drafts.append(token)
                self._cond.notify_all()
            if len(drafts) == k or llama_cpp.llama_vocab_is_eog(self._vocab, token):
                break
            self._decode(slot.seq, len(slot.tokens), [token])
            slot.tokens.append(token)
        self.proposals += 1
        self.drafted += len(drafts)

    def proposer(self, fallback: NgramProposer, lookahead: bool = True) -> DraftModelProposer:
        return DraftModelProposer(self, fallback, lookahead)

    def statistics(self) -> dict[str, int]:
        return {
            "proposals": self.proposals,
            "drafted": self.drafted,
            "decoded": self.decoded,
            "steals": self.steals,
            "lookahead_hits": self.lookahead_hits,
            "lookahead_misses": self.lookahead_misses,
            "waited_ms": round(self.waited_s * 1000),
        }

    def close(self) -> None:
        self._closing = True
        if self._thread is not None:
            while True:  # drop what waits, then stop the thread
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.cancelled = True
                    with self._cond:
                        job.finished = True
                        self._cond.notify_all()
            self._queue.put(None)
            self._thread.join(DRAFT_WAIT_S)
            if self._thread.is_alive():
                log.error("the drafting thread did not stop; the draft model is left loaded")
                return
            self._thread = None
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

    def __init__(self, model: DraftModel, fallback: NgramProposer, lookahead: bool = True) -> None:
        self.model = model
        self.fallback = fallback
        self.lookahead = lookahead
        self._ahead: _Job | None = None  # the look-ahead queued after the last proposal
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
                drafts = self._from_lookahead(k)
                if drafts is None:
                    drafts = self.model.draft(self, self._tokens, k)
                if self.lookahead and drafts:
                    # What would follow if every draft is accepted: the target's next token (guessed)
                    # and the k + 1 drafts after it (k may grow by one), drafted while the window travels.
                    self._ahead = self.model.submit(self, [*self._tokens, *drafts], k + 2)
                return drafts
            except DraftModelError as exc:
                log.warning("draft model failed, drafting by n-gram lookup: %s", exc)
        self.fallbacks += 1
        return self.fallback.propose(k)

    def _from_lookahead(self, k: int) -> tuple[int, ...] | None:
        """Drafts from the look-ahead if the history went as it guessed, else None (it is dropped)."""
        job, self._ahead = self._ahead, None
        if job is None:
            return None
        base, history = job.history, self._tokens
        n = len(base)
        extra = len(history) - n
        if extra < 0 or tuple(history[:n]) != base:
            self._miss(job)
            return None
        for i in range(extra + 1):  # the tokens it guessed, one by one: a wrong one ends the wait
            self.model._wait(job, i + 1)
            if len(job.tokens) <= i or (i < extra and job.tokens[i] != history[n + i]):
                self._miss(job)
                return None
        self.model._wait(job, extra + k)
        self.model.lookahead_hits += 1
        return tuple(job.tokens[extra : extra + k])

    def _miss(self, job: _Job) -> None:
        job.cancelled = True
        self.model.lookahead_misses += 1


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
