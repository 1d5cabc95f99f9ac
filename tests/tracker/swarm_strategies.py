"""Hypothesis strategies and builders for swarm snapshots (shared by the pure tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from tracker.coordinates import NetCoord
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot

FP = "f" * 64
OTHER_FP = "e" * 64


def shard(node: str, start: int, end: int, ms: float = 10.0, fp: str = FP, **kw: object) -> ShardView:
    return ShardView(
        node_id=node,
        model_fingerprint=fp,
        start=start,
        end=end,
        decode_ms_per_token=ms,
        prefill_tokens_per_s=100.0,
        **kw,
    )  # type: ignore[arg-type]


def snapshot(n_layers: int, shards: list[ShardView], **kw: object) -> SwarmSnapshot:
    models = (ModelInfo(FP, "m", n_layers, 64), ModelInfo(OTHER_FP, "other", n_layers, 64))
    return SwarmSnapshot(models=models, shards=tuple(shards), **kw)  # type: ignore[arg-type]


def coords() -> st.SearchStrategy[NetCoord]:
    """Network coordinates in a 300 ms cube, with heights and errors (some untrusted)."""
    axis = st.floats(-150.0, 150.0, allow_nan=False)
    return st.builds(
        NetCoord,
        st.tuples(axis, axis, axis),
        st.floats(0.05, 30.0),
        st.sampled_from([0.05, 0.2, 0.5, 0.9]),
    )


@st.composite
def swarms(
    draw: st.DrawFn, max_layers: int = 12, max_shards: int = 14, positioned: bool | None = None
) -> SwarmSnapshot:
    """Random swarms: one shard per node per model, some of another model, random load; with
    ``positioned`` (None: either) some nodes have network coordinates and uplinks."""
    n_layers = draw(st.integers(1, max_layers))
    count = draw(st.integers(0, max_shards))
    with_coords = draw(st.booleans()) if positioned is None else positioned
    shards = []
    for i in range(count):
        start = draw(st.integers(0, n_layers - 1))
        end = draw(st.integers(start + 1, n_layers))
        max_sessions = draw(st.integers(1, 4))
        shards.append(
            shard(
                f"n{i:03d}",
                start,
                end,
                ms=draw(st.floats(0.5, 50.0)),
                fp=draw(st.sampled_from([FP, FP, FP, OTHER_FP])),
                active_sessions=draw(st.integers(0, max_sessions)),
                max_sessions=max_sessions,
                queue_depth=draw(st.integers(0, 3)),
                relayed=draw(st.booleans()),
                coord=draw(st.none() | coords()) if with_coords else None,
                uplink_mbit_s=draw(st.none() | st.floats(0.5, 1000.0)) if with_coords else None,
            )
        )
    latency = {}
    if shards and not with_coords and draw(st.booleans()):
        for _ in range(draw(st.integers(0, 10))):
            a = draw(st.sampled_from(shards)).node_id
            b = draw(st.sampled_from(shards)).node_id
            latency[(a, b)] = draw(st.floats(0.0, 30.0))
    return snapshot(n_layers, shards, latency_ms=latency)
