"""Per-hop overhead of the data plane: decode through two nodes on loopback vs the same split in-process.

    python -m sim.bench_hop [--tokens 48] [--rounds 4] [--tls] [--out bench-results/hop.json]

Every setup runs the test model split [0,15) + [15,30) with the same engine
settings (1 compute thread each, per-sequence KV), greedy, the same prompt:

* ``in-process``: two ``ShardEngine`` objects in this process, stepped in lock
  step (the hidden state handed over directly): the compute floor;
* ``push``: two ``swarm-node start`` processes (port 0, no tracker,
  ``--insecure-no-tickets``) driven by the gateway's own Route Session code
  (``gateway.route_session``, through ``sim.route_client``) with direct push:
  stage 0 pushes its hidden states to stage 1, stage 1 pushes the next decode
  step back to stage 0 (the ring) -- two node-to-node transfers per token;
* ``relay``: the same nodes and code with ``data_plane=relay``: both transfers
  go through the gateway (four gRPC transits per token);
* with ``--tls``, also ``push+tls`` and ``relay+tls``: a second pair of nodes
  serving gRPC over TLS (their own certificates, pinned by fingerprint as a
  gateway pins them), the first pair ``--insecure-plaintext``; all four node
  processes live at once, so TLS and plaintext are measured side by side. The
  cost of TLS per hop = (``push+tls`` - ``push``) / 2. Decode-time medians on a
  shared machine move by a few tenths of a millisecond between runs, so
  ``--tls`` also measures the transport alone (:func:`transport_cost`): round
  trips of a decode step's frame and of a prefill chunk through the adapter,
  plaintext vs pinned TLS, in alternating blocks.

Rounds rotate the order of the setups so machine drift lands on all of them.
Decode time per token is a request's decode time over its tokens after the
first (the span between token arrivals; single arrivals can bunch). Per-hop
overhead = (setup - in-process) / 2, a hop being one stage-to-stage transfer.
It also reads the nodes' scheduler counters: engine rounds that ran on the trio
thread (no thread hand-off) vs on the engine thread (two hand-offs: there and
back), so the thread hand-offs per stage step are counted, not guessed; gRPC's
own completion-queue wake-up (one per message, inside grpcio) comes on top.
All processes started here are stopped by pid.
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
            threads=1, max_sessions=MAX_SESSIONS, session_kv_tokens=SESSION_KV, batch_tokens=BATCH
        )
        self.a = ShardEngine(extract_shard(model, 0, 15, cache), config, cache)
        self.b = ShardEngine(extract_shard(model, 15, 30, cache), config, cache)
        self.a.open_session("bench")
        self.b.open_session("bench")
        self.pos = 0

    def reset(self) -> None:
        for engine in (self.a, self.b):
            engine.release("bench")
            engine.open_session("bench")
        self.pos = 0

    def generate(self, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
        """Greedy tokens and the decode time of each one after the first."""
        self.reset()
        tokens = [self.step(prompt)]
        times = []
        while len(tokens) < n_new:
            t0 = time.perf_counter()
            tokens.append(self.step([tokens[-1]]))
            times.append(time.perf_counter() - t0)
        return tokens, times

    def step(self, tokens: list[int]) -> int:
        from node.engine import Work

        (ra,) = self.a.step([Work("bench", self.pos, tokens=np.asarray(tokens, dtype=np.int32))])
        (rb,) = self.b.step([Work("bench", self.pos, hidden=ra.hidden, sample=True)])
        if rb.sampled is None:
            raise RuntimeError(f"in-process step failed: {ra.error or rb.error}")
        self.pos += len(tokens)
        return rb.sampled.token_id

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _start_node(sup: Supervisor, name: str, model: Path, layers: str, cache: Path, tls: bool) -> Service:
    return sup.start_node(
        name,
        model=model,
        layers=layers,
        tracker_url=None,
        tls=tls,
        max_sessions=MAX_SESSIONS,
        session_kv_tokens=SESSION_KV,
        cache_dir=cache,
        admin=True,
        extra_args=["--batch-tokens", str(BATCH), "--no-benchmark", "--log-level", "warning"],
    )


def _scheduler_counts(admin_ports: list[int]) -> list[tuple[float, float]]:
    """(inline rounds, all rounds) of each node, from its admin /metrics."""
    import httpx

    out = []
    for port in admin_ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        values = {
            line.split()[0]: float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(("swarm_node_inline_rounds_total ", "swarm_node_batches_total "))
        }
        out.append(
            (values.get("swarm_node_inline_rounds_total", 0.0), values.get("swarm_node_batches_total", 0.0))
        )
    return out


def run(
    model: Path, cache: Path, prompt: list[int], n_new: int, rounds: int, tls: bool = False
) -> dict[str, Any]:
    """All setups live at once; each round runs one request per setup, in a rotating order."""
    import trio

    from common.grpc_adapter import open_grpc
    from gateway.grpc_bridge import NodeChannels
    from gateway.route_session import DataPlane
    from sim.route_client import generate, route_on

    names = ["in-process", "push", "relay", *(["push+tls", "relay+tls"] if tls else [])]
    results: dict[str, Any] = {name: [] for name in names}
    tokens: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-hop-") as tmp, Supervisor(Path(tmp)) as sup:
        pairs = [("", False), *([("t", True)] if tls else [])]
        nodes = [
            _start_node(sup, prefix + name, model, layers, cache, secure)
            for prefix, secure in pairs
            for name, layers in (("a", "0:15"), ("b", "15:30"))
        ]
        ports = [node.wait_port(180) for node in nodes]
        admin = [node.admin_port for node in nodes[:2]]  # the scheduler counts: the plaintext pair
        inproc = InProcess(model, cache)
        try:

            async def main() -> list[tuple[float, float]]:
                async with open_grpc() as grpc_rt:
                    channels = NodeChannels(grpc_rt, max_frame_bytes=4 * 1024 * 1024, allow_plaintext=True)
                    addresses = [f"127.0.0.1:{p}" for p in ports]
                    pins = [node.tls_fingerprint() for node in nodes]
                    routes = {"": await route_on(channels, addresses[:2], pins[:2])}
                    if tls:
                        assert all(pins[2:]) and not any(pins[:2])  # the pairs serve what they say
                        routes["+tls"] = await route_on(channels, addresses[2:], pins[2:])
                    planes = {"push": DataPlane(push=True), "relay": DataPlane(push=False)}
                    for route, stages in routes.values():  # warm-up: channels, caches, TLS handshakes
                        for plane in planes.values():
                            await generate(channels, route, stages, prompt, 4, plane=plane)
                    before = _scheduler_counts(admin)
                    for r in range(rounds):
                        k = r % len(names)
                        for name in names[k:] + names[:k]:
                            if name == "in-process":
                                toks, times = inproc.generate(prompt, n_new)
                            else:
                                plane_name, _, secure = name.partition("+")
                                route, stages = routes["+tls" if secure else ""]
                                gen = await generate(
                                    channels, route, stages, prompt, n_new, plane=planes[plane_name]
                                )
                                toks, times = gen.tokens, gen.intervals_s()
                            tokens.setdefault(name, toks)
                            results[name] += times
                    after = _scheduler_counts(admin)
                    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]

            counts = trio.run(main)
        finally:
            inproc.close()
    results["tokens"] = tokens
    results["scheduler"] = counts
    return results


def transport_cost(frame_bytes: int, blocks: int = 12, per_block: int = 200) -> dict[str, float]:
    """The transport alone: round trips of one ``frame_bytes`` message through the grpcio adapter on
    loopback, plaintext and pinned TLS to the same in-process echo service, in alternating blocks.

    A hop is one transit, a round trip two: TLS cost per hop = (TLS - plaintext) median round trip / 2.
    """
    import trio

    from common.grpc_adapter import CallInfo, MessageStream, Service, StreamClosed, open_grpc
    from common.tls import generate_self_signed

    async def echo(stream: MessageStream, info: CallInfo) -> None:
        while True:
            try:
                await stream.send(await stream.receive())
            except StreamClosed:
                return

    service = Service("bench.Echo", {"Echo": echo}, {}, {})
    cert = generate_self_signed()
    payload = os.urandom(frame_bytes)
    times: dict[str, list[float]] = {"plaintext": [], "tls": []}

    async def main() -> None:
        async with open_grpc() as rt, trio.open_nursery() as nursery:
            plain = await nursery.start(lambda **kw: rt.serve("127.0.0.1", 0, [service], **kw))
            secure = await nursery.start(lambda **kw: rt.serve("127.0.0.1", 0, [service], tls=cert, **kw))
            targets = {"plaintext": (plain, None), "tls": (secure, cert.fingerprint)}
            async with (
                rt.open_stream(f"127.0.0.1:{plain}", "/bench.Echo/Echo") as a,
                rt.open_stream(f"127.0.0.1:{secure}", "/bench.Echo/Echo", pin=targets["tls"][1]) as b,
            ):
                streams = {"plaintext": a, "tls": b}
                for stream in streams.values():  # warm-up: connections, handshakes
                    for _ in range(50):
                        await stream.send(payload)
                        await stream.receive()
                for block in range(blocks):
                    for name in ("plaintext", "tls") if block % 2 == 0 else ("tls", "plaintext"):
                        stream = streams[name]
                        for _ in range(per_block):
                            t0 = time.perf_counter()
                            await stream.send(payload)
                            await stream.receive()
                            times[name].append(time.perf_counter() - t0)
            nursery.cancel_scope.cancel()

    trio.run(main)
    plain_ms = statistics.median(times["plaintext"]) * 1e3
    tls_ms = statistics.median(times["tls"]) * 1e3
    return {
        "frame_bytes": frame_bytes,
        "round_trips": len(times["tls"]),
        "plaintext_round_trip_ms": plain_ms,
        "tls_round_trip_ms": tls_ms,
        "tls_cost_per_hop_ms": (tls_ms - plain_ms) / 2,
        "ratio_tls_to_plaintext": tls_ms / plain_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request (default 48)")
    parser.add_argument("--rounds", type=int, default=4, help="requests per setup (default 4)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="also measure a TLS pair of nodes (push+tls, relay+tls) side by side",
    )
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
        measured = run(model, args.cache_dir or Path(tmp_cache), prompt, args.tokens, args.rounds, args.tls)
    tokens = measured["tokens"]
    names = [name for name in measured if name not in ("tokens", "scheduler")]
    same = all(tokens[name] == tokens["in-process"] for name in names)
    rows = {
        name: {
            "median_ms": statistics.median(measured[name]) * 1e3,
            "min_ms": min(measured[name]) * 1e3,
            "p90_ms": _pct(measured[name], 90) * 1e3,
            "requests": len(measured[name]),
        }
        for name in names
    }
    floor = rows["in-process"]["median_ms"]
    for name in names[1:]:
        rows[name]["per_hop_overhead_ms"] = (rows[name]["median_ms"] - floor) / 2
        rows[name]["ratio_to_in_process"] = rows[name]["median_ms"] / floor
    tls_cost: dict[str, dict[str, float]] = {}
    for plane in ("push", "relay") if args.tls else ():
        plain, secure = rows[plane], rows[plane + "+tls"]
        tls_cost[plane] = {
            # Two stage-to-stage transfers per token in both planes (relay: each through the gateway).
            "tls_cost_per_hop_ms": (secure["median_ms"] - plain["median_ms"]) / 2,
            "tls_cost_per_hop_min_ms": (secure["min_ms"] - plain["min_ms"]) / 2,
            "ratio_tls_to_plaintext": secure["median_ms"] / plain["median_ms"],
        }
    # One decode step's hidden state (576 floats, f32) plus frame header, and a 256-token prefill chunk.
    transport = [transport_cost(n) for n in (2_600, 600_000)] if args.tls else []
    handoffs = []
    for inline, total in measured["scheduler"]:
        thread_rounds = max(0.0, total - inline)
        handoffs.append(
            {
                "rounds": total,
                "inline_rounds": inline,
                "handoffs_per_step": 2 * thread_rounds / max(1.0, total),
            }
        )
    print(
        f"decode per token, test model split [0,15)+[15,30), 1 thread per stage, "
        f"{args.rounds} x {args.tokens} tokens"
    )
    print(
        f"{'setup':<12} {'median ms':>10} {'min ms':>10} {'p90 ms':>10} {'per hop ms':>11} {'x in-proc':>10}"
    )
    for name, r in rows.items():
        hop = f"{r['per_hop_overhead_ms']:11.2f}" if "per_hop_overhead_ms" in r else f"{'':>11}"
        ratio = f"{r['ratio_to_in_process']:10.2f}" if "ratio_to_in_process" in r else f"{'':>10}"
        print(f"{name:<12} {r['median_ms']:>10.2f} {r['min_ms']:>10.2f} {r['p90_ms']:>10.2f} {hop} {ratio}")
    for i, h in enumerate(handoffs):
        print(
            f"node {i}: {h['rounds']:.0f} engine rounds, {h['inline_rounds']:.0f} on the trio thread; "
            f"thread hand-offs per stage step: {h['handoffs_per_step']:.2f} "
            "(+1 grpcio completion wake-up per message)"
        )
    for plane, cost in tls_cost.items():
        print(
            f"TLS cost per hop ({plane}): {cost['tls_cost_per_hop_ms']:.3f} ms median "
            f"({cost['tls_cost_per_hop_min_ms']:.3f} ms on the minima); "
            f"{plane}+tls / {plane} = {cost['ratio_tls_to_plaintext']:.3f}"
        )
    for t in transport:
        print(
            f"transport, {t['frame_bytes']} B frames: round trip "
            f"{t['plaintext_round_trip_ms']:.3f} ms plaintext, {t['tls_round_trip_ms']:.3f} ms TLS; "
            f"TLS cost per hop {t['tls_cost_per_hop_ms']:.3f} ms "
            f"(x{t['ratio_tls_to_plaintext']:.3f})"
        )
    print(f"same tokens in every setup: {same}")
    result: dict[str, Any] = {
        "benchmark": "bench_hop",
        "tokens_per_request": args.tokens,
        "rounds": args.rounds,
        "prompt_tokens": len(prompt),
        "rows": rows,
        "per_hop_overhead_ms": rows["push"]["per_hop_overhead_ms"],
        "tls": tls_cost,
        "tls_transport": transport,
        "handoffs": handoffs,
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
