"""When a node acts on the tracker's rebalancing advice: the node's half of the hysteresis.

Pure (no clock: times are passed in). The tracker already refuses moves that gain less than
its ``rebalance_min_gain`` and counts the moves it advised; the node adds two brakes of its
own so one noisy answer, or a demand that swings back and forth, does not cost a drain and a
download each time:

* a **cool-down**: no move within ``cooldown_s`` of the node's start (or of its last move,
  which is a start), so a node serves for a while wherever it lands;
* **confirmations**: the same target (model, start, end) advised ``confirmations`` times in
  a row; any other answer (stay, or another target) starts the count again.

A pinned node never moves (the operator fixed its span).
"""

from __future__ import annotations

from dataclasses import dataclass

Target = tuple[str, int, int]  # model fingerprint, start, end


@dataclass(frozen=True)
class MovePolicy:
    cooldown_s: float = 600.0
    confirmations: int = 2
    pinned: bool = False


@dataclass(frozen=True)
class MoveState:
    serving_since_s: float  # when the node started serving its current span
    target: Target | None = None  # the target advised in the last answers
    seen: int = 0  # how many answers in a row advised it


def on_advice(
    policy: MovePolicy, state: MoveState, target: Target | None, now_s: float
) -> tuple[MoveState, bool]:
    """The state after one answer (``target`` None: stay), and whether to move now."""
    if target is None or policy.pinned:
        return MoveState(state.serving_since_s), False
    seen = state.seen + 1 if target == state.target else 1
    after = MoveState(state.serving_since_s, target, seen)
    cooled = now_s - state.serving_since_s >= policy.cooldown_s
    return after, cooled and seen >= policy.confirmations


__all__ = ["MovePolicy", "MoveState", "Target", "on_advice"]
