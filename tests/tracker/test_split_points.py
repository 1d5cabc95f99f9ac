"""Placement and route selection honour a model's published split points (pure functions)."""

from __future__ import annotations

import random

import pytest

from tracker.errors import NoFittingSpan
from tracker.placement import recommend_span
from tracker.routing import select_routes
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot

FP = "f" * 64


def _shard(node: str, start: int, end: int) -> ShardView:
    return ShardView(
        node, FP, start, end, decode_ms_per_token=10.0, prefill_tokens_per_s=1000.0, max_sessions=8
    )


def _snap(points: tuple[int, ...] | None, *shards: ShardView, n: int = 9) -> SwarmSnapshot:
    return SwarmSnapshot(models=(ModelInfo(FP, "m", n, 64, "qwen3moe", split_points=points),), shards=shards)


def test_without_split_points_placement_is_unchanged() -> None:
    assert recommend_span(_snap(None), FP, 4, rng=random.Random(0)) == (0, 4)


def test_spans_are_shortened_to_the_last_split_point_within_capacity() -> None:
    points = (0, 1, 2, 5, 7, 8, 9)
    # From 0, capacity 4 reaches only split point 2; ending at 9, a span can start at 5 and hold 4 layers.
    assert recommend_span(_snap(points), FP, 4, rng=random.Random(0)) == (5, 9)
    assert recommend_span(_snap(points, _shard("z", 5, 9)), FP, 4, rng=random.Random(0)) == (1, 5)
    # With [0, 5) served, the next span starts at 5 and may end at 9 (4 layers).
    assert recommend_span(_snap(points, _shard("a", 0, 5)), FP, 4, rng=random.Random(0)) == (5, 9)
    # Capacity 3 from 5: 8 is the last split point within reach.
    assert recommend_span(_snap(points, _shard("a", 0, 5)), FP, 3, rng=random.Random(0)) == (5, 8)


def test_a_model_served_whole_is_recommended_only_to_a_node_that_holds_it() -> None:
    """Placement never recommends a span longer than the node's capacity (issue 14): a model that can
    only be served whole goes to nodes that hold all of it; others are told nothing fits."""
    snap = _snap((0, 62), n=62)
    for cap in (62, 100):
        assert recommend_span(snap, FP, cap, rng=random.Random(1)) == (0, 62)
    for cap in (10, 31, 61):
        with pytest.raises(NoFittingSpan, match="cut only at 0, 62"):
            recommend_span(snap, FP, cap, rng=random.Random(1))


def test_routes_skip_shards_cut_where_the_model_cannot_be_cut() -> None:
    points = (0, 1, 2, 5, 7, 8, 9)
    shards = (_shard("a", 0, 3), _shard("b", 3, 9), _shard("c", 0, 5), _shard("d", 5, 9))
    sel = select_routes(_snap(points, *shards), FP, 2, rng=random.Random(0))
    assert [r.node_ids for r in sel.routes] == [("c", "d")]
    # The same shards with every boundary allowed give both routes.
    sel = select_routes(_snap(None, *shards), FP, 2, rng=random.Random(0))
    assert sorted(r.node_ids for r in sel.routes) == [("a", "b"), ("c", "d")]
