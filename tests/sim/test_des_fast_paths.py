"""The simulator's fast paths give what the plain code gives (docs/simulation.md, the simulator at
10 000 nodes for an hour): the noise draws taken at once are ``rng.random()``'s, in order, and
leave the stream where drawing them one by one would; a node's view made by copying its fields
equals the ``ShardView`` built field by field, at every heartbeat of a run with churn and
coordinates."""

from __future__ import annotations

import random

import pytest
import simcases

import sim.des.simulator as simulator
from sim.des.coords import uniforms
from sim.des.node import SimNode
from sim.des.snapshots import SnapshotCache
from tracker.snapshot import ShardView


@pytest.mark.parametrize("n", [0, 1, 2, 3, 623, 624, 625, 5000])
def test_uniforms_are_the_streams_next_values(n: int) -> None:
    a, b = random.Random("7/coordinates"), random.Random("7/coordinates")
    for _ in range(311):  # start mid-state
        a.randrange(1000)
        b.randrange(1000)
    assert uniforms(a, n).tolist() == [b.random() for _ in range(n)]
    assert [a.random(), a.randrange(10**6), a.gauss(0.0, 1.0)] == [
        b.random(),
        b.randrange(10**6),
        b.gauss(0.0, 1.0),
    ]


class CheckedViews(SnapshotCache):
    checked = 0

    def _view(self, node: SimNode) -> ShardView:
        view = super()._view(node)
        loading = node.state == "loading"
        plain = ShardView(
            node_id=node.node_id,
            model_fingerprint=node.model_fingerprint,
            start=node.start,
            end=node.end,
            decode_ms_per_token=node.cost.single_token_ms,
            prefill_tokens_per_s=node.cost.prefill_tokens_per_s,
            active_sessions=0 if loading else len(node.sessions),
            max_sessions=node.profile.max_sessions,
            queue_depth=0 if loading else node.queue_depth,
            address=node.node_id,
            region=node.endpoint.region,
            coord=self._coords.coord(node.node_id) if self._coords is not None else None,
            uplink_mbit_s=node.profile.uplink_mbps if self._coords is not None else None,
        )
        assert view == plain and vars(view) == vars(plain)
        CheckedViews.checked += 1
        return view


def test_views_made_by_copy_are_the_plain_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulator, "SnapshotCache", CheckedViews)
    CheckedViews.checked = 0
    sc = simcases.churn(12, seed=5, policy={"routing": "tracker"})
    result = simulator.run(sc)
    assert result["metrics"]["swarm"]["crashes"] > 0
    assert result["metrics"]["per_token_latency_ms"]["n"] > 0
    assert CheckedViews.checked > 500
