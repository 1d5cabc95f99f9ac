"""The simulated clock: a heap of timestamped callbacks.

Invariants
    * time never goes backwards: ``schedule_at`` refuses a time before ``now``;
    * events at the same time run in the order they were scheduled (a
      sequence number breaks ties), so a run is a pure function of its inputs
      and seeds;
    * nothing sleeps: ``run_until`` jumps from event to event.

The hot paths (a node's steps, a frame's hops) schedule with :meth:`EventLoop.push`: the
same heap entry as ``schedule_at`` without the check, for times their callers compute as
``now`` plus a non-negative delay.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events_processed = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count(1)
        heap, seq, heappush = self._heap, self._seq, heapq.heappush

        def push(t: float, fn: Callable[..., None], arg: Any) -> None:
            """``schedule_at(t, fn, arg)`` for a ``t`` known not to be before ``now``."""
            heappush(heap, (t, next(seq), fn, (arg,)))

        self.push = push

    def schedule_at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        if t < self.now:
            raise ValueError(f"cannot schedule at {t} before now={self.now}")
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def schedule_in(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self.schedule_at(self.now + max(delay_s, 0.0), fn, *args)

    def run_until(self, end_s: float) -> None:
        heap = self._heap
        pop = heapq.heappop
        n = 0
        try:
            while heap and heap[0][0] <= end_s:
                t, _seq, fn, args = pop(heap)
                self.now = t
                fn(*args)
                n += 1
        finally:
            self.events_processed += n
        self.now = end_s

    @property
    def pending(self) -> int:
        return len(self._heap)
