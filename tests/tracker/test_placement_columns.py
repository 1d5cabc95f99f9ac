"""Placement reads a snapshot's shards as arrays once (tracker.placement._spans): the coverage it
computes is, to the last bit, the shard-by-shard sum it replaced."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from swarm_strategies import FP, OTHER_FP, shard, snapshot

from tracker.placement import DEFAULT_WEIGHTS, layer_coverage, provide_spans, recommend_span


def _reference(snap, fp: str, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    diff = [0.0] * (n + 1)
    count = [0] * (n + 1)
    for s in snap.shards:
        if s.model_fingerprint != fp or not 0 <= s.start < s.end <= n:
            continue
        tps = 1000.0 / max(s.decode_ms_per_token, DEFAULT_WEIGHTS.min_decode_ms_per_token)
        diff[s.start] += tps
        diff[s.end] -= tps
        count[s.start] += 1
        count[s.end] -= 1
    cover, run, holders = [], 0.0, 0
    for i in range(n):
        run += diff[i]
        holders += count[i]
        cover.append(max(run, 0.0) if holders else 0.0)
    return cover


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.integers(-2, 12), st.integers(-2, 14), st.floats(0.0, 500.0), st.booleans()),
        max_size=40,
    ),
    st.integers(0, 2**32),
)
def test_coverage_is_the_shard_by_shard_sum(rows: list[tuple[int, int, float, bool]], seed: int) -> None:
    shards = [
        shard(f"n{i}", a, b, ms, fp=FP if mine else OTHER_FP) for i, (a, b, ms, mine) in enumerate(rows)
    ]
    snap = snapshot(12, shards)
    assert layer_coverage(snap, FP, 12) == _reference(snap, FP, 12)
    assert layer_coverage(snap, FP, 12) == _reference(snap, FP, 12)  # from the memo, the same
    span = recommend_span(snap, FP, 5, rng=random.Random(seed))
    assert 0 <= span[0] < span[1] <= 12 and span[1] - span[0] <= 5


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.integers(-1, 12), st.integers(0, 13), st.floats(0.5, 500.0)), max_size=30),
    st.integers(0, 2**32),
)
def test_provided_spans_place_as_read_ones(rows: list[tuple[int, int, float]], seed: int) -> None:
    """A caller that keeps the columns (the simulator) hands them over: the same coverage and the
    same recommendation as placement reading the shards itself."""
    shards = [shard(f"n{i}", a, b, ms) for i, (a, b, ms) in enumerate(rows)]
    read, given_ = snapshot(12, shards), snapshot(12, shards)
    provide_spans(given_, FP, 12, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    assert layer_coverage(given_, FP, 12) == layer_coverage(read, FP, 12)
    assert recommend_span(given_, FP, 5, rng=random.Random(seed)) == recommend_span(
        read, FP, 5, rng=random.Random(seed)
    )


def test_provided_spans_must_be_columns_of_one_length() -> None:
    with pytest.raises(ValueError, match="one length"):
        provide_spans(snapshot(12, []), FP, 12, [0, 1], [3], [1.0, 1.0])
