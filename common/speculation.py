"""Speculative decoding's pure parts: draft-free n-gram proposals, adaptive k, greedy acceptance.

No I/O, no clock, no randomness: a gateway or a node (the last stage, where the ring continues)
feeds the session's token history in and asks for drafts; whoever verifies a window applies
:func:`accept_greedy` to the target's greedy tokens at the window's positions.

Terms::

    history    the session's accepted tokens, prompt first (what every stage's KV holds)
    draft      k tokens guessed to follow the history
    window     the last accepted token plus the k drafts: k + 1 positions computed in one pass;
               the target's greedy token after window position i verifies draft i
    accepted   the longest prefix of the drafts the target agrees with (0..k)
    correction the target's own token after the accepted prefix (always produced: a window of k
               drafts yields between 1 and k + 1 tokens, and a window of 0 drafts is a plain step)

Proposer (:class:`NgramProposer`, "prompt lookup"): the longest suffix of the history, from
``max_ngram`` down to ``min_ngram`` tokens, that occurred earlier in the history; the draft is what
followed its most recent earlier occurrence, up to k tokens. Agents, code edits and quoting repeat
the prompt, so these drafts are often right; on novel text they rarely match, and then no draft is
offered at all (the step costs what a plain one costs).

Bounds: the proposer keeps at most ``capacity`` tokens of history and an index of at most
``(max_ngram - min_ngram + 1) * capacity`` n-grams. When the history passes ``capacity`` it keeps
its newest ``capacity // 2`` tokens and rebuilds the index (amortised O(n-gram span) per token).

Adaptive k (:class:`DraftController`): k starts at ``start_k``; a window whose drafts were all
accepted grows it by one (up to ``max_k``); a window accepting ``a < k`` drafts sets it to
``max(1, a + 1)`` (one more than what was right). ``fail_limit`` windows in a row accepting nothing
start a back-off: no drafts for ``pause`` steps, ``pause`` doubling (``min_pause`` to ``max_pause``)
each time a back-off ends with another rejected window, reset by any accepted draft. At the longest
pause one window of failed drafts runs per ``max_pause`` steps, so speculation that keeps failing
costs nothing measurable.

Exactness under greedy decoding needs the target to compute a position inside a (k+1)-row batch
bit for bit like a single-row step; ``max_k`` is where a model's limit goes (docs/performance.md:
SmolLM2 is exact at windows up to 9, Gemma 3 only up to 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

# --------------------------------------------------------------------------- proposer


class Proposer(Protocol):
    """What drafts for one session: it follows the session's history and proposes what comes next.

    :class:`NgramProposer` (draft-free lookup) and the node's draft model
    (``node.draft_model.DraftModelProposer``) are the two kinds.
    """

    @property
    def length(self) -> int:
        """Tokens of history seen in all."""
        ...

    def extend(self, tokens: Sequence[int]) -> None:
        """Append accepted tokens to the history."""
        ...

    def truncate(self, length: int) -> None:
        """Forget the history from ``length`` on (a rollback)."""
        ...

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens guessed to follow the history (none: no guess)."""
        ...


@dataclass(frozen=True)
class NgramConfig:
    """How the n-gram proposer looks (all counts in tokens)."""

    min_ngram: int = 2  # shortest suffix matched (1 matches any repeated token: too eager)
    max_ngram: int = 4  # longest suffix matched; longer matches are tried first
    capacity: int = 8192  # history kept; older tokens are forgotten (see the module docstring)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram <= 16:
            raise ValueError("need 1 <= min_ngram <= max_ngram <= 16")
        if self.capacity < 4 * self.max_ngram:
            raise ValueError("capacity must be at least 4 * max_ngram tokens")


class NgramProposer:
    """Prompt lookup over one session's history, bounded (see the module docstring)."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._tokens: list[int] = []
        # n-gram -> index of the token that followed its most recent occurrence. Only n-grams that
        # have a continuation are in it: the history's own suffix is never its own match.
        self._index: dict[tuple[int, ...], int] = {}
        self._forgotten = 0  # tokens dropped from the front (bounded history)

    @property
    def length(self) -> int:
        """Tokens of history seen in all (kept ones plus forgotten ones)."""
        return self._forgotten + len(self._tokens)

    @property
    def kept(self) -> int:
        return len(self._tokens)

    @property
    def index_size(self) -> int:
        return len(self._index)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append accepted tokens to the history."""
        for token in tokens:
            self._append(int(token))

    def truncate(self, length: int) -> None:
        """Forget the history from ``length`` on (a rollback); rebuilds the index."""
        if length < 0:
            raise ValueError("length must be >= 0")
        if length >= self.length:
            return
        keep = max(0, length - self._forgotten)
        self._forgotten = min(self._forgotten, length)
        self._tokens = self._tokens[:keep]
        self._rebuild()

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return ()
        tokens = self._tokens
        n_kept = len(tokens)
        for n in range(min(self.config.max_ngram, n_kept), self.config.min_ngram - 1, -1):
            follow = self._index.get(tuple(tokens[n_kept - n :]))
            if follow is not None:
                # The continuation may run into the suffix itself (a repeating loop): that is fine.
                return tuple(tokens[follow : follow + k])
        return ()

    def _append(self, token: int) -> None:
        tokens = self._tokens
        i = len(tokens)
        for n in range(self.config.min_ngram, min(self.config.max_ngram, i) + 1):
            self._index[tuple(tokens[i - n : i])] = i
        tokens.append(token)
        if len(tokens) > self.config.capacity:
            drop = len(tokens) - self.config.capacity // 2
            self._forgotten += drop
            self._tokens = tokens[drop:]
            self._rebuild()

    def _rebuild(self) -> None:
        tokens, self._tokens = self._tokens, []
        self._index = {}
        forgotten = self._forgotten
        for token in tokens:
            self._append(token)
        self._forgotten = forgotten


# --------------------------------------------------------------------------- adaptive k


@dataclass(frozen=True)
class DraftPolicy:
    """How many drafts a window carries, and how speculation backs off (see the module docstring)."""

    max_k: int = 8  # the model's exactness limit goes here (a window holds max_k + 1 positions)
    start_k: int = 4
    fail_limit: int = 2  # windows in a row with nothing accepted before a back-off
    min_pause: int = 4  # steps without drafts after the first back-off
    max_pause: int = 256  # the longest back-off

    def __post_init__(self) -> None:
        if not 1 <= self.max_k <= 64:
            raise ValueError("max_k must be in 1..64")
        if not 1 <= self.start_k <= self.max_k:
            raise ValueError("start_k must be in 1..max_k")
        if self.fail_limit < 1 or not 1 <= self.min_pause <= self.max_pause:
            raise ValueError("need fail_limit >= 1 and 1 <= min_pause <= max_pause")


@dataclass(frozen=True)
class DraftState:
    """The controller's state for one request (immutable: :func:`observe` returns a new one)."""

    k: int
    failures: int = 0  # windows in a row that accepted nothing
    pause_left: int = 0  # steps still to run without drafts
    next_pause: int = 0  # length of the next back-off (0: min_pause)
    windows: int = 0  # windows that carried drafts
    drafted: int = 0  # drafts sent in all
    accepted: int = 0  # drafts accepted in all

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def initial_state(policy: DraftPolicy) -> DraftState:
    return DraftState(k=policy.start_k)


def draft_budget(policy: DraftPolicy, state: DraftState, room: int) -> int:
    """Drafts the next window may carry: 0 while backing off; never past ``room`` (KV or max_tokens left)."""
    if state.pause_left > 0:
        return 0
    return max(0, min(state.k, policy.max_k, room))


def skip(state: DraftState) -> DraftState:
    """A step ran without drafts (backing off, or nothing matched): the back-off counts down."""
    if state.pause_left == 0:
        return state
    return _replace(state, pause_left=state.pause_left - 1)


def observe(policy: DraftPolicy, state: DraftState, drafted: int, accepted: int) -> DraftState:
    """A window that carried ``drafted`` drafts came back with ``accepted`` of them accepted."""
    if drafted <= 0:
        return skip(state)
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted {accepted} of {drafted} drafts")
    base = _replace(
        state,
        windows=state.windows + 1,
        drafted=state.drafted + drafted,
        accepted=state.accepted + accepted,
    )
    if accepted == drafted:
        k = min(policy.max_k, max(state.k, drafted) + 1)
        return _replace(base, k=k, failures=0, next_pause=0)
    if accepted > 0:
        return _replace(base, k=max(1, accepted + 1), failures=0, next_pause=0)
    failures = state.failures + 1
    if failures < policy.fail_limit and state.next_pause == 0:
        return _replace(base, k=1, failures=failures)
    # Back off: a window that fails right after a back-off doubles the next one.
    pause = state.next_pause or policy.min_pause
    return _replace(
        base,
        k=1,
        failures=0,
        pause_left=pause,
        next_pause=min(policy.max_pause, pause * 2),
    )


def _replace(state: DraftState, **changes: int) -> DraftState:
    values = {
        "k": state.k,
        "failures": state.failures,
        "pause_left": state.pause_left,
        "next_pause": state.next_pause,
        "windows": state.windows,
        "drafted": state.drafted,
        "accepted": state.accepted,
    }
    values.update(changes)
    return DraftState(**values)


# --------------------------------------------------------------------------- choosing a proposer


@dataclass(frozen=True)
class ChoicePolicy:
    """How :class:`ProposerChoice` compares a costly proposer (a draft model) with a free one (n-gram)."""

    probe_passes: int = 4  # passes each proposer drafts while they are compared
    hold_passes: int = 32  # passes the faster one then drafts before they are compared again
    decay: float = 0.75  # weight of the older measurements at each new one (per proposer)

    def __post_init__(self) -> None:
        if self.probe_passes < 1 or self.hold_passes < 1 or not 0.0 <= self.decay < 1.0:
            raise ValueError("need probe_passes >= 1, hold_passes >= 1 and 0 <= decay < 1")


class ProposerChoice:
    """Which of two proposers drafts the next window, by the tokens per second each one yields.

    A draft model proposes better than n-gram lookup but its time is part of every pass: where a
    pass is cheap (a compute-bound route on loopback) that time can cost more than its extra tokens
    save, where a pass is dear (a WAN) it is small. So the session measures rather than guesses:
    ``probe_passes`` passes with each, then ``hold_passes`` with the one that produced more tokens
    per second (the time from one proposal to the next, drafting included), then both again.
    Pure: the caller measures and reports with :meth:`record`. ``fixed``: always that arm.
    """

    ARMS = ("model", "ngram")

    def __init__(self, policy: ChoicePolicy | None = None, fixed: str | None = None) -> None:
        if fixed is not None and fixed not in self.ARMS:
            raise ValueError(f"fixed must be one of {self.ARMS}")
        self.policy = policy or ChoicePolicy()
        self.fixed = fixed
        self._tokens = dict.fromkeys(self.ARMS, 0.0)
        self._seconds = dict.fromkeys(self.ARMS, 0.0)
        self._plan: list[str] = []
        self.passes = dict.fromkeys(self.ARMS, 0)  # passes each drafted

    def rate(self, arm: str) -> float:
        """Tokens per second measured for ``arm`` (decayed), 0 before any measurement."""
        return self._tokens[arm] / self._seconds[arm] if self._seconds[arm] > 0 else 0.0

    def choose(self) -> str:
        if self.fixed is not None:
            self.passes[self.fixed] += 1
            return self.fixed
        if not self._plan:
            p = self.policy
            measured = all(self._seconds[a] > 0 for a in self.ARMS)
            best = max(self.ARMS, key=self.rate) if measured else self.ARMS[0]
            probe = [a for a in self.ARMS for _ in range(p.probe_passes)]
            self._plan = (probe if not measured else [best] * p.hold_passes + probe)[::-1]
        arm = self._plan.pop()
        self.passes[arm] += 1
        return arm

    def record(self, arm: str, tokens: int, seconds: float) -> None:
        """A pass drafted by ``arm`` produced ``tokens`` tokens in ``seconds`` (drafting included)."""
        if seconds <= 0 or tokens < 0:
            return
        d = self.policy.decay
        self._tokens[arm] = self._tokens[arm] * d + tokens
        self._seconds[arm] = self._seconds[arm] * d + seconds


# --------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class Verdict:
    """What a verified window yields."""

    accepted: int  # drafts accepted (0..k)
    tokens: tuple[int, ...]  # the tokens the window produced, in order (1..k + 1 of them)
    end_of_generation: bool  # the last of ``tokens`` ends the generation


def accept_greedy(
    drafts: Sequence[int], targets: Sequence[int], is_eog: Callable[[int], bool] = lambda _t: False
) -> Verdict:
    """Greedy verification of one window.

    ``targets[i]`` is the target's greedy token after window position i (the last accepted token is
    position 0, draft i sits at position i + 1), so ``len(targets) == len(drafts) + 1``. The drafts
    agreeing with the targets are accepted up to the first disagreement, and the target's token
    there is the correction. An end-of-generation token among them ends the window: nothing after
    it is produced (the positions after it are rejected like a wrong draft).
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"a window of {len(drafts)} drafts needs {len(drafts) + 1} target tokens")
    out: list[int] = []
    accepted = 0
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        out.append(target)
        if is_eog(target):
            return Verdict(accepted + 1, tuple(out), True)
        accepted += 1
    correction = targets[accepted]
    out.append(correction)
    return Verdict(accepted, tuple(out), is_eog(correction))


def rollback_position(kv_len: int, window_start: int, max_rollback: int) -> int:
    """Where a stage truncates its KV before computing a window that starts at ``window_start``.

    A stage holding ``kv_len`` positions receives the next window; its start is the accepted
    history's length, so the positions in ``[window_start, kv_len)`` are the previous window's
    rejected drafts. At most ``max_rollback`` of them may go (the previous window's draft count):
    anything else is a position mismatch, raised as ``ValueError``.
    """
    if window_start > kv_len:
        raise ValueError(f"window starts at {window_start}; the stage holds only {kv_len} positions")
    if kv_len - window_start > max_rollback:
        raise ValueError(
            f"window starts at {window_start}: {kv_len - window_start} positions to drop, "
            f"more than the {max_rollback} drafts of the previous window"
        )
    return window_start
