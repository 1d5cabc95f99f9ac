"""Which llama.cpp layout carries a node's KV pool (node.kvlayout, pure)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.kvlayout import LayoutError, LayoutFacts, choose_layout, sparse_obstacle

# SmolLM2-like: 30 layers x (K + V) of 384 bytes per position; trained for 8,192 positions.
FACTS = LayoutFacts(
    pool_tokens=16384, max_sessions=32, session_cap=1 << 30, n_ctx_train=8192, bytes_per_position=23040
)


def test_sparse_streams_as_long_as_the_model_allows_where_they_apply() -> None:
    choice = choose_layout("auto", FACTS)
    assert choice.layout == "sparse" and choice.n_streams == 32
    assert choice.stream_cells == 8192 and choice.session_limit == 8192
    # The operator's cap and the pool bound a session too.
    assert choose_layout("auto", dataclasses.replace(FACTS, session_cap=3000)).session_limit == 3000
    assert choose_layout("auto", dataclasses.replace(FACTS, session_cap=3000)).stream_cells == 3072
    small = choose_layout("auto", dataclasses.replace(FACTS, pool_tokens=4096))
    assert small.session_limit == 4096 and small.stream_cells == 4096


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"gpu_offload": True}, "device memory"),
        ({"sliding_window": True}, "sliding-window"),
        ({"bytes_per_position": 0}, "geometry"),
        ({"linux": False}, "Linux"),
        ({"strict_overcommit": True}, "overcommit"),
        ({"virtual_room_bytes": 64 << 20}, "address space"),
    ],
)
def test_where_sparse_streams_cannot_apply_the_fallback_is_resident_and_says_why(
    change: dict[str, object], words: str
) -> None:
    facts = dataclasses.replace(FACTS, **change)  # type: ignore[arg-type]
    obstacle = sparse_obstacle(facts)
    assert obstacle is not None and words in obstacle
    choice = choose_layout("auto", facts)
    assert choice.layout == "resident" and choice.reason == f"fallback: {obstacle}"
    # Resident streams divide the pool: 16,384 / 32 = 512 positions per session, all of it resident.
    assert choice.stream_cells == 512 and choice.session_limit == 512 and choice.n_ctx == 16384
    with pytest.raises(LayoutError, match="cannot be used here"):
        choose_layout("sparse", facts)


def test_enough_address_space_keeps_sparse_streams_and_too_little_shortens_them() -> None:
    roomy = dataclasses.replace(FACTS, virtual_room_bytes=64 << 30)  # 5.6 GiB virtual fits
    assert choose_layout("auto", roomy).stream_cells == 8192
    # 4 GiB of address space: 80 % of it holds 32 streams of 4,608 cells (still more than 512 resident).
    short = choose_layout("auto", dataclasses.replace(FACTS, virtual_room_bytes=4 << 30))
    assert short.layout == "sparse" and short.stream_cells == short.session_limit == 4608
    assert "shortened to 4608" in short.reason


def test_explicit_layouts_and_nonsense() -> None:
    assert choose_layout("resident", FACTS).layout == "resident"
    unified = choose_layout("unified", FACTS)
    assert (unified.layout, unified.n_streams, unified.stream_cells, unified.session_limit) == (
        "unified",
        1,
        16384,
        8192,
    )
    with pytest.raises(LayoutError, match="unknown"):
        choose_layout("paged", FACTS)
    with pytest.raises(LayoutError):
        choose_layout("auto", dataclasses.replace(FACTS, pool_tokens=100))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(256, 1 << 20),
    st.integers(1, 64),
    st.integers(1, 1 << 16),
    st.integers(0, 1 << 16),
    st.sampled_from(["auto", "resident", "unified"]),
    st.booleans(),
)
def test_a_session_never_gets_more_positions_than_its_stream_holds(
    pool: int, sessions: int, cap: int, n_ctx_train: int, requested: str, offload: bool
) -> None:
    facts = LayoutFacts(pool, sessions, cap, n_ctx_train, 23040, gpu_offload=offload)
    choice = choose_layout(requested, facts)
    assert 1 <= choice.session_limit <= choice.stream_cells
    assert choice.stream_cells % 256 == 0
    assert choice.session_limit <= min(cap, pool, n_ctx_train or cap)
    if choice.layout == "resident":
        assert choice.stream_cells >= 256 and choice.n_streams == sessions
        assert choice.n_ctx <= max(pool, 256 * sessions)  # the pool's memory (a small pool: 256 a stream)


def test_an_automatic_pool_larger_than_the_streams_can_use_keeps_its_layout() -> None:
    # The default pool (sized from memory) is far larger than max_sessions streams of the trained
    # context: sparse streams still apply, and resident ones are no longer than one session may grow.
    huge = dataclasses.replace(FACTS, pool_tokens=4_000_000, max_sessions=8)
    sparse = choose_layout("auto", huge)
    assert (sparse.layout, sparse.stream_cells, sparse.session_limit) == ("sparse", 8192, 8192)
    resident = choose_layout("auto", dataclasses.replace(huge, sliding_window=True))
    assert resident.layout == "resident" and resident.stream_cells == 8192 and resident.n_ctx == 8 * 8192
    # A small pool is still divided evenly.
    even = choose_layout("resident", dataclasses.replace(FACTS, pool_tokens=16384, max_sessions=8))
    assert even.stream_cells == 2048 and even.session_limit == 2048
