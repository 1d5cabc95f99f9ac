"""logit_bias, frequency/presence penalties, choices and grammars on the last stage (node/sampling.py).

The penalties are checked against a plain-Python reference of OpenAI's documented
formula (``mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence``,
counts over the completion so far); the grammar against llguidance itself on the
real SmolLM2 vocabulary.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import llguidance
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.sampling import SamplingError, SamplingParams, adjusted_logits, sample, sample_choices

RNG = np.random.default_rng(7)
LOGITS = RNG.normal(0, 2, size=300).astype(np.float32)


def reference_adjust(logits: list[float], params: SamplingParams, history: list[int]) -> list[float]:
    """OpenAI's formula, written out token by token (no numpy)."""
    out = [float(x) for x in logits]
    for token, bias in params.logit_bias:
        out[token] += bias
    counts = Counter(history[params.completion_start :])
    for token, c in counts.items():
        out[token] -= c * params.frequency_penalty + (1.0 if c > 0 else 0.0) * params.presence_penalty
    return out


@settings(max_examples=60, deadline=None)
@given(
    freq=st.floats(-2, 2),
    pres=st.floats(-2, 2),
    start=st.integers(0, 20),
    history=st.lists(st.integers(0, 299), max_size=40),
    bias=st.lists(st.tuples(st.integers(0, 299), st.floats(-100, 100)), max_size=5, unique_by=lambda t: t[0]),
)
def test_penalties_and_bias_match_the_reference_formula(
    freq: float, pres: float, start: int, history: list[int], bias: list[tuple[int, float]]
) -> None:
    params = SamplingParams(
        frequency_penalty=freq, presence_penalty=pres, completion_start=start, logit_bias=tuple(bias)
    ).validate()
    got = adjusted_logits(LOGITS, params, np.asarray(history, np.int32))
    want = reference_adjust(LOGITS.tolist(), params, history)
    assert np.allclose(got, want, rtol=0, atol=1e-9)
    # Greedy picks the argmax of the adjusted logits (ties to the lowest id).
    token = sample(LOGITS, params, position=len(history), history=np.asarray(history, np.int32)).token_id
    assert token == int(np.argmax(np.asarray(want)))


def test_presence_penalty_changes_a_repetitive_greedy_choice() -> None:
    logits = np.array([3.0, 2.5, 0.0], np.float32)
    history = np.array([9, 9, 0], np.int32)  # prompt [9, 9], completion [0]
    plain = SamplingParams(completion_start=2)
    assert sample(logits, plain, 3, history).token_id == 0
    penalised = SamplingParams(presence_penalty=1.0, completion_start=2)
    assert sample(logits, penalised, 3, history).token_id == 1
    # The prompt does not count: the same tokens before completion_start change nothing.
    assert sample(logits, SamplingParams(presence_penalty=1.0, completion_start=3), 3, history).token_id == 0


def test_logit_bias_bans_and_forces_tokens() -> None:
    top = int(np.argmax(LOGITS))
    banned = SamplingParams(logit_bias=((top, -100.0),))
    assert sample(LOGITS, banned, 0).token_id != top
    forced = SamplingParams(temperature=1.5, seed=3, logit_bias=((17, 100.0),))
    assert {sample(LOGITS, forced, p).token_id for p in range(50)} == {17}


def test_logprobs_stay_those_of_the_model() -> None:
    params = SamplingParams(logit_bias=((17, 100.0),), top_logprobs=3)
    out = sample(LOGITS, params, 0)
    lse = math.log(float(np.exp(LOGITS.astype(np.float64)).sum()))
    assert out.token_id == 17
    assert out.logprob == pytest.approx(float(LOGITS[17]) - lse, abs=1e-5)
    assert out.top_logprobs[0][0] == int(np.argmax(LOGITS))


def test_choices_equal_separate_draws_with_derived_seeds() -> None:
    params = SamplingParams(temperature=1.2, seed=2**63 - 2, choices=4, completion_start=10)
    drawn = sample_choices(LOGITS, params, 10)
    assert len(drawn) == 4
    for i, token in enumerate(drawn):
        alone = SamplingParams(temperature=1.2, seed=(2**63 - 2 + i) % 2**63, completion_start=10)
        assert token.token_id == sample(LOGITS, alone, 10).token_id
    # Only the first completion token is drawn per choice.
    assert len(sample_choices(LOGITS, params, 11)) == 1


@pytest.mark.parametrize(
    ("params", "what"),
    [
        (SamplingParams(frequency_penalty=2.5), "frequency_penalty"),
        (SamplingParams(presence_penalty=-3), "presence_penalty"),
        (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias"),
        (SamplingParams(choices=0), "choices"),
        (SamplingParams(completion_start=-1), "completion_start"),
    ],
)
def test_out_of_range_controls_are_refused(params: SamplingParams, what: str) -> None:
    with pytest.raises(SamplingError, match=what):
        params.validate()


# --------------------------------------------------------------------------- grammars (llguidance)


@pytest.fixture(scope="module")
def lltokenizer(model_path: Path) -> tuple[object, int, object]:
    from common.vocab import Vocabulary
    from node.constraints import tokenizer_for

    vocab = Vocabulary(model_path)
    ptr = vocab._vocab  # noqa: SLF001 - the test reads the real vocabulary
    n = int(vocab.n_vocab)
    eog = [t for t in range(n) if vocab.is_eog(t)]
    return tokenizer_for(ptr, n, eog), n, vocab


def test_grammar_masks_follow_the_history_and_rebuild_after_a_cut(lltokenizer: tuple) -> None:
    from node.constraints import GrammarConstraint

    tok, n, vocab = lltokenizer
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
        defaults={"whitespace_flexible": False},
    )
    c = GrammarConstraint(tok, grammar, n)
    first = c.allowed([])
    assert first is not None
    allowed_text = {vocab.token_bytes(t) for t in np.flatnonzero(first)}
    assert all(b.startswith(b"{") or b"{".startswith(b) for b in allowed_text if b)
    # Drive it greedily over random logits: the result parses and validates.
    rng = np.random.default_rng(0)
    completion: list[int] = []
    params = SamplingParams(grammar=grammar)
    for _ in range(40):
        logits = rng.normal(0, 1, n).astype(np.float32)
        token = sample(logits, params, len(completion), np.asarray(completion, np.int32), c).token_id
        if vocab.is_eog(token):
            break
        completion.append(token)
    assert json.loads(vocab.detokenize(completion)) in ({"ok": True}, {"ok": False})
    # A replacement (fresh constraint) and a cut history give the same masks as the original.
    fresh = GrammarConstraint(tok, grammar, n)
    cut = completion[:3]
    assert np.array_equal(fresh.allowed(cut), c.allowed(cut))
    assert np.array_equal(fresh.allowed(completion), c.allowed(completion))


@pytest.mark.parametrize(
    ("text", "cost"),
    [
        ("", 0),
        ("<tool_call>\n", 0),
        ("{", 1),
        ('{"a', 5),
        ('{"a"', 3),
        ('{"a": ', 2),
        ('{"a": "x', 2),
        ('{"a": [1, {"b": ', 4),
        ('{"a": 1}', 0),
        ('{"a": "}\\"', 2),
    ],
)
def test_json_scan_counts_what_closing_needs(text: str, cost: int) -> None:
    from node.constraints import JsonScan

    scan = JsonScan()
    scan.feed(text)
    assert scan.cost() == cost


def test_json_closes_before_the_budget_ends(lltokenizer: tuple) -> None:
    """Random logits favour long strings; with 24 tokens of budget the JSON still closes (and parses)."""
    from node.constraints import GrammarConstraint, Pieces

    tok, n, vocab = lltokenizer
    eog = [t for t in range(n) if vocab.is_eog(t)]
    pieces = Pieces(tok, n, eog)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "object"}, defaults={"whitespace_flexible": False}
    )
    rng = np.random.default_rng(5)
    for trial in range(5):
        c = GrammarConstraint(tok, grammar, n, pieces)
        completion: list[int] = []
        budget = 24
        params = SamplingParams(temperature=1.0, seed=trial, grammar=grammar)
        for pos in range(budget):
            logits = rng.normal(0, 1, n).astype(np.float32)
            token = sample(logits, params, pos, np.asarray(completion, np.int32), c, budget - pos).token_id
            if vocab.is_eog(token):
                break
            completion.append(token)
        assert isinstance(json.loads(vocab.detokenize(completion)), dict), vocab.detokenize(completion)
