"""gateway/open_plan.py: which routes an OPEN tries and what each failure to open means (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import KvExhausted, Overloaded, Preempted, StageBusy, StageFailed, Unconfirmable
from gateway.open_plan import OPEN_ATTEMPTS, AfterOpenFailure, OpenPlan


def busy(node: str, kv_short: bool = False) -> StageBusy:
    err = StageBusy("full", node_id=node, retry_after_s=3)
    err.kv_short = kv_short
    return err


def test_the_callers_and_the_gateways_avoided_nodes_are_never_candidates() -> None:
    plan = OpenPlan(frozenset({"dead"}), {"liar"})
    assert not plan.admits(["a", "dead"]) and not plan.admits(["liar"]) and plan.admits(["a", "b"])
    assert plan.start() is False  # a re-run's first route is not the fork's
    assert OpenPlan().start() is True


def test_a_broken_route_is_forgotten_a_busy_or_short_one_only_left_out() -> None:
    plan = OpenPlan()
    assert plan.open_failed(StageFailed("gone", node_id="a"), fork=False) is AfterOpenFailure.FORGET
    assert plan.open_failed(busy("b", kv_short=True), fork=False) is AfterOpenFailure.NEXT
    assert plan.open_failed(Preempted("p", node_id="c"), fork=False) is AfterOpenFailure.NEXT
    assert plan.excluded == {"a", "b", "c"}
    full = OpenPlan()
    assert full.open_failed(busy("d"), fork=True) is AfterOpenFailure.NEXT  # the fork's route: nobody blamed
    assert full.excluded == set() and full.last_error is None


def test_unconfirmable_nodes_are_left_out_then_let_back_in_once() -> None:
    plan = OpenPlan()
    plan.start()
    plan.cannot_check(Unconfirmable("no check", node_id="p", failed_nodes=frozenset({"p"})))
    assert plan.attempt == 0 and not plan.admits(["p"])  # not an attempt: the route did not fail
    assert plan.no_route() is True and plan.allow_unconfirmed and plan.admits(["p"])
    assert plan.no_route() is False  # only once


def test_with_unconfirmed_routes_refused_the_client_gets_unconfirmable_not_an_unchecked_run() -> None:
    plan = OpenPlan(serve_unconfirmed=False)
    plan.start()
    err = Unconfirmable("no check", node_id="p", failed_nodes=frozenset({"p"}))
    plan.cannot_check(err)
    assert plan.no_route() is False and not plan.allow_unconfirmed and not plan.admits(["p"])
    refused = plan.give_up()
    assert refused is err and refused.status == 503 and refused.code == "unconfirmable"
    assert refused.retry_after_s == 5


def test_giving_up_says_what_the_client_should_do() -> None:
    assert isinstance(OpenPlan().give_up(), Overloaded)
    short = OpenPlan()
    short.open_failed(busy("a", kv_short=True), fork=False)
    assert isinstance(short.give_up(), KvExhausted) and short.give_up().retry_after_s == 3
    preempted = OpenPlan()
    preempted.open_failed(Preempted("p", node_id="a"), fork=False)
    assert isinstance(preempted.give_up(), KvExhausted)
    full = OpenPlan()
    full.open_failed(busy("a"), fork=False)
    given_up = full.give_up()
    assert isinstance(given_up, Overloaded) and not isinstance(given_up, KvExhausted)
    broken = OpenPlan()
    err = StageFailed("gone", node_id="a")
    broken.unreachable(err)
    assert broken.give_up() is err


@given(st.lists(st.sampled_from(["broken", "busy", "short", "fork", "unconfirmable", "info"]), max_size=30))
def test_at_most_attempts_routes_fail_and_every_excluded_node_failed_or_was_avoided(kinds: list[str]) -> None:
    plan = OpenPlan(frozenset({"avoided"}))
    failed = 0
    for i, kind in enumerate(kinds):
        if not plan.more():
            break
        first = plan.start()
        node = f"n{i}"
        if kind == "broken":
            plan.open_failed(StageFailed("x", node_id=node), fork=first)
        elif kind in ("busy", "short", "fork"):
            plan.open_failed(busy(node, kv_short=kind == "short"), fork=first and kind == "fork")
        elif kind == "unconfirmable":
            plan.cannot_check(Unconfirmable("x", node_id=node, failed_nodes=frozenset({node})))
            continue
        else:
            plan.unreachable(StageFailed("x", node_id=node))
        failed += 1
    assert failed <= OPEN_ATTEMPTS
    assert plan.excluded <= {"avoided"} | {f"n{i}" for i in range(len(kinds))}
    assert "avoided" in plan.excluded
