"""The cross-recipe tolerance of spot checks (gateway/checks.py ``Tolerance``), pure.

Two honest nodes of other check fingerprints (another build, other CPU features) report one step
with other low-order bits and, at a near tie, another greedy token; a liar's report is inconsistent
with an honest one. The margin's calibration on real builds is sim/bench_cross_recipe.py's job
(docs/security.md, Heterogeneity); these tests pin the rules with hand-made reports."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from gateway.checks import CROSS_RECIPE_MARGIN_NATS, Comparator, Tolerance, plain_greedy, verdict
from gateway.session_machine import StepReport
from proto.codec import Sampled

TOL = Tolerance(0.5)


def dist(*pairs: tuple[int, float]) -> tuple[tuple[int, float], ...]:
    """Candidates (token, logprob), best first."""
    return tuple(sorted(pairs, key=lambda p: -p[1]))


def greedy_report(tops: tuple[tuple[int, float], ...]) -> Sampled:
    return Sampled(tops[0][0], tops[0][1], tops, False)


def step(
    stage: int, node: str, start: int, end: int, sampled: Sampled | None, digest: bytes = b"d"
) -> StepReport:
    return StepReport(stage, node, 1, start + 2, start, end, digest, sampled)


HONEST_A = dist((7, -0.70), (9, -0.75), (3, -2.5), (4, -4.0))
HONEST_B = dist((9, -0.71), (7, -0.74), (3, -2.6), (4, -3.9))  # other rounding: 9 now on top


def test_an_honest_near_tie_across_recipes_is_consistent() -> None:
    a, b = greedy_report(HONEST_A), greedy_report(HONEST_B)
    assert a.token_id != b.token_id
    assert TOL.consistent(a, b, greedy=True) and TOL.consistent(b, a, greedy=True)


def test_the_same_token_with_logprobs_within_the_margin_is_consistent_and_beyond_it_is_not() -> None:
    a = greedy_report(dist((5, -0.1), (6, -3.0), (8, -4.0), (2, -5.0)))
    b = greedy_report(dist((5, -0.2), (6, -3.3), (8, -4.1), (2, -5.2)))
    assert TOL.consistent(a, b, greedy=True)
    far = greedy_report(dist((5, -0.1), (6, -3.0), (8, -4.0), (2, -6.0)))
    assert not TOL.consistent(far, b, greedy=True)  # token 2: 0.8 nats apart
    assert not TOL.consistent(a, Sampled(5, -0.2, b.top_logprobs, True), greedy=True)  # end flag differs


def test_a_swapped_sampler_is_inconsistent_with_itself() -> None:
    """node/failpoints.py swap_sampler: the next token id, the top's logprob and candidates kept."""
    honest = greedy_report(HONEST_A)
    lie = Sampled(8, honest.logprob, honest.top_logprobs, False)
    assert not TOL.consistent(lie, greedy_report(HONEST_B), greedy=True)
    assert not TOL.consistent(lie, greedy_report(HONEST_B), greedy=False)


def test_a_runner_up_reported_as_the_best_is_caught_unless_it_was_a_near_tie() -> None:
    """The hardest token lie: the second-best token with the two best candidates' logprobs swapped,
    so the report is consistent with itself. Caught where the honest gap exceeds the margin."""
    honest = dist((5, -0.2), (6, -2.0), (8, -3.0), (2, -4.0))
    lie = greedy_report(dist((6, -0.2), (5, -2.0), (8, -3.0), (2, -4.0)))
    assert not TOL.consistent(lie, greedy_report(honest), greedy=True)
    near = dist((5, -0.60), (6, -0.80), (8, -3.0), (2, -4.0))
    near_lie = greedy_report(dist((6, -0.60), (5, -0.80), (8, -3.0), (2, -4.0)))
    assert TOL.consistent(near_lie, greedy_report(near), greedy=True)  # within the margin: allowed


def test_a_token_the_other_never_considered_is_caught() -> None:
    """no_model: a random token reported with the top's logprob and the honest candidates."""
    b = greedy_report(HONEST_B)
    random_token = Sampled(40_000, -0.7, dist((40_000, -0.7), (2, -3.0), (11, -3.5), (12, -4.0)), False)
    assert not TOL.consistent(random_token, b, greedy=True)
    assert not TOL.consistent(random_token, b, greedy=False)  # 40000 at -0.7 would be b's candidate


def test_greedy_tokens_must_be_near_the_other_runs_top() -> None:
    """Sampled (temperature > 0) tokens may be any likely candidate; greedy ones only a near tie."""
    a = Sampled(3, -2.5, HONEST_A, False)  # a drawn token, not the top
    b = Sampled(3, -2.6, HONEST_B, False)
    assert TOL.consistent(a, b, greedy=False)
    assert not TOL.consistent(a, b, greedy=True)  # not the top of its own candidates


def test_reports_without_candidates_compare_the_token_and_its_logprob() -> None:
    assert TOL.consistent(Sampled(4, -1.0, (), False), Sampled(4, -1.3, (), False), greedy=True)
    assert not TOL.consistent(Sampled(4, -1.0, (), False), Sampled(4, -1.8, (), False), greedy=True)
    assert not TOL.consistent(Sampled(4, -1.0, (), False), Sampled(5, -1.0, (), False), greedy=True)
    assert TOL.consistent(None, None, greedy=True) and not TOL.consistent(
        None, Sampled(4, -1, (), False), greedy=True
    )


def test_plain_greedy_only_without_adjustments() -> None:
    assert plain_greedy(0.0)
    assert not plain_greedy(0.7)
    assert not plain_greedy(0.0, repetition_penalty=1.1)
    assert not plain_greedy(0.0, grammar=True)
    assert not plain_greedy(0.0, logit_bias=True)


def test_runs_that_part_at_a_near_tie_are_not_compared_afterwards() -> None:
    """Across recipes the runs part at a near tie; later steps are fed other tokens: not compared."""
    c = Comparator(("primary", "shadow"), exact=False, tolerance=TOL, greedy=True)
    c.add("primary", step(1, "p", 0, 8, greedy_report(HONEST_A)), 30)
    assert not c.add("shadow", step(1, "s", 0, 8, greedy_report(HONEST_B)), 30)
    assert c.parted_at == 8 and c.first_divergence() is None
    wild = greedy_report(dist((1, -0.1), (2, -5.0), (13, -6.0), (14, -7.0)))
    c.add("primary", step(1, "p", 8, 9, greedy_report(HONEST_A)), 30)
    assert not c.add("shadow", step(1, "s", 8, 9, wild), 30)  # other inputs: not compared
    assert c.first_divergence() is None


def test_a_liar_across_recipes_is_a_divergence_and_the_judge_decides_with_the_tolerance() -> None:
    c = Comparator(("primary", "shadow"), exact=False, tolerance=TOL, greedy=True)
    honest = greedy_report(HONEST_A)
    lie = Sampled(8, honest.logprob, honest.top_logprobs, False)
    c.add("primary", step(1, "p", 0, 8, honest), 30)
    assert c.add("shadow", step(1, "liar", 0, 8, lie), 30)
    div = c.first_divergence()
    assert div is not None
    judge = step(1, "j", 0, 8, greedy_report(HONEST_B))  # a third recipe: the near tie's other side
    v = verdict(div, judge, exact=False, tolerance=TOL, greedy=True)
    assert (v.liar, v.node_id, v.exact) == ("shadow", "liar", False)


def test_the_default_margin_is_positive_and_bounded() -> None:
    assert 0.0 < CROSS_RECIPE_MARGIN_NATS < 20.0
    assert Tolerance().margin_nats == CROSS_RECIPE_MARGIN_NATS


candidates = st.lists(
    st.tuples(st.integers(0, 50), st.floats(-12.0, -0.01, allow_nan=False)),
    min_size=1,
    max_size=6,
    unique_by=lambda p: p[0],
)


@given(candidates, st.floats(0.0, 0.3), st.booleans())
def test_an_honest_report_is_consistent_with_itself_and_a_nearby_copy_and_symmetric(
    pairs: list[tuple[int, float]], shift: float, greedy: bool
) -> None:
    # Normalise so the candidates are a possible head of a distribution (probabilities sum below 1).
    total = sum(math.exp(lp) for _, lp in pairs)
    pairs = [(t, lp - math.log(total) - 0.05) for t, lp in pairs]
    a = greedy_report(dist(*pairs))
    b = greedy_report(dist(*[(t, lp - shift) for t, lp in pairs]))  # every logprob off alike
    assert TOL.consistent(a, a, greedy=greedy)
    assert TOL.consistent(a, b, greedy=greedy) == (shift <= TOL.margin_nats)
    assert TOL.consistent(a, b, greedy=greedy) == TOL.consistent(b, a, greedy=greedy)
