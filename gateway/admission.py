"""Admission policy: how many Route Sessions run, how many requests wait, who is refused (pure).

State machine of one request::

    arrive --decide()--> ADMIT  (a session slot is free and nobody waits)
                     --> QUEUE  (all slots busy, queue has room, client under its limit)
                     --> REJECT (queue full -> 503 "overloaded"; client at its limit -> 429)
    QUEUE  --promote()--> ADMIT  (first in line when a slot frees: FIFO)
           --abandon()--> gone   (queue wait timed out -> 503, or the client went away)
    ADMIT  --release()--> gone

Invariants: ``active <= max_sessions``; ``len(queue) <= max_queue``; a client
never holds more than ``max_per_client`` admitted plus queued requests (0 = no
limit); no waiting request is skipped while a slot is free. ``Retry-After``
estimates when a slot frees from the mean session time.

No clock and no event loop: the trio shell (``gateway.gate``) owns waiting.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class Decision:
    action: str  # "admit", "queue" or "reject"
    status: int = 200  # for "reject": 503 or 429
    reason: str = ""
    retry_after_s: int = 0


@dataclass(frozen=True)
class AdmissionStats:
    active: int
    queued: int
    max_sessions: int
    max_queue: int
    admitted_total: int
    rejected_total: int


class AdmissionPolicy:
    def __init__(
        self, max_sessions: int, max_queue: int, max_per_client: int = 0, mean_session_s: float = 5.0
    ) -> None:
        if max_sessions < 1 or max_queue < 0 or max_per_client < 0:
            raise ValueError("max_sessions >= 1, max_queue >= 0, max_per_client >= 0")
        self.max_sessions = max_sessions
        self.max_queue = max_queue
        self.max_per_client = max_per_client
        self._active: dict[int, str] = {}  # ticket -> client
        self._queue: OrderedDict[int, str] = OrderedDict()
        self._per_client: dict[str, int] = {}
        self._mean_s = mean_session_s
        self._admitted = 0
        self._rejected = 0

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            len(self._active),
            len(self._queue),
            self.max_sessions,
            self.max_queue,
            self._admitted,
            self._rejected,
        )

    def retry_after_s(self) -> int:
        """Seconds until a slot plausibly frees for one more request: waves of sessions ahead of it."""
        waves = (len(self._queue) + 1) / self.max_sessions
        return max(1, min(60, math.ceil(self._mean_s * waves)))

    def decide(self, ticket: int, client: str) -> Decision:
        if self.max_per_client and self._per_client.get(client, 0) >= self.max_per_client:
            self._rejected += 1
            return Decision(
                "reject",
                429,
                f"client has {self.max_per_client} requests in flight (the limit)",
                self.retry_after_s(),
            )
        if len(self._active) < self.max_sessions and not self._queue:
            self._take(ticket, client)
            return Decision("admit")
        if len(self._queue) >= self.max_queue:
            self._rejected += 1
            return Decision(
                "reject",
                503,
                f"{len(self._active)} sessions running and {len(self._queue)} "
                f"requests queued (limits {self.max_sessions} and {self.max_queue})",
                self.retry_after_s(),
            )
        self._queue[ticket] = client
        self._per_client[client] = self._per_client.get(client, 0) + 1
        return Decision("queue")

    def _take(self, ticket: int, client: str) -> None:
        self._active[ticket] = client
        self._per_client[client] = self._per_client.get(client, 0) + 1
        self._admitted += 1

    def promote(self) -> list[int]:
        """Move waiting requests into free slots, first come first served; returns their tickets."""
        moved: list[int] = []
        while self._queue and len(self._active) < self.max_sessions:
            ticket, client = self._queue.popitem(last=False)
            self._active[ticket] = client
            self._admitted += 1
            moved.append(ticket)
        return moved

    def _drop_client(self, client: str) -> None:
        left = self._per_client.get(client, 0) - 1
        if left > 0:
            self._per_client[client] = left
        else:
            self._per_client.pop(client, None)

    def abandon(self, ticket: int) -> None:
        """A queued request gives up (timeout or disconnect); it never ran."""
        client = self._queue.pop(ticket, None)
        if client is not None:
            self._rejected += 1
            self._drop_client(client)

    def release(self, ticket: int, session_s: float | None = None) -> None:
        """An admitted request ends; ``session_s`` feeds the Retry-After estimate."""
        client = self._active.pop(ticket, None)
        if client is None:
            return
        self._drop_client(client)
        if session_s is not None and session_s >= 0:
            self._mean_s = 0.8 * self._mean_s + 0.2 * session_s

    def is_active(self, ticket: int) -> bool:
        return ticket in self._active


@dataclass(frozen=True)
class KvWaitStats:
    waiting: int
    max_waiters: int
    waits_total: int  # requests (and preempted sessions) that entered the wait
    served_total: int  # ... and left it with a route that had room
    rejected_total: int  # refused at once: the wait was full
    timed_out_total: int  # gave up after kv_wait_s
    waited_s_total: float  # time spent waiting by those that left the wait


class KvWaitPolicy:
    """Who waits for KV room, first come first served (pure).

    A request whose prompt plus ``max_tokens`` fits some route's context but no
    route's free KV now, and a session a node preempted, wait here::

        enter() --> QUEUE  (room in the wait: it waits its turn)
                --> REJECT (``max_waiters`` already wait -> 503 kv_exhausted)
        QUEUE --leave(served=True)-->  gone (it found a route with room)
              --leave(served=False)--> gone (timed out -> 503 kv_exhausted, or the client left)

    Only the first in line tries the routes again (:meth:`is_first`), so a long
    request is not overtaken for ever by short ones that happen to fit a gap.
    Invariants: ``waiting <= max_waiters``; order of arrival is kept.
    ``Retry-After`` estimates from the mean of the waits served so far.
    """

    def __init__(self, max_waiters: int, mean_wait_s: float = 5.0) -> None:
        if max_waiters < 0:
            raise ValueError("max_waiters >= 0")
        self.max_waiters = max_waiters
        self._queue: OrderedDict[int, float] = OrderedDict()  # ticket -> when it entered
        self._mean_s = mean_wait_s
        self._waits = 0
        self._served = 0
        self._rejected = 0
        self._timed_out = 0
        self._waited_s = 0.0

    def stats(self) -> KvWaitStats:
        return KvWaitStats(
            len(self._queue),
            self.max_waiters,
            self._waits,
            self._served,
            self._rejected,
            self._timed_out,
            self._waited_s,
        )

    def retry_after_s(self) -> int:
        """Seconds until KV room plausibly comes for one more: the waits ahead of it, each a mean wait."""
        return max(1, min(60, math.ceil(self._mean_s * (len(self._queue) + 1))))

    def enter(self, ticket: int, now: float) -> Decision:
        if ticket in self._queue:
            return Decision("queue")
        if len(self._queue) >= self.max_waiters:
            self._rejected += 1
            return Decision(
                "reject",
                503,
                f"{len(self._queue)} requests already wait for KV room (the limit)",
                self.retry_after_s(),
            )
        self._queue[ticket] = now
        self._waits += 1
        return Decision("queue")

    def is_first(self, ticket: int) -> bool:
        return next(iter(self._queue), None) == ticket

    def is_waiting(self, ticket: int) -> bool:
        return ticket in self._queue

    def leave(self, ticket: int, now: float, *, served: bool, timed_out: bool = False) -> None:
        since = self._queue.pop(ticket, None)
        if since is None:
            return
        waited = max(0.0, now - since)
        self._waited_s += waited
        if served:
            self._served += 1
            self._mean_s = 0.8 * self._mean_s + 0.2 * waited
        elif timed_out:
            self._timed_out += 1


def kv_room(free_per_stage: Sequence[int | None]) -> int | None:
    """Free KV positions a route has for a new request: its tightest stage's, None if no stage said."""
    known = [f for f in free_per_stage if f is not None]
    return min(known) if known else None


def fits_kv(free_per_stage: Sequence[int | None], need_tokens: int) -> bool:
    """A route can hold ``need_tokens`` more KV positions on every stage (unknown stages are trusted)."""
    room = kv_room(free_per_stage)
    return room is None or room >= need_tokens


def least_loaded(routes: Sequence[R], load: Callable[[R], int], cost: Callable[[R], float]) -> R:
    """The route with the least load (sessions in flight on its nodes); ties go to the cheaper route,
    then the first listed."""
    if not routes:
        raise ValueError("no routes to choose from")
    best = min(range(len(routes)), key=lambda i: (load(routes[i]), cost(routes[i]), i))
    return routes[best]


def cheapest_now(
    routes: Sequence[R],
    cost_now: Callable[[R], float | None],
    load: Callable[[R], int],
    cost: Callable[[R], float],
) -> R:
    """The route cheapest at its stages' load now (``cost_now``: its expected time per token
    re-priced, ``common.route_cost.repriced_ms``), ties to the less loaded, then the first listed.
    Unless every route can be re-priced (``cost_now`` None: the tracker sent no load figures): then
    :func:`least_loaded` (``load``, ties to the lower ``cost``, the tracker's price)."""
    if not routes:
        raise ValueError("no routes to choose from")
    priced = [cost_now(r) for r in routes]
    if any(p is None for p in priced):
        return least_loaded(routes, load, cost)
    best = min(range(len(routes)), key=lambda i: (priced[i], load(routes[i]), i))
    return routes[best]


def route_context(session_max_per_stage: Sequence[int | None]) -> int | None:
    """The most positions one session may hold on a route: its tightest stage's, None if no stage said."""
    known = [m for m in session_max_per_stage if m is not None]
    return min(known) if known else None


def kv_verdict(need_tokens: int, largest_context: int | None, free_per_route: Sequence[int | None]) -> str:
    """What to do with a request needing ``need_tokens`` positions on every stage.

    ``largest_context``: the most positions any route of the swarm lets one session hold (None:
    unknown); ``free_per_route``: each candidate route's free room now (:func:`kv_room`; None:
    unknown, trusted). "too_long" (413: no route can ever hold it), "fits" (some route has room,
    or nobody said) or "wait" (it fits the swarm, not its free KV now)."""
    if largest_context is not None and need_tokens > largest_context:
        return "too_long"
    if not free_per_route or any(f is None or f >= need_tokens for f in free_per_route):
        return "fits"
    return "wait"
