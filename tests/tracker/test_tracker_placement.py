"""Shard placement: range properties and worked examples.

Hypothesis runs derandomized (the same examples every run, so CI is reproducible);
for a wider search locally, raise ``max_examples`` and drop ``derandomize``.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from swarm_strategies import FP, OTHER_FP, shard, snapshot, swarms

from tracker.errors import UnknownModel
from tracker.placement import layer_coverage, recommend_span
from tracker.snapshot import SwarmSnapshot


@settings(max_examples=200, deadline=None, derandomize=True)
@given(swarms(max_layers=40, max_shards=20), st.integers(1, 60), st.integers(0, 2**32))
def test_span_in_range(snap: SwarmSnapshot, capacity: int, seed: int) -> None:
    n = snap.model(FP).n_layers  # type: ignore[union-attr]
    a, b = recommend_span(snap, FP, capacity, rng=random.Random(seed))
    assert 0 <= a < b <= n
    assert b - a <= capacity
    assert (a, b) == recommend_span(snap, FP, capacity, rng=random.Random(seed))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(swarms(max_layers=30, max_shards=12), st.integers(1, 30), st.integers(0, 2**32))
def test_span_covers_a_hole_when_there_is_one(snap: SwarmSnapshot, capacity: int, seed: int) -> None:
    n = snap.model(FP).n_layers  # type: ignore[union-attr]
    cover = layer_coverage(snap, FP, n)
    a, b = recommend_span(snap, FP, capacity, rng=random.Random(seed))
    if 0.0 in cover:
        assert any(cover[i] == 0.0 for i in range(a, b))


def test_empty_swarm_starts_at_zero() -> None:
    snap = snapshot(30, [shard("o", 0, 30, fp=OTHER_FP)])
    assert recommend_span(snap, FP, 10, rng=random.Random(0)) == (0, 10)
    assert recommend_span(snap, FP, 100, rng=random.Random(0)) == (0, 30)


def test_fills_the_gap_aligned() -> None:
    snap = snapshot(30, [shard("a", 0, 10), shard("b", 20, 30)])
    assert recommend_span(snap, FP, 10, rng=random.Random(0)) == (10, 20)
    assert recommend_span(snap, FP, 15, rng=random.Random(0)) == (10, 20)


def test_extends_chain_from_layer_zero() -> None:
    snap = snapshot(30, [shard("a", 0, 10)])
    assert recommend_span(snap, FP, 10, rng=random.Random(0)) == (10, 20)


def test_reinforces_weakest_covered_span() -> None:
    snap = snapshot(
        20,
        [
            shard("a", 0, 10, ms=5.0),
            shard("a2", 0, 10, ms=5.0),
            shard("b", 10, 20, ms=40.0),
        ],
    )
    assert recommend_span(snap, FP, 10, rng=random.Random(0)) == (10, 20)


def test_errors() -> None:
    snap = snapshot(10, [])
    with pytest.raises(UnknownModel):
        recommend_span(snap, "0" * 64, 4, rng=random.Random(0))
    with pytest.raises(ValueError):
        recommend_span(snap, FP, 0, rng=random.Random(0))
