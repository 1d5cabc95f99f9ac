"""The node's index of the KV it keeps, by chained hashes of 16-token blocks (pure).

Every kept session (node/kept_sessions.py) is indexed by the chain hashes of its whole blocks
(common/prefix_chain.py: each block's hash covers its parent's, its 16 token ids and the recipe
fingerprint). A hash names one prefix of one model: whichever kept session holds it holds exactly
those tokens' KV, so a new session whose prompt starts with them can start from a copy of it and
compute only the rest (``KvSource.session_id = "blocks:<hex>"``, docs/protocol.md).

* :meth:`PrefixBlocks.find`: the holder of a chain hash (the most recently used when several hold
  it) and the blocks up to it.
* :meth:`PrefixBlocks.longest`: the longest cached prefix of a token list.
* :meth:`PrefixBlocks.find_tail`: a prefix that ends inside a block (a KvSource naming the tail
  hashes of the 1..15 tokens after a whole block, common.prefix_chain.tails): the kept session whose
  own tokens after that block give the longest of them. Two clients' prompts that share a system
  prompt part a few tokens into a block; copying only the whole blocks would leave up to 15 shared
  positions to prefill again, each attending over the whole prefix.
* :meth:`PrefixBlocks.heads`: what the node reports in its heartbeat (bounded): for each kept
  session, most recently used first, the head of its last whole block and of its deepest block that
  another kept session shares (where two conversations of one app part ways: the end of their common
  system prompt), then a ladder of heads at 2, 4, 8 ... blocks, the longest first.

Order and bounds are the kept-session table's: it adds a session when it keeps it, removes it when it
leaves (evicted, expired, taken over) and marks it used when a prefix is copied out of it, so the index
holds exactly the blocks of the kept sessions, and is bounded as they are.

No trio, no grpc, no llama.cpp: the ``pure`` import contract holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from common.prefix_chain import BLOCK_TOKENS, chain, head, tails
from proto.announce import MAX_PREFIX_HEADS

MAX_HEADS = MAX_PREFIX_HEADS  # heads one heartbeat carries (proto.announce refuses more)


class PrefixBlocks:
    """Chain hash -> the kept sessions holding it; sessions least recently used first."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self._chains: OrderedDict[str, list[bytes]] = OrderedDict()
        self._where: dict[bytes, dict[str, int]] = {}  # chain hash -> {session id: its block index}
        self._tokens: dict[str, tuple[int, ...]] = {}  # session id -> its indexed tokens (for tails)

    def __len__(self) -> int:
        return len(self._chains)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._chains

    def blocks(self) -> int:
        """Distinct blocks indexed (a block several sessions share counts once)."""
        return len(self._where)

    def add(self, session_id: str, tokens: Sequence[int]) -> int:
        """Index ``session_id``'s whole blocks of ``tokens`` (replacing what it held) as the most
        recently used; returns the blocks indexed."""
        self.remove(session_id)
        hashes = chain(self.fingerprint, tokens)
        self._chains[session_id] = hashes
        self._tokens[session_id] = tuple(tokens)
        for i, h in enumerate(hashes):
            self._where.setdefault(h, {})[session_id] = i
        return len(hashes)

    def remove(self, session_id: str) -> None:
        self._tokens.pop(session_id, None)
        for h in self._chains.pop(session_id, ()):
            holders = self._where.get(h)
            if holders is not None:
                holders.pop(session_id, None)
                if not holders:
                    del self._where[h]

    def touch(self, session_id: str) -> None:
        """A prefix was copied out of ``session_id``: it becomes the most recently used."""
        if session_id in self._chains:
            self._chains.move_to_end(session_id)

    def find(self, chain_hash: bytes) -> tuple[str, int] | None:
        """(session id, blocks up to and including ``chain_hash``) of the most recently used kept
        session holding it; None when none does."""
        holders = self._where.get(chain_hash)
        if not holders:
            return None
        sid = max(holders, key=self._recency)
        return sid, holders[sid] + 1

    def find_tail(self, parent: bytes, named: Sequence[bytes]) -> tuple[str, int] | None:
        """(session id, positions) of the kept session whose tokens after the whole block ``parent``
        give the longest tail hash among ``named`` (common.prefix_chain.tails; the most recently used
        on a tie); positions end inside the block after ``parent``. None when no holder of ``parent``
        gives any of them."""
        holders = self._where.get(parent)
        if not holders or not named:
            return None
        wanted = set(named)
        best: tuple[int, int, str] | None = None  # (positions, recency, session id)
        for sid, index in holders.items():
            start = (index + 1) * BLOCK_TOKENS
            after = self._tokens.get(sid, ())[start : start + BLOCK_TOKENS - 1]
            hashes = tails(parent, after)
            for k in range(len(hashes), 0, -1):
                if hashes[k - 1] in wanted:
                    key = (start + k, self._recency(sid), sid)
                    if best is None or key[:2] > best[:2]:
                        best = key
                    break
        return None if best is None else (best[2], best[0])

    def longest(self, tokens: Sequence[int]) -> tuple[str, int] | None:
        """The longest cached prefix of ``tokens``: (session id, whole blocks); None when not even the
        first block is held."""
        best: tuple[str, int] | None = None
        for h in chain(self.fingerprint, tokens):
            found = self.find(h)
            if found is None:
                break
            best = found
        return best

    def heads(self, limit: int = MAX_HEADS) -> list[str]:
        """The heads to report (at most ``limit``, no repeats): see the module docstring."""
        recent = list(reversed(self._chains.values()))
        picked: list[bytes] = []
        for hashes in recent:
            if not hashes:
                continue
            picked.append(hashes[-1])
            shared = [i for i, h in enumerate(hashes) if len(self._where[h]) > 1]
            if shared:
                picked.append(hashes[shared[-1]])
        for hashes in recent:
            k = 1
            ladder: list[bytes] = []
            while (1 << k) < len(hashes):
                ladder.append(hashes[(1 << k) - 1])
                k += 1
            picked += reversed(ladder)
        out: list[str] = []
        seen: set[bytes] = set()
        for h in picked:
            if h in seen:
                continue
            seen.add(h)
            out.append(head(h))
            if len(out) >= limit:
                break
        return out

    def _recency(self, session_id: str) -> int:
        for i, sid in enumerate(reversed(self._chains)):
            if sid == session_id:
                return -i
        return -len(self._chains)
