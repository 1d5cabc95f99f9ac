"""The trio shell around :class:`gateway.admission.AdmissionPolicy`: waiting for a session slot.

``async with gate.slot(client):`` admits at once, waits in the FIFO queue (at
most ``queue_timeout_s``, then 503), or refuses at once (503 queue full, 429
client limit), each refusal carrying ``Retry-After``. Leaving the block frees
the slot and wakes the next waiter. A waiter cancelled while queued (its
client went away) leaves the queue; one cancelled just as it was promoted
gives its slot back.

:class:`KvGate` is the shell around :class:`gateway.admission.KvWaitPolicy` and
:class:`gateway.admission.KvLedger`: ``async with kv_gate.waiting(model, need) as waiter`` enters
the wait for KV room (or raises :class:`KvExhausted` at once when the wait is full); ``await
waiter.turn()`` returns when the policy names this waiter on the room the gateway believes its
routes have (``kv_admission``: fifo, fit or shortest, with the starvation bound), or when nothing
changed for ``retry_s`` and it would go first were there room (then on fresh figures), so the
caller tries the routes again; past ``wait_s`` from entering it raises :class:`KvExhausted` with
``Retry-After``. Leaving the block leaves the wait. The gate also counts, per node, this gateway's
sessions holding their whole prompt (from their first token to their end or preemption) and the
most at once.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from gateway.admission import AdmissionPolicy, AdmissionStats, KvLedger, KvWaitPolicy, KvWaitStats
from gateway.errors import KvExhausted, Overloaded, RateLimited


class Gate:
    def __init__(self, policy: AdmissionPolicy, *, queue_timeout_s: float) -> None:
        self._policy = policy
        self._timeout_s = queue_timeout_s
        self._waiters: dict[int, trio.Event] = {}
        self._tickets = itertools.count(1)

    def statistics(self) -> AdmissionStats:
        return self._policy.stats()

    def _release(self, ticket: int, session_s: float | None) -> None:
        self._policy.release(ticket, session_s)
        for promoted in self._policy.promote():
            event = self._waiters.pop(promoted, None)
            if event is not None:
                event.set()

    @asynccontextmanager
    async def slot(self, client: str) -> AsyncIterator[None]:
        ticket = next(self._tickets)
        decision = self._policy.decide(ticket, client)
        if decision.action == "reject":
            cls = RateLimited if decision.status == 429 else Overloaded
            raise cls(
                f"The gateway is at capacity: {decision.reason}. Retry later.",
                retry_after_s=decision.retry_after_s,
            )
        if decision.action == "queue":
            event = trio.Event()
            self._waiters[ticket] = event
            try:
                with trio.fail_after(self._timeout_s):
                    await event.wait()
            except trio.TooSlowError as err:
                self._waiters.pop(ticket, None)
                self._policy.abandon(ticket)
                raise Overloaded(
                    f"The gateway is at capacity: no session slot freed within "
                    f"{self._timeout_s:g} s. Retry later.",
                    retry_after_s=self._policy.retry_after_s(),
                ) from err
            except BaseException:
                self._waiters.pop(ticket, None)
                if self._policy.is_active(ticket):
                    self._release(ticket, None)
                else:
                    self._policy.abandon(ticket)
                raise
        started = trio.current_time()
        try:
            yield
        finally:
            self._release(ticket, trio.current_time() - started)


class KvShort(KvExhausted):
    """No route has the request's KV room now as this gateway believes it, or others wait for room
    before it: it waits in the KV wait, needing ``need_tokens`` positions on every stage."""

    def __init__(
        self, message: str, *, need_tokens: int, queued: bool = False, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.need_tokens = need_tokens
        self.queued = queued  # it did not try: others wait before it (it may go at once when named)


class KvWaiter:
    """One request's place in the wait for KV room (see :class:`KvGate`)."""

    def __init__(
        self, gate: KvGate, ticket: int, entered: float, deadline: float, key: str, rkey: int | None
    ) -> None:
        self._gate = gate
        self.ticket = ticket
        self.entered = entered
        self.deadline = deadline
        self.key = key  # the model it waits for
        self.rkey = rkey  # the request's key in the ledger (what a try commits under)
        self.served = False
        self.turns = 0

    def set_need(self, need: int) -> None:
        self._gate.policy.set_need(self.ticket, need)
        self._gate.changed_now()

    async def turn(self, hint_s: float = 0.0, *, after_try: bool = True) -> bool:
        """Wait until this waiter may try the routes (:meth:`KvWaitPolicy.next_up` names it, on the
        room this gateway believes its routes have), or -- when nobody may -- until ``retry_s``
        passed and it would go first were there room (it looks at fresh figures for everyone).
        ``after_try``: it has just tried and found no room, so it waits for a change (a session
        ended, a waiter left) first; False: it did not try (others waited before it). ``hint_s``: a node's
        retry_after, slept first (at most ``retry_s``). True when let through on the timer (the
        caller looks at fresh figures). KvExhausted past the deadline."""
        gate = self._gate
        again = after_try
        self.turns += 1
        gate.stop_trying(self)
        stale = False
        try:
            with trio.fail_at(self.deadline):
                floor = min(max(0.0, hint_s), gate.retry_s)
                if floor:
                    await trio.sleep(floor)
                while True:
                    if not again and gate.may_try(self):
                        break
                    again = False
                    changed = gate.changed
                    with trio.move_on_after(gate.retry_s) as idle:
                        await changed.wait()
                    if idle.cancelled_caught and gate.would_go_first(self):
                        stale = True
                        break  # nothing changed for retry_s: try on fresh figures
            gate.start_trying(self)
            return stale
        except trio.TooSlowError as err:
            gate.leave(self, timed_out=True)
            raise KvExhausted(
                f"no route had KV room for this request within {gate.wait_s:g} s; retry later",
                retry_after_s=gate.policy.retry_after_s(),
            ) from err


class KvGate:
    """The wait for KV room, in the order of :class:`KvWaitPolicy`, and the ledger of the KV this
    gateway committed (:class:`KvLedger`) that rooms are computed with.

    ``room(key)``: the most positions one route of model ``key`` can take now as this gateway
    believes it (announced less committed, ``RouteChoice.kv_room_now``); None = not known (the
    waiters then go in order and the routes decide). Waiters let through and still trying hold
    their need out of that room until they are served or turn again, so a burst of waiters is not
    let through on one figure."""

    def __init__(
        self,
        policy: KvWaitPolicy,
        *,
        wait_s: float,
        retry_s: float,
        ledger: KvLedger | None = None,
        room: Callable[[str], int | None] | None = None,
    ) -> None:
        self.policy = policy
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.ledger = ledger if ledger is not None else KvLedger(lag_s=15.0)
        self.room: Callable[[str], int | None] = room if room is not None else (lambda key: None)
        self.changed = trio.Event()  # set (and replaced) when a session ends, a waiter leaves or tries
        self._tickets = itertools.count(1)
        self._trying: dict[int, KvWaiter] = {}  # ticket -> waiter let through, not served yet
        self._holding: dict[str, int] = {}  # node id -> sessions of this gateway holding their whole prompt
        self._holding_peak: dict[str, int] = {}
        self._holders: dict[int, tuple[str, ...]] = {}  # request key -> its route's nodes

    def statistics(self) -> KvWaitStats:
        return self.policy.stats()

    def changed_now(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def notify_freed(self) -> None:
        """A session ended (its stages freed its KV): the waiters look again now."""
        self.changed_now()

    # -- whose turn ----------------------------------------------------------------------------

    def _room_left(self, key: str) -> int | None:
        room = self.room(key)
        if room is None:
            return None
        held = 0
        for w in self._trying.values():
            if w.key == key:
                need = self.policy.need(w.ticket)
                held += need or 0
        return max(0, room - held)

    def may_try(self, waiter: KvWaiter) -> bool:
        return self.policy.next_up(trio.current_time(), self._room_left, skip=self._trying) == waiter.ticket

    def would_go_first(self, waiter: KvWaiter) -> bool:
        return self.policy.next_up(trio.current_time(), lambda key: None, skip=self._trying) == waiter.ticket

    def start_trying(self, waiter: KvWaiter) -> None:
        self._trying[waiter.ticket] = waiter
        self.changed_now()  # the next in line may fit the room left too

    def stop_trying(self, waiter: KvWaiter) -> None:
        if self._trying.pop(waiter.ticket, None) is not None:
            self.changed_now()

    def must_wait(self, rkey: int, key: str) -> bool:
        """A request not let through by the wait finds others of its model waiting: it waits its turn."""
        if any(w.rkey == rkey for w in self._trying.values()):
            return False
        return self.policy.waiting_for(key)

    # -- in and out ----------------------------------------------------------------------------

    def leave(self, waiter: KvWaiter, *, timed_out: bool = False) -> None:
        self._trying.pop(waiter.ticket, None)
        if not self.policy.is_waiting(waiter.ticket):
            return
        self.policy.leave(waiter.ticket, trio.current_time(), served=waiter.served, timed_out=timed_out)
        self.changed_now()

    def enter(self, key: str = "", need: int | None = None, rkey: int | None = None) -> KvWaiter:
        """A place in the wait; KvExhausted (503, Retry-After) when the wait is full. The caller
        must :meth:`leave` it (:meth:`waiting` does)."""
        ticket = next(self._tickets)
        now = trio.current_time()
        decision = self.policy.enter(ticket, now, need, key)
        if decision.action == "reject":
            raise KvExhausted(
                f"no route has KV room for this request now and {decision.reason}; retry later",
                retry_after_s=decision.retry_after_s,
            )
        return KvWaiter(self, ticket, now, now + self.wait_s, key, rkey)

    @asynccontextmanager
    async def waiting(self, key: str = "", need: int | None = None) -> AsyncIterator[KvWaiter]:
        waiter = self.enter(key, need)
        try:
            yield waiter
        finally:
            self.leave(waiter)

    # -- sessions holding their whole prompt ---------------------------------------------------

    def holding(self, rkey: int, nodes: tuple[str, ...]) -> None:
        """A session's whole prompt is in every stage's KV (its first token came)."""
        if rkey in self._holders:
            return
        self._holders[rkey] = nodes
        for node in nodes:
            n = self._holding.get(node, 0) + 1
            self._holding[node] = n
            if n > self._holding_peak.get(node, 0):
                self._holding_peak[node] = n
        if len(self._holding_peak) > 4096:  # bounded: forget idle nodes' peaks
            for node in [k for k in self._holding_peak if k not in self._holding][:1024]:
                del self._holding_peak[node]

    def not_holding(self, rkey: int) -> None:
        """The session ended or was preempted: its stages freed its KV."""
        for node in self._holders.pop(rkey, ()):
            left = self._holding.get(node, 0) - 1
            if left > 0:
                self._holding[node] = left
            else:
                self._holding.pop(node, None)

    def holding_now(self) -> dict[str, int]:
        return dict(self._holding)

    def holding_peak(self) -> dict[str, int]:
        return dict(self._holding_peak)
