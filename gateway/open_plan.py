"""Which routes a request's OPEN tries, and what a failure to open one means (pure).

Opening is invisible to the client (nothing was streamed yet), so a route that fails to open is
replaced by another, at most ``attempts`` times:

* **Candidates.** The cached routes that avoid every excluded node (the caller's ``avoid``: the
  nodes a failed run named; the nodes this gateway avoids; the nodes that failed here). None left:
  a fresh look-up without them. None there either: the nodes this gateway avoids only because they
  were silent when last dialled (``silent``; not those that failed in this request) are let back in
  once -- a node slow to answer once is a better bet than a sure 503, and for the last holder of a
  layer there is no other (issue 26: on a loaded machine one slow ``Info`` kept a model
  unroutable here for ``avoid_unreachable_s``). Still none: when some nodes were left out only
  because no route could check them (on probation, :class:`gateway.errors.Unconfirmable`), they are let back
  in once and run unconfirmed (a swarm where nobody can check anybody yet, docs/security.md) --
  unless ``serve_unconfirmed`` is off (``unconfirmed_routes = refuse``): then the client gets the
  503 ``unconfirmable`` (with Retry-After); else the look-up's refusal stands, or the last failure
  does.
* **A failure to open** (:meth:`OpenPlan.open_failed`): the choice fork's route full -- another
  route, nobody excluded; a node short of KV (busy, or preempted while opening) -- excluded, the
  route is not broken; anything else -- the node excluded and the shell forgets what it knew of
  the route (cached routes, node infos, kept prefixes) and notes the node as unreachable.
  A route that cannot be checked does not count as an attempt.
* **Giving up** (:meth:`OpenPlan.give_up`): the last failure, mapped to what the client should
  do -- full everywhere: 503 ``Overloaded``; short of KV: ``KvExhausted`` (the KV wait); else the
  failure itself.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.errors import (
    GatewayError,
    KvExhausted,
    Overloaded,
    Preempted,
    StageBusy,
    StageFailed,
    Unconfirmable,
)

OPEN_ATTEMPTS = 3


class AfterOpenFailure(enum.Enum):
    NEXT = "next"  # another route; nothing learned about this one
    FORGET = "forget"  # another route; the shell forgets this route and notes the node unreachable


@dataclass
class OpenPlan:
    avoid: frozenset[str] = frozenset()  # the caller's: nodes a failed run named
    excluded: set[str] = field(default_factory=set)
    attempts: int = OPEN_ATTEMPTS
    attempt: int = 0
    unconfirmable: set[str] = field(default_factory=set)  # left out: no route could check them
    allow_unconfirmed: bool = False
    serve_unconfirmed: bool = True  # False: a route nobody can check is refused, never run unchecked
    last_error: StageFailed | None = None
    silent: frozenset[str] = frozenset()  # avoided by this gateway only for being silent when dialled
    failed: set[str] = field(default_factory=set)  # nodes that failed in this request
    silent_let_in: bool = False

    def __post_init__(self) -> None:
        self.excluded |= self.avoid

    def admits(self, node_ids: Iterable[str]) -> bool:
        """Whether a route of these nodes is a candidate."""
        return not self.excluded.intersection(node_ids)

    def more(self) -> bool:
        return self.attempt < self.attempts

    def no_route(self) -> bool:
        """The look-up found no route without the excluded nodes: True to look again (the nodes
        nobody could check let back in, unconfirmed; or first the nodes avoided for silence), False to
        stop (:meth:`give_up`, or the look-up's refusal when nothing failed here)."""
        back = (self.silent & self.excluded) - self.avoid - self.failed - self.unconfirmable
        if back and not self.silent_let_in:
            self.silent_let_in = True
            self.excluded -= back
            return True
        if self.unconfirmable and not self.allow_unconfirmed and self.serve_unconfirmed:
            self.allow_unconfirmed = True
            self.excluded -= self.unconfirmable
            return True
        return False

    def start(self) -> bool:
        """A route is tried: returns whether it is the first (the one a choice fork's KV may serve)."""
        self.attempt += 1
        return self.attempt == 1 and not self.avoid

    def unreachable(self, err: StageFailed) -> None:
        """A node of the route picked did not answer before its session was opened (Info)."""
        self.excluded.add(err.node_id)
        self.failed.add(err.node_id)
        self.last_error = err

    def cannot_check(self, err: Unconfirmable) -> None:
        """The route's nodes on probation cannot be checked: another route without them (not an
        attempt: the route did not fail)."""
        self.attempt -= 1
        self.unconfirmable |= err.failed_nodes
        self.excluded |= err.failed_nodes
        self.last_error = err

    def open_failed(self, err: StageFailed, *, fork: bool) -> AfterOpenFailure:
        if fork and isinstance(err, StageBusy):
            return AfterOpenFailure.NEXT  # the fork's route is full: another, with a prefill of its own
        self.excluded.add(err.node_id)
        self.failed.add(err.node_id)
        self.last_error = err
        if isinstance(err, Preempted) or (isinstance(err, StageBusy) and err.kv_short):
            return AfterOpenFailure.NEXT  # short of KV, not broken: another route now, this one later
        return AfterOpenFailure.FORGET

    def give_up(self) -> GatewayError:
        """What the client gets when no route opened."""
        err = self.last_error
        if err is None:
            return Overloaded("every route tried is full right now; retry later", retry_after_s=2)
        if isinstance(err, StageBusy) and err.kv_short:
            return KvExhausted(
                f"every route tried is short of KV right now ({err.message})",
                retry_after_s=err.retry_after_s or 2,
            )
        if isinstance(err, Preempted):
            return KvExhausted(
                f"a route preempted the session while it opened ({err.message})",
                retry_after_s=err.retry_after_s or 2,
            )
        if isinstance(err, StageBusy):
            return Overloaded(
                f"every route tried is full right now ({err.message}); retry later",
                retry_after_s=err.retry_after_s or 2,
            )
        return err
