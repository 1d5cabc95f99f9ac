"""gateway/prompt_plan.py: a request's budget on a route, its refusal, its sampling settings (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import ContextLengthExceeded
from gateway.prompt_plan import SEED_MODULUS, TooLongHere, budget, context_limit, sampling_settings
from gateway.protocol import GenerationRequest


@dataclass(frozen=True)
class Stage:
    max_kv_tokens_per_session: int
    n_ctx_train: int


def request(
    kind: str = "completion", max_tokens: int | None = None, cap: int = 0, **kw: object
) -> GenerationRequest:
    return GenerationRequest(kind=kind, model="m", max_tokens=max_tokens, max_tokens_cap=cap, **kw)  # type: ignore[arg-type]


def test_the_context_is_the_smallest_grant_and_never_past_the_trained_context() -> None:
    assert context_limit([Stage(4096, 8192), Stage(2048, 8192)]) == 2048
    assert context_limit([Stage(32768, 8192), Stage(32768, 8192)]) == 8192  # pooled: the model's own bound
    assert context_limit([Stage(1024, 0)]) == 1024  # a stage that does not say
    assert context_limit([]) == 0


def test_max_tokens_must_fit_with_the_prompt() -> None:
    b = budget(request(max_tokens=10), 90, 100)
    assert (b.max_new, b.kv_budget) == (10, 99)  # the last token is never fed back
    with pytest.raises(TooLongHere) as err:
        budget(request(kind="chat", max_tokens=11), 90, 100)
    assert (err.value.limit, err.value.wanted, err.value.param) == (100, 101, "messages")
    assert isinstance(err.value, ContextLengthExceeded)


def test_without_max_tokens_the_rest_of_the_context_at_most_the_cap() -> None:
    assert budget(request(), 90, 100).max_new == 10
    assert budget(request(cap=4), 90, 100).max_new == 4
    with pytest.raises(TooLongHere) as err:
        budget(request(), 100, 100)
    assert err.value.wanted == 101 and err.value.max_tokens is None


def test_the_refusal_names_the_largest_context_and_what_to_shorten() -> None:
    with pytest.raises(TooLongHere) as err:
        budget(request(kind="chat", max_tokens=50), 3000, 2048)
    refusal = err.value.refusal(8192)
    assert refusal.status == 413 and refusal.max_context_tokens == 8192
    assert "3050 tokens of context (3000 in the messages and 50 for the completion)" in refusal.message
    with pytest.raises(TooLongHere) as err:
        budget(request(), 9000, 8192)
    assert "The prompt has 9000 tokens" in err.value.refusal(8192).message


@given(
    st.integers(1, 5000), st.integers(1, 5000), st.one_of(st.none(), st.integers(1, 5000)), st.integers(0, 64)
)
def test_a_budget_always_fits_the_context(prompt: int, limit: int, max_tokens: int | None, cap: int) -> None:
    try:
        b = budget(request(max_tokens=max_tokens, cap=cap), prompt, limit)
    except TooLongHere as err:
        assert err.wanted > limit
        return
    assert b.max_new >= 1 and prompt + b.max_new <= limit and b.kv_budget == prompt + b.max_new - 1


def test_sampling_seeds_choices_apart_and_asks_for_the_checks_candidates() -> None:
    r = request(n=3, logprobs=True, top_logprobs=2, temperature=0.7)
    first = sampling_settings(
        r, seed=SEED_MODULUS - 1, index=0, grammar="", prompt_tokens=12, check_top_logprobs=5
    )
    second = sampling_settings(
        r, seed=SEED_MODULUS - 1, index=1, grammar="g", prompt_tokens=12, check_top_logprobs=0
    )
    assert (first.seed, second.seed) == (SEED_MODULUS - 1, 0)  # wraps, never out of range
    assert (first.choices, second.choices) == (3, 1)  # choice 0's session forks the others
    assert (first.n_top_logprobs, second.n_top_logprobs) == (5, 2)
    assert first.completion_start == 12 and second.grammar == "g" and first.temperature == 0.7
