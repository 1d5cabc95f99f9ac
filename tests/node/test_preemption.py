"""The preemption choice of a full KV pool (node.preemption, pure): examples and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.preemption import Holder, choose_victims


def _plan(holders: list[Holder], need: int, free: int, req: str = "r", req_seq: int = 0, bound: int = 3):
    return choose_victims(
        holders,
        requester=req,
        requester_opened_seq=req_seq,
        need_blocks=need,
        free_blocks=free,
        max_preemptions=bound,
    )


def test_nothing_is_preempted_while_free_blocks_cover_the_need() -> None:
    plan = _plan([Holder("a", 1, 10)], need=4, free=4)
    assert plan.victims == () and plan.blocks_freed == 0 and not plan.preempts


def test_the_youngest_goes_first_and_only_as_many_as_needed() -> None:
    holders = [Holder("old", 1, 8), Holder("mid", 2, 3), Holder("young", 3, 2)]
    assert _plan(holders, need=3, free=1).victims == ("young",)
    plan = _plan(holders, need=6, free=1)
    assert plan.victims == ("young", "mid") and plan.blocks_freed == 5


def test_a_requester_younger_than_every_candidate_yields_itself() -> None:
    holders = [Holder("old", 1, 8), Holder("r", 9, 2)]
    plan = _plan(holders, need=4, free=0, req="r", req_seq=9)
    assert plan.victims == ("r",) and plan.blocks_freed == 2


def test_sessions_at_their_bound_and_empty_ones_are_spared() -> None:
    holders = [Holder("worn", 5, 10, preemptions=3), Holder("empty", 4, 0), Holder("ok", 2, 4)]
    assert _plan(holders, need=4, free=0).victims == ("ok",)


def test_no_plan_when_the_candidates_cannot_cover_the_need() -> None:
    assert _plan([Holder("a", 1, 2), Holder("b", 2, 1)], need=10, free=2).victims == ()


def test_negative_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        _plan([], need=-1, free=0)


holders_st = st.lists(
    st.builds(
        Holder,
        session=st.sampled_from([f"s{i}" for i in range(12)]),
        opened_seq=st.integers(0, 50),
        blocks=st.integers(0, 20),
        preemptions=st.integers(0, 4),
    ),
    max_size=12,
    unique_by=lambda h: h.session,
)


@settings(max_examples=300, deadline=None)
@given(holders_st, st.integers(0, 100), st.integers(0, 40), st.integers(0, 60), st.integers(0, 4))
def test_plan_properties(holders: list[Holder], need: int, free: int, req_seq: int, bound: int) -> None:
    plan = _plan(holders, need=need, free=free, req="s0", req_seq=req_seq, bound=bound)
    by = {h.session: h for h in holders}
    if plan.victims == ("s0",):
        others = [h for h in holders if h.session != "s0" and h.blocks and h.preemptions < bound]
        assert need > free and others and all(req_seq > h.opened_seq for h in others)
        return
    assert len(set(plan.victims)) == len(plan.victims)
    assert "s0" not in plan.victims
    for v in plan.victims:
        assert by[v].blocks > 0 and by[v].preemptions < bound
    seqs = [by[v].opened_seq for v in plan.victims]
    assert seqs == sorted(seqs, reverse=True)
    assert plan.blocks_freed == sum(by[v].blocks for v in plan.victims)
    if plan.victims:
        # covers the shortfall, and minimally: without the last victim it would not
        assert free + plan.blocks_freed >= need
        assert free + plan.blocks_freed - by[plan.victims[-1]].blocks < need
        # every spared eligible session is older than (or as old as) the oldest victim
        for h in holders:
            if h.session not in plan.victims and h.session != "s0" and h.blocks and h.preemptions < bound:
                assert h.opened_seq <= seqs[-1]
    else:
        eligible = sum(h.blocks for h in holders if h.session != "s0" and h.blocks and h.preemptions < bound)
        assert need <= free or free + eligible < need


def test_a_requester_at_its_bound_does_not_yield_older_sessions_make_room() -> None:
    holders = [Holder("old", 1, 8), Holder("r", 9, 2)]
    plan = choose_victims(
        holders,
        requester="r",
        requester_opened_seq=9,
        need_blocks=4,
        free_blocks=0,
        max_preemptions=3,
        requester_preemptions=3,
    )
    assert plan.victims == ("old",) and plan.blocks_freed == 8
