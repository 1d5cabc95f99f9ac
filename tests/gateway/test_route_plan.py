"""The route plan (gateway/route_plan.py): what a choice does after a failed Route Session."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.route_plan import MAX_ROUTE_RECOVERIES, Ended, Next, RoutePlan


def stage(node: str, *, opened: bool = True, recoverable: bool = True) -> Ended:
    return Ended("stage", opened, recoverable, frozenset({node}))


def test_a_recoverable_stage_failure_re_runs_avoiding_only_the_failed_nodes() -> None:
    plan = RoutePlan()
    assert plan.after(Ended("stage", True, True, frozenset({"a", "a2"}))) is Next.RETRY
    assert plan.avoid == {"a", "a2"} and plan.recoveries == 1


def test_re_runs_are_bounded() -> None:
    plan = RoutePlan()
    steps = [plan.after(stage(f"n{i}")) for i in range(MAX_ROUTE_RECOVERIES + 1)]
    assert steps == [Next.RETRY] * MAX_ROUTE_RECOVERIES + [Next.GIVE_UP]
    assert plan.avoid == {f"n{i}" for i in range(MAX_ROUTE_RECOVERIES)}  # not the one given up on


def test_what_no_other_route_fixes_gives_up() -> None:
    assert RoutePlan().after(stage("a", recoverable=False)) is Next.GIVE_UP  # the node's hint is NONE
    assert RoutePlan().after(Ended("other", True)) is Next.GIVE_UP  # a client or protocol error
    assert RoutePlan().after(stage("a", opened=False)) is Next.GIVE_UP  # the service's OPEN loop tried


def test_after_a_re_run_a_failure_before_opening_reports_the_failure_that_started_it() -> None:
    plan = RoutePlan()
    assert plan.after(stage("a")) is Next.RETRY
    assert plan.after(Ended("other", False)) is Next.GIVE_UP_EARLIER


def test_kv_exhausted_before_opening_waits_only_when_the_gateway_waits() -> None:
    assert RoutePlan().after(Ended("kv_exhausted", False)) is Next.WAIT_FOR_KV
    assert RoutePlan(wait_for_kv=False).after(Ended("kv_exhausted", False)) is Next.GIVE_UP
    assert RoutePlan().after(Ended("kv_exhausted", True)) is Next.GIVE_UP


def test_preemptions_wait_and_resume_without_avoiding_the_node_then_fail_past_the_bound() -> None:
    plan = RoutePlan(max_preemptions=2)
    ended = Ended("preempted", True, False, frozenset({"a"}))
    assert [plan.after(ended) for _ in range(3)] == [
        Next.WAIT_FOR_KV,
        Next.WAIT_FOR_KV,
        Next.TOO_MANY_PREEMPTIONS,
    ]
    assert plan.avoid == set() and plan.recoveries == 0 and plan.preemptions == 3


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        RoutePlan(max_recoveries=-1)


endings = st.builds(
    Ended,
    kind=st.sampled_from(["stage", "preempted", "kv_exhausted", "other"]),
    opened=st.booleans(),
    recoverable=st.booleans(),
    failed_nodes=st.frozensets(st.sampled_from("abcdef"), max_size=2),
)


@given(
    seq=st.lists(endings, max_size=30),
    max_recoveries=st.integers(0, 4),
    max_preemptions=st.integers(0, 4),
    wait=st.booleans(),
)
def test_plan_properties(seq: list[Ended], max_recoveries: int, max_preemptions: int, wait: bool) -> None:
    plan = RoutePlan(max_recoveries=max_recoveries, max_preemptions=max_preemptions, wait_for_kv=wait)
    avoided: set[str] = set()
    retried = False
    for ended in seq:
        before = (plan.recoveries, plan.preemptions)
        step = plan.after(ended)
        # Bounds: never more re-runs or resumptions than allowed (one past the bound ends the choice).
        assert plan.recoveries <= max_recoveries and plan.preemptions <= max_preemptions + 1
        if step is Next.RETRY:
            assert ended.kind == "stage" and ended.opened and ended.recoverable
            assert plan.recoveries == before[0] + 1
            avoided |= ended.failed_nodes
            retried = True
        else:
            assert plan.recoveries == before[0]
        if step is Next.GIVE_UP_EARLIER:
            assert retried and not ended.opened
        if step is Next.TOO_MANY_PREEMPTIONS:
            assert plan.preemptions == max_preemptions + 1
        assert plan.avoid == avoided  # only the nodes of failures that started a re-run
        if step in (Next.GIVE_UP, Next.GIVE_UP_EARLIER, Next.TOO_MANY_PREEMPTIONS):
            break
