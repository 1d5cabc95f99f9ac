"""Speculative decoding on the route, side by side with plain decoding in one run (issue 24).

``python -m sim.bench_spec [--model smol|qwen] [--nodes 3] [--rounds 3] [--max-tokens 96]
[--out docs/perf/spec.json]``

Starts a swarm on loopback (swarm-tracker, ``--nodes`` swarm-node processes splitting the model
evenly, one llama.cpp thread each, swarm-gateway with ``--kv-keep-s 0`` and no spot checks) and
sends streamed greedy chat requests of two prompt classes, speculation on and off taking turns
(the request's extra_body ``speculation``):

* ``edit``: editing code or text given in the prompt (the answer repeats most of it);
* ``chat``: open questions (novel text: n-gram drafts rarely match).

Per request it times the first text piece and the last one at the client (plain httpx) and reads
the completion's token count from the usage chunk; the per-token time is (last - first) / (tokens -
1), the decode part only. Tokens per pass come from the gateway's speculation counters. It checks
that the texts with and without speculation are identical. Prints a table and writes JSON; the
machine is shared, so figures are for comparison within one run (ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from node.testmodel import qwen_coder_model_path, test_model_path
from sim.launcher import LocalSwarm, start_local_swarm

EDIT = [
    "Repeat this code exactly, adding type hints to every function:\n\n"
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n",
    "Rewrite this paragraph with British spelling, changing nothing else:\n\n"
    "The color of the harbor changed at dusk. The neighbors organized a program to honor the "
    "center's labor, and everyone realized the favor they owed to the theater's behavior.",
    "Rename the variable `x` to `count` in this code and return the whole code:\n\n"
    "def tally(items):\n    x = 0\n    for item in items:\n        if item:\n            x += 1\n"
    "    return x\n\n\ndef reset():\n    x = 0\n    return x\n",
]
CHAT = [
    "Tell me about the ocean.",
    "What makes a good friend?",
    "Describe a walk in a forest in autumn.",
]
N_LAYERS = {"smol": 30, "qwen": 28}


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def stream_chat(base: str, model: str, prompt: str, max_tokens: int, spec: bool) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": spec,
    }
    parts: list[str] = []
    first = last = 0.0
    tokens = 0
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    parts.append(text)
    return {
        "text": "".join(parts),
        "tokens": tokens,
        "ttft_s": first - t0,
        "per_token_ms": (last - first) * 1000 / max(1, tokens - 1),
    }


def run(swarm: LocalSwarm, rounds: int, max_tokens: int) -> dict[str, Any]:
    base = swarm.base_url.removesuffix("/v1")
    model = swarm.model_name
    out: dict[str, Any] = {}
    for cls, prompts in (("edit", EDIT), ("chat", CHAT)):
        rows: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        counters = {"windows": 0.0, "window_tokens": 0.0, "drafted": 0.0, "decode_tokens": 0}
        identical = True
        stream_chat(base, model, prompts[0], 8, False)  # warm-up (caches, first connections)
        for r in range(rounds):
            for p in prompts:
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                texts = {}
                for mode in order:
                    before = [
                        metric(base, f"swarm_gateway_spec_{n}_total")
                        for n in ("windows", "window_tokens", "drafted_tokens")
                    ]
                    res = stream_chat(base, model, p, max_tokens, mode == "on")
                    texts[mode] = res.pop("text")
                    rows[mode].append(res)
                    if mode == "on":
                        after = [
                            metric(base, f"swarm_gateway_spec_{n}_total")
                            for n in ("windows", "window_tokens", "drafted_tokens")
                        ]
                        counters["windows"] += after[0] - before[0]
                        counters["window_tokens"] += after[1] - before[1]
                        counters["drafted"] += after[2] - before[2]
                        counters["decode_tokens"] += res["tokens"] - 1
                identical &= texts["on"] == texts["off"]
        summary: dict[str, Any] = {"identical_text": identical}
        for mode, items in rows.items():
            summary[mode] = {
                "requests": len(items),
                "tokens": sum(i["tokens"] for i in items),
                "per_token_ms_median": statistics.median(i["per_token_ms"] for i in items),
                "per_token_ms_mean": statistics.fmean(i["per_token_ms"] for i in items),
                "ttft_ms_median": statistics.median(i["ttft_s"] * 1000 for i in items),
            }
        # Decode passes with speculation: a window is one pass; the other decode tokens took one each.
        plain_passes = counters["decode_tokens"] - counters["window_tokens"]
        passes = counters["windows"] + max(0.0, plain_passes)
        summary["spec"] = {
            "windows": counters["windows"],
            "window_tokens": counters["window_tokens"],
            "drafted": counters["drafted"],
            "tokens_per_window": counters["window_tokens"] / max(1.0, counters["windows"]),
            "acceptance": (counters["window_tokens"] - counters["windows"]) / max(1.0, counters["drafted"]),
            "decode_tokens_per_pass": counters["decode_tokens"] / max(1.0, passes),
        }
        summary["ratio_on_over_off"] = (
            summary["on"]["per_token_ms_mean"] / summary["off"]["per_token_ms_mean"]
        )
        out[cls] = summary
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", choices=sorted(N_LAYERS), default="smol")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    path = test_model_path() if args.model == "smol" else qwen_coder_model_path()
    n = N_LAYERS[args.model]
    cuts = [round(i * n / args.nodes) for i in range(args.nodes + 1)]
    layers = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:], strict=False)]
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        swarm = start_local_swarm(
            Path(tmp),
            model=path,
            n_nodes=args.nodes,
            layers=layers,
            node_cache=Path(os.environ.get("SWARM_BENCH_CACHE", Path(tmp) / "cache")),
            gateway_args=["--check-fraction", "0", "--probation-checks", "0", "--kv-keep-s", "0"],
            node_args=["--no-benchmark"],
        )
        try:
            started = time.time()
            results = run(swarm, args.rounds, args.max_tokens)
        finally:
            swarm.stop()
    print(
        f"\nspeculative decoding, {args.model}, {args.nodes} nodes on loopback, {args.rounds} rounds, greedy"
    )
    head = ("class", "off ms/tok", "on ms/tok", "on/off", "tok/window", "accept", "tok/pass", "same")
    print("{:6} {:>11} {:>10} {:>7} {:>11} {:>7} {:>9} {:>5}".format(*head))
    for cls, s in results.items():
        print(
            f"{cls:6} {s['off']['per_token_ms_mean']:11.1f} {s['on']['per_token_ms_mean']:10.1f} "
            f"{s['ratio_on_over_off']:7.2f} {s['spec']['tokens_per_window']:11.2f} "
            f"{s['spec']['acceptance']:7.2f} {s['spec']['decode_tokens_per_pass']:9.2f} "
            f"{str(s['identical_text']):>5}"
        )
    if args.out:
        doc = {
            "command": "python -m sim.bench_spec " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": args.model,
            "nodes": args.nodes,
            "layers": layers,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "started_unix": started,
            "load_avg_1m": os.getloadavg()[0],
            "results": results,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    ok = all(s["identical_text"] for s in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
