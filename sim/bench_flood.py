"""The tracker under a hostile client: junk announcements, a read flood, and a signed flood from one key.

Usage::

    python3 -m sim.bench_flood --out docs/perf/tracker-flood.json --label after
    python3 -m sim.bench_flood --out docs/perf/tracker-flood.json --label before --source /tmp/old-tree \\
        --tracker-arg=--no-challenges   # flags the old code knows; --source runs another checkout's tracker

One ``swarm-tracker serve`` (SQLite, port 0) in a child process; this process is every client, each
phase from its own loopback source address (127.0.0.x), as attackers on other hosts would be:

1. **honest**: ``--honest-nodes`` nodes announce (relayed nodes of one 30-layer model; the tracker
   runs with ``--no-challenges``, so they are live at once) from 127.0.0.1 and heartbeat every
   ``--heartbeat-s`` for the whole run; every heartbeat's status is recorded.
2. **junk**: ``--junk`` announcements, each from a fresh key with a fake model of its own (live at
   once on probation: the worst case for route search), spread over ten source
   addresses 127.0.1.x; accepted, refused and the time taken are recorded.
3. **read flood**: four concurrent loops of ``GET /v1/models`` from 127.0.2.1 for
   ``--read-flood-s``, while a probe from 127.0.0.1 times ``/healthz`` and ``POST /v1/routes`` for
   the honest model (before the flood, for a baseline, and during it).
4. **key flood**: one key sends signed heartbeats as fast as ``--flood-concurrency`` tasks can
   (from 127.0.3.1) for ``--flood-s``, while the honest nodes keep beating; reported: the flood's
   requests per second handled by the tracker by status, and the honest heartbeats sent/accepted.

``--label`` names the run in the JSON (the file keeps other labels' results, so a "before" run
with ``--source`` and an "after" run sit side by side). The client and the tracker share the
machine's cores: the figures are the machine's, and the JSON records its core count.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
import httpx
import nacl.signing
import trio

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from proto.announce import Announce, Hardware, Heartbeat, ModelSpec  # noqa: E402
from proto.signing import make_payload, public_key_hex, sign_envelope  # noqa: E402

HONEST_MODEL = ModelSpec(
    fingerprint="cd" * 32, name="honest-model", architecture="llama", n_layers=30, n_embd=576
)
HARDWARE = Hardware(cpu_cores=4, ram_bytes=8 << 30, gpus=(), backends=("cpu",), free_disk_bytes=50 << 30)


def _announce(key: nacl.signing.SigningKey, model: ModelSpec, start: int, end: int) -> dict[str, Any]:
    a = Announce(
        node_id=public_key_hex(key),
        addresses=(),
        relay=True,
        relay_via="ab" * 32,
        hardware=HARDWARE,
        software_version="bench",
        model=model,
        shard_start=start,
        shard_end=end,
        decode_ms_per_token=10.0,
        prefill_tokens_per_s=200.0,
        max_sessions=8,
    )
    return sign_envelope(key, make_payload("announce", "node_id", key, time.time(), a.to_json()))


def _heartbeat(key: nacl.signing.SigningKey) -> dict[str, Any]:
    h = Heartbeat(
        node_id=public_key_hex(key), active_sessions=0, queue_depth=0, kv_free_tokens=4096, tokens_served=0
    )
    return sign_envelope(key, make_payload("heartbeat", "node_id", key, time.time(), h.to_json()))


def _client(source: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(local_address=source, limits=limits), timeout=60.0
    )


def _ms(samples: list[float]) -> dict[str, float | int | None]:
    if not samples:
        return {"n": 0, "p50_ms": None, "p95_ms": None, "max_ms": None}
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


async def _probe(url: str, seconds: float) -> dict[str, Any]:
    """/healthz and a route request for the honest model, one after the other, for ``seconds``."""
    health: list[float] = []
    routes: list[float] = []
    route_status: Counter[int] = Counter()
    async with _client("127.0.0.1") as c:
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            t0 = time.perf_counter()
            await c.get(url + "/healthz")
            health.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = await c.post(url + "/v1/routes", json={"model": HONEST_MODEL.name, "k": 1})
            routes.append(time.perf_counter() - t0)
            route_status[r.status_code] += 1
            await trio.sleep(0.1)
    return {"healthz": _ms(health), "routes": _ms(routes), "route_status": dict(route_status)}


class Honest:
    def __init__(self, url: str, n: int, interval_s: float) -> None:
        self.url, self.interval_s = url, interval_s
        self.keys = [nacl.signing.SigningKey.generate() for _ in range(n)]
        self.status: Counter[int] = Counter()
        self.window: Counter[int] | None = None  # statuses during the key flood

    async def announce(self) -> None:
        async with _client("127.0.0.1") as c:
            for i, k in enumerate(self.keys):
                start = (i % 3) * 10
                r = await c.post(
                    self.url + "/v1/announce", json=_announce(k, HONEST_MODEL, start, start + 10)
                )
                r.raise_for_status()

    async def run(self) -> None:
        async with _client("127.0.0.1") as c:
            while True:
                t0 = trio.current_time()
                for k in self.keys:
                    r = await c.post(self.url + "/v1/heartbeat", json=_heartbeat(k))
                    self.status[r.status_code] += 1
                    if self.window is not None:
                        self.window[r.status_code] += 1
                await trio.sleep_until(t0 + self.interval_s)


async def _junk(url: str, n: int) -> dict[str, Any]:
    status: Counter[int] = Counter()
    t0 = time.perf_counter()

    async def sender(source: str, count: int, offset: int) -> None:
        async with _client(source) as c:
            for i in range(count):
                j = offset + i
                model = ModelSpec(
                    fingerprint=f"{j + 1:064x}",
                    name=f"junk-{j}",
                    architecture="llama",
                    n_layers=30,
                    n_embd=576,
                )
                r = await c.post(
                    url + "/v1/announce", json=_announce(nacl.signing.SigningKey.generate(), model, 0, 30)
                )
                status[r.status_code] += 1

    per = n // 10
    async with trio.open_nursery() as nursery:
        for s in range(10):
            nursery.start_soon(sender, f"127.0.1.{s + 1}", per if s < 9 else n - 9 * per, s * per)
    return {"sent": n, "status": dict(status), "seconds": round(time.perf_counter() - t0, 2)}


async def _read_flood(url: str, seconds: float) -> dict[str, Any]:
    status: Counter[int] = Counter()
    times: list[float] = []
    probe: dict[str, Any] = {}

    async def reader(c: httpx.AsyncClient, deadline: float) -> None:
        while trio.current_time() < deadline:
            t0 = time.perf_counter()
            try:
                r = await c.get(url + "/v1/models")
                status[r.status_code] += 1
            except httpx.HTTPError:
                status[0] += 1
            times.append(time.perf_counter() - t0)

    async def probing() -> None:
        probe.update(await _probe(url, seconds))

    async with _client("127.0.2.1") as c, trio.open_nursery() as nursery:
        deadline = trio.current_time() + seconds
        for _ in range(4):
            nursery.start_soon(reader, c, deadline)
        nursery.start_soon(probing)
    return {"models_status": dict(status), "models_latency": _ms(times), "probe": probe}


async def _key_flood(url: str, seconds: float, concurrency: int, honest: Honest) -> dict[str, Any]:
    key = nacl.signing.SigningKey.generate()
    status: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    async with _client("127.0.3.1") as c:
        r = await c.post(url + "/v1/announce", json=_announce(key, HONEST_MODEL, 0, 10))
        announced = r.status_code
        honest.window = Counter()
        t0 = time.perf_counter()

        async def flooder(deadline: float) -> None:
            while trio.current_time() < deadline:
                try:
                    r = await c.post(url + "/v1/heartbeat", json=_heartbeat(key))
                    status[r.status_code] += 1
                except httpx.HTTPError as err:
                    status[0] += 1
                    errors[type(err).__name__] += 1

        async with trio.open_nursery() as nursery:
            deadline = trio.current_time() + seconds
            for _ in range(concurrency):
                nursery.start_soon(flooder, deadline)
        elapsed = time.perf_counter() - t0
    window, honest.window = honest.window, None
    handled = sum(status.values())
    return {
        "flood_announce_status": announced,
        "flood_status": dict(status),
        "flood_errors": dict(errors),
        "flood_requests_per_s": round(handled / elapsed, 1),
        "flood_accepted_per_s": round(status.get(200, 0) / elapsed, 1),
        "honest_heartbeats": sum(window.values()),
        "honest_status": dict(window),
        "honest_all_accepted": set(window) == {200},
    }


async def _run(url: str, opts: dict[str, Any]) -> dict[str, Any]:
    honest = Honest(url, opts["honest_nodes"], opts["heartbeat_s"])
    await honest.announce()
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(honest.run)
        out["baseline"] = await _probe(url, 3.0)
        out["junk"] = await _junk(url, opts["junk"])
        out["read_flood"] = await _read_flood(url, opts["read_flood_s"])
        out["after_read_flood"] = await _probe(url, 2.0)
        out["key_flood"] = await _key_flood(url, opts["flood_s"], opts["flood_concurrency"], honest)
        nursery.cancel_scope.cancel()
    out["honest_heartbeats_total"] = dict(honest.status)
    return out


def _start_tracker(
    work: Path, source: str | None, extra: tuple[str, ...], settings: tuple[str, ...]
) -> tuple[subprocess.Popen[bytes], str]:
    port_file = work / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_TRACKER_")}
    for item in settings:
        name, _, value = item.partition("=")
        env["SWARM_TRACKER_" + name.upper()] = value
    if source:
        env["PYTHONPATH"] = source
    argv = [sys.executable, "-m", "tracker.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    argv += ["--port-file", str(port_file), "--data-dir", str(work), "--no-zeroconf"]
    # The nodes here are relayed keys with no gateway to carry their join challenge: without this
    # they would wait in `challenging` (docs/security.md), never live, never routed.
    argv += ["--db-url", f"sqlite:///{work / 'tracker.db'}", "--no-challenges", *extra]
    log = (work / "tracker.log").open("wb")
    proc = subprocess.Popen(argv, env=env, cwd=source or ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise click.ClickException(
                f"the tracker did not start: {(work / 'tracker.log').read_text()[-2000:]}"
            )
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def _print(label: str, r: dict[str, Any]) -> None:
    def lat(x: dict[str, Any]) -> str:
        return f"p50 {x['p50_ms']} ms, max {x['max_ms']} ms (n={x['n']})"

    print(f"== {label}")
    print(
        f"baseline      /healthz {lat(r['baseline']['healthz'])}; /v1/routes {lat(r['baseline']['routes'])}"
    )
    print(
        f"junk          {r['junk']['sent']} announcements in {r['junk']['seconds']} s: {r['junk']['status']}"
    )
    rf = r["read_flood"]
    print(f"read flood    GET /v1/models {rf['models_status']} {lat(rf['models_latency'])}")
    print(f"  during it   /healthz {lat(rf['probe']['healthz'])}; /v1/routes {lat(rf['probe']['routes'])}")
    print(f"  routes      {rf['probe']['route_status']}")
    kf = r["key_flood"]
    rate = f"{kf['flood_requests_per_s']} req/s handled ({kf['flood_accepted_per_s']} accepted/s)"
    print(f"key flood     {rate}: {kf['flood_status']} {kf['flood_errors']}")
    print(f"  honest      {kf['honest_heartbeats']} heartbeats during it: {kf['honest_status']}")


@click.command()
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="JSON file (other labels kept).")
@click.option("--label", default="after", show_default=True, help="Name of this run in the JSON.")
@click.option("--source", default=None, help="Run the tracker from this source tree (e.g. an older commit).")
@click.option("--tracker-arg", "tracker_args", multiple=True, help="Extra flag for swarm-tracker serve.")
@click.option(
    "--setting",
    "settings",
    multiple=True,
    help="FIELD=VALUE: a tracker setting through its environment (e.g. nonce_cache_max_entries=3000).",
)
@click.option("--junk", default=1000, show_default=True)
@click.option("--honest-nodes", default=20, show_default=True)
@click.option("--heartbeat-s", default=1.0, show_default=True, help="Honest heartbeat interval.")
@click.option("--read-flood-s", default=10.0, show_default=True)
@click.option("--flood-s", default=15.0, show_default=True)
@click.option("--flood-concurrency", default=8, show_default=True)
def main(
    out: str,
    label: str,
    source: str | None,
    tracker_args: tuple[str, ...],
    settings: tuple[str, ...],
    **opts: Any,
) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        proc, url = _start_tracker(Path(tmp), source, tracker_args, settings)
        try:
            result = trio.run(_run, url, opts)
        finally:
            proc.terminate()
            proc.wait(30)
    result["options"] = {
        **opts,
        "tracker_args": list(tracker_args),
        "source": "other tree" if source else "this tree",
    }
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    _print(label, result)
    path = Path(out)
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing[label] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(existing, indent=2) + "\n")


if __name__ == "__main__":
    main()
