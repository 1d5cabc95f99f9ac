"""A session's drafter with two proposers (node/drafting.py, pure): which one drafts, and their
separate back-offs. The draft model is stood in for by a proposer that always proposes the same
tokens (the real one: tests/node/test_draft_model.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from common.speculation import NgramProposer
from node.drafting import SessionDrafter, proposer_choice


class FixedProposer:
    """Follows the history like the draft model's proposer (feeding the n-gram one it wraps) and
    always proposes ``drafts``."""

    def __init__(self, ngram: NgramProposer, drafts: tuple[int, ...]) -> None:
        self.ngram = ngram
        self.drafts = drafts
        self.calls = 0

    @property
    def length(self) -> int:
        return self.ngram.length

    def extend(self, tokens: Sequence[int]) -> None:
        self.ngram.extend(tokens)

    def truncate(self, length: int) -> None:
        self.ngram.truncate(length)

    def propose(self, k: int) -> tuple[int, ...]:
        self.calls += 1
        return self.drafts[:k]


def drafter_with(choice: str) -> tuple[SessionDrafter, list[FixedProposer]]:
    made: list[FixedProposer] = []

    def factory(ngram: NgramProposer) -> FixedProposer:
        made.append(FixedProposer(ngram, (7, 8, 9)))
        return made[-1]

    return SessionDrafter(4, factory, proposer_choice(choice)), made


LOOP = [1, 2, 3] * 4  # n-gram lookup always finds a continuation here


def test_failing_ngram_windows_do_not_pause_the_model() -> None:
    drafter, (model,) = drafter_with("auto")
    history = list(LOOP)
    arms = []
    for i in range(16):  # the node's probe: 8 passes each
        calls = model.calls
        drafts = drafter.drafts(history, [], history[i % 3], room=50, now=float(i))
        arms.append("model" if model.calls > calls else "ngram")
        drafter.observe(len(drafts), 0 if arms[-1] == "ngram" else len(drafts))
        history.append(history[i % 3])
    assert arms == ["model"] * 8 + ["ngram"] * 8
    ngram = drafter.states["ngram"]
    assert ngram.accepted == 0 and ngram.next_pause > 0  # n-gram's windows failed: it backed off
    assert drafter.states["model"].pause_left == 0 and drafter.states["model"].accepted > 0


def test_always_drafts_with_the_model_and_without_times_nothing_is_measured() -> None:
    drafter, (model,) = drafter_with("always")
    history = list(LOOP)
    for _ in range(20):
        drafts = drafter.drafts(history, [], 4, room=50)  # no times: nothing measured
        assert drafts and drafts == (7, 8, 9)[: len(drafts)]
        drafter.observe(len(drafts), len(drafts))
        history += [4, *drafts]
    assert model.calls == 20
    assert drafter.choice is not None and drafter.choice.passes == {"model": 20, "ngram": 0}
    assert drafter.choice.rate("model") == 0.0
    with pytest.raises(ValueError, match="choice must be one of"):
        proposer_choice("sometimes")


def test_without_a_draft_model_only_ngram_drafts() -> None:
    drafter = SessionDrafter(4)
    assert drafter.choice is None and drafter.proposer is drafter.ngram
    assert drafter.drafts(LOOP, [], 1, room=50, now=0.0) == (2, 3, 1)


def test_sessions_share_the_nodes_measurements() -> None:
    """A second session starts with what the first measured: no probe of its own."""
    choice = proposer_choice("auto")
    made: list[FixedProposer] = []

    def factory(ngram: NgramProposer) -> FixedProposer:
        made.append(FixedProposer(ngram, (7, 8, 9)))
        return made[-1]

    first = SessionDrafter(4, factory, choice)
    history, now = list(LOOP), 0.0
    for _ in range(16):  # the probe: model passes yield 4 tokens a second, n-gram passes 1 token in 0.1 s
        calls = made[0].calls
        drafts = first.drafts(history, [], 4, room=500, now=now)
        drafted_by_model = made[0].calls > calls
        first.observe(len(drafts), len(drafts) if drafted_by_model else 0)
        history += [4, *drafts] if drafted_by_model else [4]
        now += 1.0 if drafted_by_model else 0.1
    second = SessionDrafter(4, factory, choice)
    second.drafts(list(LOOP), [], 1, room=500, now=now)
    assert second.arm == "ngram" and made[1].calls == 0
