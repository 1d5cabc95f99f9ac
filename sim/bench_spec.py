"""Speculative decoding on the route, side by side with plain decoding in one run (issue 24).

``python -m sim.bench_spec [--model smol|qwen] [--nodes 3] [--rounds 3] [--max-tokens 96]
[--proposers ngram,draft,draft-always,ngram-flight,draft-always-flight] [--windows 2]
[--clients 1] [--draft-model FILE.gguf] [--out docs/perf/spec.json]``

Starts a swarm on loopback (swarm-tracker, ``--nodes`` swarm-node processes splitting the model
evenly, one llama.cpp thread each, swarm-gateway with ``--kv-keep-s 0`` and no spot checks) and
sends streamed greedy chat requests of two prompt classes, speculation on and off taking turns
(the request's extra_body ``speculation``). With ``draft`` among ``--proposers`` a second swarm,
the same but with every node started with ``--draft-model`` (default: a Q4_0 copy of the target
made with llama.cpp's quantizer; ``draft_model_choice`` auto: each session measures whether the
model or n-gram lookup yields more), runs beside it, and its speculating requests take their turn
too; ``draft-always`` one more whose nodes always draft with the model (``--draft-model-choice
always``). ``ngram-flight`` and ``draft-always-flight``: the same proposers on a swarm whose nodes
keep ``--windows`` verify windows in flight (``--speculate-windows-in-flight``). No speculation,
n-gram drafts and draft-model drafts side by side, in an order that rotates.

* ``edit``: editing code or text given in the prompt (the answer repeats most of it);
* ``chat``: open questions (novel text: n-gram drafts rarely match).

Per request it times the first text piece and the last one at the client (plain httpx) and reads
the completion's token count from the usage chunk; the per-token time is (last - first) / (tokens -
1), the decode part only. Tokens per pass come from the gateway's speculation counters. It checks
that the texts with and without speculation are identical. Prints a table and writes JSON; the
machine is shared, so figures are for comparison within one run (ratios).

``--clients N`` (N > 1) measures the aggregate instead: per mode, N clients at once each stream one
request (the six prompts of both classes in turn, so editing and chat mix), and the aggregate is all
their completion tokens over the wall time from the first request sent to the last one finished;
modes take turns, the order rotating per round. Each client's text is checked against the same
prompt without speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from node.testmodel import qwen_coder_model_path, test_model_path
from sim.launcher import LocalSwarm, start_local_swarm

COUNTERS = ("windows", "window_tokens", "drafted_tokens")

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
PLAIN = ("off", "server")  # modes without speculation
PROPOSERS = ("ngram", "draft", "draft-always", "ngram-flight", "draft-always-flight")


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def stream_chat(base: str, model: str, prompt: str, max_tokens: int, spec: bool | None) -> dict[str, Any]:
    """One streamed greedy chat request; ``spec`` None: no ``speculation`` field (another server)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec is not None:
        body["speculation"] = spec
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
    tokens = tokens or len(parts)  # no usage chunk (llama-cpp-python's server): a piece per token
    return {
        "text": "".join(parts),
        "tokens": tokens,
        "ttft_s": first - t0,
        "per_token_ms": (last - first) * 1000 / max(1, tokens - 1),
    }


def run(swarms: dict[str, Any], rounds: int, max_tokens: int) -> dict[str, Any]:
    """``swarms``: mode -> the swarm its requests go to; modes ``off`` and ``server`` (llama-cpp-python's
    server, ``--server``) run without speculation."""
    out: dict[str, Any] = {}
    modes = list(swarms)
    for cls, prompts in (("edit", EDIT), ("chat", CHAT)):
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        counters = {
            m: dict.fromkeys(("windows", "window_tokens", "drafted", "decode_tokens"), 0.0) for m in modes
        }
        identical = {m: True for m in modes if m not in PLAIN}
        for swarm in {id(s): s for s in swarms.values()}.values():  # warm-up (caches, first connections)
            plain = None if swarm is swarms.get("server") else False
            stream_chat(swarm.base_url.removesuffix("/v1"), swarm.model_name, prompts[0], 8, plain)
        turn = 0
        for _ in range(rounds):
            for p in prompts:
                order = modes[turn % len(modes) :] + modes[: turn % len(modes)]
                turn += 1
                texts = {}
                for mode in order:
                    base = swarms[mode].base_url.removesuffix("/v1")
                    spec = mode not in PLAIN
                    before = [metric(base, f"swarm_gateway_spec_{n}_total") for n in COUNTERS] if spec else []
                    res = stream_chat(
                        base, swarms[mode].model_name, p, max_tokens, None if mode == "server" else spec
                    )
                    texts[mode] = res.pop("text")
                    rows[mode].append(res)
                    if spec:
                        after = [metric(base, f"swarm_gateway_spec_{n}_total") for n in COUNTERS]
                        c = counters[mode]
                        c["windows"] += after[0] - before[0]
                        c["window_tokens"] += after[1] - before[1]
                        c["drafted"] += after[2] - before[2]
                        c["decode_tokens"] += res["tokens"] - 1
                for mode in identical:
                    identical[mode] &= texts[mode] == texts["off"]
        summary: dict[str, Any] = {"identical_text": identical}
        for mode, items in rows.items():
            summary[mode] = {
                "requests": len(items),
                "tokens": sum(i["tokens"] for i in items),
                "per_token_ms_median": statistics.median(i["per_token_ms"] for i in items),
                "per_token_ms_mean": statistics.fmean(i["per_token_ms"] for i in items),
                "ttft_ms_median": statistics.median(i["ttft_s"] * 1000 for i in items),
            }
            if "server" in rows:  # decode tok/s over the server's (per-token times' inverse ratio)
                summary[mode]["decode_speed_over_server"] = statistics.fmean(
                    i["per_token_ms"] for i in rows["server"]
                ) / statistics.fmean(i["per_token_ms"] for i in items)
            if mode == "server":
                summary[mode]["over_off"] = (
                    summary[mode]["per_token_ms_mean"] / summary["off"]["per_token_ms_mean"]
                )
            if mode in PLAIN:
                continue
            c = counters[mode]
            # Decode passes with speculation: a window is one pass; the other decode tokens took one each.
            passes = c["windows"] + max(0.0, c["decode_tokens"] - c["window_tokens"])
            summary[mode]["spec"] = {
                "windows": c["windows"],
                "window_tokens": c["window_tokens"],
                "drafted": c["drafted"],
                "tokens_per_window": c["window_tokens"] / max(1.0, c["windows"]),
                "acceptance": (c["window_tokens"] - c["windows"]) / max(1.0, c["drafted"]),
                "decode_tokens_per_pass": c["decode_tokens"] / max(1.0, passes),
            }
            summary[mode]["over_off"] = (
                summary[mode]["per_token_ms_mean"] / summary["off"]["per_token_ms_mean"]
            )
        out[cls] = summary
    return out


def _client(i: int, args: tuple[Any, ...], results: list[Any], errors: list[BaseException]) -> None:
    """One client's request (a thread): its result in ``results[i]``, or its error in ``errors``."""
    try:
        results[i] = stream_chat(*args)
    except BaseException as exc:  # reported after the round
        errors.append(exc)


def run_clients(swarms: dict[str, LocalSwarm], clients: int, rounds: int, max_tokens: int) -> dict[str, Any]:
    """``clients`` streams at once per mode and round; the aggregate tokens/s per mode."""
    modes = list(swarms)
    prompts = [p for pair in zip(EDIT, CHAT, strict=True) for p in pair]
    for swarm in {id(s): s for s in swarms.values()}.values():  # warm-up (caches, first connections)
        stream_chat(swarm.base_url.removesuffix("/v1"), swarm.model_name, prompts[0], 8, False)
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    texts: dict[str, dict[int, set[str]]] = {m: {} for m in modes}  # mode -> prompt -> texts seen
    counters = {m: dict.fromkeys(("windows", "window_tokens", "drafted"), 0.0) for m in modes}
    failures: dict[str, list[str]] = {m: [] for m in modes}  # requests that failed (not counted)
    for r in range(rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            base = swarms[mode].base_url.removesuffix("/v1")
            results: list[dict[str, Any] | None] = [None] * clients
            errors: list[BaseException] = []

            before = [metric(base, f"swarm_gateway_spec_{n}_total") for n in COUNTERS]
            args = [
                (base, swarms[mode].model_name, prompts[i % len(prompts)], max_tokens, mode != "off")
                for i in range(clients)
            ]
            threads = [
                threading.Thread(target=_client, args=(i, a, results, errors), daemon=True)
                for i, a in enumerate(args)
            ]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            after = [metric(base, f"swarm_gateway_spec_{n}_total") for n in COUNTERS]
            failures[mode] += [repr(exc)[:300] for exc in errors]
            done = [res for res in results if res is not None]
            if not done:
                raise RuntimeError(f"{mode}: all {clients} requests failed: {errors[0]!r}")
            tokens = sum(res["tokens"] for res in done)
            for i, res in enumerate(done):
                texts[mode].setdefault(i % len(prompts), set()).add(res.pop("text"))
            if mode != "off":
                c = counters[mode]
                for key, b, a in zip(("windows", "window_tokens", "drafted"), before, after, strict=True):
                    c[key] += a - b
            rows[mode].append(
                {
                    "round": r,
                    "wall_s": wall,
                    "tokens": tokens,
                    "tokens_per_s": tokens / wall,
                    "per_token_ms_median": statistics.median(res["per_token_ms"] for res in done),
                    "ttft_ms_median": statistics.median(res["ttft_s"] * 1000 for res in done),
                }
            )
            print(
                f"round {r} {mode:20} {tokens / wall:7.1f} tok/s ({tokens} tokens, {wall:.1f} s, "
                f"{len(errors)} failed)",
                flush=True,
            )
    out: dict[str, Any] = {
        "identical_text": {m: texts[m] == texts["off"] for m in modes if m != "off"},
        # Prompts whose texts differ between requests (any mode, off included): prompt -> texts.
        "differing": {
            str(j): sorted({t for m in modes for t in texts[m].get(j, ())})
            for j in range(len(prompts))
            if len({t for m in modes for t in texts[m].get(j, ())}) > 1
        },
        "off_self_consistent": all(len(v) == 1 for v in texts["off"].values()),
    }
    for mode, items in rows.items():
        total_tokens = sum(i["tokens"] for i in items)
        total_wall = sum(i["wall_s"] for i in items)
        out[mode] = {
            "rounds": items,
            "tokens": total_tokens,
            "wall_s": total_wall,
            "tokens_per_s": total_tokens / total_wall,
            "tokens_per_s_median": statistics.median(i["tokens_per_s"] for i in items),
            "failed_requests": failures[mode],
        }
        if mode != "off":
            c = counters[mode]
            out[mode]["spec"] = {
                "windows": c["windows"],
                "window_tokens": c["window_tokens"],
                "drafted": c["drafted"],
                "tokens_per_window": c["window_tokens"] / max(1.0, c["windows"]),
            }
    for mode in modes:
        out[mode]["over_off"] = out[mode]["tokens_per_s"] / out["off"]["tokens_per_s"]
    return out


@dataclass
class _Endpoint:
    """A server other than a swarm (``--server``): where its OpenAI API is and its model's name."""

    base_url: str
    model_name: str


def _start(tmp: Path, name: str, path: Path, nodes: int, layers: list[str], extra: list[str]) -> LocalSwarm:
    return start_local_swarm(
        tmp / name,
        model=path,
        n_nodes=nodes,
        layers=layers,
        node_cache=Path(os.environ.get("SWARM_BENCH_CACHE", tmp / "cache")),
        # Open and dial timeouts of 10 s (default 2 s / 1.5 s): on a shared machine under load a node
        # may answer OPEN late, and the gateway would avoid it for a minute (503s, not a measurement).
        gateway_args=[
            "--check-fraction",
            "0",
            "--probation-checks",
            "0",
            "--kv-keep-s",
            "0",
            "--open-timeout-s",
            "10",
            "--dial-timeout-s",
            "10",
        ],
        node_args=["--no-benchmark", *extra],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", choices=sorted(N_LAYERS), default="smol")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--proposers", default="ngram", help=", ".join(PROPOSERS) + " (commas)")
    ap.add_argument("--windows", type=int, default=2, help="windows in flight of the *-flight modes")
    ap.add_argument(
        "--clients", type=int, default=1, help="> 1: that many streams at once, aggregate tokens/s"
    )
    ap.add_argument("--draft-model", type=Path, default=None, help="default: a Q4_0 copy of the target")
    ap.add_argument(
        "--server",
        type=int,
        default=0,
        help="T > 0: llama-cpp-python's server on the whole model with T threads beside (mode server)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the swarms' folders (logs) here")
    args = ap.parse_args(argv)
    proposers = [p for p in args.proposers.split(",") if p]
    if not proposers or set(proposers) - set(PROPOSERS):
        ap.error("--proposers: " + ", ".join(PROPOSERS) + " (commas)")
    if args.clients < 1 or args.clients > 8:
        ap.error("--clients must be in 1..8 (the nodes hold 8 sessions)")
    if not 2 <= args.windows <= 4:
        ap.error("--windows must be in 2..4")
    path = test_model_path() if args.model == "smol" else qwen_coder_model_path()
    n = N_LAYERS[args.model]
    cuts = [round(i * n / args.nodes) for i in range(args.nodes + 1)]
    layers = [f"{a}:{b}" for a, b in zip(cuts, cuts[1:], strict=False)]
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp_dir:
        tmp = Path(tmp_dir)
        if args.workdir is not None:  # kept after the run (the services' logs)
            tmp = args.workdir
            tmp.mkdir(parents=True, exist_ok=True)
        draft_path = args.draft_model
        if {"draft", "draft-always", "draft-always-flight"} & set(proposers) and draft_path is None:
            from node.draft_model import quantize

            draft_path = quantize(path, tmp / "draft-q4_0.gguf", "q4_0")
        started_swarms: list[LocalSwarm] = []
        stops: list[Callable[[], None]] = []
        try:
            plain = _start(tmp, "ngram", path, args.nodes, layers, [])
            started_swarms.append(plain)
            swarms: dict[str, Any] = {"off": plain}
            if "ngram" in proposers:
                swarms["ngram"] = plain
            flight = ["--speculate-windows-in-flight", str(args.windows)]
            model_args = ["--draft-model", str(draft_path), "--draft-model-choice"]
            for mode, extra in (
                ("draft", [*model_args, "auto"]),
                ("draft-always", [*model_args, "always"]),
                ("ngram-flight", flight),
                ("draft-always-flight", [*model_args, "always", *flight]),
            ):
                if mode in proposers:
                    drafting = _start(tmp, mode, path, args.nodes, layers, extra)
                    started_swarms.append(drafting)
                    swarms[mode] = drafting
            if args.server > 0:
                from sim.bench_swarm import start_server

                if args.clients > 1:
                    ap.error("--server is for one stream (--clients 1)")
                server = start_server(path, args.server, tmp / "server")
                stops.append(server.stop)
                swarms["server"] = _Endpoint(server.base_url, server.model)
            started = time.time()
            load_start = os.getloadavg()[0]
            if args.clients > 1:
                results = run_clients(swarms, args.clients, args.rounds, args.max_tokens)
            else:
                results = run(swarms, args.rounds, args.max_tokens)
        finally:
            for swarm in started_swarms:
                swarm.stop()
            for stop in stops:
                stop()
    if args.clients > 1:
        print(
            f"\nspeculative decoding, {args.model}, {args.nodes} nodes on loopback, {args.clients} clients "
            f"at once, {args.rounds} rounds, greedy"
        )
        print(
            "{:20} {:>9} {:>7} {:>9} {:>11} {:>5}".format(
                "mode", "tok/s", "/off", "median", "tok/window", "same"
            )
        )
        for mode in ("off", *proposers):
            m = results[mode]
            tpw = f"{m['spec']['tokens_per_window']:11.2f}" if mode != "off" else " " * 11
            same = str(results["identical_text"].get(mode, ""))
            print(
                f"{mode:20} {m['tokens_per_s']:9.1f} {m['over_off']:7.2f} {m['tokens_per_s_median']:9.1f} "
                f"{tpw} {same:>5}"
            )
    else:
        _print_table(args.model, args.nodes, args.rounds, proposers, results)
    if args.out:
        doc = {
            "command": "python -m sim.bench_spec " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": args.model,
            "nodes": args.nodes,
            "layers": layers,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "clients": args.clients,
            "proposers": proposers,
            "windows_in_flight": args.windows,
            "draft_model": None if draft_path is None else draft_path.name,
            "started_unix": started,
            "load_avg_1m_start": load_start,
            "load_avg_1m": os.getloadavg()[0],
            "results": results,
        }
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.clients > 1:
        return 0 if all(results["identical_text"].values()) else 1
    ok = all(all(s["identical_text"].values()) for s in results.values())
    return 0 if ok else 1


def _print_table(model: str, nodes: int, rounds: int, proposers: list[str], results: dict[str, Any]) -> None:
    print(f"\nspeculative decoding, {model}, {nodes} nodes on loopback, {rounds} rounds, greedy")
    print(
        "{:6} {:12} {:>9} {:>7} {:>8} {:>11} {:>7} {:>9} {:>5}".format(
            "class", "mode", "ms/tok", "/off", "x server", "tok/window", "accept", "tok/pass", "same"
        )
    )
    for cls, res in results.items():
        for mode in ("off", *(["server"] if "server" in res else []), *proposers):
            m = res[mode]
            vs = f"{m['decode_speed_over_server']:8.2f}" if "decode_speed_over_server" in m else " " * 8
            if mode in PLAIN:
                print(f"{cls:6} {mode:12} {m['per_token_ms_mean']:9.1f} {m.get('over_off', 1.0):7.2f} {vs}")
                continue
            sp = m["spec"]
            print(
                f"{cls:6} {mode:12} {m['per_token_ms_mean']:9.1f} {m['over_off']:7.2f} {vs} "
                f"{sp['tokens_per_window']:11.2f} {sp['acceptance']:7.2f} "
                f"{sp['decode_tokens_per_pass']:9.2f} "
                f"{str(res['identical_text'][mode]):>5}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
