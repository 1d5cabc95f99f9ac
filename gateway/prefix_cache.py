"""Which route holds which kept prefix: the gateway's index of warm KV (pure; no I/O, no clock of its own).

After a request whose Route Session was released with ``keep_ms`` (every stage
confirmed), the route keeps the session's KV for the committed tokens (prompt
plus the generated tokens fed back). :class:`PrefixCache` remembers, per entry,
the client it belongs to, the model, the node chain, the session id and those
tokens. A new request looks up the entry of the same client and model whose
tokens share the longest prefix with its prompt; the request then opens on that
route with ``KvSource(session id, positions)`` and prefills only the rest.

Isolation: an entry is found by the client key it was stored under (a hash
of the API key, else the client's address) and only for a prompt whose first
``positions`` tokens are exactly the entry's; the session ids nodes know them by
are 128-bit secrets of this gateway. Shared prefixes: with ``share_min_tokens``
> 0, a request may also start from another client's entry when their prompts
agree on at least that many positions (the same long system prompt and tools of
one chat app): the nodes then *copy* those positions (``KvSource.copy``) and the
entry stays its owner's. Nothing of the other client's beyond the shared tokens
is reachable (a copy is cut at the agreeing positions); what a client can learn
is timing: that some client sent the same first ``share_min_tokens`` or more
tokens recently (docs/gateway.md says so; 0 turns sharing off).

Exactness: llama.cpp's low-order bits depend on how a prompt is cut into
batches, so with ``exact`` a request reuses only positions that the kept
session computed in whole prefill steps from position 0, cut at a multiple of
the step: its prefill then runs in exactly the steps a cold run would use, and
its output is bit-identical to a cold run's. Without it every matching position
is reused (as llama.cpp's own ``cache_prompt`` does), which is faster and may
change low-order bits (rarely a token). The class defaults to ``exact``; the
gateway passes its ``prefix_exact`` setting, which is off by default (the
speed of a warm turn is what most chat clients come for; docs/gateway.md,
"Exactness", has the measured trade-off and says how to turn it on).

An entry is taken (removed) when used: the nodes hand its sequence to the new
session, which is kept again under its own id when it ends. Entries expire a
little before the nodes drop them (``ttl_s``), and they are bounded in number
(``max_entries``, the oldest go first) and per node (``max_per_node``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from common.prefix_chain import BLOCK_TOKENS, MAX_SOURCE_HASHES, chain, parse_source_id, source_id, tails


@dataclass(frozen=True)
class Kept:
    client: str
    model: str  # fingerprint
    nodes: tuple[str, ...]  # the route's node ids, in stage order
    session_id: str
    tokens: tuple[int, ...]
    expires_at: float
    exact: int = 0  # positions computed as a cold run would (whole prefill steps); see lookup()
    step: int = 1  # the session's prefill step


@dataclass(frozen=True)
class Hit:
    entry: Kept
    positions: int  # prompt positions the route can reuse
    shared: bool = False  # another client's entry: copied, and left in the index


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(
        self,
        *,
        ttl_s: float,
        max_entries: int = 1024,
        max_per_node: int = 8,
        min_tokens: int = 16,
        exact: bool = True,
        share_min_tokens: int = 0,
    ) -> None:
        self.exact = exact
        self.share_min_tokens = share_min_tokens
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_per_node = max_per_node
        self.min_tokens = min_tokens
        self._entries: OrderedDict[str, Kept] = OrderedDict()  # by session id, oldest first
        self.hits = 0
        self.shared_hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        client: str,
        model: str,
        nodes: Sequence[str],
        session_id: str,
        tokens: Sequence[int],
        now: float,
        *,
        exact: int = 0,
        step: int = 1,
    ) -> None:
        if len(tokens) < self.min_tokens or self.ttl_s <= 0 or (self.exact and exact < self.min_tokens):
            return
        entry = Kept(
            client,
            model,
            tuple(nodes),
            session_id,
            tuple(tokens),
            now + self.ttl_s,
            min(exact, len(tokens)),
            max(1, step),
        )
        self._entries[session_id] = entry
        self._entries.move_to_end(session_id)
        for node in entry.nodes:  # a node keeps a bounded number of sessions: so does the index
            held = [k for k, e in self._entries.items() if node in e.nodes]
            for k in held[: max(0, len(held) - self.max_per_node)]:
                del self._entries[k]
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def lookup(self, client: str, model: str, prompt: Sequence[int], now: float) -> Hit | None:
        """The entry sharing the longest prefix with ``prompt`` (at least ``min_tokens``, and at least
        one prompt token left to prefill), not removed yet (see :meth:`take`)."""
        best: Hit | None = None
        for sid, entry in list(self._entries.items()):
            if entry.expires_at <= now:
                del self._entries[sid]
                continue
            shared = entry.client != client
            if entry.model != model or (shared and not self.share_min_tokens):
                continue
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if self.exact:
                n = (min(n, entry.exact) // entry.step) * entry.step
            least = max(self.min_tokens, self.share_min_tokens) if shared else self.min_tokens
            # The longest; on a tie the client's own entry (taken over, not copied).
            if n >= least and (best is None or n > best.positions or (n == best.positions and not shared)):
                best = Hit(entry, n, shared)
        return best

    def take(self, hit: Hit | None) -> None:
        """The hit is being used (or was found useless): it leaves the index, unless it is another
        client's shared prefix (copied: its owner still holds it)."""
        if hit is None:
            return
        if not hit.shared:
            self._entries.pop(hit.entry.session_id, None)
        self.shared_hits += hit.shared
        self.hits += 1
        self.reused_tokens += hit.positions

    def forget_node(self, node_id: str) -> None:
        """A node failed or left: what it kept is gone."""
        for sid in [k for k, e in self._entries.items() if node_id in e.nodes]:
            del self._entries[sid]


def with_tails(source: tuple[str, int], prompt: Sequence[int], fingerprint: str) -> tuple[str, int]:
    """A KvSource naming a shared prefix by whole blocks (``blocks:<deepest>+...``, not exact), asking
    for the prompt's positions inside the next block too: the tail hashes of its next 1..15 tokens
    (common.prefix_chain.tails, the longest first; at least one prompt token is left to prefill) go
    before the blocks' hashes, and the positions asked grow by them. A node holding the deepest
    block copies as far as its kept tokens give one of the tails (a node that does not know tails
    copies the whole blocks, and the OPEN's ack says so). Two prompts sharing a system prompt part a
    few tokens into a block: without the tails those positions are prefilled again, each attending
    over the whole prefix. Anything else (a session id, exact reuse by whole steps, a cut inside a
    block, a deepest hash that is not the prompt's) comes back as it was."""
    named = parse_source_id(source[0])
    positions = source[1]
    if named is None or named[1] != 0 or positions % BLOCK_TOKENS or positions < BLOCK_TOKENS:
        return source
    hashes, _step = named
    own = chain(fingerprint, prompt[:positions])
    if len(own) * BLOCK_TOKENS != positions or own[-1] != hashes[0]:
        return source
    after = prompt[positions : min(positions + BLOCK_TOKENS - 1, len(prompt) - 1)]
    if not after:
        return source
    tail = tails(hashes[0], after)[::-1]
    rest = list(hashes[1:])
    room = MAX_SOURCE_HASHES - len(tail) - 1
    if len(rest) > room:
        # Thin the shallower fallbacks evenly, keeping the shallowest (the floor).
        last = len(rest) - 1
        rest = [rest[k] for k in sorted({round(i * last / max(1, room - 1)) for i in range(room)})]
    names = [*tail, hashes[0], *rest]
    return source_id(names[0], 0, names[1:]), positions + len(tail)
