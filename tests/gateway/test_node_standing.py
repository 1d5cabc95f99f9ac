"""gateway/node_standing.py: whom the gateway routes around, probation by checks passed here, and
the bounded queues that go to the tracker."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.node_standing import NodeStanding


def test_avoided_nodes_expire_at_their_deadline_each_table_on_its_own() -> None:
    s = NodeStanding()
    s.avoid_liar("liar", until=100.0)
    s.avoid_silent("dead", until=50.0)
    assert s.avoided(10.0) == {"liar", "dead"}
    assert s.avoided(50.0) == {"liar"}  # a deadline reached is over
    assert s.avoided(99.9) == {"liar"}
    assert s.avoided(100.0) == frozenset()


def test_a_silent_node_is_named_once_to_the_tracker_even_when_not_avoided() -> None:
    s = NodeStanding(max_unreported=2)
    s.avoid_silent("a", until=None)  # avoid_unreachable_s 0: reported, not avoided
    s.avoid_silent("a", until=None)
    s.avoid_silent("b", until=5.0)
    s.avoid_silent("c", until=5.0)  # the report is full: c waits for a later sighting
    assert s.avoided(0.0) == {"b", "c"}
    assert s.take_unreachable() == ("a", "b")
    assert s.take_unreachable() == ()


def test_probation_ends_after_enough_passes_here_unless_the_tracker_still_says_so() -> None:
    s = NodeStanding()
    assert s.on_probation("n", tracker_says=False, needed=2)
    s.passed(["n"])
    assert s.on_probation("n", tracker_says=False, needed=2)
    s.passed(["n", "m"])
    assert not s.on_probation("n", tracker_says=False, needed=2)
    assert s.on_probation("n", tracker_says=True, needed=2)
    assert not s.on_probation("new", tracker_says=True, needed=0)  # the operator trusts every node
    assert dict(s.checks_passed) == {"n": 2, "m": 1}


def test_evidence_is_bounded_oldest_first_and_the_drops_are_counted_once() -> None:
    s = NodeStanding(max_evidence=3)
    for i in range(5):
        s.add_evidence({"request_id": f"r{i}"})
    assert [e["request_id"] for e in s.evidence] == ["r2", "r3", "r4"]
    assert s.take_evidence_dropped() == 2
    assert s.take_evidence_dropped() == 0


def test_the_node_tables_forget_the_least_recently_touched_first() -> None:
    s = NodeStanding(max_nodes=2)
    s.passed(["a"])
    s.passed(["b"])
    s.passed(["a"])  # a touched last: b is the oldest
    s.passed(["c"])
    assert (s.passes("a"), s.passes("b"), s.passes("c")) == (2, 0, 1)  # b forgotten: on probation again
    assert set(s.checks_passed) == {"a", "c"}


def test_bounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError):
        NodeStanding(max_nodes=0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["liar", "silent", "pass", "evidence"]), st.integers(0, 20), st.floats(0, 100)
        ),
        max_size=200,
    )
)
def test_every_table_stays_within_its_bound(ops: list[tuple[str, int, float]]) -> None:
    s = NodeStanding(max_nodes=5, max_evidence=4, max_unreported=3)
    for kind, node, t in ops:
        name = f"n{node}"
        if kind == "liar":
            s.avoid_liar(name, t)
        elif kind == "silent":
            s.avoid_silent(name, t)
        elif kind == "pass":
            s.passed([name])
        else:
            s.add_evidence({"n": name})
        assert len(s.avoided(0.0)) <= 10 and len(s.checks_passed) <= 5
        assert len(s.evidence) <= 4 and len(s.unreachable_to_report) <= 3
