"""The node's KV pool: block accounting for the positions sessions hold (pure).

One pool per node. Sessions take KV in blocks of :data:`BLOCK_TOKENS`
positions as they grow -- nothing is reserved when a session opens -- and give
blocks back when they are truncated, released, cancelled or fail. The pool
never overcommits: a growth that does not fit is refused whole (the engine
then refuses that piece of work and touches no KV).

Invariants: ``0 <= used_blocks <= total_blocks``; ``used_blocks`` is the sum
of every session's ``blocks_for(positions)``; a session absent from the pool
holds nothing. The engine maps blocks to llama.cpp cells of one unified KV
stream (docs/engine.md, "The KV pool"): a session holding ``p`` positions
uses ``p`` cells, at most ``16 * blocks_for(p)``, so the cells in use never
exceed the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_TOKENS = 16


def blocks_for(positions: int) -> int:
    """Blocks that hold ``positions`` KV positions."""
    return -(-max(0, positions) // BLOCK_TOKENS)


@dataclass(frozen=True)
class PoolStats:
    total_blocks: int
    used_blocks: int
    sessions: int

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    @property
    def total_tokens(self) -> int:
        return self.total_blocks * BLOCK_TOKENS

    @property
    def free_tokens(self) -> int:
        return self.free_blocks * BLOCK_TOKENS


class KvPool:
    """Blocks held per session against a fixed total."""

    def __init__(self, total_tokens: int) -> None:
        if total_tokens < BLOCK_TOKENS:
            raise ValueError(f"a KV pool needs at least {BLOCK_TOKENS} positions, got {total_tokens}")
        self.total_blocks = total_tokens // BLOCK_TOKENS
        self._held: dict[str, int] = {}  # session -> positions it holds
        self._used = 0

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self._used

    def positions(self, session: str) -> int:
        return self._held.get(session, 0)

    def growth_blocks(self, session: str, positions: int) -> int:
        """Extra blocks ``session`` needs to hold ``positions`` positions (0 if it holds enough)."""
        return max(0, blocks_for(positions) - blocks_for(self._held.get(session, 0)))

    def fits(self, extra_blocks: int) -> bool:
        return extra_blocks <= self.free_blocks

    def resize(self, session: str, positions: int) -> bool:
        """Make ``session`` hold ``positions`` positions; False (and nothing changed) if it would not fit."""
        if positions < 0:
            raise ValueError(f"positions must be >= 0, got {positions}")
        delta = blocks_for(positions) - blocks_for(self._held.get(session, 0))
        if delta > self.free_blocks:
            return False
        self._used += delta
        if positions:
            self._held[session] = positions
        else:
            self._held.pop(session, None)
        return True

    def move(self, source: str, target: str) -> None:
        """``target`` takes over what ``source`` holds (a kept session reopened under another id)."""
        held = self._held.pop(source, 0)
        if target in self._held:
            self._used -= blocks_for(self._held.pop(target))
        if held:
            self._held[target] = held

    def release(self, session: str) -> int:
        """Give back everything ``session`` holds; returns the blocks freed."""
        freed = blocks_for(self._held.pop(session, 0))
        self._used -= freed
        return freed

    def stats(self) -> PoolStats:
        return PoolStats(self.total_blocks, self._used, len(self._held))
