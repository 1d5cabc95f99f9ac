"""Per-identity quotas for the tracker: token buckets in bounded tables, and a per-key nonce share.

Pure logic: no I/O, no event loop, the clock passed in by the caller (seconds,
any monotonic origin), so tests drive it with plain numbers.

:class:`TokenBuckets` keeps one bucket per identity (a source address, or a
signing key after its signature checked out): ``burst`` tokens at most, refilled
at ``rate_per_s``; a request takes ``cost`` tokens or is refused with the
seconds until it would fit (the ``Retry-After`` a client is sent). Bounds:

- the table holds at most ``max_keys`` identities; the least recently used one
  goes first. An evicted identity comes back with a full bucket, which only a
  caller cycling through more than ``max_keys`` identities faster than buckets
  refill can exploit, and the per-address limit bounds how fast one host can.
- a refused request takes nothing, so a client that keeps retrying is not
  starved forever once it slows down to the rate.

``rate_per_s <= 0`` turns a limit off (every request passes, nothing is kept).

:class:`NonceShare` bounds how many unexpired nonces one signing key may hold
in the tracker's in-memory replay cache, so one key flooding signed messages
is refused on its own and cannot fill the cache that every honest node shares.
Its table is bounded by the cache it guards: a key is only counted while it has
a nonce in it.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float  # 0.0 when allowed

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, at least 1 (HTTP's ``Retry-After``)."""
        return str(max(1, math.ceil(self.retry_after_s)))


ALLOWED = Decision(True, 0.0)


@dataclass(frozen=True)
class BucketStatistics:
    keys: int
    allowed: int
    refused: int
    evicted: int


class TokenBuckets:
    def __init__(self, rate_per_s: float, burst: float, max_keys: int) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        if rate_per_s > 0 and burst < 1:
            raise ValueError("burst must be >= 1 when the limit is on")
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.max_keys = max_keys
        # identity -> (tokens at the last update, time of the last update); most recently used last
        self._table: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._allowed = 0
        self._refused = 0
        self._evicted = 0

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    def __len__(self) -> int:
        return len(self._table)

    def take(self, key: str, now_s: float, cost: float = 1.0) -> Decision:
        if not self.enabled:
            return ALLOWED
        cost = min(cost, self.burst)  # a cost over the burst could never pass
        entry = self._table.pop(key, None)
        if entry is None:
            tokens = self.burst
        else:
            before, at_s = entry
            tokens = min(self.burst, before + max(0.0, now_s - at_s) * self.rate_per_s)
        if tokens >= cost:
            self._table[key] = (tokens - cost, now_s)
            self._allowed += 1
            decision = ALLOWED
        else:
            self._table[key] = (tokens, now_s)
            self._refused += 1
            decision = Decision(False, (cost - tokens) / self.rate_per_s)
        while len(self._table) > self.max_keys:
            self._table.popitem(last=False)
            self._evicted += 1
        return decision

    def statistics(self) -> BucketStatistics:
        return BucketStatistics(len(self._table), self._allowed, self._refused, self._evicted)


class NonceShare:
    """At most ``max_per_key`` unexpired nonces per key (see the module docstring)."""

    def __init__(self, max_per_key: int) -> None:
        if max_per_key < 1:
            raise ValueError("max_per_key must be >= 1")
        self.max_per_key = max_per_key
        self._live: dict[str, int] = {}
        self._heap: list[tuple[float, str]] = []  # (expiry, key) of every counted nonce

    def __len__(self) -> int:
        return len(self._heap)

    def keys(self) -> int:
        return len(self._live)

    def _expire(self, now_s: float) -> None:
        while self._heap and self._heap[0][0] < now_s:
            _, key = heapq.heappop(self._heap)
            left = self._live[key] - 1
            if left:
                self._live[key] = left
            else:
                del self._live[key]

    def full(self, key: str, now_s: float) -> bool:
        """Whether ``key`` already holds its share (then its next message is refused)."""
        self._expire(now_s)
        return self._live.get(key, 0) >= self.max_per_key

    def add(self, key: str, expires_at_s: float) -> None:
        """Count a nonce the cache accepted for ``key`` until ``expires_at_s``."""
        self._live[key] = self._live.get(key, 0) + 1
        heapq.heappush(self._heap, (expires_at_s, key))
