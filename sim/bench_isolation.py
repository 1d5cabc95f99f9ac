"""What batch isolation costs a node: aggregate throughput with some sessions isolated.

    python -m sim.bench_isolation [--model smollm2|gemma3|FILE] [--sessions 8] [--out FILE]

One node (a first-stage span of the model, one llama.cpp thread) serves
``--sessions`` concurrent sessions through the real scheduler
(node.scheduler over node.backend.EngineBackend): each session sends one
prefill step of ``--prompt`` tokens, then ``--decode`` decode steps; every
round queues one step of every session before the scheduler plans, as a busy
node sees them. The sessions marked isolated (``OpenSession.isolated``: the
runs of a spot check) run in batches of their own (node.batching); the rest
share batches. Reported per setting: aggregate decode tok/s and prefill
tok/s, and both relative to no isolated session. Settings run interleaved,
``--repeats`` times each; the median counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from node.backend import EngineBackend
from node.engine import EngineConfig, ShardEngine
from node.sampling import SamplingParams
from node.scheduler import Scheduler
from node.session_machine import Compute, FreeKv, OpenKv, StepJob, StepOutcome
from node.shard import extract_shard, read_model_meta
from node.testmodel import gemma3_model_path, test_model_path


async def _round_trip(
    engine: ShardEngine, n_sessions: int, n_isolated: int, prompt: int, decode: int, rng: np.random.Generator
) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one run."""
    outcomes: dict[int, StepOutcome] = {}
    done = trio.Event()
    want = 0

    def on_outcome(outcome: StepOutcome) -> None:
        outcomes[outcome.job_id] = outcome
        if len(outcomes) >= want:
            done.set()

    scheduler = Scheduler(EngineBackend(engine), on_outcome, max_batch_tokens=512, prefill_chunk_tokens=256)
    n_vocab = 100
    sids = [f"s{i}" for i in range(n_sessions)]
    ids = iter(range(1, 1 << 30))
    times: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        for sid in sids:
            await scheduler.run_control(OpenKv(sid, prompt + decode + 1, SamplingParams()))
        for r in range(decode + 1):
            for k, sid in enumerate(sids):
                start, n = (0, prompt) if r == 0 else (prompt + r - 1, 1)
                toks = rng.integers(1, n_vocab, size=n).astype(np.int32)
                job = StepJob(
                    next(ids),
                    sid,
                    start,
                    toks,
                    None,
                    False,
                    None,
                    r > 0,
                    token_ids=toks,
                    isolated=k < n_isolated,
                )
                scheduler.submit(Compute(job))
            want = len(outcomes) + n_sessions
            done = trio.Event()
            t0 = time.perf_counter()
            await done.wait()
            times.append(time.perf_counter() - t0)
        for sid in sids:
            await scheduler.run_control(FreeKv(sid))
        nursery.cancel_scope.cancel()
    bad = [o for o in outcomes.values() if o.error_status is not None]
    if bad:
        raise RuntimeError(f"steps failed: {bad[0].error_message}")
    return n_sessions * prompt / times[0], n_sessions * decode / sum(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3 or a GGUF file")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--isolated", default="0,1,2,all", help="isolated sessions per setting")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = {"smollm2": test_model_path, "gemma3": gemma3_model_path}.get(
        args.model, lambda: Path(args.model)
    )()
    settings = [args.sessions if s == "all" else int(s) for s in args.isolated.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        meta = read_model_meta(path, cache)
        span = (0, meta.n_layers // 2)
        files = extract_shard(path, *span, cache)
        config = EngineConfig(
            threads=1,
            max_sessions=args.sessions,
            session_kv_tokens=max(256, args.prompt + args.decode + 1),
            batch_tokens=512,
        )
        runs: dict[int, list[tuple[float, float]]] = {k: [] for k in settings}
        with ShardEngine(files, config, cache) as engine:
            trio.run(_round_trip, engine, args.sessions, 0, args.prompt, 4, rng)  # warm-up
            for _ in range(args.repeats):
                for k in settings:
                    runs[k].append(
                        trio.run(_round_trip, engine, args.sessions, k, args.prompt, args.decode, rng)
                    )
    base_p = statistics.median(p for p, _ in runs[settings[0]])
    base_d = statistics.median(d for _, d in runs[settings[0]])
    rows: list[dict[str, Any]] = []
    print(f"model {path.name} span {span} sessions {args.sessions} prompt {args.prompt} decode {args.decode}")
    print("isolated  prefill tok/s  rel   decode tok/s  rel")
    for k in settings:
        p = statistics.median(x for x, _ in runs[k])
        d = statistics.median(y for _, y in runs[k])
        rows.append(
            {
                "isolated_sessions": k,
                "prefill_tok_s": p,
                "decode_tok_s": d,
                "prefill_rel": p / base_p,
                "decode_rel": d / base_d,
                "runs": runs[k],
            }
        )
        print(f"{k:8d}  {p:13.1f}  {p / base_p:4.2f}  {d:12.1f}  {d / base_d:4.2f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "model": path.name,
            "span": span,
            "sessions": args.sessions,
            "prompt": args.prompt,
            "decode": args.decode,
            "rows": rows,
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
