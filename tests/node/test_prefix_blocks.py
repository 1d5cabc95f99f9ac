"""node/prefix_blocks.py and common/prefix_chain.py: chained block hashes, the longest cached prefix,
the reported heads, and the index following the kept-session table's order and bounds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.prefix_chain import (
    BLOCK_TOKENS,
    chain,
    head,
    held_blocks,
    is_head,
    parse_source_id,
    source_id,
)
from node.kept_sessions import KeptSessions
from node.prefix_blocks import MAX_HEADS, PrefixBlocks

FP = "ab" * 32
tokens_st = st.lists(st.integers(0, 5), max_size=6 * BLOCK_TOKENS)  # a small alphabet: many shared prefixes


def common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // BLOCK_TOKENS


@given(tokens_st, tokens_st)
def test_chains_agree_exactly_as_far_as_the_whole_blocks_agree(a: list[int], b: list[int]) -> None:
    ca, cb = chain(FP, a), chain(FP, b)
    assert len(ca) == len(a) // BLOCK_TOKENS
    same = sum(1 for x, y in zip(ca, cb, strict=False) if x == y)
    assert same == min(common_blocks(a, b), len(ca), len(cb))
    # Positional: a block's hash depends on everything before it, so after the first difference no
    # block agrees, even where the blocks themselves are equal.
    assert all(x != y for x, y in zip(ca[same:], cb[same:], strict=False))


def test_a_chain_depends_on_the_fingerprint_and_on_the_position_of_a_block() -> None:
    block = list(range(BLOCK_TOKENS))
    assert chain(FP, block) != chain("cd" * 32, block)
    twice = chain(FP, block + block)
    assert twice[0] != twice[1]  # the same 16 tokens at block 1 hash otherwise than at block 0
    assert chain(FP, block + block[:5]) == chain(FP, block)  # a partial block has no hash
    assert chain(FP, block + block)[1:] == chain(FP, block, start=twice[0])
    with pytest.raises(ValueError, match="token ids"):
        chain(FP, [-1] * BLOCK_TOKENS)


def test_heads_and_source_ids_round_trip_and_refuse_nonsense() -> None:
    h = chain(FP, list(range(BLOCK_TOKENS)))[0]
    assert is_head(head(h)) and head(h) != h.hex()[:32]  # one-way, not a prefix of the hash
    assert parse_source_id(source_id(h)) == ((h,), 0)
    assert parse_source_id(source_id(h, 256)) == ((h,), 256)
    for bad in (
        "0123",
        "blocks:xyz",
        "blocks:" + "a" * 63,
        "blocks:" + "a" * 64 + "/x",
        "blocks:" + "A" * 64,
    ):
        assert parse_source_id(bad) is None
    assert not is_head("A" * 32) and not is_head("a" * 31) and not is_head(3)


@settings(max_examples=60)
@given(st.lists(tokens_st, min_size=1, max_size=5), tokens_st)
def test_the_longest_cached_prefix_is_the_longest_whole_block_agreement(
    kept: list[list[int]], prompt: list[int]
) -> None:
    index = PrefixBlocks(FP)
    for i, toks in enumerate(kept):
        index.add(f"s{i}", toks)
    want = max(min(common_blocks(toks, prompt), len(toks) // BLOCK_TOKENS) for toks in kept)
    found = index.longest(prompt)
    if want == 0:
        assert found is None
    else:
        assert found is not None and found[1] == want
        sid = found[0]
        holder = kept[int(sid[1:])]
        assert holder[: want * BLOCK_TOKENS] == prompt[: want * BLOCK_TOKENS]
    # find() by the chain hash names a holder of exactly that many blocks
    hashes = chain(FP, prompt)
    for i, h in enumerate(hashes[:want]):
        hit = index.find(h)
        assert hit is not None and hit[1] == i + 1


@settings(max_examples=60)
@given(st.lists(tokens_st, min_size=1, max_size=6))
def test_heads_are_bounded_distinct_and_each_names_a_held_prefix(kept: list[list[int]]) -> None:
    index = PrefixBlocks(FP)
    for i, toks in enumerate(kept):
        index.add(f"s{i}", toks)
    heads = index.heads(limit=8)
    assert len(heads) <= 8 and len(set(heads)) == len(heads) and all(is_head(h) for h in heads)
    held = {head(h) for toks in kept for h in chain(FP, toks)}
    assert set(heads) <= held
    # the most recently kept session's last whole block comes first
    last = chain(FP, kept[-1])
    if last:
        assert heads[0] == head(last[-1])


def test_two_conversations_of_one_app_report_where_they_part() -> None:
    system = list(range(100, 100 + 90 * BLOCK_TOKENS // 10))  # 144 tokens: 9 blocks
    a = system + [1] * 40
    b = system + [2] * 40
    index = PrefixBlocks(FP)
    index.add("a", a)
    assert held_blocks(index.heads(), [head(h) for h in chain(FP, system + [3] * 40)]) == 8  # the ladder: 8
    index.add("b", b)
    # a third client's prompt: the branch point (the end of the shared system prompt) is reported
    c_heads = [head(h) for h in chain(FP, system + [3] * 40)]
    assert held_blocks(index.heads(), c_heads) == 9
    found = index.find(chain(FP, system)[-1])
    assert found == ("b", 9)  # the most recently used holder
    index.touch("a")
    assert index.find(chain(FP, system)[-1]) == ("a", 9)


def test_removing_a_session_forgets_only_its_blocks() -> None:
    shared = list(range(2 * BLOCK_TOKENS))
    index = PrefixBlocks(FP)
    index.add("a", shared + [1] * BLOCK_TOKENS)
    index.add("b", shared + [2] * BLOCK_TOKENS)
    assert index.blocks() == 4
    index.remove("a")
    assert index.blocks() == 3 and index.longest(shared + [1] * BLOCK_TOKENS) == ("b", 2)
    index.remove("b")
    assert index.blocks() == 0 and index.heads() == [] and index.longest(shared) is None


@dataclass
class Entry:
    kv_len: int
    expires_at: float = 100.0


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), tokens_st, st.booleans()), max_size=20))
def test_the_index_holds_exactly_the_kept_sessions_blocks(ops: list[tuple[str, list[int], bool]]) -> None:
    """Whatever is kept, used and evicted: the index holds the kept blocks, in the table's order."""
    kept: KeptSessions[Entry] = KeptSessions(max_sessions=3, max_positions=4 * BLOCK_TOKENS, fingerprint=FP)
    truth: dict[str, list[int]] = {}
    for sid, toks, use in ops:
        if use and sid in kept:
            kept.used(sid)
            continue
        for victim in kept.keep(sid, Entry(len(toks)), toks):
            kept.pop(victim)
        truth[sid] = toks
    assert list(kept.index._chains) == list(kept)  # same sessions, same recency order
    want = {h for sid in kept for h in chain(FP, truth[sid])}
    assert kept.index.blocks() == len(want)
    assert kept.index.blocks() <= kept.max_positions // BLOCK_TOKENS
    assert len(kept.index.heads()) <= MAX_HEADS
