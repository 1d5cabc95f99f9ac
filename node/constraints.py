"""Grammar-constrained sampling on the last stage, with llguidance.

A session opened with ``SamplingParams.grammar`` (llguidance's Lark syntax;
JSON schemas embedded as ``%json{...}``, built by ``gateway/structured.py``)
gets a :class:`GrammarConstraint`: before each draw it tells
:func:`node.sampling.sample` which tokens keep the grammar satisfiable, and
once the grammar is complete only end-of-generation tokens remain.

State is a function of the token history, never of what happened on this node:
:meth:`GrammarConstraint.allowed` is handed the completion tokens so far and
brings its matcher to exactly that sequence (consuming what is new, rolling back
or restarting when the history was cut, e.g. by a re-attach), so a replacement
last stage that replays the history draws the same tokens.

Closing in time. A grammar does not know ``max_tokens``: a small model can
keep a JSON string or array going until the budget ends, and the client gets
JSON cut in the middle. So once the tokens left (the session's KV budget minus
the position) come within a few of what the JSON still needs to be closed
(:class:`JsonScan`: open strings, keys waiting for a value, open brackets), the
allowed set is narrowed to the tokens the grammar allows that bring the JSON
strictly closer to closed (quotes, brackets, a short value), or end the
generation. This is a function of the history and the budget only, so it
replays too. It cannot help when the schema forbids closing (a required
property still missing): then the grammar alone decides.

Costs: the tokenizer (the token byte strings of the vocabulary, built once per
engine from llama.cpp's vocabulary: about a second for 50 000 tokens) and one
matcher per constrained session (milliseconds for a JSON schema); a mask costs
tens to hundreds of microseconds per token (``sim/bench_constrained.py``
measures it). Bounds: llguidance's own parser limits (``LLParserLimits``) cap
the work of building a grammar and of each mask.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import llama_cpp
import llguidance
import numpy as np
import numpy.typing as npt
from llguidance import LLTokenizer
from llguidance.llamacpp import lltokenizer_from_vocab

log = logging.getLogger("swarm.node.constraints")

__all__ = ["ConstraintError", "GrammarConstraint", "JsonScan", "LLTokenizer", "Pieces", "tokenizer_for"]


class ConstraintError(ValueError):
    """The grammar cannot be used (llguidance refused it)."""


# Tokens kept in hand for what a grammar forces after the JSON (a tool call's closing tag, the end token).
CLOSING_MARGIN = 8
_CLOSERS = frozenset('"}],:0123456789.- \n')


class JsonScan:
    """How many characters the JSON text seen so far still needs to be closed (an upper bound on tokens).

    Text before the first ``{`` or ``[`` (a tool-call tag, say) is skipped; text after the JSON closed
    costs nothing here (the grammar forces what follows).
    """

    __slots__ = ("stack", "in_str", "esc", "key", "expect", "started", "done")

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.in_str = False
        self.esc = False
        self.key = False
        self.expect = ""
        self.started = False
        self.done = False

    def copy(self) -> JsonScan:
        other = JsonScan()
        other.stack = list(self.stack)
        other.in_str, other.esc, other.key = self.in_str, self.esc, self.key
        other.expect, other.started, other.done = self.expect, self.started, self.done
        return other

    def feed(self, text: str) -> None:
        for c in text:
            if self.done:
                return
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    self.expect = "colon" if self.key else "next"
                continue
            if not self.started:
                if c in "{[":
                    self.started = True
                    self.stack.append(c)
                    self.expect = "key_or_close" if c == "{" else "value_or_close"
                continue
            if c in " \t\r\n":
                if self.expect == "scalar":
                    self.expect = "next"
            elif c in "{[":
                self.stack.append(c)
                self.expect = "key_or_close" if c == "{" else "value_or_close"
            elif c in "}]":
                if self.stack:
                    self.stack.pop()
                self.expect = "next"
                if not self.stack:
                    self.done = True
            elif c == '"':
                self.in_str = True
                self.key = self.expect in ("key", "key_or_close")
            elif c == ":":
                self.expect = "value"
            elif c == ",":
                self.expect = "key" if self.stack and self.stack[-1] == "{" else "value"
            else:
                self.expect = "scalar"

    def cost(self) -> int:
        if self.done or not self.started:
            return 0
        extra = {"value": 1, "key": 4, "colon": 2}.get(self.expect, 0)
        if self.in_str:
            extra = 1 + (3 if self.key else 0)
        return len(self.stack) + extra


class Pieces:
    """Each token's text (for :class:`JsonScan`) and which tokens can close JSON, built once per engine."""

    def __init__(self, tokenizer: LLTokenizer, n_vocab: int, eog: Sequence[int]) -> None:
        self.text = [tokenizer.decode_bytes([t]).decode("utf-8", "replace") for t in range(n_vocab)]
        self.closing = np.array(
            [bool(t) and (set(t) <= _CLOSERS or t.strip() in ("null", "true", "false")) for t in self.text],
            dtype=bool,
        )
        self.eog = np.zeros(n_vocab, dtype=bool)
        self.eog[[t for t in eog if 0 <= t < n_vocab]] = True


def tokenizer_for(vocab: llama_cpp.llama_vocab_p, n_vocab: int, eog: Sequence[int]) -> LLTokenizer:
    """llguidance's view of a llama.cpp vocabulary; every end-of-generation token ends a grammar."""
    eos = list(eog) or [int(llama_cpp.llama_vocab_eos(vocab))]
    with warnings.catch_warnings():  # llguidance reads token attributes through a deprecated alias
        warnings.simplefilter("ignore", DeprecationWarning)
        return lltokenizer_from_vocab(vocab, n_vocab=n_vocab, eos_token=eos)


class GrammarConstraint:
    """One session's grammar (see the module docstring)."""

    def __init__(
        self, tokenizer: LLTokenizer, grammar: str, n_vocab: int, pieces: Pieces | None = None
    ) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"grammar refused: {self._matcher.get_error()}")
        self._pieces = pieces
        self._scan = JsonScan()
        self._consumed: list[int] = []
        self._n_vocab = n_vocab
        self._words = (n_vocab + 31) // 32
        self._bits = np.zeros(self._words, dtype=np.int32)
        self.failed = ""

    def _sync(self, completion: Sequence[int]) -> bool:
        """Bring the matcher to ``completion``; False when the history breaks the grammar."""
        done = self._consumed
        common = 0
        limit = min(len(done), len(completion))
        while common < limit and done[common] == completion[common]:
            common += 1
        if common < len(done):
            back = len(done) - common
            if not self._matcher.rollback(back):
                self._matcher.reset()
                common = 0
            del done[common:]
            self._scan = JsonScan()
            if self._pieces is not None:
                self._scan.feed("".join(self._pieces.text[t] for t in done))
        for token in completion[common:]:
            if not self._matcher.consume_token(int(token)):
                self.failed = self._matcher.get_error() or f"token {token} is not allowed by the grammar"
                return False
            done.append(int(token))
            if self._pieces is not None and 0 <= token < len(self._pieces.text):
                self._scan.feed(self._pieces.text[token])
        return True

    def allowed(
        self, completion: Sequence[int], remaining: int | None = None
    ) -> npt.NDArray[np.bool_] | None:
        """The tokens allowed after ``completion`` with ``remaining`` tokens left to the budget (this one
        included); None (no limit) once the history left the grammar."""
        if self.failed:
            return None
        if not self._sync(completion):
            log.warning("grammar constraint dropped: %s", self.failed)
            return None
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            self.failed = self._matcher.get_error()
            return None
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        mask = bits[: self._n_vocab].astype(bool)
        if remaining is not None and self._pieces is not None:
            mask = self._closing(mask, remaining)
        return mask

    def _closing(self, mask: npt.NDArray[np.bool_], remaining: int) -> npt.NDArray[np.bool_]:
        cost = self._scan.cost()
        if cost == 0 or remaining > cost + CLOSING_MARGIN:
            return mask
        pieces = self._pieces
        assert pieces is not None
        better = mask & pieces.eog
        for t in np.flatnonzero(mask & pieces.closing):
            probe = self._scan.copy()
            probe.feed(pieces.text[t])
            if probe.cost() < cost:
                better[t] = True
        return better if better.any() else mask

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())
