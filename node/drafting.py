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
drafts greedily with the small model and falls back on n-gram lookup past its bounds (on a thread of
its own, drafting the next window ahead: :mod:`node.draft_model`). A request may choose the proposer
(``SamplingParams.proposer``: n-gram lookup, or the draft model for every window); the machine makes
the session's drafter accordingly (``FrameServer._drafter``).

With windows in flight (``speculate_windows_in_flight`` > 1, docs/protocol.md) the proposer also
drafts past the windows still round the ring (:meth:`SessionDrafter.continue_drafts`: it follows
their tokens as if accepted), but only while the last verified window accepted all its drafts; a
rejection makes it forget them again (:meth:`SessionDrafter.forget`).

Bounds: one :class:`SessionDrafter` per speculating session on the last stage; its n-gram proposer
keeps at most ``HISTORY_TOKENS`` tokens and ``2 x HISTORY_TOKENS`` n-grams (n = 2 and 3); the draft
model's own bounds are in :mod:`node.draft_model`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from common.speculation import (
    ChoicePolicy,
    DraftPolicy,
    DraftState,
    NgramConfig,
    NgramProposer,
    Proposer,
    ProposerChoice,
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
# How a session with a draft model picks the proposer of each window (draft_model_choice).
CHOICES = ("auto", "always")
# The node's comparison of the two: measured over all its speculating sessions' passes, since a
# handful of passes of one session decide by chance (a pass yields 1 to k + 1 tokens).
NODE_CHOICE = ChoicePolicy(probe_passes=8, hold_passes=64, decay=0.9)


def proposer_choice(kind: str) -> ProposerChoice:
    """The node's :class:`ProposerChoice` for ``draft_model_choice`` = ``kind``."""
    if kind not in CHOICES:
        raise ValueError(f"choice must be one of {CHOICES}")
    return ProposerChoice(NODE_CHOICE, fixed="model" if kind == "always" else None)


# Makes a session's proposer around its n-gram proposer (the node's draft model, --draft-model:
# node.draft_model.DraftModel.proposer, which falls back on the n-gram one past its bounds).
ProposerFactory = Callable[[NgramProposer], Proposer]


class SessionDrafter:
    """One session's proposers and adaptive k.

    With a draft model (``factory``) the session has two proposers, the model and n-gram lookup,
    and ``choice`` -- the node's, shared by its sessions (:func:`proposer_choice`) -- says which
    drafts each window: the one measured to yield more tokens per second (a pass's tokens over the
    time from one proposal to the next, the machine's clock, drafting included), or always the
    model. Each proposer has its own adaptive k and back-off, so n-gram windows that fail do not
    pause the model's.
    """

    def __init__(
        self, max_drafts: int, factory: ProposerFactory | None = None, choice: ProposerChoice | None = None
    ) -> None:
        self.policy = DraftPolicy(max_k=max_drafts, start_k=min(4, max_drafts))
        self.ngram = NgramProposer(NGRAM)
        # The proposer that follows the history (the model's feeds the n-gram one it wraps).
        self.proposer: Proposer = self.ngram if factory is None else factory(self.ngram)
        self.choice: ProposerChoice | None = None
        self.arm = "ngram"  # the proposer of the last window
        if factory is not None:
            self.choice = choice or proposer_choice("always")
            self.arm = "model"
        self.states = {arm: initial_state(self.policy) for arm in ("model", "ngram")}
        self._last: tuple[str, float, int] | None = None  # arm, when and history length of the last proposal
        # Windows in flight: the last verified window accepted every draft. Only then do further windows
        # follow a head before it is verified (a window after a rejection is itself likely rejected, and
        # on every stage before the last it would delay the head behind it).
        self.last_full = False

    @property
    def state(self) -> DraftState:
        """The adaptive k of the proposer that drafted the last window."""
        return self.states[self.arm]

    def drafts(
        self,
        history: Sequence[int],
        applied: Sequence[int],
        token: int,
        room: int,
        now: float | None = None,
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
        if self.choice is not None:
            length = self.proposer.length
            if self._last is not None and now is not None:
                arm, then, before = self._last
                if length > before:  # a rollback (re-attach) measures nothing
                    self.choice.record(arm, length - before, now - then)
            self.arm = self.choice.choose()
            self._last = None if now is None else (self.arm, now, length)
        state = self.states[self.arm]
        k = draft_budget(self.policy, state, room)
        proposer = self.proposer if self.arm == "model" else self.ngram
        proposed = proposer.propose(k) if k else ()
        if not proposed:
            self.states[self.arm] = skip(state)
        return proposed

    def continue_drafts(self, start: int, tail: Sequence[int], room: int) -> tuple[int, ...]:
        """Windows in flight: tokens to follow ``tail`` -- the windows in flight, from position ``start``
        on -- drafted as if every one of them were accepted; at most ``room``, none while backing off.

        The proposer has followed the accepted history up to ``start`` at least (:meth:`drafts` came
        first); it now follows the tail too (what it saw past ``start`` is an earlier part of the same
        tail). The window carries them all as guesses: the window before it verifies the first one.
        """
        seen = self.proposer.length
        end = start + len(tail)
        if seen < start:
            return ()  # it does not follow the history here: no guess
        if seen > end:
            self.proposer.truncate(end)
            seen = end
        self.proposer.extend(tail[seen - start :])
        k = draft_budget(self.policy, self.states[self.arm], room)
        proposer = self.proposer if self.arm == "model" else self.ngram
        return proposer.propose(k) if k else ()

    def forget(self, length: int) -> None:
        """Windows in flight were discarded: the proposer forgets what it followed from ``length`` on."""
        if self.proposer.length > length:
            self.proposer.truncate(length)

    def observe(self, drafted: int, accepted: int) -> None:
        """The last window (drafted by ``self.arm``) accepted ``accepted`` of its ``drafted`` drafts."""
        self.states[self.arm] = observe(self.policy, self.states[self.arm], drafted, accepted)
        self.last_full = drafted > 0 and accepted == drafted


def verdict(window_tokens: Sequence[int], draws: Sequence[int], eog: Sequence[bool]) -> Verdict:
    """The verdict on a window: ``window_tokens`` = [token, drafts...], ``draws[i]`` the token drawn
    after window position i, ``eog[i]`` whether it ends the generation."""
    if len(draws) != len(window_tokens) or len(eog) != len(draws):
        raise ValueError(f"{len(draws)} draws for a window of {len(window_tokens)} positions")
    ends = {t for t, e in zip(draws, eog, strict=True) if e}
    return accept_greedy(window_tokens[1:], draws, ends.__contains__)
