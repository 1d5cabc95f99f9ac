"""Per-hop overhead of the node daemon: one decode step through two nodes on loopback vs in-process.

    python3 -m sim.bench_hop [--steps 64] [--out bench-results/hop.json]

Both setups run the test model split [0,15) + [15,30) with the same engine
settings (1 compute thread each, flash attention, per-sequence KV):

* ``in-process``: two ``ShardEngine`` objects in this process; a decode step is
  ``engine_a.step`` then ``engine_b.step`` with the hidden state handed over
  directly;
* ``loopback``: two ``swarm-node start`` processes (port 0, no tracker,
  ``--insecure-no-tickets``), driven over gRPC by a minimal client that relays
  stage A's frames to stage B like a gateway (f32 hidden states, one stream
  per stage).

Both setups are up at the same time; the same prompt is prefilled in both,
then ``--steps`` greedy decode steps are timed one by one, alternating between
the two setups so that load from other processes hits both alike. The table
shows median, min and p90 per step. Per-hop overhead = (loopback -
in-process) / 2, a hop being one stage's round trip (client -> node ->
client). The nodes run under ``sim.procs.Supervisor`` and are stopped by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from sim.procs import Service, Supervisor

MAX_SESSIONS = 6
SESSION_KV = 512
BATCH = 256
PROMPT = "The capital of France is"


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


class InProcess:
    """The two stages as ShardEngine objects in this process."""

    def __init__(self, model: Path, cache: Path) -> None:
        from node.engine import EngineConfig, ShardEngine
        from node.shard import extract_shard

        config = EngineConfig(
            n_threads_count=1, max_sessions=MAX_SESSIONS, session_kv_tokens=SESSION_KV, n_batch_tokens=BATCH
        )
        self.a = ShardEngine(extract_shard(model, 0, 15, cache), config, cache)
        self.b = ShardEngine(extract_shard(model, 15, 30, cache), config, cache)
        self.a.open_session("bench")
        self.b.open_session("bench")
        self.pos = 0

    def step(self, tokens: list[int]) -> int:
        from node.engine import Work

        (ra,) = self.a.step([Work("bench", self.pos, tokens=np.asarray(tokens, dtype=np.int32))])
        (rb,) = self.b.step([Work("bench", self.pos, hidden=ra.hidden, sample=True)])
        if rb.sampled is None:
            raise RuntimeError(f"in-process step failed: {ra.error or rb.error}")
        self.pos += len(tokens)
        return rb.sampled.token

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _start_node(sup: Supervisor, name: str, model: Path, layers: str, cache: Path) -> Service:
    return sup.start_node(
        name,
        model=model,
        layers=layers,
        tracker_url=None,
        max_sessions=MAX_SESSIONS,
        session_kv_tokens=SESSION_KV,
        cache_dir=cache,
        admin=False,
        extra_args=["--batch-tokens", str(BATCH), "--no-benchmark", "--log-level", "warning"],
    )


def run(model: Path, cache: Path, prompt: list[int], steps: int) -> dict[str, Any]:
    """Both setups live at once; decode steps alternate between them so load drift hits both alike."""
    from node.loopback_client import RouteSession, Stage, node_info

    with tempfile.TemporaryDirectory(prefix="bench-hop-") as tmp, Supervisor(Path(tmp)) as sup:
        inproc = None
        session = None
        try:
            nodes = [
                _start_node(sup, name, model, layers, cache)
                for name, layers in (("a", "0:15"), ("b", "15:30"))
            ]
            ports = [node.wait_port(180) for node in nodes]
            stages = [Stage(f"127.0.0.1:{port}", node_info(f"127.0.0.1:{port}")) for port in ports]
            inproc = InProcess(model, cache)
            session = RouteSession(stages, b"{}", budget=SESSION_KV)
            local = [inproc.step(prompt)]
            remote = [session.step(prompt).token_id]  # type: ignore[union-attr]
            t_local: list[float] = []
            t_remote: list[float] = []
            for i in range(steps):
                order = ("local", "remote") if i % 2 == 0 else ("remote", "local")
                for which in order:
                    t0 = time.perf_counter()
                    if which == "local":
                        local.append(inproc.step([local[-1]]))
                        t_local.append(time.perf_counter() - t0)
                    else:
                        remote.append(session.step([remote[-1]]).token_id)  # type: ignore[union-attr]
                        t_remote.append(time.perf_counter() - t0)
            session.release()
        finally:
            if session is not None:
                session.close()
            if inproc is not None:
                inproc.close()
    return {"in-process": (t_local, local), "loopback": (t_remote, remote)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps (default 64)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="node cache (shards); default: a temp dir"
    )
    args = parser.parse_args(argv)

    from common.vocab import Vocabulary
    from node.testmodel import test_model_path

    model = test_model_path()
    with Vocabulary(model) as vocab:
        prompt = vocab.tokenize(PROMPT, add_special=True)
    with tempfile.TemporaryDirectory(prefix="bench-hop-cache-") as tmp_cache:
        measured = run(model, args.cache_dir or Path(tmp_cache), prompt, args.steps)
    inproc_t, inproc_tokens = measured["in-process"]
    loop_t, loop_tokens = measured["loopback"]
    same = inproc_tokens == loop_tokens
    rows = {
        name: {
            "median_ms": statistics.median(t) * 1e3,
            "min_ms": min(t) * 1e3,
            "p90_ms": _pct(t, 90) * 1e3,
        }
        for name, t in (("in-process", inproc_t), ("loopback", loop_t))
    }
    overhead_ms = (rows["loopback"]["median_ms"] - rows["in-process"]["median_ms"]) / 2
    overhead_min_ms = (rows["loopback"]["min_ms"] - rows["in-process"]["min_ms"]) / 2
    ratio = rows["loopback"]["median_ms"] / rows["in-process"]["median_ms"]
    print(f"decode step, test model split [0,15)+[15,30), 1 thread per stage, {args.steps} steps")
    print(f"{'setup':<12} {'median ms':>10} {'min ms':>10} {'p90 ms':>10}")
    for name, r in rows.items():
        print(f"{name:<12} {r['median_ms']:>10.2f} {r['min_ms']:>10.2f} {r['p90_ms']:>10.2f}")
    print(
        f"per-hop overhead: {overhead_ms:.2f} ms (median), {overhead_min_ms:.2f} ms (min)   "
        f"loopback / in-process: {ratio:.2f}x   same tokens: {same}"
    )
    result: dict[str, Any] = {
        "benchmark": "bench_hop",
        "steps": args.steps,
        "prompt_tokens": len(prompt),
        "rows": rows,
        "per_hop_overhead_ms": overhead_ms,
        "per_hop_overhead_min_ms": overhead_min_ms,
        "ratio": ratio,
        "same_tokens": same,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "time": time.time(),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
