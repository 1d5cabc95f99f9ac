"""The trio shell around :class:`gateway.admission.AdmissionPolicy`: waiting for a session slot.

``async with gate.slot(client):`` admits at once, waits in the FIFO queue (at
most ``queue_timeout_s``, then 503), or refuses at once (503 queue full, 429
client limit), each refusal carrying ``Retry-After``. Leaving the block frees
the slot and wakes the next waiter. A waiter cancelled while queued (its
client went away) leaves the queue; one cancelled just as it was promoted
gives its slot back.

:class:`KvGate` is the shell around :class:`gateway.admission.KvWaitPolicy`:
``async with kv_gate.waiting() as waiter`` enters the wait for KV room (or
raises :class:`KvExhausted` at once when the wait is full); ``await
waiter.turn()`` returns when this waiter is first in line and a session of
this gateway ended (its KV freed) or ``retry_s`` passed, so the caller tries
the routes again; past ``wait_s`` from entering it raises
:class:`KvExhausted` with ``Retry-After``. Leaving the block leaves the wait.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from gateway.admission import AdmissionPolicy, AdmissionStats, KvWaitPolicy, KvWaitStats
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


class KvWaiter:
    """One request's place in the wait for KV room (see :class:`KvGate`)."""

    def __init__(self, gate: KvGate, ticket: int, entered: float, deadline: float) -> None:
        self._gate = gate
        self.ticket = ticket
        self.entered = entered
        self.deadline = deadline
        self.served = False
        self.turns = 0

    async def turn(self, hint_s: float = 0.0) -> None:
        """Wait until first in line and a session ended or ``retry_s`` passed (at least ``hint_s``,
        a node's retry_after hint, at most ``retry_s``); KvExhausted past the deadline."""
        gate = self._gate
        self.turns += 1
        try:
            with trio.fail_at(self.deadline):
                floor = min(max(0.0, hint_s), gate.retry_s)
                if floor:
                    await trio.sleep(floor)
                while not gate.policy.is_first(self.ticket):
                    await gate.moved.wait()
                with trio.move_on_after(gate.retry_s):
                    await gate.freed.wait()
        except trio.TooSlowError as err:
            gate.leave(self, timed_out=True)
            raise KvExhausted(
                f"no route had KV room for this request within {gate.wait_s:g} s; retry later",
                retry_after_s=gate.policy.retry_after_s(),
            ) from err


class KvGate:
    def __init__(self, policy: KvWaitPolicy, *, wait_s: float, retry_s: float) -> None:
        self.policy = policy
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.freed = trio.Event()  # set (and replaced) when a session of this gateway ends
        self.moved = trio.Event()  # set (and replaced) when someone leaves the wait
        self._tickets = itertools.count(1)

    def statistics(self) -> KvWaitStats:
        return self.policy.stats()

    def notify_freed(self) -> None:
        """A session ended (its stages freed its KV): the first in line tries again now."""
        self.freed.set()
        self.freed = trio.Event()

    def leave(self, waiter: KvWaiter, *, timed_out: bool = False) -> None:
        if not self.policy.is_waiting(waiter.ticket):
            return
        self.policy.leave(waiter.ticket, trio.current_time(), served=waiter.served, timed_out=timed_out)
        self.moved.set()
        self.moved = trio.Event()

    def enter(self) -> KvWaiter:
        """A place at the end of the wait; KvExhausted (503, Retry-After) when the wait is full. The
        caller must :meth:`leave` it (:meth:`waiting` does)."""
        ticket = next(self._tickets)
        now = trio.current_time()
        decision = self.policy.enter(ticket, now)
        if decision.action == "reject":
            raise KvExhausted(
                f"no route has KV room for this request now and {decision.reason}; retry later",
                retry_after_s=decision.retry_after_s,
            )
        return KvWaiter(self, ticket, now, now + self.wait_s)

    @asynccontextmanager
    async def waiting(self) -> AsyncIterator[KvWaiter]:
        waiter = self.enter()
        try:
            yield waiter
        finally:
            self.leave(waiter)
