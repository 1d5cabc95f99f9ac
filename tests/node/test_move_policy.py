"""The node's half of rebalancing's hysteresis (node/move_policy.py): cool-down, confirmations, pins."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from node.move_policy import MovePolicy, MoveState, on_advice

A = ("aa" * 32, 0, 18)
B = ("bb" * 32, 0, 30)


def test_moves_only_after_the_cooldown_and_enough_confirmations() -> None:
    policy = MovePolicy(cooldown_s=60.0, confirmations=2)
    state = MoveState(serving_since_s=0.0)
    state, go = on_advice(policy, state, A, 10.0)
    assert not go and state.seen == 1
    state, go = on_advice(policy, state, A, 20.0)
    assert not go and state.seen == 2  # confirmed, but still cooling down
    state, go = on_advice(policy, state, A, 61.0)
    assert go
    # Another target, or a "stay", starts the count again.
    state, go = on_advice(policy, state, B, 70.0)
    assert not go and state.seen == 1
    state, go = on_advice(policy, state, None, 80.0)
    assert not go and state == MoveState(0.0)


def test_a_pinned_node_never_moves() -> None:
    policy = MovePolicy(cooldown_s=0.0, confirmations=1, pinned=True)
    assert on_advice(policy, MoveState(0.0), A, 1e9) == (MoveState(0.0), False)


@given(
    st.lists(st.sampled_from([A, B, None]), max_size=30),
    st.integers(min_value=1, max_value=5),
    st.floats(min_value=0.0, max_value=100.0),
)
def test_a_move_needs_that_many_equal_answers_in_a_row(
    answers: list[tuple[str, int, int] | None], confirmations: int, cooldown_s: float
) -> None:
    policy = MovePolicy(cooldown_s=cooldown_s, confirmations=confirmations)
    state = MoveState(serving_since_s=0.0)
    for i, target in enumerate(answers):
        now = float(i * 10)
        state, go = on_advice(policy, state, target, now)
        if go:
            tail = answers[max(0, i - confirmations + 1) : i + 1]
            assert len(tail) == confirmations and all(t == target for t in tail) and target is not None
            assert now >= cooldown_s
