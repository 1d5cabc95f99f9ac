"""The schedule of ``sim.bench_kvpool_mixed`` without the model: how many sessions run at once.

    python -m sim.kvpool_schedule [--scale 1] [--out docs/perf/kvpool-mixed-schedule.json]

The bench's own admission and step loop (``sim.bench_kvpool_mixed._run``) over
an engine stand-in whose steps take every piece whole and sample token 0: the
bench generates exactly ``--new`` tokens per request whatever they are, so
requests completed and refused, the most sessions at once, the mean and the
step count depend on the schedule only, and equal a real run's (checked:
the real runs of docs/perf/kvpool-mixed.json and
docs/perf/kvpool-mixed-sparse-fifo.json give the same figures). For the three
admission policies (``fifo``, ``fit``, ``short``) and both layouts; a table and JSON, and the bound
of any policy that holds every running request's whole prompt plus generation (the shortest
requests that fit the pool together).
Not a measurement of speed or exactness: the real bench does those.
"""

from __future__ import annotations

import argparse
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.vocab import Vocabulary
from node.engine import Work
from node.kvpool import BLOCK_TOKENS, KvPool, blocks_for
from node.testmodel import test_model_path
from sim import bench_kvpool_mixed as mixed


@dataclass(frozen=True)
class _Result:
    n_tokens: int
    sampled: Any
    error: Any = None


class _Schedule:
    """Stands in for a ShardEngine in ``mixed._run``: every piece runs, every draw is token 0."""

    def __init__(self, max_sessions: int, session_limit: int, pool_tokens: int) -> None:
        self.config = types.SimpleNamespace(max_sessions=max_sessions)
        self.session_kv_limit = session_limit
        self.pool = KvPool(pool_tokens) if pool_tokens else None

    def open_session(self, session_id: str) -> None:
        return None

    def release(self, session_id: str) -> None:
        return None

    def step(self, works: list[Work]) -> list[_Result]:
        return [_Result(w.n_tokens, types.SimpleNamespace(token_id=0)) for w in works]

    def statistics(self) -> Any:
        return types.SimpleNamespace(kv_pool=None, kv_pool_compactions=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=32, help="the pool's most sessions")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with Vocabulary(test_model_path()) as vocab:
        prompts = mixed._requests(vocab, args.requests, args.seed, args.scale)
    kv = 16384 // args.scale
    result: dict[str, Any] = {"requests": args.requests, "scale": args.scale, "kv_positions": kv, "rows": []}
    print("| admission | layout | completed | refused | most at once | mean at once | steps |")
    print("|---|---|---|---|---|---|---|")
    for admit in ("fifo", "fit", "short"):
        for name, engine in (
            ("per_seq 8 x " + str(2048 // args.scale), _Schedule(8, 2048 // args.scale, 0)),
            (f"pool of {kv}, {args.sessions} sessions", _Schedule(args.sessions, min(8192, kv), kv)),
        ):
            row = mixed._run(engine, prompts, args.new, pool=engine.pool is not None, admit=admit)  # type: ignore[arg-type]
            row = {k: row[k] for k in ("completed", "refused", "peak_sessions", "mean_sessions", "steps")}
            result["rows"].append({"admit": admit, "layout": name, **row})
            print(
                f"| {admit} | {name} | {row['completed']} | {row['refused']} | {row['peak_sessions']} | "
                f"{row['mean_sessions']} | {row['steps']} |"
            )
    # The bound of any admission that holds each running request's whole prompt plus generation: the
    # most requests whose KV fits the pool at once are the shortest ones.
    held, bound = 0, 0
    for p in sorted(len(x) for x in prompts):
        held += blocks_for(p + args.new)
        if held * BLOCK_TOKENS > kv:
            break
        bound += 1
    result["most_at_once_bound"] = bound
    print(f"most requests whose prompt plus generation fit {kv} positions at once (the shortest): {bound}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
