"""Checks that need no disjoint route (issue 27), the pure part (gateway/checks.py): runs on routes cut
differently compare where their layer boundaries meet, and with no third node to judge, a node on
probation that contradicts a trusted one is named."""

from __future__ import annotations

from gateway.checks import Comparator, trusted_verdict
from gateway.session_machine import StepReport
from proto.codec import Sampled

A, B, L = "a" * 64, "b" * 64, "c" * 64


def report(
    stage: int, node: str, start: int, end: int, digest: bytes, token: int | None = None
) -> StepReport:
    sampled = None if token is None else Sampled(token, -0.5, ((token, -0.5),), False)
    return StepReport(stage, node, 1, start + 2, start, end, digest, sampled)


def test_routes_cut_differently_compare_at_the_boundaries_they_share() -> None:
    """Primary [0,15)+[15,30) against a shadow holding [0,30) alone: only layer 30 is common."""
    c = Comparator(("primary", "shadow"))
    assert not c.add("primary", report(0, A, 0, 8, b"h15"), 15)
    assert not c.add("primary", report(1, B, 0, 8, b"t", 7), 30)
    assert not c.add("shadow", report(0, L, 0, 8, b"t", 7), 30)  # agrees at 30; 15 is not compared
    assert c.compared == 1 and c.first_divergence() is None
    assert c.settled_before((30, 8, 9), ("primary", "shadow"))  # layer 15 is not waited for
    assert not c.add("shadow", report(0, L, 8, 9, b"u", 9), 30)  # nothing to compare with yet
    assert not c.add("primary", report(0, A, 8, 9, b"h15b"), 15)
    assert c.add("primary", report(1, B, 8, 9, b"t2", 8), 30)
    div = c.first_divergence()
    assert div is not None and div.key == (30, 8, 9)
    assert {r.node_id for r in div.reports.values()} == {B, L}


def test_a_node_on_probation_contradicting_a_trusted_one_is_named_and_nobody_else() -> None:
    c = Comparator(("primary", "shadow"))
    c.add("primary", report(1, B, 0, 4, b"x", 1), 30)
    c.add("shadow", report(1, L, 0, 4, b"y", 2), 30)
    div = c.first_divergence()
    assert div is not None
    v = trusted_verdict(div, frozenset({B}))
    assert v is not None and (v.liar, v.node_id, v.honest) == ("shadow", L, ("primary",))
    assert trusted_verdict(div, frozenset()) is None  # both on probation: no verdict, the request fails
    assert trusted_verdict(div, frozenset({B, L})) is None  # both trusted: no guess either


def test_across_recipes_the_sampled_token_decides_and_hidden_digests_are_not_compared() -> None:
    """Two honest nodes of different builds: other low-order bits (digest, logprob), the same token
    (the tolerance's finer rules: tests/gateway/test_cross_recipe_tolerance.py)."""
    c = Comparator(("primary", "shadow"), exact=False)
    c.add("primary", report(0, A, 0, 8, b"bits-of-build-1"), 15)
    assert not c.add("shadow", report(0, L, 0, 8, b"bits-of-build-2"), 15)  # not comparable: skipped
    assert c.compared == 0
    near = StepReport(1, L, 1, 2, 0, 8, b"other", Sampled(7, -0.5000001, ((7, -0.5000001),), False))
    c.add("primary", report(1, B, 0, 8, b"t", 7), 30)
    assert not c.add("shadow", near, 30) and c.compared == 1
    assert c.first_divergence() is None
    sure = StepReport(1, L, 1, 10, 8, 9, b"u", Sampled(9, -0.01, ((9, -0.01),), False))
    assert c.add("shadow", sure, 30) is False
    # Another token each run is sure of (not a near tie the tolerance accepts): a divergence even so.
    other = StepReport(1, B, 1, 10, 8, 9, b"u", Sampled(8, -0.01, ((8, -0.01),), False))
    assert c.add("primary", other, 30)
    exact = Comparator(("primary", "shadow"))
    exact.add("primary", report(1, B, 0, 8, b"t", 7), 30)
    assert exact.add("shadow", near, 30)  # within one recipe the logprob's last bit counts
