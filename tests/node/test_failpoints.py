"""Test-only lying (node/failpoints.py): refused without consent, and each lie is the lie it claims."""

from __future__ import annotations

import random

import numpy as np
import pytest

from node.failpoints import CONSENT, CONSENT_ENV, ENV, FailpointError, Failpoints, Liar, from_environment
from node.session_machine import StepOutcome
from proto.codec import Sampled


def test_no_failpoints_no_lies() -> None:
    fp = from_environment({})
    assert not fp.active
    outcome = StepOutcome(1, kv_len=3, hidden=np.ones((2, 4), np.float32))
    assert fp.corrupt(outcome, random.Random(0)) is outcome
    assert fp.announced_decode_ms(12.5) == 12.5


def test_failpoints_without_consent_are_refused() -> None:
    with pytest.raises(FailpointError, match="tests only"):
        from_environment({ENV: "swap_sampler"})
    with pytest.raises(FailpointError, match="tests only"):
        from_environment({ENV: "swap_sampler", CONSENT_ENV: "yes"})
    with pytest.raises(FailpointError, match="unknown failpoints"):
        from_environment({ENV: "swap_sampler,lie_politely", CONSENT_ENV: CONSENT})


def test_each_lie_changes_what_it_says_and_nothing_else() -> None:
    hidden = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    outcome = StepOutcome(
        7, kv_len=5, hidden=hidden.copy(), sampled=Sampled(10, -0.5, ((10, -0.5), (11, -1.0)))
    )
    rng = random.Random(0)

    swapped = Failpoints(frozenset({"swap_sampler"}), n_vocab=100).corrupt(outcome, rng)
    assert swapped.sampled is not None and swapped.sampled.token_id == 11
    assert swapped.sampled.logprob == -0.5 and np.array_equal(swapped.hidden, hidden)

    perturbed = Failpoints(frozenset({"perturb_hidden"}), n_vocab=100).corrupt(outcome, rng)
    assert perturbed.hidden is not None
    diff = perturbed.hidden != hidden
    assert diff.sum() == 1  # one value, by one ulp
    assert perturbed.hidden.reshape(-1)[0] == np.nextafter(hidden.reshape(-1)[0], np.float32(np.inf))
    assert perturbed.sampled == outcome.sampled
    assert outcome.hidden is not None and np.array_equal(outcome.hidden, hidden)  # the input is not touched

    empty = Failpoints(frozenset({"no_model"}), n_vocab=100).corrupt(outcome, rng)
    assert empty.hidden is not None and not empty.hidden.any()
    assert empty.sampled is not None and 0 <= empty.sampled.token_id < 100

    assert Failpoints(frozenset({"fake_speed"})).announced_decode_ms(40.0) == 0.01
    failed = StepOutcome(8, kv_len=5, error_status="INTERNAL")
    assert Failpoints(frozenset({"no_model"}), n_vocab=100).corrupt(failed, rng) is failed


def test_a_liar_may_answer_its_first_steps_honestly() -> None:
    fp = from_environment({ENV: "swap_sampler,honest_steps=2", CONSENT_ENV: CONSENT}, n_vocab=100)
    assert fp.kinds == {"swap_sampler"} and fp.honest_steps == 2
    liar = Liar(fp, random.Random(0))
    outcome = StepOutcome(1, kv_len=1, sampled=Sampled(5, -0.1))
    tokens = [liar(outcome).sampled.token_id for _ in range(4)]  # type: ignore[union-attr]
    assert tokens == [5, 5, 6, 6]
    with pytest.raises(FailpointError, match="integer"):
        from_environment({ENV: "swap_sampler,honest_steps=x", CONSENT_ENV: CONSENT})


def test_preempt_every_turns_every_nth_sampled_step_into_a_preemption_k_times() -> None:
    fp = from_environment({ENV: "preempt_every=3,preempt_times=2", CONSENT_ENV: CONSENT})
    assert fp.active and (fp.preempt_every, fp.preempt_times) == (3, 2) and not fp.kinds
    liar = Liar(fp, random.Random(0))
    hidden_only = StepOutcome(1, kv_len=4, hidden=np.ones((1, 4), np.float32))
    assert liar(hidden_only) is hidden_only  # not a last stage's step: untouched
    statuses = [liar(StepOutcome(i, kv_len=i, sampled=Sampled(5, -0.1))).error_status for i in range(12)]
    assert statuses == [None, None, "PREEMPTED", None, None, "PREEMPTED", *[None] * 6]
    with pytest.raises(FailpointError, match="preempt_every must be an integer"):
        from_environment({ENV: "preempt_every=often", CONSENT_ENV: CONSENT})
