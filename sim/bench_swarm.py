"""The swarm against single-machine llama.cpp, in one run on one machine.

    python -m sim.bench_swarm [--out bench-results/swarm.json] [--concurrency 1,4,8]
                              [--setups server:1,server:2,swarm2,swarm3]
                              [--fail-on swarm2.c1.decode_ratio=0.8 ...]

Setups, each driven with the same prompts over the same HTTP API (streaming
chat completions, greedy, ``--max-tokens`` new tokens each):

* ``server``: llama-cpp-python's own OpenAI server (``python -m llama_cpp.server``)
  running the whole model in one process -- the baseline;
* ``swarmN``: ``swarm-sim up`` with N nodes (tracker placement) and a gateway.

Equal CPU: each node gets ``--threads-per-node`` llama.cpp threads and the
baseline server gets the same total (N x threads-per-node), both said in the
report. All setups are up at once and driven in turn: at each concurrency
level C there are ``--rounds`` rounds, and in each round every setup (in an
order rotated every round) gets C clients sending one request each, so drift
of the shared machine falls on every setup alike. Reported per setup and level: time to first token,
decode tok/s per stream, aggregate tok/s, p50/p95 request latency, the RSS of
every process, and the ratio of each swarm figure to the baseline's. JSON and
a PNG chart are written; ``--fail-on`` makes it usable as a gate.

Load tools (one swarm, ``--setups swarmN``; the gateway is started with
``--gateway-max-sessions`` and ``--gateway-max-queue`` so that it refuses
work at a concurrency this machine can reach)::

    python -m sim.bench_swarm --mode stress   [--ramp 1,2,4,8,16,32] [--refusal-threshold 0.05]
    python -m sim.bench_swarm --mode capacity [--ramp 1,2,4,8,16]    [--ttft-slo-s 2.0]

* ``stress`` ramps the concurrency level by level (each client sends
  ``--requests-per-client`` requests per level) until the share of requests
  refused (HTTP 429/503: admission control doing its job) passes the threshold;
  it reports, per level, the refusal and error rates, TTFT and latency p95 and
  the aggregate tok/s, and the level where refusals began.
* ``capacity`` ramps until the TTFT p95 passes the SLO and reports the last
  level under it: the concurrency this swarm serves within the SLO.

Gates (exit code 1, the failures printed): ``--max-error-rate R`` (requests that
failed other than by a refusal, over the whole run), ``--max-ttft-p95-s S`` at
``--gate-concurrency C`` (default: the first level), ``--min-capacity N``
(capacity mode).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from node.testmodel import test_model_path
from sim.launcher import start_local_swarm
from sim.procs import Supervisor, wait_http

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some facts about the planet Mars.",
    "Describe the water cycle for a child.",
    "What makes a good cup of tea?",
    "Give advice to someone learning to cook.",
    "Summarize the history of the printing press.",
    "Why do cats purr?",
]


@dataclass
class RequestStats:
    ttft_s: float
    latency_s: float
    tokens: int
    decode_tok_s: float | None


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def stream_one(client: httpx.Client, base_url: str, model: str, prompt: str, max_tokens: int) -> RequestStats:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    completion_tokens = None
    with client.stream("POST", f"{base_url}/chat/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                completion_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    end = time.perf_counter()
    n = completion_tokens or len(stamps)
    ttft = (stamps[0] - t0) if stamps else end - t0
    decode = (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return RequestStats(ttft, end - t0, n, decode)


def attempt_one(
    client: httpx.Client, base_url: str, model: str, prompt: str, max_tokens: int
) -> RequestStats | str:
    """:func:`stream_one`, but a refusal (429/503) is ``"refused"`` and any other failure ``"error"``."""
    try:
        return stream_one(client, base_url, model, prompt, max_tokens)
    except httpx.HTTPStatusError as err:
        return "refused" if err.response.status_code in (429, 503) else "error"
    except (httpx.HTTPError, ValueError):
        return "error"


def ramp_level(
    base_url: str, model: str, concurrency: int, requests_per_client: int, max_tokens: int
) -> dict:
    """One level of a ramp: ``concurrency`` clients, ``requests_per_client`` requests each."""
    outcomes: list[RequestStats | str] = []
    lock = threading.Lock()

    def client_loop(cid: int) -> None:
        with httpx.Client() as client:
            for r in range(requests_per_client):
                got = attempt_one(client, base_url, model, PROMPTS[(cid + r) % len(PROMPTS)], max_tokens)
                with lock:
                    outcomes.append(got)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client_loop, c) for c in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    served = [o for o in outcomes if isinstance(o, RequestStats)]
    refused = sum(1 for o in outcomes if o == "refused")
    errors = sum(1 for o in outcomes if o == "error")
    row = summarize(concurrency, served, wall) if served else {"concurrency": concurrency, "requests": 0}
    row.update(
        attempted=len(outcomes),
        refused=refused,
        errors=errors,
        refusal_rate=refused / len(outcomes),
        error_rate=errors / len(outcomes),
    )
    return row


def run_ramp(
    base_url: str,
    model: str,
    levels: list[int],
    *,
    mode: str,
    requests_per_client: int,
    max_tokens: int,
    refusal_threshold: float,
    ttft_slo_s: float,
    say: Callable[[str], None] = print,
) -> dict:
    """Stress: until the refusal rate passes the threshold. Capacity: until TTFT p95 passes the SLO."""
    rows = []
    stopped_at = None
    for level in levels:
        row = ramp_level(base_url, model, level, requests_per_client, max_tokens)
        rows.append(row)
        say(
            f"  c={level:>3}: {row['attempted']} requests, refused {row['refusal_rate']:.0%}, "
            f"errors {row['error_rate']:.0%}, ttft p95 {row.get('ttft_p95_s', math.nan):.2f} s, "
            f"{row.get('aggregate_tok_s', 0.0):.1f} tok/s"
        )
        if mode == "stress" and row["refusal_rate"] > refusal_threshold:
            stopped_at = level
            break
        if mode == "capacity" and not row.get("ttft_p95_s", math.inf) <= ttft_slo_s:
            stopped_at = level
            break
    under_slo = [
        r["concurrency"]
        for r in rows
        if r.get("ttft_p95_s", math.inf) <= ttft_slo_s and r["refusal_rate"] == 0
    ]
    attempted = sum(r["attempted"] for r in rows)
    return {
        "mode": mode,
        "levels": rows,
        "stopped_at": stopped_at,  # None: the ramp ended before the threshold/SLO was passed
        "refusal_threshold": refusal_threshold,
        "ttft_slo_s": ttft_slo_s,
        # capacity: the highest level (before the stop) served with no refusal and TTFT p95 within the SLO
        "capacity": max((c for c in under_slo if stopped_at is None or c < stopped_at), default=0),
        "error_rate": sum(r["errors"] for r in rows) / attempted if attempted else 0.0,
        "refusal_rate": sum(r["refused"] for r in rows) / attempted if attempted else 0.0,
    }


def ramp_gates(
    ramp: dict,
    *,
    max_error_rate: float | None,
    max_ttft_p95_s: float | None,
    gate_concurrency: int | None,
    min_capacity: int | None,
) -> list[str]:
    failures = []
    if max_error_rate is not None and ramp["error_rate"] > max_error_rate:
        failures.append(f"error rate {ramp['error_rate']:.3f} > {max_error_rate}")
    if max_ttft_p95_s is not None:
        level = gate_concurrency if gate_concurrency is not None else ramp["levels"][0]["concurrency"]
        row = next((r for r in ramp["levels"] if r["concurrency"] == level), None)
        p95 = row.get("ttft_p95_s", math.inf) if row else math.inf
        if not p95 <= max_ttft_p95_s:
            failures.append(f"ttft p95 at c={level} = {p95:.3f} s > {max_ttft_p95_s} s")
    if min_capacity is not None and ramp["capacity"] < min_capacity:
        failures.append(f"capacity {ramp['capacity']} < {min_capacity}")
    return failures


class RssSampler:
    """Peak RSS of each watched process, sampled in a background thread while a setup runs."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.5) -> None:
        self.pids = pids
        self.peak: dict[str, int] = {name: 0 for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=False)
        self.interval_s = interval_s

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                self.peak[name] = max(self.peak[name], rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def drive(
    base_url: str, model: str, concurrency: int, rounds: int, max_tokens: int, first_round: int = 0
) -> tuple[list[RequestStats], float]:
    """``concurrency`` clients each send ``rounds`` requests back to back; the results and the wall time."""
    results: list[RequestStats] = []
    lock = threading.Lock()

    def client_loop(cid: int) -> None:
        with httpx.Client() as client:
            for r in range(first_round, first_round + rounds):
                prompt = PROMPTS[(cid + r * concurrency) % len(PROMPTS)]
                stats = stream_one(client, base_url, model, prompt, max_tokens)
                with lock:
                    results.append(stats)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client_loop, c) for c in range(concurrency)]:
            f.result()
    return results, time.perf_counter() - t0


def summarize(concurrency: int, results: list[RequestStats], wall: float) -> dict:
    decode = [r.decode_tok_s for r in results if r.decode_tok_s]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": sum(r.tokens for r in results),
        "wall_s": wall,
        "aggregate_tok_s": sum(r.tokens for r in results) / wall,
        "ttft_p50_s": _percentile([r.ttft_s for r in results], 0.5),
        "ttft_p95_s": _percentile([r.ttft_s for r in results], 0.95),
        "decode_tok_s_per_stream_p50": _percentile(decode, 0.5),
        "latency_p50_s": _percentile([r.latency_s for r in results], 0.5),
        "latency_p95_s": _percentile([r.latency_s for r in results], 0.95),
    }


@dataclass
class Setup:
    """One running setup: where to send requests, which processes to watch, how to stop it."""

    name: str
    base_url: str
    model: str
    pids: dict[str, int]
    info: dict
    stop: Callable[[], None]


def start_server(model: Path, threads: int, workdir: Path) -> Setup:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sup = Supervisor(workdir)
    # Same attention settings as the nodes: flash attention on, f16 KV.
    proc = sup.spawn(
        f"llama-server-{threads}",
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            "--n_ctx",
            "4096",
            "--flash_attn",
            "true",
            "--model_alias",
            "baseline",
        ],
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_http(proc, f"{base}/models", 180)
    except BaseException:
        sup.stop_all()
        raise
    return Setup(
        f"server:{threads}",
        base,
        "baseline",
        {"llama_cpp.server": proc.pid},
        {"setup": f"server:{threads}", "threads_total": threads},
        sup.stop_all,
    )


def start_swarm(
    model: Path,
    n_nodes: int,
    threads: int,
    max_level: int,
    workdir: Path,
    node_cache: Path,
    gateway_args: list[str] | None = None,
) -> Setup:
    swarm = start_local_swarm(
        workdir / f"swarm{n_nodes}",
        model=model,
        n_nodes=n_nodes,
        threads=threads,
        max_sessions=max(8, max_level),
        session_kv_tokens=1024,
        node_cache=node_cache,
        gateway_args=gateway_args or ["--max-sessions", str(max(8, max_level))],
    )
    pids = {"tracker": swarm.tracker.pid, "gateway": swarm.gateway.pid}
    for i, node in enumerate(swarm.nodes):
        pids[f"node{i + 1} [{node.extra['span'][0]},{node.extra['span'][1]})"] = node.pid
    return Setup(
        f"swarm{n_nodes}",
        swarm.base_url,
        swarm.model_name,
        pids,
        {
            "setup": f"swarm{n_nodes}",
            "nodes": n_nodes,
            "threads_per_node": threads,
            "threads_total": n_nodes * threads,
        },
        swarm.stop,
    )


def run_interleaved(setups: list[Setup], levels: list[int], rounds: int, max_tokens: int) -> dict:
    """Every setup is up at once; at each level, round r runs each setup in turn, the order rotated
    every round, so the machine's drift (neighbours, clocks) falls on all setups alike."""
    for setup in setups:
        with httpx.Client() as c:
            stream_one(c, setup.base_url, setup.model, PROMPTS[0], 8)  # warm-up
    all_pids = {(setup.name, proc): pid for setup in setups for proc, pid in setup.pids.items()}
    collected: dict[tuple[str, int], tuple[list[RequestStats], float]] = {}
    with RssSampler({f"{k[0]}\t{k[1]}": pid for k, pid in all_pids.items()}) as rss:
        for li, level in enumerate(levels):
            for r in range(rounds):
                k = (li + r) % len(setups)
                for setup in setups[k:] + setups[:k]:
                    results, wall = drive(setup.base_url, setup.model, level, 1, max_tokens, first_round=r)
                    got, total = collected.get((setup.name, level), ([], 0.0))
                    collected[(setup.name, level)] = (got + results, total + wall)
    out = {}
    for setup in setups:
        peaks = {
            key.split("\t", 1)[1]: v for key, v in rss.peak.items() if key.split("\t", 1)[0] == setup.name
        }
        out[setup.name] = {
            **setup.info,
            "levels": [summarize(lv, *collected[(setup.name, lv)]) for lv in levels],
            "rss_bytes": peaks,
        }
    return out


def add_ratios(report: dict) -> None:
    """Ratios of each swarm figure to each baseline; the headline one is the baseline with the same
    total threads (capped at the machine's cores)."""
    servers = {name: s for name, s in report["setups"].items() if name.startswith("server")}
    cpus = report["cpu_count"] or 1
    for name, setup in report["setups"].items():
        if name.startswith("server"):
            continue
        want = min(setup["threads_total"], cpus)
        matched = min(servers, key=lambda n: abs(servers[n]["threads_total"] - want), default=None)
        setup["baseline"] = matched
        for lvl in setup["levels"]:
            lvl["vs"] = {}
            for sname, server in servers.items():
                b = next((x for x in server["levels"] if x["concurrency"] == lvl["concurrency"]), None)
                if b is None:
                    continue
                ratios = {
                    "aggregate_ratio": lvl["aggregate_tok_s"] / b["aggregate_tok_s"],
                    "decode_ratio": lvl["decode_tok_s_per_stream_p50"] / b["decode_tok_s_per_stream_p50"],
                    "ttft_ratio": lvl["ttft_p50_s"] / b["ttft_p50_s"],
                }
                lvl["vs"][sname] = ratios
                if sname == matched:
                    lvl.update(ratios)


def print_table(report: dict) -> None:
    hdr = (
        f"{'setup':<9} {'thr':>3} {'conc':>4} {'agg tok/s':>9} {'ratio':>6} "
        f"{'stream tok/s':>12} {'ratio':>6} {'ttft p50':>8} {'lat p50':>7} {'lat p95':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, setup in report["setups"].items():
        for lvl in setup["levels"]:
            agg_ratio, decode_ratio = lvl.get("aggregate_ratio", math.nan), lvl.get("decode_ratio", math.nan)
            print(
                f"{name:<9} {setup['threads_total']:>3} {lvl['concurrency']:>4} "
                f"{lvl['aggregate_tok_s']:>9.1f} "
                f"{agg_ratio:>6.2f} {lvl['decode_tok_s_per_stream_p50']:>12.1f} "
                f"{decode_ratio:>6.2f} {lvl['ttft_p50_s'] * 1000:>6.0f}ms "
                f"{lvl['latency_p50_s']:>6.2f}s {lvl['latency_p95_s']:>6.2f}s"
            )
    print("\npeak RSS (MB):")
    for name, setup in report["setups"].items():
        print(f"  {name}: " + ", ".join(f"{k} {v / 1e6:.0f}" for k, v in setup["rss_bytes"].items()))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(report["setups"])
    levels = [lvl["concurrency"] for lvl in report["setups"][names[0]]["levels"]]
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        lv = report["setups"][name]["levels"]
        xs = [i + k * width for i in range(len(lv))]
        axes[0].bar(xs, [x["aggregate_tok_s"] for x in lv], width, label=name)
        axes[1].bar(xs, [x["decode_tok_s_per_stream_p50"] for x in lv], width, label=name)
    for ax, title in zip(axes, ["aggregate tok/s", "decode tok/s per stream (p50)"], strict=True):
        ax.set_xticks(
            [i + width * (len(names) - 1) / 2 for i in range(len(levels))], [f"c={c}" for c in levels]
        )
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_gates(report: dict, gates: list[str]) -> list[str]:
    """``swarm2.c1.decode_ratio=0.8`` fails when that figure is below 0.8."""
    failures = []
    for gate in gates:
        key, _, threshold = gate.partition("=")
        setup, level, metric = key.split(".")
        lvl = next(x for x in report["setups"][setup]["levels"] if x["concurrency"] == int(level.lstrip("c")))
        if lvl[metric] < float(threshold):
            failures.append(f"{key} = {lvl[metric]:.3f} < {threshold}")
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-results/swarm.json"))
    ap.add_argument(
        "--setups",
        default="server:1,server:2,swarm2,swarm3",
        help="server:T is llama-cpp-python's server with T threads; swarmN is N nodes",
    )
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads-per-node", type=int, default=1)
    ap.add_argument("--fail-on", action="append", default=[], metavar="SETUP.cN.METRIC=MIN")
    ap.add_argument("--mode", choices=["compare", "stress", "capacity"], default="compare")
    ap.add_argument("--ramp", default="1,2,4,8,16,32", help="stress/capacity: concurrency levels, in order")
    ap.add_argument("--requests-per-client", type=int, default=2, help="stress/capacity: per level")
    ap.add_argument("--refusal-threshold", type=float, default=0.05, help="stress: stop past this share")
    ap.add_argument("--ttft-slo-s", type=float, default=2.0, help="capacity: TTFT p95 objective")
    ap.add_argument("--gateway-max-sessions", type=int, default=4, help="stress/capacity: admission")
    ap.add_argument("--gateway-max-queue", type=int, default=4, help="stress/capacity: admission")
    ap.add_argument("--gateway-queue-timeout-s", type=float, default=10.0)
    ap.add_argument("--max-error-rate", type=float, default=None, help="gate: non-refusal failures")
    ap.add_argument("--max-ttft-p95-s", type=float, default=None, help="gate: TTFT p95 at --gate-concurrency")
    ap.add_argument("--gate-concurrency", type=int, default=None)
    ap.add_argument("--min-capacity", type=int, default=None, help="gate (capacity mode)")
    args = ap.parse_args()
    if args.mode != "compare":
        raise SystemExit(run_load_mode(args))
    model = test_model_path()
    levels = [int(x) for x in args.concurrency.split(",")]
    setups = args.setups.split(",")
    work = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
    node_cache = work / "node-cache"
    report: dict = {
        "benchmark": "swarm-vs-llama.cpp-server",
        "model": model.name,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "threads_per_node": args.threads_per_node,
        "cpu_count": psutil.cpu_count(),
        "setups": {},
    }
    running: list[Setup] = []
    try:
        for name in setups:
            print(f"starting {name} ...", flush=True)
            if name.startswith("server"):
                running.append(start_server(model, int(name.partition(":")[2] or 1), work))
            else:
                running.append(
                    start_swarm(model, int(name[5:]), args.threads_per_node, max(levels), work, node_cache)
                )
        print(f"driving {', '.join(s.name for s in running)} in turn ...", flush=True)
        report["setups"] = run_interleaved(running, levels, args.rounds, args.max_tokens)
    finally:
        for setup in running:
            setup.stop()
    add_ratios(report)
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    failures = check_gates(report, args.fail_on)
    if failures:
        raise SystemExit("gate failed: " + "; ".join(failures))


def run_load_mode(args: argparse.Namespace) -> int:
    """``--mode stress|capacity`` against one swarm; the exit code says whether the gates held."""
    model = test_model_path()
    levels = [int(x) for x in args.ramp.split(",")]
    (name,) = [x for x in args.setups.split(",") if x.startswith("swarm")][:1] or ["swarm2"]
    work = Path(tempfile.mkdtemp(prefix="swarm-load-"))
    gateway_args = [
        "--max-sessions",
        str(args.gateway_max_sessions),
        "--max-queue",
        str(args.gateway_max_queue),
        "--queue-timeout-s",
        str(args.gateway_queue_timeout_s),
    ]
    print(
        f"starting {name} (gateway: {args.gateway_max_sessions} sessions, queue {args.gateway_max_queue}) ..."
    )
    setup = start_swarm(
        model, int(name[5:]), args.threads_per_node, max(levels), work, work / "node-cache", gateway_args
    )
    try:
        with httpx.Client() as c:
            stream_one(c, setup.base_url, setup.model, PROMPTS[0], 8)  # warm-up
        print(f"{args.mode}: ramping {levels} ...", flush=True)
        ramp = run_ramp(
            setup.base_url,
            setup.model,
            levels,
            mode=args.mode,
            requests_per_client=args.requests_per_client,
            max_tokens=args.max_tokens,
            refusal_threshold=args.refusal_threshold,
            ttft_slo_s=args.ttft_slo_s,
        )
    finally:
        setup.stop()
    report = {
        "benchmark": f"swarm-{args.mode}",
        "model": model.name,
        "setup": setup.info,
        "gateway": {"max_sessions": args.gateway_max_sessions, "max_queue": args.gateway_max_queue},
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "cpu_count": psutil.cpu_count(),
        **ramp,
    }
    if args.mode == "stress":
        where = f"c={ramp['stopped_at']}" if ramp["stopped_at"] else "never (within the ramp)"
        print(
            f"refusals passed {args.refusal_threshold:.0%} at {where}; "
            f"errors {ramp['error_rate']:.1%} overall"
        )
    else:
        print(f"capacity within TTFT p95 <= {args.ttft_slo_s} s: c={ramp['capacity']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    failures = ramp_gates(
        ramp,
        max_error_rate=args.max_error_rate,
        max_ttft_p95_s=args.max_ttft_p95_s,
        gate_concurrency=args.gate_concurrency,
        min_capacity=args.min_capacity,
    )
    for f in failures:
        print(f"gate failed: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    main()
