"""common.speculation: the n-gram proposer against a brute-force reference, adaptive k, greedy acceptance.

Pure code, so hypothesis drives it directly. The end-to-end property: greedy decoding of a
deterministic "model" with speculation (proposer + controller + accept_greedy) produces exactly the
tokens of plain one-token-at-a-time decoding, whatever the drafts and acceptance pattern.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.speculation import (
    ChoicePolicy,
    DraftPolicy,
    DraftState,
    NgramConfig,
    NgramProposer,
    ProposerChoice,
    accept_greedy,
    draft_budget,
    initial_state,
    observe,
    rollback_position,
    skip,
)

tokens_st = st.lists(st.integers(0, 5), max_size=200)  # a small vocabulary: plenty of repeats


def reference_propose(history: list[int], k: int, cfg: NgramConfig) -> tuple[int, ...]:
    """The longest suffix (max..min) with an earlier occurrence that has a continuation; its latest."""
    if k <= 0:
        return ()
    size = len(history)
    for n in range(min(cfg.max_ngram, size), cfg.min_ngram - 1, -1):
        suffix = history[size - n :]
        for j in range(size - n - 1, -1, -1):  # occurrence [j, j + n) followed by history[j + n]
            if history[j : j + n] == suffix:
                return tuple(history[j + n : j + n + k])
    return ()


@settings(max_examples=300, deadline=None)
@given(tokens_st, st.integers(0, 10), st.integers(1, 3), st.integers(0, 3))
def test_proposal_equals_the_brute_force_reference(history: list[int], k: int, lo: int, extra: int) -> None:
    cfg = NgramConfig(min_ngram=lo, max_ngram=lo + extra, capacity=1000)
    proposer = NgramProposer(cfg)
    for i, token in enumerate(history):
        proposer.extend([token])
        if i % 7 == 0 or i == len(history) - 1:
            assert proposer.propose(k) == reference_propose(history[: i + 1], k, cfg)
    assert proposer.propose(k) == reference_propose(history, k, cfg)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=400), st.integers(1, 8))
def test_history_and_index_stay_bounded(history: list[int], k: int) -> None:
    cfg = NgramConfig(min_ngram=1, max_ngram=4, capacity=32)
    proposer = NgramProposer(cfg)
    for token in history:
        proposer.extend([token])
        assert proposer.kept <= cfg.capacity
        assert proposer.index_size <= (cfg.max_ngram - cfg.min_ngram + 1) * cfg.capacity
    assert proposer.length == len(history)
    # Whatever was forgotten, the proposal is the reference's over the kept tokens.
    kept = history[len(history) - proposer.kept :]
    assert proposer.propose(k) == reference_propose(kept, k, cfg)


@settings(max_examples=200, deadline=None)
@given(tokens_st, st.integers(0, 200), tokens_st, st.integers(1, 8))
def test_truncate_then_extend_equals_a_fresh_history(
    first: list[int], cut: int, rest: list[int], k: int
) -> None:
    cfg = NgramConfig(min_ngram=1, max_ngram=3, capacity=1000)
    rolled = NgramProposer(cfg)
    rolled.extend(first)
    rolled.truncate(cut)
    rolled.extend(rest)
    fresh = NgramProposer(cfg)
    fresh.extend([*first[:cut], *rest])
    assert rolled.length == fresh.length
    assert rolled.propose(k) == fresh.propose(k)


def test_proposes_the_continuation_of_the_prompt() -> None:
    proposer = NgramProposer()
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 12, 13]
    proposer.extend(prompt)
    assert proposer.propose(3) == (14, 15, 16)  # "12 13" was followed by 14 15 16
    proposer.extend([14])
    assert proposer.propose(8) == (15, 16, 17, 20, 21, 12, 13, 14)  # runs into the suffix: fine
    assert NgramProposer().propose(4) == ()
    assert proposer.propose(0) == ()


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramConfig(min_ngram=0)
    with pytest.raises(ValueError):
        NgramConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        NgramConfig(capacity=3)
    with pytest.raises(ValueError):
        DraftPolicy(max_k=0)
    with pytest.raises(ValueError):
        DraftPolicy(max_k=2, start_k=3)
    with pytest.raises(ValueError):
        DraftPolicy(min_pause=8, max_pause=4)
    with pytest.raises(ValueError):
        NgramProposer().truncate(-1)


# --------------------------------------------------------------------------- acceptance


@given(st.lists(st.integers(0, 4), max_size=10), st.data())
def test_greedy_verdict_is_the_agreeing_prefix_plus_the_correction(
    drafts: list[int], data: st.DataObject
) -> None:
    targets = data.draw(st.lists(st.integers(0, 4), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    verdict = accept_greedy(drafts, targets)
    agree = 0
    while agree < len(drafts) and drafts[agree] == targets[agree]:
        agree += 1
    assert verdict.accepted == agree
    assert verdict.tokens == tuple(targets[: agree + 1])
    assert 1 <= len(verdict.tokens) <= len(drafts) + 1
    assert not verdict.end_of_generation


def test_end_of_generation_ends_the_window() -> None:
    eog = {99}.__contains__
    assert accept_greedy([5, 99, 7], [5, 99, 7, 8], eog).tokens == (5, 99)
    assert accept_greedy([5, 99, 7], [5, 99, 7, 8], eog).end_of_generation
    assert accept_greedy([5, 6], [5, 99, 1], eog).tokens == (5, 99)
    assert accept_greedy([5, 6], [5, 99, 1], eog).accepted == 1
    assert accept_greedy([], [99], eog).tokens == (99,)
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def test_rollback_is_bounded_by_the_previous_window() -> None:
    assert rollback_position(10, 10, 0) == 10
    assert rollback_position(12, 10, 3) == 10
    with pytest.raises(ValueError, match="holds only"):
        rollback_position(10, 11, 3)
    with pytest.raises(ValueError, match="more than"):
        rollback_position(15, 10, 3)


# --------------------------------------------------------------------------- adaptive k


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 64), st.floats(0, 1)), max_size=200), st.integers(1, 12))
def test_controller_stays_in_its_bounds(windows: list[tuple[int, float]], max_k: int) -> None:
    policy = DraftPolicy(max_k=max_k, start_k=1, fail_limit=2, min_pause=2, max_pause=64)
    state = initial_state(policy)
    for room, share in windows:
        budget = draft_budget(policy, state, room)
        assert 0 <= budget <= min(max_k, room)
        assert state.pause_left <= policy.max_pause
        if budget == 0:
            state = skip(state)
            continue
        state = observe(policy, state, budget, int(share * budget))
        assert 1 <= state.k <= max_k
    assert state.accepted <= state.drafted


def test_controller_grows_on_success_and_shrinks_on_partial() -> None:
    policy = DraftPolicy(max_k=6, start_k=2)
    state = initial_state(policy)
    for _ in range(10):
        state = observe(policy, state, draft_budget(policy, state, 100), draft_budget(policy, state, 100))
    assert state.k == 6
    state = observe(policy, state, 6, 2)
    assert state.k == 3
    assert state.acceptance == pytest.approx(state.accepted / state.drafted)


@pytest.mark.parametrize("steps", [1000, 10000])
def test_drafts_that_always_fail_back_off_until_they_cost_nothing(steps: int) -> None:
    policy = DraftPolicy(max_k=8, start_k=4, fail_limit=2, min_pause=4, max_pause=256)
    state = initial_state(policy)
    for _ in range(steps):
        budget = draft_budget(policy, state, 100)
        state = observe(policy, state, budget, 0) if budget else skip(state)
    # Windows that carried (useless) drafts: the first fail_limit, one per doubling back-off, then
    # one per max_pause steps.
    bound = policy.fail_limit + math.log2(policy.max_pause / policy.min_pause) + 1 + steps / policy.max_pause
    assert state.windows <= bound + 1
    assert state.windows / steps < 0.02


def test_one_accepted_draft_ends_the_back_off() -> None:
    policy = DraftPolicy(fail_limit=1, min_pause=4, max_pause=64)
    state = observe(policy, initial_state(policy), 4, 0)
    assert state.pause_left == 4 and draft_budget(policy, state, 100) == 0
    for _ in range(4):
        state = skip(state)
    state = observe(policy, state, 1, 0)  # failed again straight after: the next pause doubles
    assert state.pause_left == 8
    for _ in range(8):
        state = skip(state)
    state = observe(policy, state, 1, 1)
    assert state == DraftState(k=2, windows=3, drafted=6, accepted=1)


# --------------------------------------------------------------------------- exactness end to end


def _model(vocab: int, salt: int, history: list[int]) -> int:
    """A deterministic next-token function with repeats (so drafts are sometimes right)."""
    if len(history) >= 3 and (history[-1] + salt) % 3 == 0:
        return history[-3]  # copy from the recent past: n-gram drafts can guess this
    return (history[-1] * 7 + len(history) * salt + 1) % vocab


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 15), min_size=1, max_size=40),
    st.integers(2, 16),
    st.integers(0, 9),
    st.integers(1, 8),
    st.integers(1, 60),
)
def test_speculative_greedy_decoding_equals_plain_decoding(
    prompt: list[int], vocab: int, salt: int, max_k: int, n_new: int
) -> None:
    prompt = [t % vocab for t in prompt]
    plain = list(prompt)
    for _ in range(n_new):
        plain.append(_model(vocab, salt, plain))

    policy = DraftPolicy(max_k=max_k, start_k=1, fail_limit=2, min_pause=2, max_pause=16)
    state = initial_state(policy)
    proposer = NgramProposer(NgramConfig(min_ngram=1, max_ngram=3, capacity=64))
    proposer.extend(prompt)
    history = list(prompt)
    passes = 0
    while len(history) < len(prompt) + n_new:
        room = len(prompt) + n_new - len(history) - 1  # the window's correction is always produced
        drafts = proposer.propose(draft_budget(policy, state, room))
        # The target computes the window [last accepted, drafts...] in one pass.
        window = [*history, *drafts]
        targets = [_model(vocab, salt, window[: len(history) + i]) for i in range(len(drafts) + 1)]
        verdict = accept_greedy(drafts, targets)
        state = observe(policy, state, len(drafts), verdict.accepted) if drafts else skip(state)
        history.extend(verdict.tokens)
        proposer.extend(verdict.tokens)
        passes += 1
    assert history == plain
    assert passes <= n_new


def run_choice(choice: ProposerChoice, passes: int, rates: dict[str, tuple[int, float]]) -> list[str]:
    """``passes`` passes, each arm's pass yielding ``rates[arm]`` = (tokens, seconds)."""
    arms = []
    for _ in range(passes):
        arm = choice.choose()
        arms.append(arm)
        choice.record(arm, *rates[arm])
    return arms


def test_the_choice_probes_both_proposers_then_holds_the_faster() -> None:
    policy = ChoicePolicy(probe_passes=2, hold_passes=5)
    # The model yields 3 tokens a pass but its drafting makes a pass take 0.3 s: 10 tokens/s; n-gram
    # lookup 1.5 tokens in 0.1 s: 15 tokens/s. n-gram wins.
    slow_model = {"model": (3, 0.3), "ngram": (3, 0.2)}
    arms = run_choice(ProposerChoice(policy), 4 + 5 + 4 + 5, slow_model)
    probe = ["model", "model", "ngram", "ngram"]
    assert arms == probe + ["ngram"] * 5 + probe + ["ngram"] * 5
    # Where passes are dear (a WAN), the model's tokens per pass win.
    dear_passes = {"model": (3, 1.05), "ngram": (1, 1.0)}
    arms = run_choice(ProposerChoice(policy), 4 + 5, dear_passes)
    assert arms == probe + ["model"] * 5


def test_the_choice_follows_a_change_at_the_next_probe() -> None:
    choice = ProposerChoice(ChoicePolicy(probe_passes=2, hold_passes=4, decay=0.0))
    run_choice(choice, 4, {"model": (4, 0.1), "ngram": (1, 0.1)})
    assert run_choice(choice, 4, {"model": (1, 1.0), "ngram": (1, 0.1)}) == ["model"] * 4
    # The next probe measures the model slow now: n-gram is held.
    assert run_choice(choice, 4 + 4, {"model": (1, 1.0), "ngram": (1, 0.1)})[4:] == ["ngram"] * 4
    assert choice.rate("ngram") == pytest.approx(10.0)


def test_a_fixed_choice_never_probes_and_bad_measurements_are_ignored() -> None:
    choice = ProposerChoice(fixed="model")
    assert run_choice(choice, 50, {"model": (1, 10.0), "ngram": (9, 0.1)}) == ["model"] * 50
    choice = ProposerChoice()
    choice.record("model", 3, 0.0)
    choice.record("model", -1, 1.0)
    assert choice.rate("model") == 0.0
    with pytest.raises(ValueError):
        ProposerChoice(fixed="oracle")
    with pytest.raises(ValueError):
        ChoicePolicy(decay=1.0)
