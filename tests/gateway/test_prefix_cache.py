"""The gateway's index of kept prefixes (pure): isolation by client and model, exact alignment, bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.prefix_chain import BLOCK_TOKENS, MAX_SOURCE_HASHES, chain, parse_source_id, source_id, tails
from gateway.prefix_cache import PrefixCache, common_prefix, with_tails

NODES = ("n1", "n2")
TOKENS = list(range(1000, 1600))


def test_longest_prefix_of_the_same_client_and_model_only() -> None:
    cache = PrefixCache(ttl_s=30, min_tokens=16, exact=False)
    cache.put("alice", "m", NODES, "s-short", TOKENS[:100], now=0)
    cache.put("alice", "m", NODES, "s-long", TOKENS[:300], now=0)
    cache.put("bob", "m", NODES, "s-bob", TOKENS[:500], now=0)
    hit = cache.lookup("alice", "m", [*TOKENS[:400], 7], now=1)
    assert hit is not None and hit.entry.session_id == "s-long" and hit.positions == 300
    assert cache.lookup("carol", "m", TOKENS[:400], now=1) is None  # another client never matches
    assert cache.lookup("alice", "other-model", TOKENS[:400], now=1) is None
    # A prompt that diverges early, or is too short to leave a token to prefill, reuses less.
    assert cache.lookup("alice", "m", [*TOKENS[:10], 1, 2, 3], now=1) is None
    hit = cache.lookup("alice", "m", TOKENS[:300], now=1)
    assert hit is not None and hit.positions == 299


def test_a_long_shared_prefix_of_another_client_is_copied_and_stays_its_owners() -> None:
    cache = PrefixCache(ttl_s=30, min_tokens=16, exact=False, share_min_tokens=256)
    cache.put("alice", "m", NODES, "s-alice", TOKENS[:400], now=0)
    hit = cache.lookup("bob", "m", [*TOKENS[:300], 9, 9], now=1)
    assert hit is not None and hit.shared and hit.positions == 300
    cache.take(hit)
    assert cache.shared_hits == 1
    # Still there for its owner, who takes it over (not a copy).
    own = cache.lookup("alice", "m", [*TOKENS[:400], 1], now=2)
    assert own is not None and not own.shared and own.positions == 400
    # Under share_min_tokens another client gets nothing; sharing off: never.
    assert cache.lookup("bob", "m", [*TOKENS[:200], 9], now=1) is None
    off = PrefixCache(ttl_s=30, min_tokens=16, exact=False)
    off.put("alice", "m", NODES, "s", TOKENS[:400], now=0)
    assert off.lookup("bob", "m", TOKENS[:400], now=1) is None
    # A tie goes to the client's own entry.
    cache.put("bob", "m", NODES, "s-bob", TOKENS[:400], now=0)
    tie = cache.lookup("bob", "m", [*TOKENS[:400], 1], now=2)
    assert tie is not None and tie.entry.session_id == "s-bob" and not tie.shared


def test_exact_mode_reuses_whole_prefill_steps_only() -> None:
    cache = PrefixCache(ttl_s=30, min_tokens=16, exact=True)
    cache.put("a", "m", NODES, "s", TOKENS[:590], now=0, exact=512, step=256)
    hit = cache.lookup("a", "m", [*TOKENS[:590], 5, 6], now=1)
    assert hit is not None and hit.positions == 512
    hit = cache.lookup("a", "m", [*TOKENS[:400], 5], now=1)
    assert hit is not None and hit.positions == 256
    assert cache.lookup("a", "m", [*TOKENS[:200], 5], now=1) is None  # less than one whole step
    cache.put("a", "m", NODES, "unaligned", TOKENS[:100], now=0, exact=0, step=256)
    assert "unaligned" not in {e.session_id for e in cache._entries.values()}  # noqa: SLF001


def test_take_removes_expiry_and_bounds() -> None:
    cache = PrefixCache(ttl_s=10, min_tokens=4, exact=False, max_entries=3, max_per_node=2)
    cache.put("a", "m", ("x", "y"), "s1", TOKENS[:50], now=0)
    hit = cache.lookup("a", "m", TOKENS[:60], now=1)
    cache.take(hit)
    assert cache.lookup("a", "m", TOKENS[:60], now=1) is None and cache.hits == 1
    cache.put("a", "m", ("x", "y"), "s2", TOKENS[:50], now=0)
    assert cache.lookup("a", "m", TOKENS[:60], now=10.5) is None and len(cache) == 0  # expired
    for i in range(3):
        cache.put("a", "m", ("x", "y"), f"k{i}", TOKENS[: 50 + i], now=20)
    assert len(cache) == 2  # two per node
    for i in range(3):
        cache.put("a", "m", (f"p{i}", f"q{i}"), f"o{i}", TOKENS[:50], now=20)
    assert len(cache) == 3  # three in all, the oldest went first
    cache.forget_node("p2")
    assert "o2" not in {e.session_id for e in cache._entries.values()}  # noqa: SLF001


@settings(max_examples=100, deadline=None)
@given(
    a=st.lists(st.integers(0, 3), max_size=30),
    b=st.lists(st.integers(0, 3), max_size=30),
)
def test_a_hit_is_always_an_exact_prefix_of_the_prompt(a: list[int], b: list[int]) -> None:
    assert a[: common_prefix(a, b)] == b[: common_prefix(a, b)]
    cache = PrefixCache(ttl_s=5, min_tokens=1, exact=False)
    cache.put("c", "m", NODES, "s", a, now=0)
    hit = cache.lookup("c", "m", b, now=0)
    if hit is not None:
        assert 1 <= hit.positions < len(b) and list(hit.entry.tokens[: hit.positions]) == b[: hit.positions]


def test_a_shared_prefix_named_by_blocks_asks_for_the_positions_inside_the_next_block_too() -> None:
    fp = "ef" * 32
    prompt = [3 + i % 70 for i in range(5 * BLOCK_TOKENS + 9)]  # 5 whole blocks and 9 tokens
    hashes = chain(fp, prompt[: 5 * BLOCK_TOKENS])
    source = (source_id(hashes[4], 0, [hashes[2], hashes[0]]), 5 * BLOCK_TOKENS)
    name, positions = with_tails(source, prompt, fp)
    # The 8 tokens after the blocks (one prompt token is left to prefill): their tails, the longest
    # first, then the blocks' hashes as they were; the positions asked end at the longest tail.
    assert positions == 5 * BLOCK_TOKENS + 8
    parsed = parse_source_id(name)
    assert parsed == ((*tails(hashes[4], prompt[80:88])[::-1], hashes[4], hashes[2], hashes[0]), 0)
    # Left as they were: exact reuse by whole steps, a session id, a cut inside a block, a deepest
    # hash that is not the prompt's, a prompt with nothing after the blocks but its last token.
    for same in (
        (source_id(hashes[4], 32), 5 * BLOCK_TOKENS),
        ("0123abcd" * 4, 5 * BLOCK_TOKENS),
        (source_id(hashes[4]), 5 * BLOCK_TOKENS - 3),
        (source_id(hashes[3]), 5 * BLOCK_TOKENS),
    ):
        assert with_tails(same, prompt, fp) == same
    assert with_tails(source, prompt[: 5 * BLOCK_TOKENS + 1], fp) == source
    # A long ladder of fallbacks is thinned so that the tails fit (the shallowest kept).
    long_prompt = [3 + i % 70 for i in range(70 * BLOCK_TOKENS + 15)]
    ladder = chain(fp, long_prompt[: 70 * BLOCK_TOKENS])
    names = [ladder[k] for k in range(69, 5, -1)]  # 64 hashes: the most a source names
    name, positions = with_tails((source_id(names[0], 0, names[1:]), 70 * BLOCK_TOKENS), long_prompt, fp)
    parsed = parse_source_id(name)
    assert parsed is not None and len(parsed[0]) == MAX_SOURCE_HASHES
    assert positions == 70 * BLOCK_TOKENS + 14
    assert parsed[0][14] == ladder[69] and parsed[0][-1] == ladder[6]
