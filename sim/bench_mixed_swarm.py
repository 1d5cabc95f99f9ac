"""Mixed load on fixed KV memory through a real 2-node swarm: the pool against today's slots (issue 22).

    python -m sim.bench_mixed_swarm [--scale 1] [--requests 32] [--new 16] [--seed 3]
        [--layouts pool,slots] [--cgroup-mb 4096] [--out docs/perf/kvpool-mixed-swarm.json]

The same requests as ``sim.bench_kvpool_mixed`` (``--requests`` prompts of 100 to 6,000 tokens of
natural text, log-uniform, seeded, each a different text from its first token; ``--new`` greedy
tokens each) go **all at once** through the official ``openai`` client (one thread per request,
token-id prompts, not streamed) to a real tracker, two nodes ``[0,15)`` and ``[15,30)`` of the
bundled SmolLM2 and a gateway on loopback (``sim.launcher.start_local_swarm``; the nodes are the
operator's trusted nodes, as ``swarm-sim up`` starts them, unless ``--untrusted``), once per layout
of the same KV memory on every node:

* ``pool``: ``--kv-pool-tokens 16384`` (the memory of 8 x 2,048 positions), ``--max-sessions 32``
  sequence streams (sparse: a session may grow to the model's 8,192);
* ``slots``: ``--kv-pool-tokens 0``, today's layout of 8 slots of 2,048 positions.

``--scale k`` divides the prompt lengths, the pool and the slots by ``k`` (a cheaper run of the same
shape). The gateway runs as an operator would for such a load: up to ``--gateway-sessions`` (64)
Route Sessions and 64 waiting, KV waits long enough for the slowest request on this machine, no
warm-kept KV (so the pools must be empty afterwards) and no spot checks (one route); its step
deadlines' ceilings are raised (the run measures memory and exactness, not latency).

Every completion is compared with the same request alone through the whole model in one llama.cpp
context computed the way the e2e tests' reference is (``node.reference.ReferenceModel``: flash
attention, f16 KV, one thread, prefill in 512-position batches, greedy, stopped at end of
generation). Where a completion differs, the request is sent again **alone** through the same swarm
once the load is over: equal to the reference alone means the difference came from what the node
batched it with under load (llama.cpp's per-sequence ubatch split; docs/engine.md, Batch
composition), different alone would be a real error.

Reported per layout: completed, refused (by status and reason), identical to the reference, the
most sessions at once on each node (``swarm_node_sessions`` sampled every 0.25 s from the node's
``/metrics``), node preemptions, the gateway's KV waits and resumed preemptions, pool blocks used
after the run (must be 0), each node's peak RSS (``VmHWM``) and -- as root, where a memory cgroup
can be made -- the peak of a cgroup of ``--cgroup-mb`` holding that node (v1: charges move with
the process; the peak counts from when it moved in, after start). Figures, not assertions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from common.vocab import Vocabulary
from gateway.admission import KV_ADMISSION_ORDERS as ORDERS
from node.llama_runtime import ContextSettings
from node.reference import ReferenceModel
from node.testmodel import test_model_path
from sim import bench_kvpool_mixed as mixed
from sim.bench_join import Cgroup, make_cgroup
from sim.launcher import LocalSwarm, start_local_swarm

REF_BATCH = 512  # the e2e tests' reference prefills in 512-position batches (test_kvpool_e2e)
GATEWAY_ARGS = [
    "--max-queue",
    "64",
    "--queue-timeout-s",
    "3600",
    "--kv-wait-s",
    "3600",
    "--max-kv-waiters",
    "64",
    "--kv-keep-s",
    "0",
    "--check-fraction",
    "0",
    # A node busy with 32 sessions' prefill acknowledges an OPEN in seconds, not the default 2, and
    # on this shared 2-core machine a step of a loaded route took longer than the default ceilings
    # (30 s a decode step, 120 s a prefill step): this measures memory and exactness, not latency.
    "--open-timeout-s",
    "30",
    # ... and a node's Info answer (the default 1.5 s, then the node is avoided for 60 s) under a
    # load average of 10-15 from the other sessions on this machine:
    "--dial-timeout-s",
    "30",
    "--decode-step-timeout-s",
    "300",
    "--prefill-step-timeout-s",
    "600",
]
_METRIC = re.compile(r"^([a-z_]+)(\{[^}]*\})? (\S+)$", re.M)


def reference(model: Path, prompts: list[list[int]], n_new: int) -> list[str]:
    """Each request alone through the whole model in one fresh llama.cpp context."""
    settings = ContextSettings(
        n_threads=1, n_seq_max=1, n_ctx=8192, n_batch=REF_BATCH, n_ubatch=REF_BATCH, flash_attn=True
    )
    out = []
    with Vocabulary(model) as vocab, ReferenceModel(model, settings) as ref:
        for p in prompts:
            ref.clear()
            tokens, _ = ref.greedy(p, n_new)
            end = next((i for i, t in enumerate(tokens) if vocab.is_eog(t)), len(tokens))
            out.append(vocab.detokenize(tokens[:end]))
    return out


def metrics(url: str) -> dict[str, float]:
    """A /metrics page summed by name (labels dropped) plus ``name{labels}`` for labelled lines."""
    text = httpx.get(url, timeout=10).text
    out: dict[str, float] = {}
    for name, labels, value in _METRIC.findall(text):
        try:
            v = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + v
        if labels:
            out[name + labels] = v
    return out


def vm_hwm_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM), MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def into_cgroup(name: str, pid: int, limit_mb: int) -> Cgroup | None:
    """A memory cgroup of ``limit_mb`` holding ``pid`` (its charges move along on v1); None if none."""
    group = make_cgroup(name, limit_mb * 2**20)
    if group is None:
        return None
    if group.version == 1:
        try:
            (group.path / "memory.move_charge_at_immigrate").write_text("3")
        except OSError:
            pass
    try:
        group.procs_file().write_text(str(pid))
    except OSError:
        group.remove()
        return None
    return group


@dataclass
class Sampler:
    """Samples every node's session count and pool blocks in a thread (the most seen)."""

    urls: list[str]
    period_s: float = 0.25
    peak_sessions: list[int] = field(default_factory=list)
    peak_used_blocks: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.peak_sessions = [0] * len(self.urls)
        self.peak_used_blocks = [0] * len(self.urls)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for i, url in enumerate(self.urls):
                try:
                    m = metrics(url)
                except httpx.HTTPError:
                    continue
                self.peak_sessions[i] = max(self.peak_sessions[i], int(m.get("swarm_node_sessions", 0)))
                used = m.get("swarm_node_kv_pool_used_blocks", 0)
                self.peak_used_blocks[i] = max(self.peak_used_blocks[i], int(used))
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def ask(swarm: LocalSwarm, prompt: list[int], n_new: int) -> dict[str, Any]:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-bench", max_retries=0, timeout=7200)
    t0 = time.monotonic()
    try:
        r = client.completions.create(model=swarm.model_name, prompt=prompt, max_tokens=n_new, temperature=0)
    except openai.APIStatusError as e:
        return {"status": e.status_code, "reason": str(e.message)[:300], "s": round(time.monotonic() - t0, 1)}
    except openai.APIError as e:
        return {"status": -1, "reason": str(e)[:300], "s": round(time.monotonic() - t0, 1)}
    usage = r.usage.prompt_tokens if r.usage is not None else None
    return {
        "status": 200,
        "text": r.choices[0].text,
        "prompt_tokens": usage,
        "s": round(time.monotonic() - t0, 1),
    }


def whole_prompt_peaks(gw: dict[str, float], node_ids: list[str]) -> list[int]:
    """Each node's most sessions holding their whole prompt at once, from the gateway's
    ``swarm_gateway_kv_holding_sessions_peak{node=...}`` (counted as they happen, not sampled)."""
    return [int(gw.get(f'swarm_gateway_kv_holding_sessions_peak{{node="{n}"}}', 0)) for n in node_ids]


def run_layout(
    label: str,
    workdir: Path,
    model: Path,
    prompts: list[list[int]],
    want: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    name, _, order = label.partition(":")
    order = order or "fifo"
    pool_tokens = 16384 // args.scale
    slot = 2048 // args.scale
    node_args = [
        "--no-benchmark",
        "--kv-pool-tokens",
        str(pool_tokens if name == "pool" else 0),
        # One gateway opens all its streams from one address: the default bound on unproven streams
        # is twice max_sessions (64 for the pool's 32 sessions, 16 for the slots' 8, which a burst of
        # 32 would cut before their OPENs are read: docs/engine.md). The same bound for both layouts.
        "--max-idle-streams-per-address",
        str(2 * args.requests),
    ]
    gateway_args = [
        "--max-sessions",
        str(args.gateway_sessions),
        *GATEWAY_ARGS,
        "--kv-admission",
        order,
        "--kv-admission-max-bypass",
        str(args.max_bypass),
        "--kv-admission-max-wait-s",
        str(args.max_wait_s),
    ]
    swarm = start_local_swarm(
        workdir / label.replace(":", "-"),
        model=model,
        n_nodes=2,
        layers=["0:15", "15:30"],
        max_sessions=32 if name == "pool" else 8,
        session_kv_tokens=slot,
        node_args=node_args,
        gateway_args=gateway_args,
        timeout_s=300,
        trust_nodes=args.trust_nodes,
    )
    groups: list[Cgroup | None] = []
    try:
        node_urls = [f"http://127.0.0.1:{n.admin_port}/metrics" for n in swarm.nodes]
        node_ids = [
            str(httpx.get(f"http://127.0.0.1:{n.admin_port}/status", timeout=10).json()["node_id"])
            for n in swarm.nodes
        ]
        gw_url = swarm.base_url.removesuffix("/v1") + "/metrics"
        if args.cgroup_mb:
            stamp = int(time.time())
            groups = [
                into_cgroup(f"swarm-mixed-{name}-{i}-{stamp}", n.pid, args.cgroup_mb)
                for i, n in enumerate(swarm.nodes)
            ]
        # One request alone first: the gateway's channels to the nodes (their TLS certificates) and
        # its Info cache are made before the burst -- at a load average of 15-25 from the other
        # sessions on this machine, 32 first handshakes at once missed their 5 s and the nodes were
        # avoided for a minute (every request 503). Not counted: the figures below are deltas, and
        # the whole-prompt peak of one request alone is 1.
        # And only once the tracker has the nodes' KV figures (their heartbeats): a route answer without
        # them is "not known" to the gateway's KV admission, which then lets every request through.
        deadline = time.monotonic() + 60
        while not all(
            (x.get("shard") or {}).get("kv_free_tokens") is not None
            for x in httpx.get(f"{swarm.tracker_url}/v1/swarm", timeout=10).json()["nodes"]
        ):
            if time.monotonic() > deadline:
                raise SystemExit("the nodes' heartbeats announced no KV figures within 60 s")
            time.sleep(0.5)
        warm = ask(swarm, prompts[0][:8], 2)
        if warm["status"] != 200:
            raise SystemExit(f"the warm-up request failed: {warm}")
        before_nodes = [metrics(u) for u in node_urls]
        before_gw = metrics(gw_url)
        rss_idle = [vm_hwm_mib(n.pid) for n in swarm.nodes]
        sampler = Sampler(node_urls)
        sampler.start()
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: ask(swarm, p, args.new), prompts))
        wall = time.monotonic() - t0
        # Sessions end asynchronously (RELEASE after the last token): wait until the pools are empty.
        deadline = time.monotonic() + 60
        after_nodes = [metrics(u) for u in node_urls]
        while time.monotonic() < deadline and any(
            m.get("swarm_node_sessions", 0) or m.get("swarm_node_kv_pool_used_blocks", 0) for m in after_nodes
        ):
            time.sleep(0.5)
            after_nodes = [metrics(u) for u in node_urls]
        sampler.stop()
        after_gw = metrics(gw_url)
        rss_peak = [vm_hwm_mib(n.pid) for n in swarm.nodes]
        cg = [g.statistics() if g is not None else None for g in groups]

        def delta_gw(key: str) -> float:
            return after_gw.get(key, 0.0) - before_gw.get(key, 0.0)

        rows = []
        for i, (a, w) in enumerate(zip(answers, want, strict=True)):
            rows.append(
                {"request": i, "prompt_tokens": len(prompts[i]), **a, "identical": a.get("text") == w}
            )
        # A completion that differs: the same request alone through the same swarm, now idle.
        for row in rows:
            if row["status"] == 200 and not row["identical"]:
                alone = ask(swarm, prompts[row["request"]], args.new)
                for _ in range(12):  # a node the load made the gateway avoid is back within a minute
                    if alone["status"] == 200:
                        break
                    time.sleep(10)
                    alone = ask(swarm, prompts[row["request"]], args.new)
                row["alone_identical"] = alone.get("text") == want[row["request"]]
                row["alone_status"] = alone["status"]
        refused: dict[str, int] = {}
        for row in rows:
            if row["status"] != 200:
                key = f"{row['status']} {row['reason'][:80]}"
                refused[key] = refused.get(key, 0) + 1
        return {
            "layout": name,
            "kv_admission": order,
            "node_args": node_args,
            "gateway_args": gateway_args,
            "max_sessions": 32 if name == "pool" else 8,
            "wall_s": round(wall, 1),
            "completed": sum(r["status"] == 200 for r in rows),
            "refused": refused,
            "identical": sum(r["identical"] for r in rows),
            "differing_but_identical_alone": sum(bool(r.get("alone_identical")) for r in rows),
            "most_sessions_at_once": sampler.peak_sessions,
            "most_whole_prompt_at_once": whole_prompt_peaks(after_gw, node_ids),
            "gateway_kv_overdue": delta_gw("swarm_gateway_kv_overdue_total"),
            "most_pool_blocks_used": sampler.peak_used_blocks,
            "node_preemptions": [
                m.get("swarm_node_kv_preemptions_total", 0) - b.get("swarm_node_kv_preemptions_total", 0)
                for m, b in zip(after_nodes, before_nodes, strict=True)
            ],
            "node_pool_refusals": [
                m.get("swarm_node_kv_pool_refusals_total", 0) - b.get("swarm_node_kv_pool_refusals_total", 0)
                for m, b in zip(after_nodes, before_nodes, strict=True)
            ],
            "multi_session_batches": [
                m.get("swarm_node_multi_session_batches_total", 0)
                - b.get("swarm_node_multi_session_batches_total", 0)
                for m, b in zip(after_nodes, before_nodes, strict=True)
            ],
            "gateway_kv_waits": delta_gw("swarm_gateway_kv_waits_total"),
            "gateway_preemptions": {
                k.split("{", 1)[1].rstrip("}"): after_gw[k] - before_gw.get(k, 0.0)
                for k in after_gw
                if k.startswith("swarm_gateway_preemptions_total{")
            },
            "pool_blocks_used_after": [int(m.get("swarm_node_kv_pool_used_blocks", 0)) for m in after_nodes],
            "sessions_after": [int(m.get("swarm_node_sessions", 0)) for m in after_nodes],
            "rss_idle_mib": rss_idle,
            "rss_peak_mib": rss_peak,
            "cgroup": cg,
            "requests": rows,
        }
    finally:
        swarm.stop()
        for g in groups:
            if g is not None:
                g.remove()


def _fmt(v: Any) -> str:
    if isinstance(v, dict):  # refusals by status, preemptions by outcome
        counts: dict[str, float] = {}
        for k, n in v.items():
            key = k.split(" ", 1)[0].replace('outcome="', "").rstrip('"')
            counts[key] = counts.get(key, 0) + n
        return ", ".join(f"{k}: {_fmt(float(n))}" for k, n in sorted(counts.items())) or "0"
    if isinstance(v, list):
        return " / ".join(_fmt(x) for x in v)
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def print_table(result: dict[str, Any]) -> None:
    """The table of a run's JSON (also ``--table FILE``: a table of an earlier run)."""
    layouts = list(result["layouts"])
    keys = [
        ("completed", "completed"),
        ("refused", "failed or refused (by HTTP status)"),
        ("identical", "identical to the request alone (reference)"),
        ("differing_but_identical_alone", "differing under load, identical sent alone"),
        ("most_whole_prompt_at_once", "most sessions holding their whole prompt at once (node 1 / node 2)"),
        ("most_sessions_at_once", "most sessions open at once (node 1 / node 2)"),
        ("most_pool_blocks_used", "most pool blocks used"),
        ("node_preemptions", "node preemptions"),
        ("node_pool_refusals", "node pool refusals"),
        ("gateway_kv_waits", "gateway KV waits"),
        ("gateway_preemptions", "gateway preemptions (by outcome)"),
        ("pool_blocks_used_after", "pool blocks used after"),
        ("rss_peak_mib", "peak RSS MiB (VmHWM)"),
        ("cgroup_peak_mib", "peak of its memory cgroup MiB (since it moved in)"),
        ("wall_s", "wall s"),
    ]
    for row in result["layouts"].values():
        row["cgroup_peak_mib"] = [
            round(int(g.get("max_usage_bytes", g.get("peak_bytes", 0))) / 2**20, 1) if g else "--"
            for g in row.get("cgroup") or [None, None]
        ]
    print("\n| | " + " | ".join(layouts) + " |")
    print("|---|" + "---|" * len(layouts))
    for key, label in keys:
        print(f"| {label} | " + " | ".join(_fmt(result["layouts"][n][key]) for n in layouts) + " |")
    rows = result["layouts"]
    if "slots" in rows:
        base = max(rows["slots"].get("most_whole_prompt_at_once") or rows["slots"]["most_sessions_at_once"])
        for label, row in rows.items():
            if label == "slots" or "most_whole_prompt_at_once" not in row:
                continue
            ratio = round(max(row["most_whole_prompt_at_once"]) / max(1, base), 2)
            result.setdefault("whole_prompt_at_once_over_slots", {})[label] = ratio
            print(f"most sessions holding their whole prompt at once, {label} / slots: {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=16, help="greedy tokens per request")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--scale", type=int, default=1, help="divide prompt lengths, pool and slots by this")
    ap.add_argument(
        "--layouts",
        default="pool:shortest,pool:fifo,slots",
        help="comma-separated: pool[:ORDER] (the gateway's --kv-admission: fifo, fit, shortest) and slots",
    )
    ap.add_argument("--max-bypass", type=int, default=8, help="the gateway's --kv-admission-max-bypass")
    ap.add_argument("--max-wait-s", type=float, default=0.0, help="the gateway's --kv-admission-max-wait-s")
    ap.add_argument(
        "--cgroup-mb", type=int, default=4096, help="each node in a memory cgroup of this (0: none)"
    )
    ap.add_argument(
        "--untrusted",
        dest="trust_nodes",
        action="store_false",
        help="nodes not listed as the operator's trusted nodes (swarm-sim up lists them): on probation",
    )
    ap.add_argument(
        "--gateway-sessions",
        type=int,
        default=64,
        help="the gateway's --max-sessions (Route Sessions at once; more wait in its queue)",
    )
    ap.add_argument(
        "--ref-cache", type=Path, default=None, help="a folder keeping the reference texts between runs"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", type=Path, default=None, help="print the table of an earlier run's JSON")
    args = ap.parse_args()
    if args.table is not None:
        print_table(json.loads(args.table.read_text()))
        return
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or any(
        x != "slots" and not (x.partition(":")[0] == "pool" and x.partition(":")[2] in ("", *ORDERS))
        for x in layouts
    ):
        raise SystemExit(f"--layouts takes pool[:ORDER] (ORDER: {', '.join(ORDERS)}) and slots")
    if args.requests < 1 or args.new < 1 or args.scale < 1 or args.gateway_sessions < 1:
        raise SystemExit("--requests, --new, --scale and --gateway-sessions must be >= 1")
    model = test_model_path()
    with Vocabulary(model) as vocab:
        prompts = mixed._requests(vocab, args.requests, args.seed, args.scale)
    t0 = time.monotonic()
    key = hashlib.sha256(json.dumps([prompts, args.new]).encode()).hexdigest()[:16]
    cached = args.ref_cache / f"bench-mixed-swarm-ref-{key}.json" if args.ref_cache else None
    if cached is not None and cached.is_file():
        want = json.loads(cached.read_text())
    else:
        want = reference(model, prompts, args.new)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps(want))
    print(f"reference: {len(prompts)} requests alone in {time.monotonic() - t0:.0f} s", flush=True)
    result: dict[str, Any] = {
        "model": model.name,
        "requests": args.requests,
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": args.new,
        "seed": args.seed,
        "scale": args.scale,
        "kv_positions_per_node": 16384 // args.scale,
        "trusted_nodes": args.trust_nodes,
        "layouts": {},
    }
    workdir = Path(tempfile.mkdtemp(prefix="bench-mixed-swarm-"))
    for name in layouts:
        row = run_layout(name, workdir, model, prompts, want, args)
        result["layouts"][name] = row
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'requests'})}", flush=True)
    print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
