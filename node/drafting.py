"""The last stage's speculative decoding: drafts for the next window, verdicts on the last one (pure).

The last stage of a ring is where decoding continues, so drafting happens here: after a step it
knows the token history (its KV's token ids, prompt included: every stage passes a step's token
ids on) and the token it just produced, proposes up to k drafts by n-gram lookup
(:mod:`common.speculation`), and pushes the window ``[token, drafts...]`` to the first stage. When
the window comes back through every stage, the engine has drawn a token after each of its
positions -- with the session's own sampler, seeded per position, so a draw is exactly the token a
one-position step would have drawn there -- and :func:`verdict` keeps the longest agreeing prefix
plus the correction. Greedy and seeded sampling are therefore exact alike; grammar-constrained
sessions do not speculate (the grammar's state would have to roll back with rejected drafts).

A node started with a draft model (``draft_model``, :mod:`node.draft_model`) drafts with it instead:
the machine's ``ProposerFactory`` wraps each session's n-gram proposer in the draft model's, which
drafts greedily with the small model and falls back on n-gram lookup past its bounds.

Bounds: one :class:`SessionDrafter` per speculating session on the last stage; its n-gram proposer
keeps at most ``HISTORY_TOKENS`` tokens and ``2 x HISTORY_TOKENS`` n-grams (n = 2 and 3); the draft
model's own bounds are in :mod:`node.draft_model`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from common.speculation import (
    DraftPolicy,
    NgramConfig,
    NgramProposer,
    Proposer,
    Verdict,
    accept_greedy,
    draft_budget,
    initial_state,
    observe,
    skip,
)

HISTORY_TOKENS = 4096  # tokens of history a session's proposer looks at (the newest)
DEFAULT_MAX_DRAFTS = 8
# Most drafts per window where a model's logits at a window position are bit for bit those of a
# one-position step (sim/spec_exactness.py, docs/perf/spec_exactness.json): SmolLM2 (llama) is exact
# at windows of 2-9 positions; Gemma 3 and Qwen2.5-Coder (qwen2) only up to 3 (their logits move from
# the 4th position on: llama.cpp's CPU kernels take another path for 4 rows and more).
EXACT_DRAFTS = {"gemma3": 2, "qwen2": 2}


def max_drafts_for(architecture: str) -> int:
    """Most drafts per window a node of this architecture accepts (OpenSession.speculation is capped)."""
    return EXACT_DRAFTS.get(architecture, DEFAULT_MAX_DRAFTS)


NGRAM = NgramConfig(min_ngram=2, max_ngram=3, capacity=HISTORY_TOKENS)


# Makes a session's proposer around its n-gram proposer (the node's draft model, --draft-model:
# node.draft_model.DraftModel.proposer, which falls back on the n-gram one past its bounds).
ProposerFactory = Callable[[NgramProposer], Proposer]


class SessionDrafter:
    """One session's proposer and adaptive k."""

    def __init__(self, max_drafts: int, factory: ProposerFactory | None = None) -> None:
        self.policy = DraftPolicy(max_k=max_drafts, start_k=min(4, max_drafts))
        self.state = initial_state(self.policy)
        ngram = NgramProposer(NGRAM)
        self.proposer: Proposer = ngram if factory is None else factory(ngram)

    def drafts(
        self, history: Sequence[int], applied: Sequence[int], token: int, room: int
    ) -> tuple[int, ...]:
        """Drafts to follow ``token`` (at position ``len(history) + len(applied)``), at most ``room``.

        ``history`` then ``applied`` are the session's token history (what its KV holds; ``applied``
        the step just computed, not in ``history`` yet). The proposer follows it: tokens it has not
        seen are added, and a history shorter than what it saw (a re-attach truncated the KV) makes
        it forget the rest first. Only the unseen tail is read, so a step costs O(its tokens).
        """
        total = len(history) + len(applied)
        seen = self.proposer.length
        if seen > total:
            self.proposer.truncate(total)
            seen = total
        if seen < len(history):
            self.proposer.extend(history[seen:])
            seen = len(history)
        self.proposer.extend(applied[seen - len(history) :])
        self.proposer.extend([token])
        k = draft_budget(self.policy, self.state, room)
        proposed = self.proposer.propose(k) if k else ()
        if not proposed:
            self.state = skip(self.state)
        return proposed

    def observe(self, drafted: int, accepted: int) -> None:
        self.state = observe(self.policy, self.state, drafted, accepted)


def verdict(window_tokens: Sequence[int], draws: Sequence[int], eog: Sequence[bool]) -> Verdict:
    """The verdict on a window: ``window_tokens`` = [token, drafts...], ``draws[i]`` the token drawn
    after window position i, ``eog[i]`` whether it ends the generation."""
    if len(draws) != len(window_tokens) or len(eog) != len(draws):
        raise ValueError(f"{len(draws)} draws for a window of {len(window_tokens)} positions")
    ends = {t for t, e in zip(draws, eog, strict=True) if e}
    return accept_greedy(window_tokens[1:], draws, ends.__contains__)
