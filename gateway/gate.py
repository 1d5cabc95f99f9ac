"""The trio shell around :class:`gateway.admission.AdmissionPolicy`: waiting for a session slot.

``async with gate.slot(client):`` admits at once, waits in the FIFO queue (at
most ``queue_timeout_s``, then 503), or refuses at once (503 queue full, 429
client limit), each refusal carrying ``Retry-After``. Leaving the block frees
the slot and wakes the next waiter. A waiter cancelled while queued (its
client went away) leaves the queue; one cancelled just as it was promoted
gives its slot back.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from gateway.admission import AdmissionPolicy, AdmissionStats
from gateway.errors import Overloaded, RateLimited


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
