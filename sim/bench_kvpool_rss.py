"""A node with an automatically sized KV pool in a 4 GiB memory cgroup: the pool it reports, its RSS.

    python -m sim.bench_kvpool_rss [--limit-mb 4096] [--model FILE] [--out docs/perf/kvpool-rss.json]

Starts ``swarm-node start --layers 0:30 --kv-pool-tokens -1`` (no tracker,
one thread) inside a memory cgroup of ``--limit-mb`` (root only; v2 or v1, as
``sim.bench_join`` makes them); once it serves (after its start-up benchmark,
a short prefill and decode), reads the pool the node sized
(``/metrics``: ``swarm_node_kv_pool_blocks``), its resident set (``VmRSS``,
peak ``VmHWM``) and the cgroup's failure counters. Prints a table and writes
JSON. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from node.testmodel import test_model_path
from sim.bench_join import in_cgroup, make_cgroup
from sim.procs import Supervisor


def _metrics(admin_port: int) -> tuple[dict[str, float], str]:
    """The node's unlabelled KV gauges, and the KV layout it runs (``swarm_node_kv_layout{layout=...}``)."""
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    layout = re.search(r'^swarm_node_kv_layout\{layout="(\w[\w-]*)"\} 1(?:\.0)?$', text, re.M)
    gauges = {k: float(v) for k, v in re.findall(r"^(swarm_node_kv_\w+) (\S+)$", text, re.M)}
    return gauges, layout.group(1) if layout else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit-mb", type=int, default=4096)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = args.model or test_model_path()
    limit = args.limit_mb * 2**20
    group = make_cgroup(f"swarm-kvpool-rss-{int(time.time())}", limit)
    if group is None:
        raise SystemExit("needs root and a writable memory cgroup hierarchy")
    workdir = Path(tempfile.mkdtemp(prefix="bench-kvpool-rss-"))
    sup = Supervisor(workdir, place=in_cgroup({"node": group}))
    try:
        node = sup.start_node(
            "node", model=model, layers="0:30", tracker_url=None, extra_args=["--kv-pool-tokens", "-1"]
        ).ready(600)
        gauges, layout = _metrics(node.admin_port)
        proc = psutil.Process(node.proc.pid)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
        hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
        result: dict[str, Any] = {
            "model": model.name,
            "limit_bytes": limit,
            "cgroup_version": group.version,
            "kv_pool_tokens": int(gauges.get("swarm_node_kv_pool_blocks", 0)) * 16,
            "kv_tokens_capacity": int(gauges.get("swarm_node_kv_tokens_capacity", 0)),
            "kv_layout": layout,
            "rss_bytes": rss,
            "peak_rss_bytes": hwm,
            "cgroup": group.statistics(),
        }
    finally:
        sup.stop_all()
        group.remove()
    print(f"limit                 {limit / 2**20:8.0f} MiB (cgroup v{result['cgroup_version']})")
    print(f"pool sized            {result['kv_pool_tokens']:8d} positions ({result['kv_layout']} layout)")
    print(f"node RSS / peak       {rss / 2**20:8.0f} / {hwm / 2**20:.0f} MiB")
    print(f"cgroup                {result['cgroup']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
