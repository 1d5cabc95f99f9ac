"""The simulator hands placement its shards' spans as columns (sim/des/snapshots.py ->
tracker.placement.provide_spans) instead of placement reading every view at every join: at every
placed snapshot of a run with churn and two models, the columns are exactly what placement reads
from the snapshot's shards itself."""

from __future__ import annotations

import numpy as np
import pytest
import simcases

import sim.des.simulator as simulator
from sim.des.snapshots import SnapshotCache
from tracker.placement import _spans
from tracker.snapshot import SwarmSnapshot


class CheckedCache(SnapshotCache):
    checked = 0

    def placed(self) -> SwarmSnapshot:
        fresh = self._placed is None
        snap = super().placed()
        if fresh:
            bare = SwarmSnapshot(models=snap.models, shards=snap.shards, default_latency_ms=1.0)
            for m in snap.models:
                given = _spans(snap, m.fingerprint, m.n_layers)
                read = _spans(bare, m.fingerprint, m.n_layers)
                for a, b in zip(given, read, strict=True):
                    assert np.array_equal(a, b)
            CheckedCache.checked += 1
        return snap


def test_placed_columns_are_the_shards_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulator, "SnapshotCache", CheckedCache)
    CheckedCache.checked = 0
    sc = simcases.small_scenario(
        run={"seed": 3, "duration_s": 400.0},
        models=[{"name": "m", "n_layers": 30}, {"name": "n", "n_layers": 24}],
        nodes={"initial": 14, "mean_uptime_s": 120.0, "join_rate_per_s": 0.12, "crash_fraction": 0.5},
    )
    result = simulator.run(sc)
    assert result["metrics"]["swarm"]["crashes"] > 0 and result["metrics"]["swarm"]["joins"] > 12
    assert CheckedCache.checked > 20
