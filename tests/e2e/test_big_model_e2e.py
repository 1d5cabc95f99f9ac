"""A model larger than any node (issue 14): opt-in, because it does not fit CI's time.

``SWARM_BIG_MODEL=1 .venv/bin/python -m pytest tests/e2e/test_big_model_e2e.py -s``

Runs ``sim.bench_join`` on the 7B-class random-weight Q4_0 model of
``sim.big_model`` (about 3.9 GB, built once and cached; ``SWARM_BIG_MODEL_DIR``
says where): four nodes, each in a cgroup whose memory limit (1.5 GiB) is well
below the model's size, serve it through a tracker and a gateway, and the
completion equals the whole model run by llama-cpp-python; the server of a
local URL sends at most 1.1 x a shard plus the header; a middle shard joins
from the URL and from a peer; the memory-limited nodes' peak RSS stays under
the limit. With the model cached the run takes ~2 minutes on a 2-core machine
(measured 114 s), but it writes ~12 GB (the model, four shards, three fetched
and two joined copies) and needs root for the cgroups, which is why it is
opt-in rather than part of CI's run; the figures of the last run are in
docs/joining.md (JSON: docs/perf/join.json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SWARM_BIG_MODEL") != "1",
        reason="the 4 GB model test writes ~12 GB and needs root for its cgroups: "
        "run it with SWARM_BIG_MODEL=1",
    ),
    pytest.mark.timeout(7200),
]


def test_a_model_larger_than_any_node(tmp_path: Path) -> None:
    from sim.bench_join import main

    out = tmp_path / "join.json"
    assert main(["--json", str(out), "--workdir", str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    header = 8 * 1024 * 1024  # the model's header is a few MB (its vocabulary)
    for row in report["fetch"]:
        assert row["bytes_sent"] <= 1.1 * row["shard_bytes"] + header, row
    assert all(k.startswith("peer ") for k in report["join"]["peer"]["bytes_by_source"])
    swarm = report["swarm"]
    assert swarm["tokens_equal"] and swarm["max_logprob_difference"] < 1e-3, swarm
    limit = swarm["memory_limit_mb"] * 2**20
    assert limit < 0.5 * report["model"]["bytes"]
    for node in swarm["nodes"]:
        assert node["peak_rss_bytes"] <= limit, node
    assert all(code == 0 for code in swarm["node_exit_codes"].values()), swarm["node_exit_codes"]
    print(json.dumps({k: report[k] for k in ("fetch", "join")}, indent=1))
