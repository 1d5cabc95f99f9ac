"""Request arrivals: Poisson with bursts, and replayed traces."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from simcases import small_scenario

from sim.des.config import Burst, ScenarioError, WorkloadConfig
from sim.des.simulator import run
from sim.des.workload import poisson_requests, trace_requests


def test_burst_multiplies_arrivals() -> None:
    cfg = WorkloadConfig(rate_per_s=1.0, bursts=(Burst(start_s=100.0, duration_s=100.0, rate_per_s=9.0),))
    reqs = list(poisson_requests(cfg, [1.0], 300.0, random.Random(1)))
    inside = sum(1 for r in reqs if 100.0 <= r.t_s < 200.0)
    outside = len(reqs) - inside
    assert 700 < inside < 1300  # ~1000 expected
    assert 140 < outside < 270  # ~200 expected
    assert all(a.t_s <= b.t_s for a, b in zip(reqs, reqs[1:], strict=False))
    assert all(1 <= r.prompt_tokens <= cfg.prompt_tokens_max for r in reqs)


def test_trace_is_replayed_exactly(tmp_path: Path) -> None:
    rows = [{"t": 1.0 + 2 * i, "prompt_tokens": 50 + i, "output_tokens": 10 + i} for i in range(20)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in reversed(rows)) + "\n")
    reqs = list(trace_requests(trace, ["m"], 1000.0))
    assert [(r.t_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (r["t"], r["prompt_tokens"], r["output_tokens"]) for r in rows
    ]
    result = run(
        small_scenario(workload={"kind": "trace", "trace_file": str(trace)}, run={"duration_s": 200.0})
    )
    assert result["requests"]["arrived"] == 20
    assert result["requests"]["completed"] == 20
    assert result["metrics"]["tokens_delivered"] == sum(r["output_tokens"] for r in rows)


def test_bad_trace_row_is_an_error(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 1, "prompt_tokens": 5, "output_tokens": 5, "colour": "red"}\n')
    with pytest.raises(ScenarioError, match="colour"):
        list(trace_requests(trace, ["m"], 100.0))
