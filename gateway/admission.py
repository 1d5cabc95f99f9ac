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
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TypeVar

from common.prefix_chain import BLOCK_TOKENS

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
    overdue_total: int = 0  # waiters that reached the starvation bound and went first


KV_ADMISSION_ORDERS = ("fifo", "fit", "shortest")


@dataclass
class _Waiting:
    entered: float
    seq: int  # arrival order
    need: int | None  # KV positions it needs on every stage (None: not known yet, taken as fitting)
    key: str  # the pool it waits for (the model): waiters of different models never block each other
    bypassed: int = 0  # waiters that arrived after it and were served before it
    overdue: bool = False  # reached the starvation bound (counted once)


class KvWaitPolicy:
    """Who waits for KV room, and in which order they go (pure).

    A request whose prompt plus ``max_tokens`` fits some route's context but not the free KV the
    gateway believes its routes have now (their last heartbeats less what this gateway committed
    since, :class:`KvLedger`), a request arriving while others of its model wait, and a session a
    node preempted, wait here::

        enter() --> QUEUE  (room in the wait: it waits its turn)
                --> REJECT (``max_waiters`` already wait -> 503 kv_exhausted)
        QUEUE --leave(served=True)-->  gone (it found a route with room)
              --leave(served=False)--> gone (timed out -> 503 kv_exhausted, or the client left)

    :meth:`next_up` names the one waiter that may try the routes now, given the room each model's
    routes have (``room(key)``: the most positions one route can take now, None = not known):

    * ``fifo``: the first in line, when it fits; nobody behind it goes before it (head of line).
    * ``fit``: the first in line that fits.
    * ``shortest``: of those that fit, the one needing the fewest positions (ties: arrival order).

    Starvation bound (``fit`` and ``shortest``): a waiter that later arrivals went before
    ``max_bypass`` times, or that waited ``max_wait_s``, is *overdue*: it goes first, and nobody of
    its model that arrived after it goes until it has (0 turns either bound off). So a waiter is
    bypassed at most ``max_bypass`` times, and not after ``max_wait_s``.

    Invariants: ``waiting <= max_waiters``; among waiters of equal need, arrival order; the waiter
    named fits the room given (or the room is not known). ``Retry-After`` estimates from the mean of
    the waits served so far.
    """

    def __init__(
        self,
        max_waiters: int,
        mean_wait_s: float = 5.0,
        *,
        order: str = "fifo",
        max_bypass: int = 8,
        max_wait_s: float = 30.0,
    ) -> None:
        if max_waiters < 0 or max_bypass < 0 or max_wait_s < 0:
            raise ValueError("max_waiters, max_bypass and max_wait_s must be >= 0")
        if order not in KV_ADMISSION_ORDERS:
            raise ValueError(f"order must be one of {', '.join(KV_ADMISSION_ORDERS)}, not {order!r}")
        self.max_waiters = max_waiters
        self.order = order
        self.max_bypass = max_bypass
        self.max_wait_s = max_wait_s
        self._queue: OrderedDict[int, _Waiting] = OrderedDict()  # ticket -> its wait, in arrival order
        self._seq = 0
        self._mean_s = mean_wait_s
        self._waits = 0
        self._served = 0
        self._rejected = 0
        self._timed_out = 0
        self._overdue = 0
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
            self._overdue,
        )

    def retry_after_s(self) -> int:
        """Seconds until KV room plausibly comes for one more: the waits ahead of it, each a mean wait."""
        return max(1, min(60, math.ceil(self._mean_s * (len(self._queue) + 1))))

    def enter(self, ticket: int, now: float, need: int | None = None, key: str = "") -> Decision:
        if need is not None and need < 0:
            raise ValueError("need must be >= 0")
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
        self._seq += 1
        self._queue[ticket] = _Waiting(now, self._seq, need, key)
        self._waits += 1
        return Decision("queue")

    def set_need(self, ticket: int, need: int) -> None:
        """What a waiter needs, once known (its last try computed it)."""
        waiting = self._queue.get(ticket)
        if waiting is not None and need >= 0:
            waiting.need = need

    def is_first(self, ticket: int) -> bool:
        return next(iter(self._queue), None) == ticket

    def is_waiting(self, ticket: int) -> bool:
        return ticket in self._queue

    def waiting_for(self, key: str) -> bool:
        """Someone waits for room of this model (a newcomer then waits its turn too)."""
        return any(w.key == key for w in self._queue.values())

    def bypassed(self, ticket: int) -> int:
        waiting = self._queue.get(ticket)
        return 0 if waiting is None else waiting.bypassed

    def _is_overdue(self, waiting: _Waiting, now: float) -> bool:
        if self.order == "fifo":
            return False  # nobody is ever bypassed
        return bool(
            (self.max_bypass and waiting.bypassed >= self.max_bypass)
            or (self.max_wait_s and now - waiting.entered >= self.max_wait_s)
        )

    def need(self, ticket: int) -> int | None:
        waiting = self._queue.get(ticket)
        return None if waiting is None else waiting.need

    def next_up(self, now: float, room: Callable[[str], int | None], skip: Container[int] = ()) -> int | None:
        """The waiter that may try the routes now (class docstring), None when none may. ``skip``:
        waiters already trying (not named again; a first-in-line or overdue one still holds the
        rest of its model back)."""
        blocked: set[str] = set()  # models whose first-in-line (fifo) or overdue waiter holds the rest
        best: tuple[tuple[float, ...], int] | None = None
        for ticket, w in self._queue.items():
            if w.key in blocked:
                continue
            if ticket in skip:
                if self.order == "fifo" or self._is_overdue(w, now):
                    blocked.add(w.key)
                continue
            free = room(w.key)
            fits = w.need is None or free is None or w.need <= free
            overdue = self._is_overdue(w, now)
            if overdue and not w.overdue:
                w.overdue = True
                self._overdue += 1
            if overdue or self.order == "fifo":
                blocked.add(w.key)
            if not fits:
                continue
            if overdue:
                rank: tuple[float, ...] = (0, w.seq)
            elif self.order == "shortest":
                rank = (1, math.inf if w.need is None else w.need, w.seq)
            else:
                rank = (1, w.seq)
            if best is None or rank < best[0]:
                best = (rank, ticket)
        return None if best is None else best[1]

    def leave(self, ticket: int, now: float, *, served: bool, timed_out: bool = False) -> None:
        waiting = self._queue.pop(ticket, None)
        if waiting is None:
            return
        waited = max(0.0, now - waiting.entered)
        self._waited_s += waited
        if served:
            self._served += 1
            self._mean_s = 0.8 * self._mean_s + 0.2 * waited
            for other in self._queue.values():  # everyone of its model that came before was bypassed
                if other.seq < waiting.seq and other.key == waiting.key:
                    other.bypassed += 1
        elif timed_out:
            self._timed_out += 1


@dataclass
class _Commit:
    nodes: tuple[str, ...]
    tokens: int  # what was committed: the prompt plus max_tokens
    committed_at: float
    settled_at: float | None = None  # its whole prompt was in every stage's KV from then (first token)
    released_at: float | None = None
    used: int = 0  # positions it held when released (0: gave nothing back we can count on)


class KvLedger:
    """The KV this gateway committed to nodes that their announced free KV may not show yet (pure).

    A node announces its free KV with its heartbeat (at most ``lag_s`` before the tracker's answer
    that carried it, fetched at ``fetched_at``). A burst of requests admitted on that figure would
    all see the same free KV, so each admitted session is committed here, on every node of its
    route, with the positions it needs (prompt plus ``max_tokens``), and :meth:`free` is the
    announced figure less what the figure cannot show yet:

    * a live session whose whole prompt was not in KV ``lag_s`` before the figure was fetched (not
      *settled*: its first token had not come) counts in full;
    * a session this gateway released after the figure was fetched, that was settled before its
      heartbeat, gives its positions back (``used``: prompt plus generated; 0 when its KV was
      kept warm or it was never settled -- its KV may not have been counted);
    * anything else is what the figure shows.

    Conservative where it cannot know (a session half prefilled at the heartbeat counts in full).
    Bounded: released entries go after ``keep_s``, live ones (never released: a path that forgot)
    after ``live_s``, and at most ``max_entries`` (the oldest released first, then the oldest).
    """

    def __init__(
        self, lag_s: float, *, keep_s: float = 120.0, live_s: float = 3600.0, max_entries: int = 4096
    ) -> None:
        if lag_s < 0 or keep_s < 0 or live_s <= 0 or max_entries < 1:
            raise ValueError("lag_s >= 0, keep_s >= 0, live_s > 0, max_entries >= 1")
        self.lag_s = lag_s
        self.keep_s = keep_s
        self.live_s = live_s
        self.max_entries = max_entries
        self._commits: OrderedDict[int, _Commit] = OrderedDict()

    def __len__(self) -> int:
        return len(self._commits)

    def commit(self, key: int, nodes: Sequence[str], tokens: int, now: float) -> None:
        """``key`` (one request's choice) now holds ``tokens`` positions on each of ``nodes``
        (a new commit of the same key replaces the old)."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        self._commits.pop(key, None)
        self._commits[key] = _Commit(tuple(nodes), tokens, now)
        self._trim(now)

    def settle(self, key: int, now: float) -> None:
        """The session's whole prompt is in every stage's KV (its first token came)."""
        c = self._commits.get(key)
        if c is not None and c.released_at is None and c.settled_at is None:
            c.settled_at = now

    def release(self, key: int, now: float, used: int = 0) -> None:
        """The session ended (or was preempted) and every stage freed its KV; ``used`` positions held."""
        c = self._commits.get(key)
        if c is None or c.released_at is not None:
            return
        c.released_at = now
        c.used = max(0, min(used, c.tokens)) if c.settled_at is not None else 0
        self._trim(now)

    def live(self, key: int) -> bool:
        c = self._commits.get(key)
        return c is not None and c.released_at is None

    def adjustment(self, node: str, fetched_at: float) -> int:
        """Positions to add to ``node``'s free KV as announced in an answer fetched at ``fetched_at``."""
        seen_from = fetched_at - self.lag_s  # the heartbeat behind the figure came no earlier
        out = 0
        for c in self._commits.values():
            if node not in c.nodes:
                continue
            shown_used = c.settled_at is not None and c.settled_at < seen_from
            if c.released_at is None:
                if not shown_used:
                    out -= c.tokens
            elif shown_used and c.released_at > fetched_at:
                out += c.used
        return out

    def free(self, node: str, announced: int | None, fetched_at: float) -> int | None:
        """``node``'s free KV as this gateway believes it: announced plus :meth:`adjustment`, at
        least 0; None when the node announced nothing."""
        if announced is None:
            return None
        return max(0, announced + self.adjustment(node, fetched_at))

    def _trim(self, now: float) -> None:
        gone = [
            k
            for k, c in self._commits.items()
            if (c.released_at is not None and c.released_at < now - self.keep_s)
            or (c.released_at is None and c.committed_at < now - self.live_s)
        ]
        for key in gone:
            del self._commits[key]
        while len(self._commits) > self.max_entries:
            released = next((k for k, c in self._commits.items() if c.released_at is not None), None)
            del self._commits[released if released is not None else next(iter(self._commits))]


def kv_room(free_per_stage: Sequence[int | None]) -> int | None:
    """Free KV positions a route has for a new request: its tightest stage's, None if no stage said."""
    known = [f for f in free_per_stage if f is not None]
    return min(known) if known else None


def kv_need(prompt_tokens: int, max_tokens: int | None) -> int:
    """The KV positions a request needs on every stage: its prompt plus ``max_tokens`` (a pool grows on
    demand: without max_tokens, the prompt and one token), rounded up to whole blocks of
    :data:`~common.prefix_chain.BLOCK_TOKENS` -- a node's pool hands out and announces whole blocks, and
    counted in positions a burst of a few dozen sessions overran the pools by up to 15 positions each."""
    positions = max(0, prompt_tokens) + (max_tokens or 1)
    return -(-positions // BLOCK_TOKENS) * BLOCK_TOKENS


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
