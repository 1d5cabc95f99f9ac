"""Same scenario and seed: the same result, in one process and across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from simcases import churn, small_scenario

from sim.des.simulator import run

REPO = Path(__file__).resolve().parents[2]


def _deterministic_part(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if k != "performance"}, sort_keys=True)


def test_same_seed_same_json() -> None:
    sc = churn(9)
    assert _deterministic_part(run(sc)) == _deterministic_part(run(sc))


def test_different_seed_different_json() -> None:
    assert _deterministic_part(run(churn(9, seed=1))) != _deterministic_part(run(churn(9, seed=2)))


@pytest.mark.slow  # runs the simulator in processes
def test_deterministic_across_processes_and_hash_seeds(tmp_path: Path) -> None:
    outs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / hash_seed
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sim.cli",
                "run",
                str(REPO / "sim/scenarios/lan_small.toml"),
                "--duration-s",
                "60",
                "--no-plots",
                "--out",
                str(out),
            ],
            check=True,
            env=env,
            capture_output=True,
            cwd=tmp_path,
        )
        outs.append(json.loads((out / "result.json").read_text()))
    assert _deterministic_part(outs[0]) == _deterministic_part(outs[1])
    assert outs[0]["requests"]["completed"] > 0


def test_policies_are_part_of_the_result() -> None:
    r = run(small_scenario(policy={"placement": "random", "routing": "nearest"}, run={"duration_s": 30.0}))
    assert r["policy"] == {"placement": "random", "routing": "nearest"}
