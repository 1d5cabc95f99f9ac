"""The Responses API's stored responses, for ``previous_response_id`` and ``GET /v1/responses/{id}`` (pure).

Each entry is one response of one owner (the API key's principal, or the
anonymous client's address): the conversation up to and including that
response as chat messages (what the next turn's prompt is built from) and the
response object itself. Bounded three ways: entries older than ``ttl_s`` are
gone, at most ``max_entries`` are kept, and their sizes (JSON characters)
add up to at most ``max_chars``; the least recently used go first. Another
owner's id reads as absent, so ids cannot be probed across keys.

No clock of its own: every call takes ``now`` (seconds, any monotonic clock).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stored:
    owner: str
    history: tuple[Mapping[str, Any], ...]  # chat messages, instructions excluded
    body: Mapping[str, Any]  # the response object
    stored_at: float
    chars: int


@dataclass(frozen=True)
class StoreStats:
    entries: int
    chars: int
    evicted_total: int


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, max_chars: int) -> None:
        if max_entries < 0 or ttl_s < 0 or max_chars < 0:
            raise ValueError("max_entries, ttl_s and max_chars must be >= 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_chars = max_chars
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0
        self._evicted = 0

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._chars -= entry.chars

    def _expire(self, now: float) -> None:
        stale = [k for k, e in self._entries.items() if now - e.stored_at > self.ttl_s]
        for key in stale:
            self._drop(key)
            self._evicted += 1

    def put(
        self,
        owner: str,
        response_id: str,
        history: Sequence[Mapping[str, Any]],
        body: Mapping[str, Any],
        now: float,
    ) -> bool:
        """Keep one response; False when it alone is larger than the whole store (not kept)."""
        chars = len(json.dumps([list(history), body], separators=(",", ":")))
        if self.max_entries == 0 or chars > self.max_chars:
            return False
        self._expire(now)
        if response_id in self._entries:
            self._drop(response_id)
        while self._entries and (
            len(self._entries) >= self.max_entries or self._chars + chars > self.max_chars
        ):
            self._drop(next(iter(self._entries)))
            self._evicted += 1
        self._entries[response_id] = Stored(owner, tuple(history), body, now, chars)
        self._chars += chars
        return True

    def get(self, owner: str, response_id: str, now: float) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        if now - entry.stored_at > self.ttl_s:
            self._drop(response_id)
            self._evicted += 1
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, owner: str, response_id: str, now: float) -> bool:
        if self.get(owner, response_id, now) is None:
            return False
        self._drop(response_id)
        return True

    def statistics(self) -> StoreStats:
        return StoreStats(len(self._entries), self._chars, self._evicted)
