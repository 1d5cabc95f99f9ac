"""Which sessions a full KV pool preempts (pure).

When a stage's pool has no room for a piece of work, the node frees blocks by
preempting sessions instead of refusing: the **youngest** sessions holding
blocks go first (the ones that have done the least work lose the least), until
the blocks freed cover the need. When the session asking for room is itself
younger than every session that could make room, it is the one that yields
(the plan names only it). A session past its preemption bound is not chosen
again, not even as a yielding requester: it keeps its KV and waits, or older
sessions make room for it (no session is preempted without end).

The decision only: the frame server frees the victims' KV on every stage of
their routes and tells their gateways; the gateway keeps their tokens and
re-prefills them when room returns.

Invariants (tests/node/test_preemption.py): the victims are distinct
sessions holding blocks, never one at its bound; the requester is named only
alone, when it is younger than every other candidate; victims are chosen
youngest first; the plan is minimal (dropping its last victim leaves the need
uncovered); when the candidates cannot cover the need, nothing is preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Holder:
    """A session holding KV on this stage."""

    session: str
    opened_seq: int  # the order sessions opened on this node: higher = younger
    blocks: int  # blocks it holds now
    preemptions: int = 0  # times it was preempted already


@dataclass(frozen=True)
class PreemptionPlan:
    victims: tuple[str, ...]  # youngest first
    blocks_freed: int

    @property
    def preempts(self) -> bool:
        """Whether anyone is preempted (the requester alone, when it yields, counts)."""
        return bool(self.victims)


def choose_victims(
    holders: Sequence[Holder],
    *,
    requester: str,
    requester_opened_seq: int,
    need_blocks: int,
    free_blocks: int,
    max_preemptions: int,
    requester_preemptions: int = 0,
) -> PreemptionPlan:
    """The youngest sessions whose blocks, with the free ones, cover ``need_blocks``.

    An empty plan when the free blocks already cover the need, or when every
    eligible session together could not (then the work is refused as before:
    preempting would lose progress and still not make room). A requester at its own bound
    (``requester_preemptions >= max_preemptions``) does not yield: older sessions make room for it,
    or the work is refused and it waits with its KV intact.
    """
    if need_blocks < 0 or free_blocks < 0 or max_preemptions < 0:
        raise ValueError("need_blocks, free_blocks and max_preemptions must be >= 0")
    short = need_blocks - free_blocks
    if short <= 0:
        return PreemptionPlan((), 0)
    eligible = sorted(
        (h for h in holders if h.session != requester and h.blocks > 0 and h.preemptions < max_preemptions),
        key=lambda h: (-h.opened_seq, h.session),
    )
    yields = requester_preemptions < max_preemptions
    if eligible and yields and requester_opened_seq > eligible[0].opened_seq:
        mine = sum(h.blocks for h in holders if h.session == requester)
        return PreemptionPlan((requester,), mine)
    victims: list[str] = []
    freed = 0
    for h in eligible:
        victims.append(h.session)
        freed += h.blocks
        if freed >= short:
            return PreemptionPlan(tuple(victims), freed)
    return PreemptionPlan((), 0)
