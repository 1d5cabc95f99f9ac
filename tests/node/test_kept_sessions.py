"""node/kept_sessions.py: the kept-session table's order (least recently used first) and its bounds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.prefix_chain import BLOCK_TOKENS, chain, tails
from node.kept_sessions import KeptSessions
from node.kvpool import blocks_for


@dataclass
class Entry:
    kv_len: int
    expires_at: float = 100.0
    first_step: int = 0
    aligned_end: int = 0


def test_keeping_beyond_the_session_bound_names_the_least_recently_used() -> None:
    kept: KeptSessions[Entry] = KeptSessions(max_sessions=2, max_positions=10_000)
    assert kept.keep("a", Entry(10)) == [] and kept.keep("b", Entry(10)) == []
    kept.used("a")  # a prefix copied out of a: b is now the least recently used
    assert kept.keep("c", Entry(10)) == ["b"]
    kept.pop("b")
    assert list(kept) == ["a", "c"] and kept.oldest() == "a"


def test_the_position_bound_evicts_until_the_rest_fits() -> None:
    kept: KeptSessions[Entry] = KeptSessions(max_sessions=8, max_positions=100)
    kept.keep("a", Entry(40))
    kept.keep("b", Entry(40))
    assert kept.keep("c", Entry(50)) == ["a"]  # 130 -> 90 positions
    assert kept.positions() == 130 and kept.blocks() == blocks_for(40) * 2 + blocks_for(50)


def test_evictable_spares_the_named_and_expired_is_by_time() -> None:
    kept: KeptSessions[Entry] = KeptSessions(max_sessions=8, max_positions=1000)
    kept.keep("a", Entry(1, expires_at=5.0))
    kept.keep("b", Entry(1, expires_at=50.0))
    kept.keep("c", Entry(1, expires_at=5.0))
    assert kept.evictable(spare=("b", "x")) == ["a", "c"]
    assert kept.expired(4.9) == [] and kept.expired(5.0) == ["a", "c"]
    assert "a" in kept and "x" not in kept and kept.get("x") is None and kept.pop("x") is None


def test_iterating_is_a_snapshot_the_caller_may_evict_from() -> None:
    kept: KeptSessions[Entry] = KeptSessions(max_sessions=8, max_positions=1000)
    for sid in "abc":
        kept.keep(sid, Entry(1))
    for sid in kept:
        kept.pop(sid)
    assert len(kept) == 0 and kept.oldest() is None


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        KeptSessions(max_sessions=-1, max_positions=0)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("keep"), st.sampled_from("abcdef"), st.integers(0, 300)),
        st.tuples(st.just("used"), st.sampled_from("abcdef"), st.just(0)),
        st.tuples(st.just("pop"), st.sampled_from("abcdef"), st.just(0)),
    ),
    max_size=60,
)


@given(ops, st.integers(0, 4), st.integers(0, 600))
def test_after_the_caller_evicts_what_keep_names_the_table_is_within_its_bounds_in_use_order(
    script: list[tuple[str, str, int]], max_sessions: int, max_positions: int
) -> None:
    """The table against a plain model: a list in use order, evicted from the front."""
    kept: KeptSessions[Entry] = KeptSessions(max_sessions, max_positions)
    model: list[tuple[str, int]] = []
    for op, sid, n in script:
        if op == "keep":
            model = [(s, m) for s, m in model if s != sid] + [(sid, n)]
            over = kept.keep(sid, Entry(n))
            while model and (len(model) > max_sessions or sum(m for _, m in model) > max_positions):
                assert over and over[0] == model[0][0]
                over.pop(0)
                kept.pop(model.pop(0)[0])
            assert over == []
        elif op == "used":
            kept.used(sid)
            model = [(s, m) for s, m in model if s != sid] + [(s, m) for s, m in model if s == sid]
        else:
            kept.pop(sid)
            model = [(s, m) for s, m in model if s != sid]
        assert list(kept) == [s for s, _ in model]
        assert len(kept) <= max_sessions and kept.positions() <= max_positions


def test_a_prefix_named_by_several_hashes_is_copied_as_deep_as_a_kept_session_holds_it() -> None:
    fp = "ab" * 32
    system = [5 + i % 40 for i in range(5 * BLOCK_TOKENS)]
    kept: KeptSessions[Entry] = KeptSessions(max_sessions=8, max_positions=10_000, fingerprint=fp)
    a = system + [1] * 40  # 7 whole blocks, 5 of them the system prompt
    kept.keep("a", Entry(len(a), first_step=32, aligned_end=96), a)
    b = chain(fp, system + [2] * 40)  # another prompt: blocks 0..4 agree with a's
    deep = [b[6], b[5], b[4], b[3], b[1]]
    assert kept.prefix_source(deep, 0, 7 * BLOCK_TOKENS) == ("a", 5 * BLOCK_TOKENS)
    # The first hash must name exactly the positions asked; later ones must be shorter.
    assert kept.prefix_source([b[4]], 0, 6 * BLOCK_TOKENS) is None
    assert kept.prefix_source([b[4]], 0, 5 * BLOCK_TOKENS) == ("a", 5 * BLOCK_TOKENS)
    assert kept.prefix_source(deep, 0, 5 * BLOCK_TOKENS) == ("a", 4 * BLOCK_TOKENS)  # b[4] is not shorter
    assert kept.prefix_source([b[6], b[5]], 0, 7 * BLOCK_TOKENS) is None  # neither is held
    # Exact (whole steps of 32 from 0, up to 96 computed so): 80 is not a whole step, 64 is.
    assert kept.prefix_source(deep, 32, 7 * BLOCK_TOKENS) == ("a", 4 * BLOCK_TOKENS)
    assert kept.prefix_source(deep, 16, 7 * BLOCK_TOKENS) is None  # computed in steps of 32, not 16
    kept.pop("a")
    assert kept.prefix_source(deep, 0, 7 * BLOCK_TOKENS) is None


def test_a_prefix_ending_inside_a_block_is_copied_by_its_tail_hashes() -> None:
    fp = "cd" * 32
    system = [5 + i % 40 for i in range(5 * BLOCK_TOKENS + 6)]  # 5 whole blocks and 6 tokens
    kept: KeptSessions[Entry] = KeptSessions(max_sessions=8, max_positions=10_000, fingerprint=fp)
    a = system + [1] * 30
    kept.keep("a", Entry(len(a)), a)
    b = system + [2] * 30  # agrees with a for 86 positions: 5 blocks and 6 tokens into the sixth
    whole = 5 * BLOCK_TOKENS
    parent = chain(fp, b[:whole])[-1]
    named = [*tails(parent, b[whole : whole + 15])[::-1], parent]  # the longest first, then the block
    # a's own next tokens give the tail of 6 (of the 15 named): copied 86 positions, not 80.
    assert kept.prefix_source(named, 0, whole + 15) == ("a", whole + 6)
    # Asking fewer positions: only the tails up to them are named, the longest a holds is taken.
    assert kept.prefix_source([*tails(parent, b[whole : whole + 4])[::-1], parent], 0, whole + 4) == (
        "a",
        whole + 4,
    )
    # A kept session that parts sooner inside the block: the deeper one wins; on its own, its 3.
    c = system[: whole + 3] + [3] * 30
    kept.keep("c", Entry(len(c)), c)
    assert kept.prefix_source(named, 0, whole + 15) == ("a", whole + 6)
    kept.pop("a")
    assert kept.prefix_source(named, 0, whole + 15) == ("c", whole + 3)
    # No holder's tokens give any of the tails: the whole blocks, as before.
    other = tails(parent, [9] * 15)[::-1]
    assert kept.prefix_source([*other, parent], 0, whole + 15) == ("c", whole)
    # Exact reuse (whole steps) never takes a tail; a KV shorter than the tail is not copied past it.
    assert kept.prefix_source(named, 16, whole + 15) is None
    kept.keep("d", Entry(whole + 2), system)  # its KV holds only 2 tokens after the blocks
    kept.pop("c")
    assert kept.prefix_source(named, 0, whole + 15) == ("d", whole + 2)
