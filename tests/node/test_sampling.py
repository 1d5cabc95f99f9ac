"""Last-stage sampling: pure numpy, deterministic per (seed, position)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.sampling import SamplingError, SamplingParams, log_softmax, sample

RNG = np.random.default_rng(1234)
LOGITS = RNG.normal(0, 3, size=5000).astype(np.float32)


def test_greedy_is_argmax_and_logprob_is_the_models() -> None:
    out = sample(LOGITS, SamplingParams(), position=7)
    assert out.token_id == int(np.argmax(LOGITS))
    assert out.logprob == pytest.approx(float(log_softmax(LOGITS)[out.token_id]))


def test_top_logprobs_are_sorted_and_include_the_best() -> None:
    out = sample(LOGITS, SamplingParams(top_logprobs=5), position=0)
    ids = [t for t, _ in out.top_logprobs]
    lps = [lp for _, lp in out.top_logprobs]
    assert ids[0] == int(np.argmax(LOGITS)) and len(ids) == 5
    assert lps == sorted(lps, reverse=True)
    assert set(ids) == set(np.argsort(-LOGITS)[:5].tolist())


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32), position=st.integers(0, 10_000), temp=st.floats(0.1, 2.0))
def test_same_seed_and_position_draw_the_same_token(seed: int, position: int, temp: float) -> None:
    params = SamplingParams(temperature=temp, top_p=0.9, seed=seed)
    assert sample(LOGITS, params, position).token_id == sample(LOGITS.copy(), params, position).token_id


def test_draws_vary_with_position_and_follow_the_distribution() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    params = SamplingParams(temperature=1.0, seed=42)
    draws = np.bincount([sample(logits, params, p).token_id for p in range(3000)], minlength=3) / 3000
    assert np.allclose(draws, [0.5, 0.3, 0.2], atol=0.04)


def test_top_k_top_p_min_p_restrict_the_candidates() -> None:
    order = np.argsort(-LOGITS)
    for p in range(200):
        assert sample(LOGITS, SamplingParams(temperature=5.0, top_k=3, seed=1), p).token_id in set(
            order[:3].tolist()
        )
    probs = np.exp(log_softmax(LOGITS))
    nucleus = order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1]
    for p in range(200):
        assert sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.5, seed=2), p).token_id in set(
            nucleus.tolist()
        )
    allowed = set(np.flatnonzero(probs >= 0.2 * probs.max()).tolist())
    for p in range(200):
        assert sample(LOGITS, SamplingParams(temperature=1.0, min_p=0.2, seed=3), p).token_id in allowed


def test_repetition_penalty_discourages_recent_tokens() -> None:
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    assert sample(logits, SamplingParams(), 0).token_id == 0
    penalised = sample(logits, SamplingParams(repetition_penalty=1.5), 0, history=np.array([0]))
    assert penalised.token_id == 1
    # The reported logprob stays the model's own.
    assert penalised.logprob == pytest.approx(float(log_softmax(logits)[1]))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=1.0), "min_p"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(top_logprobs=21), "top_logprobs"),
        (SamplingParams(seed=-5), "seed"),
    ],
)
def test_invalid_settings_are_refused(params: SamplingParams, message: str) -> None:
    with pytest.raises(SamplingError, match=message):
        params.validate()
