"""Kept sessions: released sessions whose KV stays on the engine, the node's evictable cache (pure).

A gateway releasing a session may ask the node to keep its first positions for a while
(``Release.keep_ms``): the next turn of the conversation, or another request sharing the prefix,
opens with a ``KvSource`` naming it and computes only the rest (docs/protocol.md). This table is the
node's record of them; :class:`node.session_machine.FrameServer` decides when to keep and carries
out what leaving means (the engine's ``FreeKv``, the kept outputs released).

Order is recency of use, least recently used first: keeping a session, or copying a prefix out of
one, makes it the most recent. Everything that must give kept KV up takes the least recently used
first -- a new session needing a slot (:meth:`evictable`), the pool needing blocks for a live
session (:meth:`oldest`), the bounds after a keep (:meth:`over_bounds`) -- so a hot shared prefix
is the last to go. The table also keeps the index of what its sessions hold by chained block hashes
(:class:`node.prefix_blocks.PrefixBlocks`: a session's tokens go in when it is kept, out when it
leaves, and it is marked used with it), so the index's order and bounds are the table's. Bounds: at
most ``max_sessions`` entries holding at most ``max_positions`` positions together (with a KV pool,
the pool itself: kept sessions are what it evicts before any live session is preempted; without
one, the configured bound of the per-sequence layout).

No trio, no grpc, no llama.cpp: the ``pure`` import contract holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

from common.prefix_chain import BLOCK_TOKENS
from node.kvpool import blocks_for
from node.prefix_blocks import PrefixBlocks


class Entry(Protocol):
    """What the table needs of an entry (the session machine's record holds more)."""

    @property
    def kv_len(self) -> int: ...

    @property
    def expires_at(self) -> float: ...

    @property
    def first_step(self) -> int: ...  # its first aligned_end positions were computed in steps of this

    @property
    def aligned_end(self) -> int: ...


K = TypeVar("K", bound=Entry)


class KeptSessions(Generic[K]):
    """Session id -> kept entry, least recently used first; see the module docstring."""

    def __init__(self, max_sessions: int, max_positions: int, fingerprint: str = "") -> None:
        if max_sessions < 0 or max_positions < 0:
            raise ValueError(f"bounds must be >= 0, got {max_sessions} sessions, {max_positions} positions")
        self.max_sessions = max_sessions
        self.max_positions = max_positions
        self._entries: OrderedDict[str, K] = OrderedDict()
        self.index = PrefixBlocks(fingerprint)  # the kept tokens by chained block hashes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def __iter__(self) -> Iterator[str]:
        """Session ids, least recently used first (a snapshot: the caller may evict while iterating)."""
        return iter(list(self._entries))

    def get(self, session_id: str) -> K | None:
        return self._entries.get(session_id)

    def positions(self) -> int:
        """KV positions all kept sessions hold."""
        return sum(e.kv_len for e in self._entries.values())

    def blocks(self) -> int:
        """Pool blocks all kept sessions hold."""
        return sum(blocks_for(e.kv_len) for e in self._entries.values())

    def keep(self, session_id: str, entry: K, tokens: Sequence[int] = ()) -> list[str]:
        """Add (or replace) ``session_id`` as the most recently used; returns the ids that must now go
        to stay within the bounds, least recently used first (the caller evicts them). ``tokens``: the
        token ids of its KV (from position 0; what is known of them), indexed up to ``entry.kv_len``."""
        self._entries[session_id] = entry
        self._entries.move_to_end(session_id)
        self.index.add(session_id, tokens[: entry.kv_len])
        return self.over_bounds()

    def over_bounds(self) -> list[str]:
        """The least recently used entries whose eviction brings the table within its bounds."""
        count, held = len(self._entries), self.positions()
        out: list[str] = []
        for sid, entry in self._entries.items():
            if count <= self.max_sessions and held <= self.max_positions:
                break
            out.append(sid)
            count -= 1
            held -= entry.kv_len
        return out

    def used(self, session_id: str) -> None:
        """A prefix was copied out of ``session_id``: it becomes the most recently used."""
        if session_id in self._entries:
            self._entries.move_to_end(session_id)
            self.index.touch(session_id)

    def prefix_source(self, hashes: Sequence[bytes], step: int, positions: int) -> tuple[str, int] | None:
        """What an OPEN naming a prefix by chain hashes (common.prefix_chain.source_id) copies:
        (kept session id, positions) for the first of ``hashes`` (the deepest first) that a kept
        session holds whole -- the first exactly ``positions`` long, each later one shorter -- and
        (``step`` > 0) computed in whole prefill steps of ``step`` from 0; None when none is.

        Tails (``step`` 0, ``positions`` inside a block): ``hashes`` may start with the tail hashes of
        the prompt's tokens after its deepest whole block (common.prefix_chain.tails, the longest
        first), then that block's chain hash: a kept session holding the block whose own next tokens
        give one of them is copied that far (the longest); else the whole blocks as above."""
        if step == 0 and positions % BLOCK_TOKENS:
            found_tail = self._tail_source(hashes, positions)
            if found_tail is not None:
                return found_tail
        for i, chain_hash in enumerate(hashes):
            found = self.index.find(chain_hash)
            entry = None if found is None else self._entries.get(found[0])
            if found is None or entry is None:
                continue
            held = found[1] * BLOCK_TOKENS
            if (held != positions if i == 0 else held >= positions) or entry.kv_len < held:
                continue
            if step > 0 and not (entry.first_step == step and held % step == 0 and held <= entry.aligned_end):
                continue
            return found[0], held
        return None

    def _tail_source(self, hashes: Sequence[bytes], positions: int) -> tuple[str, int] | None:
        whole = positions // BLOCK_TOKENS * BLOCK_TOKENS
        for i, chain_hash in enumerate(hashes[:BLOCK_TOKENS]):
            found = self.index.find(chain_hash)
            if found is None:
                continue  # a tail (or a block no kept session holds)
            if found[1] * BLOCK_TOKENS != whole:
                return None  # the first whole block named is not the one the tails follow
            tail = self.index.find_tail(chain_hash, hashes[:i])
            if tail is None:
                return None
            entry = self._entries.get(tail[0])
            if entry is None or entry.kv_len < tail[1] or tail[1] > positions:
                return None
            return tail
        return None

    def pop(self, session_id: str) -> K | None:
        """Remove an entry (taken over by a new session, or evicted by the caller)."""
        self.index.remove(session_id)
        return self._entries.pop(session_id, None)

    def oldest(self) -> str | None:
        """The least recently used entry, None when empty."""
        return next(iter(self._entries), None)

    def evictable(self, spare: Collection[str]) -> list[str]:
        """Every entry but ``spare`` (a prefix being copied, an id reopened), least recently used first."""
        return [sid for sid in self._entries if sid not in spare]

    def expired(self, now: float) -> list[str]:
        """Entries whose keep has run out at ``now``."""
        return [sid for sid, e in self._entries.items() if now >= e.expires_at]
