"""Tracker benchmark: route selection cost and announce/heartbeat throughput.

Usage::

    python3 -m sim.bench_tracker --out bench-results/tracker.json [--duration-s 5] [--concurrency 8]
    python3 -m sim.bench_tracker --out bench-results/tracker-replicas.json --replicas \
        --postgres-url postgresql+psycopg://swarm@127.0.0.1:55432/swarm_test --swarm-nodes 10000

Part 1 times the pure functions (``select_routes`` k=1 and k=4, ``recommend_span``)
on synthetic swarms of 10, 1 000 and 10 000 nodes, one shard each, spans drawn
on a 30-layer and an 80-layer model with boundaries on a coarse grid (as
placement produces); the first nodes always form one complete chain. The same
swarms are timed again with network coordinates (``coords_k1``/``coords_k4``):
every node placed around one of six region centres (a world-like layout, 40-200
ms between regions, heights 1-25 ms, uplinks 20/100/500 Mbit/s) and the route
asked for a gateway in the first region -- the search the tracker runs once
nodes have measured each other. Part 2
starts ``swarm-tracker serve`` on SQLite in a child
process (port 0, learnt from ``--port-file``), then this process announces
``--nodes`` nodes and sends heartbeats from ``--concurrency`` trio tasks over
loopback HTTP for ``--duration-s`` seconds each, and reports requests per second.
With ``--tls`` the same phases also run (alternating with the plain ones,
``--rounds`` times each; the median round reported) against a tracker serving
HTTPS with its self-signed certificate (``--tls-self-signed``), every client
pinning it (``tracker_tls_fingerprint``): the cost of TLS on the tracker's API
(each client's first call pays a handshake, later ones reuse the connection).
``--skip-routing`` leaves part 1 out.

``--replicas`` (part 3) compares, side by side in one run, one ``swarm-tracker
serve`` on PostgreSQL with two replicas on the same PostgreSQL database (the
database is wiped first: give it a scratch database), and SQLite as the
baseline: the registry is loaded with ``--swarm-nodes`` nodes (10 000 by
default, written straight into the database), then ``--client-procs`` client
processes (``--concurrency`` tasks in all, each client's calls spread over the
replicas) send re-announces, heartbeats and route requests (k=1, over all
10 000 nodes) for ``--duration-s`` each. Every client process signs its own
messages; on a small machine the clients, the trackers and PostgreSQL share the
same cores, so the figures are the machine's, not the tracker's, ceiling: the
JSON records the core count.

Prints a table and writes everything as JSON to ``--out``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tracker.coordinates import NetCoord  # noqa: E402
from tracker.placement import recommend_span  # noqa: E402
from tracker.routing import select_routes  # noqa: E402
from tracker.snapshot import ModelInfo, ShardView, SwarmSnapshot  # noqa: E402

FP = "ab" * 32
# Throughput runs: a few client processes play thousands of nodes, so quotas per address and key are off.
NO_QUOTAS = ("--address-reads-per-s", "0", "--address-writes-per-s", "0", "--key-messages-per-s", "0")


def synthetic_swarm(n_nodes: int, n_layers: int, seed: int) -> SwarmSnapshot:
    rng = random.Random(seed)
    grid = max(1, n_layers // 10)
    shards = []
    chain = n_layers // grid  # the first nodes form one complete chain, so every size has a route
    for i in range(n_nodes):
        if i < chain:
            start, end = i * grid, (n_layers if i == chain - 1 else (i + 1) * grid)
        else:
            start = rng.randrange(0, n_layers // grid) * grid
            end = min(n_layers, start + rng.choice([1, 2, 3, 5]) * grid)
        max_sessions = rng.choice([2, 4, 8])
        shards.append(
            ShardView(
                node_id=f"{i:064x}",
                model_fingerprint=FP,
                start=start,
                end=end,
                decode_ms_per_token=rng.uniform(2.0, 40.0) * (end - start) / grid,
                prefill_tokens_per_s=500.0,
                active_sessions=rng.randrange(0, max_sessions + 1),
                max_sessions=max_sessions,
                queue_depth=rng.randrange(0, 3),
                relayed=rng.random() < 0.1,
                address=f"10.0.0.{i % 250}:7000",
            )
        )
    return SwarmSnapshot(models=(ModelInfo(FP, "bench", n_layers, 576),), shards=tuple(shards))


def with_coordinates(snap: SwarmSnapshot, seed: int) -> tuple[SwarmSnapshot, NetCoord]:
    """The swarm placed around six region centres (see the module docstring), and a gateway."""
    rng = random.Random(seed)
    centres = [(rng.uniform(-100, 100), rng.uniform(-100, 100), rng.uniform(-30, 30)) for _ in range(6)]
    shards = tuple(
        dataclasses.replace(
            s,
            coord=NetCoord(
                tuple(x + rng.gauss(0.0, 8.0) for x in rng.choice(centres)),  # type: ignore[arg-type]
                rng.uniform(1.0, 25.0),
                rng.uniform(0.05, 0.3),
            ),
            uplink_mbit_s=rng.choice([20.0, 100.0, 500.0]),
        )
        for s in snap.shards
    )
    return dataclasses.replace(snap, shards=shards), NetCoord(centres[0], 1.0, 0.05)


def _time_ms(fn: Any, repeats: int) -> dict[str, float]:
    """Wall and CPU time of ``fn`` (median, min, max of ``repeats`` calls). On a shared machine the
    CPU time (``time.thread_time``: this thread only) is the steadier figure of the work done."""
    samples = []
    cpu = []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append((time.thread_time() - c0) * 1000.0)
        samples.append((time.perf_counter() - t0) * 1000.0)
    return {
        "median_ms": statistics.median(samples),
        "min_ms": min(samples),
        "max_ms": max(samples),
        "median_cpu_ms": statistics.median(cpu),
        "repeats": repeats,
    }


def bench_routing(sizes: list[int], layer_counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n_layers in layer_counts:
        for n in sizes:
            snap = synthetic_swarm(n, n_layers, seed=n + n_layers)
            repeats = 50 if n <= 1000 else 10
            rng = random.Random(1)
            row: dict[str, Any] = {"nodes": n, "n_layers": n_layers}
            for k in (1, 4, 32):
                row[f"select_routes_k{k}"] = _time_ms(
                    lambda k=k, snap=snap, rng=rng: select_routes(snap, FP, k, rng=rng), repeats
                )
            row["routes_found_k4"] = len(select_routes(snap, FP, 4, rng=rng).routes)
            placed, origin = with_coordinates(snap, seed=n)
            for k in (1, 4, 32):
                row[f"coords_k{k}"] = _time_ms(
                    lambda k=k, snap=placed, rng=rng, origin=origin: select_routes(
                        snap, FP, k, rng=rng, origin=origin
                    ),
                    repeats,
                )
            # Cold: the first look-up on a new snapshot also builds the per-model arrays (the tracker
            # reuses one snapshot for snapshot_ttl_s; the simulator until the swarm changes).
            row["coords_k32_cold"] = _time_ms(
                lambda snap=placed, rng=rng, origin=origin: select_routes(
                    dataclasses.replace(snap), FP, 32, rng=rng, origin=origin
                ),
                repeats,
            )
            # Two runtime recipes (every other node another build): one search per recipe
            # (tracker/recipes.py); warm, the split itself is memoised per snapshot.
            mixed = dataclasses.replace(
                placed,
                shards=tuple(
                    dataclasses.replace(s, recipe_fingerprint="ab"[i % 2] * 64)
                    for i, s in enumerate(placed.shards)
                ),
            )
            row["coords_k32_two_recipes"] = _time_ms(
                lambda snap=mixed, rng=rng, origin=origin: select_routes(
                    snap, FP, 32, rng=rng, origin=origin
                ),
                repeats,
            )
            found = select_routes(placed, FP, 32, rng=rng, origin=origin).routes
            row["routes_found_coords_k32"] = len(found)
            row["distinct_nodes_coords_k32"] = len({n for r in found for n in r.node_ids})
            row["load_average"] = os.getloadavg()  # the machine is shared: what else ran meanwhile
            row["recommend_span"] = _time_ms(
                lambda snap=snap, rng=rng: recommend_span(snap, FP, 8, rng=rng), repeats
            )
            rows.append(row)
    _print_k32(rows)
    return rows


def _print_k32(rows: list[dict[str, Any]]) -> None:
    """The look-ups of 32 routes, wall and CPU time (the table main() prints has k = 1 and 4)."""
    for unit in ("median_ms", "median_cpu_ms"):
        print(
            f"{'nodes':>6} {'layers':>6} {'blind k=32':>11} {'coords k=1':>11} {'k=4':>7} {'k=32':>7} "
            f"{'k=32 cold':>10} {'2 recipes':>10}   ({unit})"
        )
        for r in rows:
            print(
                f"{r['nodes']:>6} {r['n_layers']:>6} {r['select_routes_k32'][unit]:>11.2f} "
                f"{r['coords_k1'][unit]:>11.2f} {r['coords_k4'][unit]:>7.2f} "
                f"{r['coords_k32'][unit]:>7.2f} {r['coords_k32_cold'][unit]:>10.2f} "
                f"{r['coords_k32_two_recipes'][unit]:>10.2f}"
            )
    print()


# --- HTTP throughput -----------------------------------------------------------------------------


async def _throughput(
    url: str, n_nodes: int, concurrency: int, duration_s: float, tls: Any = None
) -> dict[str, Any]:
    import nacl.signing
    import trio

    from common.tracker_client import TrackerClient
    from proto.announce import Announce, Hardware, Heartbeat, ModelSpec

    model = ModelSpec(FP, "bench", "llama", 30, 576)
    hw = Hardware(4, 8 << 30, (), ("cpu",), 10 << 30)
    keys = [nacl.signing.SigningKey(i.to_bytes(4, "big") * 8) for i in range(1, n_nodes + 1)]
    clients = [TrackerClient(url, k, tls=tls) for k in keys]
    rng = random.Random(0)
    result: dict[str, Any] = {"nodes": n_nodes, "concurrency": concurrency}
    try:
        # Announces: each node announces repeatedly (re-announce = update) until the time is up.
        async def phase(kind: str) -> dict[str, float]:
            done = 0
            errors = 0
            latencies: list[float] = []
            stop_at = time.perf_counter() + duration_s

            async def worker(w: int) -> None:
                nonlocal done, errors
                i = w
                while time.perf_counter() < stop_at:
                    c = clients[i % n_nodes]
                    t0 = time.perf_counter()
                    try:
                        if kind == "announce":
                            start = rng.randrange(0, 29)
                            await c.announce(
                                Announce(
                                    c.key_id,
                                    ("127.0.0.1:7000",),
                                    False,
                                    None,
                                    hw,
                                    "bench",
                                    model,
                                    start,
                                    min(30, start + 6),
                                    10.0,
                                    100.0,
                                    4,
                                )
                            )
                        else:
                            await c.heartbeat(Heartbeat(c.key_id, rng.randrange(0, 4), 0, 4096, 16))
                        done += 1
                        latencies.append(time.perf_counter() - t0)
                    except Exception:
                        errors += 1
                    i += concurrency

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for w in range(concurrency):
                    nursery.start_soon(worker, w)
            elapsed = time.perf_counter() - t0
            latencies.sort()
            return {
                "requests": done,
                "errors": errors,
                "seconds": elapsed,
                "per_s": done / elapsed,
                "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else 0.0,
                "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else 0.0,
            }

        result["announce"] = await phase("announce")
        result["heartbeat"] = await phase("heartbeat")
        t0 = time.perf_counter()
        routes_done = 0
        while time.perf_counter() - t0 < min(duration_s, 2.0):
            await clients[0].routes(FP, k=2)
            routes_done += 1
        result["routes_sequential_per_s"] = routes_done / (time.perf_counter() - t0)
    finally:
        for c in clients:
            await c.aclose()
    return result


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose requests per second (all phases summed) is the median one."""
    ranked = sorted(
        rounds,
        key=lambda r: r["announce"]["per_s"] + r["heartbeat"]["per_s"] + r["routes_sequential_per_s"],
    )
    return ranked[len(ranked) // 2]


def bench_http(n_nodes: int, concurrency: int, duration_s: float, *, https: bool = False) -> dict[str, Any]:
    import trio

    from common.tls import HttpTls, fingerprint_pem
    from sim.procs import Supervisor
    from tracker.config import TLS_CERT_FILE

    with tempfile.TemporaryDirectory(prefix="bench-tracker-") as tmp, Supervisor(Path(tmp)) as sup:
        # The announced nodes are not real (no gRPC server): nothing to challenge. One client process
        # is every node here: the per-address and per-key quotas are off (sim/bench_flood.py has them on).
        tracker = sup.start_tracker(
            extra_args=[
                *("--log-level", "warning", "--no-challenges", *NO_QUOTAS),
                *(("--tls-self-signed",) if https else ()),
            ]
        ).ready(30)
        if not https:
            return trio.run(_throughput, tracker.url, n_nodes, concurrency, duration_s)
        assert tracker.data_dir is not None
        pin = fingerprint_pem((tracker.data_dir / TLS_CERT_FILE).read_bytes())
        url = f"https://127.0.0.1:{tracker.port}"
        return trio.run(_throughput, url, n_nodes, concurrency, duration_s, HttpTls((pin,)))


# --- replicas on PostgreSQL ----------------------------------------------------------------------


def _node_key(i: int) -> Any:
    import nacl.signing

    return nacl.signing.SigningKey(i.to_bytes(4, "big") * 8)


def _bulk_register(db_url: str, n_nodes: int, seed: int = 7) -> None:
    """Write ``n_nodes`` live nodes (spans as :func:`synthetic_swarm` draws them) straight into the
    database, after the trackers migrated it: the HTTP phases then run against a 10 000-node registry
    without spending minutes announcing it."""
    from sqlalchemy import insert

    from proto.signing import public_key_hex
    from tracker.models import Model, Node, Shard
    from tracker.store import make_engine

    snap = synthetic_swarm(n_nodes, 30, seed)
    now = time.time()
    ids = [public_key_hex(_node_key(i + 1)) for i in range(n_nodes)]
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                insert(Model),
                [
                    dict(
                        fingerprint=FP,
                        name="bench",
                        architecture="llama",
                        n_layers=30,
                        n_embd=576,
                        first_seen_s=now,
                    )
                ],
            )
            conn.execute(
                insert(Node),
                [
                    dict(
                        id=ids[i],
                        addresses=[f"127.0.0.1:{7000 + i % 1000}"],
                        relay=False,
                        relay_via=None,
                        hardware={
                            "cpu_cores": 4,
                            "ram_bytes": 8 << 30,
                            "gpus": [],
                            "backends": ["cpu"],
                            "free_disk_bytes": 10 << 30,
                        },
                        software_version="bench",
                        first_seen_s=now,
                        last_seen_s=now,
                        state="live",
                        region="",
                    )
                    for i in range(n_nodes)
                ],
            )
            conn.execute(
                insert(Shard),
                [
                    dict(
                        node_id=ids[i],
                        model_fingerprint=FP,
                        layer_start=s.start,
                        layer_end=s.end,
                        decode_ms_per_token=s.decode_ms_per_token,
                        prefill_tokens_per_s=s.prefill_tokens_per_s,
                        active_sessions=s.active_sessions,
                        max_sessions=s.max_sessions,
                        queue_depth=s.queue_depth,
                        kv_free_tokens=4096,
                        tokens_served_total=0,
                        updated_s=now,
                    )
                    for i, s in enumerate(snap.shards)
                ],
            )
    finally:
        engine.dispose()


def _client_phase(args: tuple[str, list[str], int, int, int, float, float]) -> dict[str, Any]:
    """One client process: ``tasks`` trio tasks, node keys ``first..first+count-1``, one phase."""
    kind, urls, first, count, tasks, start_at, duration_s = args
    import trio

    from common.tracker_client import TrackerClient
    from proto.announce import Announce, Hardware, Heartbeat, ModelSpec

    model = ModelSpec(FP, "bench", "llama", 30, 576)
    hw = Hardware(4, 8 << 30, (), ("cpu",), 10 << 30)

    async def run() -> dict[str, Any]:
        import httpx

        # One connection pool for the process (a client per node key would each build its own);
        # half the keys list the replicas in one order, half in the other: load is spread.
        shared = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=tasks * 2))
        clients = [
            TrackerClient(
                urls if (first + j) % 2 == 0 else list(reversed(urls)),
                _node_key(first + j + 1),
                transport=shared,
            )
            for j in range(count)
        ]
        rng = random.Random(first)
        done = errors = 0
        latencies: list[float] = []
        await trio.sleep(max(0.0, start_at - time.time()))
        stop_at = time.perf_counter() + duration_s

        async def worker(w: int) -> None:
            nonlocal done, errors
            i = w
            while time.perf_counter() < stop_at:
                c = clients[i % count]
                t0 = time.perf_counter()
                try:
                    if kind == "announce":
                        start = rng.randrange(0, 10) * 3
                        end = min(30, start + rng.choice([3, 6, 9, 15]))
                        a = Announce(
                            c.key_id,
                            ("127.0.0.1:7000",),
                            False,
                            None,
                            hw,
                            "bench",
                            model,
                            start,
                            end,
                            10.0,
                            100.0,
                            4,
                        )
                        await c.announce(a)
                    elif kind == "heartbeat":
                        await c.heartbeat(Heartbeat(c.key_id, rng.randrange(0, 4), 0, 4096, 16))
                    else:
                        body = await c.routes(FP, k=1)
                        if not body.get("routes"):
                            raise RuntimeError("no route")
                    done += 1
                    latencies.append(time.perf_counter() - t0)
                except Exception:
                    errors += 1
                i += tasks

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for w in range(tasks):
                nursery.start_soon(worker, w)
        elapsed = time.perf_counter() - t0
        await shared.aclose()  # the clients' own aclose would close the shared transport once each
        return {"requests": done, "errors": errors, "seconds": elapsed, "latencies": latencies}

    return trio.run(run)


def _phase_all(
    kind: str, urls: list[str], n_nodes: int, concurrency: int, procs: int, duration_s: float
) -> dict[str, Any]:
    import multiprocessing

    per = n_nodes // procs
    start_at = time.time() + 2.0  # every process starts its clock together
    jobs = [
        (kind, urls, p * per, per, max(1, concurrency // procs), start_at, duration_s) for p in range(procs)
    ]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_client_phase, jobs)
    latencies = sorted(x for p in parts for x in p["latencies"])
    requests = sum(p["requests"] for p in parts)
    seconds = max(p["seconds"] for p in parts)
    return {
        "requests": requests,
        "errors": sum(p["errors"] for p in parts),
        "seconds": seconds,
        "per_s": requests / seconds,
        "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else math.nan,
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else math.nan,
    }


def _wipe(db_url: str) -> None:
    from sqlalchemy import text

    from tracker.store import make_engine

    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
    finally:
        engine.dispose()


def bench_replicas(
    postgres_url: str, n_nodes: int, concurrency: int, procs: int, duration_s: float
) -> list[dict[str, Any]]:
    """SQLite x1, PostgreSQL x1 and PostgreSQL x2, the same workload against each."""
    from sim.procs import Supervisor

    rows = []
    configs = (("sqlite x1", 1, None), ("postgres x1", 1, postgres_url), ("postgres x2", 2, postgres_url))
    for label, replicas, db in configs:
        with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp, Supervisor(Path(tmp)) as sup:
            work = Path(tmp)
            db_url = db or f"sqlite:///{work / 'tracker.sqlite3'}"
            if db:
                _wipe(db)
            urls = []
            for r in range(replicas):
                tracker = sup.start_tracker(
                    name=f"replica{r}",
                    db_url=db_url,
                    heartbeat_timeout_s=3600,
                    extra_args=[
                        "--key-file",
                        str(work / "tracker.key"),
                        "--no-dashboard",
                        "--no-challenges",
                        "--log-level",
                        "warning",
                        *NO_QUOTAS,
                    ],
                ).ready(60)
                urls.append(tracker.url)
                _wait_healthy(tracker.url)  # the first one migrates the schema before the next starts
            _bulk_register(db_url, n_nodes)
            row: dict[str, Any] = {
                "config": label,
                "replicas": replicas,
                "db": "postgresql" if db else "sqlite",
                "nodes": n_nodes,
                "concurrency": concurrency,
                "client_procs": procs,
            }
            for kind in ("announce", "heartbeat", "routes"):
                row[kind] = _phase_all(kind, urls, n_nodes, concurrency, procs, duration_s)
            rows.append(row)
    return rows


def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


def _print_replicas(rows: list[dict[str, Any]]) -> None:
    print()
    base = rows[0]
    print(
        f"{'config':>12} {'announce/s':>11} {'heartbeat/s':>12} {'routes/s':>9} {'routes p50 ms':>14} "
        f"{'errors':>7}   ({base['nodes']} nodes, {base['concurrency']} tasks in {base['client_procs']} "
        f"client processes)"
    )
    for r in rows:
        errors = sum(r[k]["errors"] for k in ("announce", "heartbeat", "routes"))
        print(
            f"{r['config']:>12} {r['announce']['per_s']:>11.0f} {r['heartbeat']['per_s']:>12.0f} "
            f"{r['routes']['per_s']:>9.1f} {r['routes']['p50_ms']:>14.1f} {errors:>7}"
        )
    one = next((r for r in rows if r["config"] == "postgres x1"), None)
    two = next((r for r in rows if r["config"] == "postgres x2"), None)
    if one and two:
        ratios = {
            k: two[k]["per_s"] / one[k]["per_s"] if one[k]["per_s"] else math.nan
            for k in ("announce", "heartbeat", "routes")
        }
        print("  two replicas / one: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


@click.command()
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Write the results here as JSON.")
@click.option("--duration-s", type=float, default=5.0, show_default=True, help="Length of each HTTP phase.")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Concurrent client tasks.")
@click.option(
    "--nodes", type=int, default=200, show_default=True, help="Distinct node keys in the HTTP phase."
)
@click.option("--skip-http", is_flag=True, help="Only time the pure functions.")
@click.option("--skip-routing", is_flag=True, help="Leave out the pure functions (part 1).")
@click.option("--tls", "tls", is_flag=True, help="The HTTP phases again against an HTTPS tracker, pinned.")
@click.option(
    "--rounds", "rounds_n", type=int, default=3, show_default=True, help="With --tls: HTTP/HTTPS rounds."
)
@click.option("--replicas", "replicas", is_flag=True, help="Part 3: two replicas on PostgreSQL vs one.")
@click.option(
    "--postgres-url",
    default=lambda: os.environ.get("SWARM_TEST_POSTGRES_URL", ""),
    help="Scratch PostgreSQL database for --replicas (wiped!); default $SWARM_TEST_POSTGRES_URL.",
)
@click.option(
    "--swarm-nodes", type=int, default=10_000, show_default=True, help="Registry size for --replicas."
)
@click.option(
    "--client-procs", type=int, default=2, show_default=True, help="Client processes for --replicas."
)
def main(
    out: str,
    duration_s: float,
    concurrency: int,
    nodes: int,
    skip_http: bool,
    skip_routing: bool,
    tls: bool,
    rounds_n: int,
    replicas: bool,
    postgres_url: str,
    swarm_nodes: int,
    client_procs: int,
) -> None:
    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "routing": [] if skip_routing else bench_routing([10, 1000, 10000], [30, 80]),
    }
    if not skip_routing:
        print(
            f"{'nodes':>6} {'layers':>6} {'select k=1 ms':>14} {'select k=4 ms':>14} {'coords k=1':>11} "
            f"{'coords k=4':>11} {'recommend ms':>13} {'routes(k=4)':>11}"
        )
    for r in results["routing"]:
        print(
            f"{r['nodes']:>6} {r['n_layers']:>6} {r['select_routes_k1']['median_ms']:>14.2f} "
            f"{r['select_routes_k4']['median_ms']:>14.2f} {r['coords_k1']['median_ms']:>11.2f} "
            f"{r['coords_k4']['median_ms']:>11.2f} {r['recommend_span']['median_ms']:>13.2f} "
            f"{r['routes_found_k4']:>11}"
        )
    if not skip_http:
        labels = {"http_sqlite": "HTTP", "https_sqlite": "HTTPS pinned"}
        names = ["http_sqlite", "https_sqlite"] if tls else ["http_sqlite"]
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for _ in range(rounds_n if tls else 1):  # HTTP and HTTPS alternate: the machine's drift hits both
            for name in names:
                rounds[name].append(bench_http(nodes, concurrency, duration_s, https=name == "https_sqlite"))
        for name in names:
            results[name] = _median_round(rounds[name])
            if len(rounds[name]) > 1:
                results[name + "_rounds"] = rounds[name]
            http = results[name]
            print()
            print(
                f"{'phase':>10} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}   "
                f"({labels[name]}, SQLite, {concurrency} concurrent client tasks, {nodes} nodes, "
                f"{duration_s:.0f} s"
                + (f", median of {len(rounds[name])} rounds)" if len(rounds[name]) > 1 else ")")
            )
            for phase in ("announce", "heartbeat"):
                p = http[phase]
                print(
                    f"{phase:>10} {p['per_s']:>8.0f} {p['p50_ms']:>8.1f} {p['p99_ms']:>8.1f} {p['errors']:>7}"
                )
            print(
                f"{'routes':>10} {http['routes_sequential_per_s']:>8.0f}   (sequential, k=2, {nodes} nodes)"
            )
        if tls:
            a, b = results["http_sqlite"], results["https_sqlite"]
            ratios = {
                "announce": b["announce"]["per_s"] / a["announce"]["per_s"],
                "heartbeat": b["heartbeat"]["per_s"] / a["heartbeat"]["per_s"],
                "routes": b["routes_sequential_per_s"] / a["routes_sequential_per_s"],
            }
            results["https_over_http"] = ratios
            print(
                "  HTTPS / HTTP requests per second: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
            )
    if replicas:
        if not postgres_url:
            raise click.UsageError("--replicas needs --postgres-url (or SWARM_TEST_POSTGRES_URL)")
        results["replicas"] = bench_replicas(postgres_url, swarm_nodes, concurrency, client_procs, duration_s)
        _print_replicas(results["replicas"])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
