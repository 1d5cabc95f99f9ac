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

__all__ = ["ConstraintError", "GrammarConstraint", "LLTokenizer", "tokenizer_for"]


class ConstraintError(ValueError):
    """The grammar cannot be used (llguidance refused it)."""


def tokenizer_for(vocab: llama_cpp.llama_vocab_p, n_vocab: int, eog: Sequence[int]) -> LLTokenizer:
    """llguidance's view of a llama.cpp vocabulary; every end-of-generation token ends a grammar."""
    eos = list(eog) or [int(llama_cpp.llama_vocab_eos(vocab))]
    with warnings.catch_warnings():  # llguidance reads token attributes through a deprecated alias
        warnings.simplefilter("ignore", DeprecationWarning)
        return lltokenizer_from_vocab(vocab, n_vocab=n_vocab, eos_token=eos)


class GrammarConstraint:
    """One session's grammar (see the module docstring)."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str, n_vocab: int) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"grammar refused: {self._matcher.get_error()}")
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
        for token in completion[common:]:
            if not self._matcher.consume_token(int(token)):
                self.failed = self._matcher.get_error() or f"token {token} is not allowed by the grammar"
                return False
            done.append(int(token))
        return True

    def allowed(self, completion: Sequence[int]) -> npt.NDArray[np.bool_] | None:
        """The tokens allowed after ``completion``; None (no limit) once the history left the grammar."""
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
        return bits[: self._n_vocab].astype(bool)

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())
