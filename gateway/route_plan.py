"""A request's route plan (pure): what one choice of a request does when a Route Session of it fails.

A choice runs as one or more Route Sessions. Inside a session the session
machine replaces a failed stage by a node of the same span (span recovery,
``gateway/recovery.py``, bounded by ``RouteConfig.max_recoveries``); when the
session itself ends in failure, this plan decides what follows -- in one
place for the service (``gateway/choice_runner.py``) and for the property-tested
in-memory swarm (``tests/gateway/session_sim.py``), so the tests exercise the
product's policy and not a copy of it:

==========================================================  =====================================
the session ended ...                                       next
==========================================================  =====================================
before it opened: no route has the free KV now              ``WAIT_FOR_KV`` (when the gateway
                                                            waits for KV), else ``GIVE_UP``
opened: a node preempted it, or had no room for its next    ``WAIT_FOR_KV``, then resume by
step                                                        re-prefill on any route (the node is
                                                            not avoided); past ``max_preemptions``
                                                            ``TOO_MANY_PREEMPTIONS``
before it opened, after an earlier failure started this     ``GIVE_UP_EARLIER``: the client hears
re-run (no route left to continue on)                       the failure that stopped it
opened: a stage failure another route can fix (the stream   ``RETRY`` on another route avoiding
broke or timed out, or the node's hint is not NONE), fewer  the failed nodes -- only those: a node
than ``max_recoveries`` re-runs so far                      that merely looks dead elsewhere is
                                                            the route choice's business
anything else                                               ``GIVE_UP``
==========================================================  =====================================

Bounded: at most ``max_recoveries`` re-runs after failures and
``max_preemptions`` resumptions per choice; the avoided set only grows by the
nodes of failures that started a re-run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

MAX_ROUTE_RECOVERIES = 2  # re-runs on another route after failures, per choice of a request
DEFAULT_MAX_PREEMPTIONS = 4

EndKind = Literal["stage", "preempted", "kv_exhausted", "other"]


@dataclass(frozen=True)
class Ended:
    """How a Route Session ended, as the plan needs to know it.

    ``kind``: ``stage`` (a stage failed), ``preempted`` (a node freed the session's KV for an older
    one, or had no room for its next step), ``kv_exhausted`` (no route has the free KV now; only
    before the session opened), ``other`` (a client error, a protocol error, anything no re-run
    fixes). ``opened``: the session was open (its body ran; tokens may have streamed)."""

    kind: EndKind
    opened: bool
    recoverable: bool = False  # kind "stage": another route can fix it
    failed_nodes: frozenset[str] = frozenset()


class Next(enum.Enum):
    RETRY = "retry"  # another Route Session now, avoiding ``RoutePlan.avoid``
    WAIT_FOR_KV = "wait_for_kv"  # wait for KV room, then another Route Session
    GIVE_UP = "give_up"  # fail with this failure
    GIVE_UP_EARLIER = "give_up_earlier"  # fail with the failure that started this re-run
    TOO_MANY_PREEMPTIONS = "too_many_preemptions"  # fail: preempted more than max_preemptions times


@dataclass
class RoutePlan:
    """One choice's plan across its Route Sessions (survives KV waits)."""

    max_recoveries: int = MAX_ROUTE_RECOVERIES
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    wait_for_kv: bool = True
    recoveries: int = 0
    preemptions: int = 0
    avoid: set[str] = field(default_factory=set)
    rerunning: bool = False  # the last session was a re-run after a failure

    def __post_init__(self) -> None:
        if self.max_recoveries < 0 or self.max_preemptions < 0:
            raise ValueError("max_recoveries and max_preemptions must be >= 0")

    def after(self, ended: Ended) -> Next:
        """The next step after a session ended in failure (and the plan's counters updated)."""
        if not ended.opened and ended.kind == "kv_exhausted" and self.wait_for_kv:
            return Next.WAIT_FOR_KV
        if ended.opened and ended.kind == "preempted":
            self.preemptions += 1
            if self.preemptions > self.max_preemptions:
                return Next.TOO_MANY_PREEMPTIONS
            return Next.WAIT_FOR_KV
        if not ended.opened and self.rerunning:
            return Next.GIVE_UP_EARLIER
        if (
            ended.kind != "stage"
            or not ended.opened
            or not ended.recoverable
            or self.recoveries >= self.max_recoveries
        ):
            return Next.GIVE_UP
        self.recoveries += 1
        self.rerunning = True
        self.avoid |= ended.failed_nodes
        return Next.RETRY
