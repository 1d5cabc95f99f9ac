"""Live rebalancing on the emulated WAN: demand shifts from one model to another, nodes move.

    sudo .venv/bin/python -m sim.bench_wan_rebalance [--runs 2] [--out docs/perf/wan-rebalance.json]

A tracker, a gateway and six nodes, each in its own network namespace of the bundled
``three-regions`` profile (eu / us / asia: 10 ms round trips inside a region, 80 ms eu-us,
120 ms us-asia, 150 ms eu-asia, real kernel delays; docs/wan.md). The tracker, the gateway
and the client sit in eu. Two real models, both registered at the tracker with a
Range-capable HTTP source (a file server in the tracker's namespace, bound to its WAN
address): model A = SmolLM2-135M (30 layers) and model B = Gemma 3 270M (18 layers).

* Start: five nodes serve all of A (eu0, eu1, us0, us1, asia0), one serves all of B
  (asia1, the far end of the WAN from the gateway): A is covered well, B thinly -- the
  ``sim/scenarios/demand_shift.toml`` situation (5 in 6 joined for A).
* Every node asks the tracker every ``rebalance_interval_s`` (2 s) whether to move and may
  move to the other model (``--rebalance-models``); cool-down 10 s, 2 confirmations, drain 2 s
  (node TOML). The tracker counts a model's demand with a 10 s half-life.
* Phase A: ``concurrency`` client threads (the official ``openai`` client, streaming chat
  completions, no retries, one new prompt per request) ask for A.
* The shift: all threads but ``trickle`` ask for B; the trickle keeps asking A for longer
  answers, so the nodes that move hold A sessions when they drain (handed back: the gateway
  replays them elsewhere).
* The run ends ``settle_s`` after ``expect_moves`` nodes serve B, or at ``max_shift_s``.

Recorded per request: model, phase, start, end, TTFT, per-token latency (streamed chunks),
success or the error, and the text; every move from the nodes' logs (advice, drain, hand
back, rejoin); the tracker's and the gateway's events that take a node out of routing or
a route from a request (challenges, expiries, nodes a gateway could not reach, failed
opens, replaced stages, failed requests); and the tracker's view -- which node serves
which model while ``live``, and the state of the others -- each time it changed (polled
once a second). Reported: B's median latency while the
swarm is moving (from the shift until the last move is live) against after the moves, the
failed requests (the goal is none), and a sample of texts against the whole model alone
(greedy, one plain llama.cpp context).

Needs root (network namespaces); says why and exits 2 without.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

MODEL_NAMES = {"A": "smollm2-wan", "B": "gemma3-wan"}
MODEL_LAYERS = {"A": 30, "B": 18}
QUESTIONS = (
    "Name a colour of the sea.",
    "What is the capital of France?",
    "Say something about the moon.",
    "Write one line about rivers.",
    "What do bees make?",
    "Describe a tree in a few words.",
    "Why is the sky blue?",
    "Give a word that rhymes with cat.",
)


@dataclass(frozen=True)
class NodePlan:
    name: str  # the WAN host, e.g. "eu0"
    region: str
    model: str  # "A" or "B"


@dataclass(frozen=True)
class Scenario:
    nodes: tuple[NodePlan, ...] = (
        NodePlan("eu0", "eu", "A"),
        NodePlan("eu1", "eu", "A"),
        NodePlan("us0", "us", "A"),
        NodePlan("us1", "us", "A"),
        NodePlan("asia0", "asia", "A"),
        NodePlan("asia1", "asia", "B"),
    )
    profile: str = "three-regions"
    phase_a_s: float = 30.0
    max_shift_s: float = 240.0
    settle_s: float = 40.0
    expect_moves: int = 3
    concurrency: int = 6
    trickle: int = 1  # client threads that keep asking A after the shift
    max_tokens: int = 24
    trickle_tokens: int = 64
    rebalance_interval_s: float = 2.0
    confirmations: int = 2
    cooldown_s: float = 10.0
    drain_s: float = 2.0
    half_life_s: float = 10.0
    min_holders: int = 2
    pending_s: float = 120.0
    text_sample: int = 40  # per model; 0 = compare every request's text
    after_grace_s: float = 5.0  # "after the moves" starts this long after the last move is live
    ready_s: float = 180.0  # how long the nodes may take to load and go live
    # Each node's memory (node memory_limit_mb): six nodes share this one machine, and a node sizes its
    # KV pool from the memory it may use -- by default the whole machine's, so three nodes moving to
    # Gemma 3 at once (4-5 GB each) got the only Gemma node OOM-killed (2026-12-07).
    memory_limit_mb: int = 2048


@dataclass
class RequestRecord:
    model: str
    phase: str  # "A" (before the shift) or "B" (after it)
    prompt: str
    max_tokens: int
    start_s: float  # since the shift's clock origin (the start of phase A)
    end_s: float = 0.0
    ttft_ms: float | None = None
    per_token_ms: float | None = None
    chunks: int = 0
    ok: bool = False
    error: str = ""
    text: str = ""
    same_as_alone: bool | None = None  # None: not compared


@dataclass
class Run:
    scenario: Scenario
    requests: list[RequestRecord] = field(default_factory=list)
    node_events: list[dict[str, Any]] = field(default_factory=list)
    # (t, host -> model of the live nodes), and (t, host -> state of the others), each on a change
    tracker_view: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    tracker_states: list[tuple[float, dict[str, str]]] = field(default_factory=list)
    service_events: list[dict[str, Any]] = field(default_factory=list)  # the tracker's and gateway's
    shift_s: float = 0.0
    moves: list[dict[str, Any]] = field(default_factory=list)  # host, from, to, live_s
    end_s: float = 0.0
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)


def _toml(section: str, values: dict[str, float | int]) -> str:
    return f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())


class Clients:
    """``concurrency`` threads, each sending one streamed chat completion after another (official
    ``openai`` client, no retries, 120 s timeout): bounded by the thread count."""

    def __init__(self, base_url: str, sc: Scenario, clock: Callable[[], float]) -> None:
        self.base_url = base_url
        self.sc = sc
        self.clock = clock
        self.phase = "A"
        self.stop = threading.Event()
        self.records: list[RequestRecord] = []
        self.lock = threading.Lock()
        self.counter = itertools.count()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(sc.concurrency)
        ]

    def _request(self, client: Any, model: str, phase: str, n: int) -> RequestRecord:
        i = next(self.counter)
        # A new prompt each time: a kept prefix would draw every request to the node that holds it.
        prompt = f"Request {i}. {QUESTIONS[i % len(QUESTIONS)]}"
        rec = RequestRecord(model, phase, prompt, n, self.clock())
        first = last = None
        parts: list[str] = []
        try:
            stream = client.chat.completions.create(
                model=MODEL_NAMES[model],
                messages=[{"role": "user", "content": prompt}],
                max_tokens=n,
                temperature=0,
                stream=True,
            )
            for chunk in stream:
                if not chunk.choices:
                    continue
                piece = chunk.choices[0].delta.content
                if piece:
                    now = self.clock()
                    first = now if first is None else first
                    last = now
                    rec.chunks += 1
                    parts.append(piece)
            rec.ok = True
        except Exception as err:  # every failure is recorded with its cause
            rec.error = f"{type(err).__name__}: {err}"[:400]
        rec.end_s = self.clock()
        rec.text = "".join(parts)
        if first is not None:
            rec.ttft_ms = (first - rec.start_s) * 1e3
            if last is not None and rec.chunks > 1:
                rec.per_token_ms = (last - first) * 1e3 / (rec.chunks - 1)
        return rec

    def _run(self, index: int) -> None:
        import openai

        client = openai.OpenAI(base_url=self.base_url, api_key="bench", max_retries=0, timeout=120)
        while not self.stop.is_set():
            phase = self.phase
            trickle = phase == "B" and index < self.sc.trickle
            model = "A" if phase == "A" or trickle else "B"
            n = self.sc.trickle_tokens if trickle else self.sc.max_tokens
            rec = self._request(client, model, phase, n)
            with self.lock:
                self.records.append(rec)
            if not rec.ok:
                self.stop.wait(0.5)  # a failure is not retried; the next request comes a little later

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


def _origin(wan: Any, files: dict[str, Path]) -> tuple[Any, str]:
    """A Range-capable file server bound to the tracker host's WAN address (the models' source)."""
    from http.server import ThreadingHTTPServer

    from sim.range_server import RangeServer

    server = RangeServer(files)
    handler = server.httpd.RequestHandlerClass
    server.httpd.server_close()
    address = wan.address("tracker")
    server.httpd = wan.call("tracker", ThreadingHTTPServer, (address, 0), handler)
    server.httpd.daemon_threads = True
    server.port = server.httpd.server_address[1]
    server.thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    return server, f"http://{address}:{server.port}"


def _register(wan: Any, tracker: Any, url: str, path: Path, name: str, source: str) -> str:
    from sim.procs import console_script, service_env

    argv = [*console_script("swarm-tracker"), "model", "add", str(path), "--name", name, "--source", source,
            "--tracker", url, "--data-dir", str(tracker.data_dir)]  # fmt: skip
    done = subprocess.run(
        wan.argv("tracker", argv), capture_output=True, text=True, timeout=120, check=False, env=service_env()
    )
    if done.returncode != 0:
        raise RuntimeError(f"model add {name}: {done.stderr}{done.stdout}")
    for line in done.stdout.splitlines():
        if line.startswith("fingerprint"):
            return line.split()[1]
    raise RuntimeError(f"model add {name}: no fingerprint in {done.stdout!r}")


# The moves (advice, drain, the new span's source, fetched and cut, loaded, announced) and the nodes'
# refusals by the tracker.
NODE_EVENTS = ("rebalance_advice", "rebalance_draining", "rebalance_drained", "rebalance_moving",
               "rebalance_move_failed", "model_source", "fetch_source_slow", "fetch_retry", "shard_ready",
               "node_serving", "announced", "tracker_refused")  # fmt: skip
# What takes a node out of routing at the tracker, or a route from a request at the gateway.
TRACKER_EVENTS = ("node_rechallenged", "node_rechallenge_spared", "node_challenged", "node_expired",
                  "node_restored", "node_left", "node_announced")  # fmt: skip
GATEWAY_EVENTS = ("node_unreachable", "route_open_failed", "session_recovering", "stage_replacement_failed",
                  "request_failed", "routes_served_stale", "tracker_lookup_failed")  # fmt: skip
MAX_EVENTS = 5000  # per log
DROPPED = ("logger", "level", "ts", "start", "end", "model", "tracker", "tracker_id", "reporter")


def _node_events(log: str, host: str, t0_wall: float, names: Sequence[str] = NODE_EVENTS,
                 hosts: dict[str, str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The events ``names`` of a JSON log since ``t0_wall`` (wall clock), trimmed; node ids become
    host names where ``hosts`` knows them."""
    out: list[dict[str, Any]] = []
    for line in log.splitlines():
        if len(out) >= MAX_EVENTS:
            break
        if not line.startswith("{") or not any(f'"{n}"' in line for n in names):
            continue
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") not in names or float(e.get("ts", 0.0)) < t0_wall - 30.0:
            continue
        if e.get("event") == "rebalance_advice" and e.get("advice") == "stay":
            continue  # the many "stay" answers are counted, not listed
        t = round(float(e.get("ts", 0.0)) - t0_wall, 2)
        e = {k: (v[:200] if isinstance(v, str) else v) for k, v in e.items() if k not in DROPPED}
        if hosts is not None and "node_id" in e:
            e["node"] = hosts.get(str(e.pop("node_id")), "?")
        e["host"] = host
        e["t_s"] = t
        out.append(e)
    return out


def run_scenario(sc: Scenario, workdir: Path, *, say: Callable[[str], None] = print) -> Run:
    """One run of the demand shift on the emulated WAN (needs root); everything is torn down after."""
    from node.testmodel import gemma3_model_path, test_model_path
    from sim.procs import NO_SPOT_CHECKS, Supervisor, wait_http
    from sim.wan import WanEmulator
    from sim.wan.profile import load_profile

    paths = {"A": test_model_path(), "B": gemma3_model_path()}
    hosts = {"tracker": "eu", "gateway": "eu", "client": "eu"} | {n.name: n.region for n in sc.nodes}
    run = Run(sc, load_before=os.getloadavg())
    (workdir / "tracker.toml").write_text(
        _toml("tracker", {
            "demand_half_life_s": sc.half_life_s, "rebalance_min_holders": sc.min_holders,
            "rebalance_pending_s": sc.pending_s, "probation_checks": 0, "heartbeat_timeout_s": 30.0,
        })
    )  # fmt: skip
    (workdir / "node.toml").write_text(
        _toml("node", {
            "rebalance_cooldown_s": sc.cooldown_s, "rebalance_confirmations": sc.confirmations,
            "rebalance_drain_s": sc.drain_s, "memory_limit_mb": sc.memory_limit_mb,
        })
    )  # fmt: skip
    wan = WanEmulator(load_profile(sc.profile), hosts)
    wan.start()
    sup = Supervisor(workdir / "swarm", place=wan.argv)
    origin = None
    try:
        origin, origin_url = _origin(wan, {"/a.gguf": paths["A"], "/b.gguf": paths["B"]})
        origin.__enter__()
        tracker = sup.start_tracker(
            host=wan.address("tracker"),
            extra_args=["--heartbeat-interval-s", "1"],
            env={"SWARM_TRACKER_CONFIG": str(workdir / "tracker.toml")},
        )
        tracker.wait_port(120)
        url = f"http://{wan.address('tracker')}:{tracker.port}"
        wan.call("tracker", wait_http, tracker, f"{url}/healthz", 120)
        fps = {m: _register(wan, tracker, url, paths[m], MODEL_NAMES[m], f"{origin_url}/{m.lower()}.gguf")
               for m in ("A", "B")}  # fmt: skip
        model_of_fp = {fp: m for m, fp in fps.items()}
        say(f"  models registered: A {fps['A'][:12]} (SmolLM2), B {fps['B'][:12]} (Gemma 3 270M)")
        nodes = {}
        for n in sc.nodes:
            other = MODEL_NAMES["B" if n.model == "A" else "A"]
            nodes[n.name] = sup.start_node(
                n.name, model=paths[n.model], layers=f"0:{MODEL_LAYERS[n.model]}", tracker_url=url,
                host=wan.address(n.name), cache_dir=workdir / "cache" / n.name,
                extra_args=["--no-benchmark", "--config", str(workdir / "node.toml"),
                            "--heartbeat-interval-s", "1", "--rtt-probe-interval-s", "1",
                            "--rebalance-interval-s", str(sc.rebalance_interval_s),
                            "--rebalance-models", other, "--log-level", "info"],
            )  # fmt: skip
        ids = {}
        for name, node in nodes.items():
            node.wait_port(sc.ready_s)
            health = wan.call(
                name, wait_http, node, f"http://127.0.0.1:{node.admin_port}/healthz", sc.ready_s
            )
            ids[health.json()["node_id"]] = name
        gateway = sup.start_gateway(
            tracker_url=url,
            host=wan.address("gateway"),
            extra_args=["--stats-interval-s", "1", "--rtt-probe-interval-s", "1", "--route-ttl-s", "2",
                        *NO_SPOT_CHECKS],
        )  # fmt: skip
        gateway.wait_port(120)
        wan.call(
            "gateway", wait_http, gateway, f"http://{wan.address('gateway')}:{gateway.port}/healthz", 120
        )
        tracker_local = f"http://127.0.0.1:{wan.forward('tracker', tracker.port)}"
        base = f"http://127.0.0.1:{wan.forward('gateway', gateway.port)}/v1"

        last: dict[str, str] = {}
        states: dict[str, str] = {}

        def view() -> dict[str, str]:
            """Host -> the model it serves, live nodes only (the last answer if the tracker is slow);
            the others' states go to ``states``."""
            nonlocal last, states
            try:
                got = httpx.get(f"{tracker_local}/v1/swarm", timeout=30).json()["nodes"]
            except httpx.HTTPError as err:
                say(f"  the tracker's /v1/swarm did not answer ({err!r}); keeping the last view")
                return dict(last)
            last = {
                ids[x["node_id"]]: model_of_fp.get(x["shard"]["model_fingerprint"], "?")
                for x in got
                if x["state"] == "live" and x["node_id"] in ids
            }
            states = {ids[x["node_id"]]: str(x["state"]) for x in got
                      if x["state"] != "live" and x["node_id"] in ids}  # fmt: skip
            return dict(last)

        def record(t: float, v: dict[str, str]) -> None:
            """The view and the states, each when it changed."""
            if not run.tracker_view or run.tracker_view[-1][1] != v:
                run.tracker_view.append((t, v))
            if not run.tracker_states or run.tracker_states[-1][1] != states:
                run.tracker_states.append((t, dict(states)))

        deadline = time.monotonic() + sc.ready_s
        while len(view()) < len(sc.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every node live within {sc.ready_s:g} s: {view()}")
            time.sleep(1)
        initial = view()
        say(f"  live: {initial}")
        # A moment for the coordinates (1 s probes): routes from the eu gateway prefer near nodes.
        time.sleep(10)
        t0 = time.monotonic()
        t0_wall = time.time()
        clock = lambda: time.monotonic() - t0  # noqa: E731
        moved: dict[str, float] = {}
        with Clients(base, sc, clock) as clients:
            # Phase A
            while clock() < sc.phase_a_s:
                record(round(clock(), 2), view())
                time.sleep(1)
            clients.phase = "B"
            run.shift_s = clock()
            say(f"  t={run.shift_s:.0f} s: demand shifts to B")
            stop_at = run.shift_s + sc.max_shift_s
            while clock() < stop_at:
                v = view()
                record(round(clock(), 2), v)
                for host, m in v.items():
                    if m != initial[host] and host not in moved:
                        moved[host] = clock()
                        say(f"  t={moved[host]:.0f} s: {host} serves {m} (was {initial[host]})")
                if len(moved) >= sc.expect_moves:
                    stop_at = min(stop_at, max(moved.values()) + sc.settle_s)
                time.sleep(1)
        run.end_s = clock()
        run.requests = sorted(clients.records, key=lambda r: r.start_s)
        for host, node in nodes.items():
            run.node_events += _node_events(node.log_text(), host, t0_wall)
        run.node_events.sort(key=lambda e: e["t_s"])
        for host, svc, wanted in (("tracker", tracker, TRACKER_EVENTS), ("gateway", gateway, GATEWAY_EVENTS)):
            run.service_events += _node_events(svc.log_text(), host, t0_wall, wanted, ids)
        run.service_events.sort(key=lambda e: e["t_s"])
        final = run.tracker_view[-1][1]
        run.moves = [
            {"host": h, "from": initial[h], "to": final.get(h, "?"), "live_s": round(t, 2)}
            for h, t in sorted(moved.items(), key=lambda kv: kv[1])
        ]
    finally:
        names = wan.namespaces()
        try:
            sup.stop_all()
        finally:
            if origin is not None:
                origin.__exit__()
            wan.close()
        from sim.wan import netns

        left = set(names) & set(netns.list_namespaces())
        if left:
            raise RuntimeError(f"namespaces left behind: {sorted(left)}")
    run.load_after = os.getloadavg()
    return run


def compare_texts(run: Run, sample: int) -> None:
    """Set ``same_as_alone`` for a sample of each model's successful requests (``sample`` 0: all):
    the whole model alone in one plain llama.cpp context, greedy, through the chat template."""
    from node.testmodel import gemma3_model_path, test_model_path
    from sim.reference import Reference

    paths = {"A": test_model_path(), "B": gemma3_model_path()}
    for m in ("A", "B"):
        done = [r for r in run.requests if r.model == m and r.ok]
        if sample and len(done) > sample:
            step = len(done) / sample
            done = [done[int(i * step)] for i in range(sample)]
        if not done:
            continue
        ref = Reference(paths[m])
        try:
            for r in done:
                r.same_as_alone = ref.chat(r.prompt, r.max_tokens) == r.text
        finally:
            ref.close()


def _median(xs: Sequence[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if got else None


def summarize(run: Run) -> dict[str, Any]:
    sc = run.scenario
    last_live = max((m["live_s"] for m in run.moves), default=None)
    reqs = run.requests

    def window(rs: list[RequestRecord]) -> dict[str, Any]:
        ok = [r for r in rs if r.ok]
        return {
            "requests": len(rs),
            "ok": len(ok),
            "median_latency_ms": _median([(r.end_s - r.start_s) * 1e3 for r in ok]),
            "median_ttft_ms": _median([r.ttft_ms for r in ok]),
            "median_per_token_ms": _median([r.per_token_ms for r in ok]),
        }

    b = [r for r in reqs if r.model == "B" and r.phase == "B"]
    during = [r for r in b if last_live is None or r.start_s < last_live]
    after = [r for r in b if last_live is not None and r.start_s >= last_live + sc.after_grace_s]
    a_before = [r for r in reqs if r.model == "A" and r.phase == "A"]
    compared = [r for r in reqs if r.same_as_alone is not None]
    drains = [e for e in run.node_events if e.get("event") == "rebalance_drained"]
    b_during, b_after = window(during), window(after)
    d, a = b_during["median_latency_ms"], b_after["median_latency_ms"]
    return {
        "shift_s": round(run.shift_s, 2),
        "end_s": round(run.end_s, 2),
        "moves": run.moves,
        "last_move_live_s": last_live,
        "handed_back_sessions": sum(int(e.get("sessions_handed_back") or 0) for e in drains),
        "drains": len(drains),
        "move_failed": sum(1 for e in run.node_events if e.get("event") == "rebalance_move_failed"),
        "requests": len(reqs),
        "failed": sum(1 for r in reqs if not r.ok),
        "failures": [f"{r.model} t={r.start_s:.1f}: {r.error}" for r in reqs if not r.ok][:20],
        "a_before_shift": window(a_before),
        "b_during_moves": b_during,
        "b_after_moves": b_after,
        "b_after_over_during": (a / d) if d and a else None,
        "a_trickle_after_shift": window([r for r in reqs if r.model == "A" and r.phase == "B"]),
        "move_seconds": _move_seconds(run),
        "service_events": {
            name: sum(1 for e in run.service_events if e.get("event") == name)
            for name in (*TRACKER_EVENTS, *GATEWAY_EVENTS)
        },  # fmt: skip
        "left_live_without_moving": _left_live(run),
        "texts_compared": len(compared),
        "texts_same": sum(1 for r in compared if r.same_as_alone),
        "load_before": run.load_before,
        "load_after": run.load_after,
    }


def _move_seconds(run: Run) -> list[dict[str, Any]]:
    """Per move: from the drain's start to live again at the tracker (None: not live by the end)."""
    out = []
    for e in run.node_events:
        if e.get("event") == "rebalance_draining":
            live = next(
                (m["live_s"] for m in run.moves if m["host"] == e["host"] and m["live_s"] >= e["t_s"]), None
            )
            out.append(
                {
                    "host": e["host"],
                    "drain_s": e["t_s"],
                    "seconds": None if live is None else round(live - e["t_s"], 1),
                }
            )
    return out


def _left_live(run: Run) -> list[dict[str, Any]]:
    """Spells in which a node that was not moving was out of the tracker's ``live`` view (a spell
    that starts within 10 s after the node began to drain is its move)."""
    drains: dict[str, list[float]] = {}
    for e in run.node_events:
        if e.get("event") == "rebalance_draining":
            drains.setdefault(e["host"], []).append(e["t_s"])
    spells: list[dict[str, Any]] = []
    out_since: dict[str, float] = {}
    hosts = {n.name for n in run.scenario.nodes}
    end: tuple[float | None, dict[str, str]] = (None, {h: "" for h in hosts})  # still out at the end
    for t, v in [*run.tracker_view, end]:
        for h in sorted(hosts):
            if h not in v and h not in out_since and t is not None:
                out_since[h] = t
            elif h in v and h in out_since:
                since = out_since.pop(h)
                if not any(d - 1.0 <= since <= d + 10.0 for d in drains.get(h, [])):
                    spells.append({"host": h, "from_s": since, "to_s": t})
    return spells


def _request_row(r: RequestRecord) -> dict[str, Any]:
    """One request for the JSON: times rounded to 10 ms, the text only where it was compared."""
    row = asdict(r)
    for k in ("start_s", "end_s"):
        row[k] = round(row[k], 2)
    for k in ("ttft_ms", "per_token_ms"):
        row[k] = None if row[k] is None else round(row[k], 1)
    if r.same_as_alone is None:
        row["text"] = None
    return row


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.0f}{unit}"


def print_table(summaries: list[dict[str, Any]]) -> None:
    print("run | moves (host: live at s) | B median latency during moves -> after (ms) | "
          "B per token during -> after (ms) | B TTFT during -> after (ms) | requests | failed | "
          "texts same | handed back")  # fmt: skip
    for i, s in enumerate(summaries, 1):
        d, a = s["b_during_moves"], s["b_after_moves"]
        moves = ", ".join(f"{m['host']}: {m['live_s'] - s['shift_s']:.0f}" for m in s["moves"]) or "none"
        print(
            f"{i} | {moves} | {_fmt(d['median_latency_ms'])} ({d['ok']}) -> {_fmt(a['median_latency_ms'])} "
            f"({a['ok']}) | {_fmt(d['median_per_token_ms'])} -> {_fmt(a['median_per_token_ms'])} | "
            f"{_fmt(d['median_ttft_ms'])} -> {_fmt(a['median_ttft_ms'])} | {s['requests']} | {s['failed']} | "
            f"{s['texts_same']}/{s['texts_compared']} | {s['handed_back_sessions']}"
        )
        for f in s["failures"]:
            print(f"    failed: {f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--phase-a-s", type=float, default=Scenario.phase_a_s)
    parser.add_argument("--settle-s", type=float, default=Scenario.settle_s)
    parser.add_argument("--max-shift-s", type=float, default=Scenario.max_shift_s)
    parser.add_argument("--concurrency", type=int, default=Scenario.concurrency)
    parser.add_argument("--text-sample", type=int, default=Scenario.text_sample)
    parser.add_argument("--out", type=Path, default=Path("docs/perf/wan-rebalance.json"))
    args = parser.parse_args(argv)
    if args.runs < 1 or args.concurrency < 2:
        parser.error("--runs must be >= 1 and --concurrency >= 2")

    from sim.wan.support import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_wan_rebalance: the emulated WAN is unavailable here: {reason}", file=sys.stderr)
        return 2
    sc = replace(
        Scenario(), phase_a_s=args.phase_a_s, settle_s=args.settle_s, max_shift_s=args.max_shift_s,
        concurrency=args.concurrency, text_sample=args.text_sample,
    )  # fmt: skip
    runs = []
    summaries = []
    for i in range(args.runs):
        print(f"run {i + 1} of {args.runs}")
        with tempfile.TemporaryDirectory(prefix="bench-wan-rebalance-") as tmp:
            run = run_scenario(sc, Path(tmp), say=lambda s: print(s, flush=True))
        compare_texts(run, sc.text_sample)
        summaries.append(summarize(run))
        runs.append(run)
    print_table(summaries)
    result = {
        "benchmark": "bench_wan_rebalance",
        "scenario": asdict(sc),
        "summaries": summaries,
        "runs": [
            {
                "requests": [_request_row(r) for r in run.requests],
                "node_events": run.node_events,
                "service_events": run.service_events,
                "tracker_view": run.tracker_view,
                "tracker_states": run.tracker_states,
            }
            for run in runs
        ],
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "time": time.time(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
