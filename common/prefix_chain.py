"""Chained hashes of 16-token blocks: how nodes name the KV prefixes they keep, and how a gateway
recognises them (pure; shared by node/prefix_blocks.py and gateway/route_choice.py).

A prompt's KV is cut into blocks of :data:`BLOCK_TOKENS` positions (the KV pool's block). The hash of
block ``i`` covers the hash of block ``i - 1`` (for the first block: a root derived from the runtime
recipe's fingerprint, which names the model and how it is computed), and the block's 16 token ids. So
equal hashes at block ``i`` mean the same first ``16 * (i + 1)`` tokens of the same model and recipe:
prefix overlap is positional by construction, and a node holding block ``i`` of a chain holds every
block before it.

Two digests per block:

* the **chain hash** (:func:`chain`, 32 bytes of BLAKE2b): what an OPEN names a prefix by
  (``KvSource.session_id = "blocks:<hex>[+<hex>...][/<step>]"``, docs/protocol.md: the deepest
  prefix wanted first, then shallower ones the node may copy instead, at most
  :data:`MAX_SOURCE_HASHES`). Computing it needs the tokens, so only a party that knows the prompt
  can ask a node for the KV behind it.
* the **head** (:func:`head`, 16 bytes, hex): a one-way digest of a chain hash that nodes report in
  their heartbeats and the tracker hands to gateways with its routes. A gateway recognises its
  prompt's heads among them; a head alone does not let anyone open the KV behind it.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence

BLOCK_TOKENS = 16  # = node.kvpool.BLOCK_TOKENS
CHAIN_BYTES = 32
HEAD_BYTES = 16
HEAD_HEX = 2 * HEAD_BYTES
SOURCE_PREFIX = "blocks:"  # KvSource.session_id naming a prefix by its chain hash
MAX_SOURCE_HASHES = 64  # chain hashes one KvSource may name (the deepest first)

_BLOCK = struct.Struct(f"<{BLOCK_TOKENS}I")
_HEAD_RE = re.compile(rf"[0-9a-f]{{{HEAD_HEX}}}")
_CHAIN_RE = re.compile(rf"[0-9a-f]{{{2 * CHAIN_BYTES}}}")


def root(fingerprint: str) -> bytes:
    """The chain's parent of block 0: the recipe fingerprint's own hash."""
    return hashlib.blake2b(
        fingerprint.lower().encode("utf-8"), digest_size=CHAIN_BYTES, person=b"swarm-kv-root"
    ).digest()


def chain(fingerprint: str, tokens: Sequence[int], *, start: bytes | None = None) -> list[bytes]:
    """The chain hashes of the whole blocks of ``tokens`` (a trailing partial block has none).

    ``start``: the hash of the block before ``tokens[0]`` (continuing a chain); None = position 0.
    Token ids must fit 32 bits (ValueError otherwise)."""
    parent = root(fingerprint) if start is None else start
    out: list[bytes] = []
    for i in range(len(tokens) // BLOCK_TOKENS):
        block = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        try:
            packed = _BLOCK.pack(*block)
        except struct.error as err:
            raise ValueError(f"token ids must be 0..2**32-1: {list(block)}") from err
        parent = hashlib.blake2b(parent + packed, digest_size=CHAIN_BYTES, person=b"swarm-kv-block").digest()
        out.append(parent)
    return out


def tails(parent: bytes, tokens: Sequence[int]) -> list[bytes]:
    """The **tail hashes** of the first 1, 2, ... ``len(tokens)`` tokens after the whole block whose
    chain hash is ``parent`` (at most ``BLOCK_TOKENS - 1`` tokens: a whole block has a chain hash).
    A KvSource names them (longest first, before the whole blocks' hashes) to ask for the positions
    of a prompt that agree with a kept session's inside its next block: a node holding ``parent``
    copies as far as its own tokens give one of them, else falls back to the whole blocks. Like a
    chain hash, computing one needs the tokens."""
    if len(tokens) >= BLOCK_TOKENS:
        raise ValueError(f"a tail holds at most {BLOCK_TOKENS - 1} tokens, got {len(tokens)}")
    out: list[bytes] = []
    state = parent
    for token in tokens:
        try:
            packed = struct.pack("<I", token)
        except struct.error as err:
            raise ValueError(f"token ids must be 0..2**32-1: {token}") from err
        state = hashlib.blake2b(state + packed, digest_size=CHAIN_BYTES, person=b"swarm-kv-tail").digest()
        out.append(state)
    return out


def head(chain_hash: bytes) -> str:
    """The reported form of a chain hash: 32 lowercase hex digits, one-way."""
    return hashlib.blake2b(chain_hash, digest_size=HEAD_BYTES, person=b"swarm-kv-head").hexdigest()


def is_head(value: object) -> bool:
    return isinstance(value, str) and _HEAD_RE.fullmatch(value) is not None


def source_id(chain_hash: bytes, step: int = 0, fallbacks: Sequence[bytes] = ()) -> str:
    """``KvSource.session_id`` naming the prefix that ends with ``chain_hash``; ``step`` > 0 asks for
    a copy only if the holder computed those positions in whole prefill steps of ``step`` from 0 (so
    the rest runs in the batches a cold run uses: bit-exact). ``fallbacks``: chain hashes of shorter
    prefixes of the same prompt, deepest first, that the node copies instead when it does not hold
    ``chain_hash`` (the first it holds; the OPEN's ack says how many positions it copied). At most
    :data:`MAX_SOURCE_HASHES` hashes in all (ValueError)."""
    hashes = [chain_hash, *fallbacks]
    if len(hashes) > MAX_SOURCE_HASHES:
        raise ValueError(f"a KvSource names at most {MAX_SOURCE_HASHES} chain hashes, got {len(hashes)}")
    return SOURCE_PREFIX + "+".join(h.hex() for h in hashes) + (f"/{step}" if step > 0 else "")


def parse_source_id(value: str) -> tuple[tuple[bytes, ...], int] | None:
    """(chain hashes, deepest first; step) of a :func:`source_id`; None for anything else (a
    session id, or more than :data:`MAX_SOURCE_HASHES` hashes)."""
    if not value.startswith(SOURCE_PREFIX):
        return None
    body, _, step = value[len(SOURCE_PREFIX) :].partition("/")
    parts = body.split("+", MAX_SOURCE_HASHES)
    if (
        len(parts) > MAX_SOURCE_HASHES
        or any(_CHAIN_RE.fullmatch(p) is None for p in parts)
        or (step and not step.isdigit())
        or len(step) > 9
    ):
        return None
    return tuple(bytes.fromhex(p) for p in parts), int(step or 0)


def held_blocks(heads: Sequence[str], prompt_heads: Sequence[str]) -> int:
    """Blocks of a prompt whose chain a node holds, as far as its reported ``heads`` tell: one more
    than the index of the prompt's deepest head among them (0: none)."""
    reported = set(heads)
    for i in range(len(prompt_heads) - 1, -1, -1):
        if prompt_heads[i] in reported:
            return i + 1
    return 0
