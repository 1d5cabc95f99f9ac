"""What spot checks cost and what they catch, on a real local swarm (``sim/liars.py``).

    .venv/bin/python -m sim.bench_checks [--parts overhead,detection] [--out FILE.json]

* ``overhead``: the same workload (``--requests`` greedy chats of
  ``--tokens`` tokens, ``--concurrency`` at a time) through gateways that
  check a fraction 0, 0.05, 0.2 and 1 of the requests (no probation, so the
  fraction is the only difference), one gateway per fraction on the same
  four honest nodes, in rounds whose order rotates. Reported per fraction:
  aggregate tokens/s, time to first token and total time per request, and
  the ratio to the unchecked gateway. On this machine every node shares two
  cores, so a checked request's second route competes with the first for
  the same CPU: the throughput cost is close to the worst case (1 + f times
  the compute); on volunteers' machines the shadow runs on idle nodes.
* ``detection``: per lie (``swap_sampler``, ``perturb_hidden``,
  ``no_model``), requests sent until the gateway names the liar (every
  answer compared with the whole model's greedy output), with a new node on
  probation (the gateway default: 3 checks) and with a node past probation
  that lies from then on (probation 0, fractions 0.2 and 0.05).

Prints a table and writes the figures as JSON.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import openai

from sim.liars import Answer, LiarSwarm, chat, metric, requests_until_caught
from sim.procs import Service, wait_http

FRACTIONS = (0.0, 0.05, 0.2, 1.0)
KINDS = ("swap_sampler", "perturb_hidden", "no_model")
QUESTIONS = tuple(
    f"In two sentences, what is worth knowing about {topic}?"
    for topic in (
        "lighthouses",
        "tides",
        "bread",
        "glaciers",
        "bees",
        "rivers",
        "copper",
        "owls",
        "clocks",
        "maps",
        "salt",
        "kites",
    )
)


def _gateway(ls: LiarSwarm, name: str, fraction: float, probation: int) -> tuple[Service, openai.OpenAI, str]:
    sup = ls.swarm.supervisor
    gw = sup.start_gateway(
        tracker_url=ls.swarm.tracker_url,
        name=name,
        extra_args=[
            *("--route-ttl-s", "1", "--kv-keep-s", "0"),
            *("--check-fraction", str(fraction), "--probation-checks", str(probation)),
        ],
    ).ready(120)
    base = f"http://127.0.0.1:{gw.port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=600)
    wait_http(gw, base + "/v1/models", 120)
    return gw, client, base


def overhead(ls: LiarSwarm, args: argparse.Namespace, expected: dict[str, str]) -> dict[str, Any]:
    gateways = {f: _gateway(ls, f"gw-f{f}", f, 0) for f in FRACTIONS}
    runs: dict[float, list[dict[str, float]]] = {f: [] for f in FRACTIONS}
    wrong = 0
    # Warm every gateway (vocabulary, routes, node connections) before measuring.
    for _, client, _ in gateways.values():
        chat(client, ls.swarm.model_name, QUESTIONS[0], 4)
    for r in range(args.rounds):
        order = list(FRACTIONS[r % len(FRACTIONS) :] + FRACTIONS[: r % len(FRACTIONS)])
        for f in order:
            _, client, base = gateways[f]
            checked_before = metric(base, "swarm_gateway_checks_total", outcome="started")
            qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results: list[Answer] = list(
                    pool.map(
                        chat, [client] * len(qs), [ls.swarm.model_name] * len(qs), qs, [args.tokens] * len(qs)
                    )
                )
            wall = time.perf_counter() - t0
            wrong += sum(a.text != expected[q] for q, a in zip(qs, results, strict=True))
            tokens = sum(a.completion_tokens for a in results)
            checked = metric(base, "swarm_gateway_checks_total", outcome="started") - checked_before
            runs[f].append(
                {
                    "tokens_per_s": tokens / wall,
                    "ttft_s": statistics.mean(a.ttft_s for a in results),
                    "request_s": statistics.mean(a.total_s for a in results),
                    "checked": checked,
                    "requests": len(qs),
                }
            )
            print(
                f"  round {r + 1} f={f:<4}: {tokens / wall:6.1f} tok/s, "
                f"ttft {runs[f][-1]['ttft_s'] * 1000:5.0f} ms, {int(checked)}/{len(qs)} checked",
                flush=True,
            )
    for gw, _, _ in gateways.values():
        gw.stop()
    base_tps = statistics.median(x["tokens_per_s"] for x in runs[0.0])
    base_ttft = statistics.median(x["ttft_s"] for x in runs[0.0])
    table = {}
    for f in FRACTIONS:
        tps = statistics.median(x["tokens_per_s"] for x in runs[f])
        ttft = statistics.median(x["ttft_s"] for x in runs[f])
        table[str(f)] = {
            "tokens_per_s": round(tps, 2),
            "throughput_ratio": round(tps / base_tps, 3),
            "ttft_ms": round(ttft * 1000, 1),
            "ttft_ratio": round(ttft / base_ttft, 3),
            "request_s": round(statistics.median(x["request_s"] for x in runs[f]), 3),
            "checked_share": round(
                sum(x["checked"] for x in runs[f]) / sum(x["requests"] for x in runs[f]), 3
            ),
        }
    return {"by_fraction": table, "wrong_answers": wrong, "rounds": {str(f): runs[f] for f in FRACTIONS}}


def detection(ls: LiarSwarm, args: argparse.Namespace, expected: dict[str, str]) -> dict[str, Any]:
    setups = [("new node, probation 3, f=0.05", 0.05, 3), ("past probation, f=0.2", 0.2, 0)]
    if not args.quick:
        setups.append(("past probation, f=0.05", 0.05, 0))
    out: dict[str, Any] = {}
    for label, fraction, probation in setups:
        gw, _, base = _gateway(ls, f"gw-detect-{fraction}-{probation}", fraction, probation)
        ls.swarm.gateway, saved = gw, ls.swarm.gateway  # sim.liars reads the gateway from the swarm
        try:
            for kind in KINDS:
                liar = ls.start_liar(kind)
                try:
                    found = requests_until_caught(
                        ls,
                        liar,
                        kind,
                        QUESTIONS,
                        expected.__getitem__,
                        n_new=args.detect_tokens,
                        max_requests=args.max_requests,
                    )
                finally:
                    ls.stop_liar(liar)
                row = asdict(found)
                row["verdict"] = (
                    {k: found.verdict.get(k) for k in ("stage", "positions", "detail")}
                    if found.verdict
                    else None
                )
                out.setdefault(label, {})[kind] = row
                print(
                    f"  {label:32s} {kind:15s} caught={found.caught} after {found.requests} requests "
                    f"({found.through_liar} through it, {found.seconds:.1f} s), "
                    f"wrong answers {found.wrong_answers}",
                    flush=True,
                )
        finally:
            ls.swarm.gateway = saved
            gw.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="overhead,detection")
    parser.add_argument("--requests", type=int, default=8, help="requests per round and fraction")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--detect-tokens", type=int, default=12)
    parser.add_argument("--max-requests", type=int, default=120)
    parser.add_argument("--quick", action="store_true", help="skip the slowest detection setup")
    parser.add_argument("--out", type=Path, default=Path("bench-results/checks.json"))
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))

    from node.shard import read_model_meta
    from node.testmodel import test_model_path
    from sim.liars import start_liar_swarm
    from sim.reference import Reference

    model = test_model_path()
    work = Path(tempfile.mkdtemp(prefix="bench-checks-"))
    cache = work / "node-cache"
    ref = Reference(model)  # the whole model in one llama.cpp context: what every answer must equal
    expected = {n: {q: ref.chat(q, n) for q in QUESTIONS} for n in {args.tokens, args.detect_tokens}}
    ref.close()
    n_layers = read_model_meta(model, cache).n_layers
    print(
        f"swarm: 4 honest nodes + a liar slot, 1 thread each, {n_layers} layers; work dir {work}", flush=True
    )
    ls = start_liar_swarm(
        work, model=model, node_cache=cache, n_layers=n_layers, check_fraction=0.0, probation_checks=0
    )
    result: dict[str, Any] = {
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "settings": vars(args) | {"out": str(args.out)},
    }
    try:
        if "overhead" in parts:
            print("overhead (same workload, one gateway per check fraction):", flush=True)
            result["overhead"] = overhead(ls, args, expected[args.tokens])
        if "detection" in parts:
            print("detection (requests until the liar is named):", flush=True)
            result["detection"] = detection(ls, args, expected[args.detect_tokens])
    finally:
        ls.swarm.stop()
    if "overhead" in result:
        print("\nfraction  tok/s   ratio  ttft ms  ratio  checked")
        for f, row in result["overhead"]["by_fraction"].items():
            print(
                f"{f:>8}  {row['tokens_per_s']:6.1f}  {row['throughput_ratio']:5.2f}  "
                f"{row['ttft_ms']:7.0f}  {row['ttft_ratio']:5.2f}  {row['checked_share']:.2f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
