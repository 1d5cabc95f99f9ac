"""Joining a model larger than any node: bytes fetched, time to join, and a swarm of memory-limited nodes.

``python -m sim.bench_join [--model FILE] [--nodes 4] [--memory-limit-mb 1536] [--json OUT]``

On the 7B-class random-weight model of ``sim.big_model`` (built once, about
3.9 GB) by default:

1. **Bytes fetched.** For the first, a middle and the last of ``--nodes``
   equal spans, ``swarm-node shard extract --model URL`` against a
   Range-capable server on loopback (``sim.range_server``): the bytes the
   server sent against the shard's bytes.
2. **Time to join.** ``swarm-node start`` of a middle span until it serves
   (its port file), from the local URL, then from that node as a peer
   (``--model <fingerprint> --peer``, no URL), each with an empty cache; the
   node's own ``join_s`` (model resolution, header, fetch) beside it.
3. **A swarm of memory-limited nodes.** ``--nodes`` nodes, each in its own
   cgroup with a memory limit (``--memory-limit-mb``, well below the model's
   size; the shards are cut first and the page cache dropped, so each node's
   reads are charged to its own cgroup), a tracker and a gateway; one greedy
   completion through the gateway;
   each node's peak resident set (``VmHWM``) against its shard bytes + KV +
   150 MB; the cgroups' failure counters. Then the whole model in one
   llama-cpp-python context (``node.reference``, the same context settings)
   must give the same tokens, and log-probabilities within 1e-3.
4. **Which limit binds.** One node started under ``prlimit --as`` at the same
   limit: whether ``RLIMIT_AS`` lets a node with an mmapped shard start at all.

Prints a table and writes the figures as JSON (default
``docs/perf/join-<date>.json``). Needs root for the cgroups (else step 3 runs
without limits and says so). Heavy: minutes to tens of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from sim.procs import LaunchError, Service, Supervisor, console_script
from sim.range_server import RangeServer

URL_PATH = "/model.gguf"
PROMPT = "The capital of France is"
NODE_SETTINGS = [
    "--max-sessions",
    "1",
    "--session-kv-tokens",
    "512",
    "--batch-tokens",
    "64",
    "--threads",
    "1",
]


def _run(cmd: list[str], timeout_s: float = 3600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)


def spans_for(n_layers: int, nodes: int) -> list[tuple[int, int]]:
    cuts = [round(i * n_layers / nodes) for i in range(nodes + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(nodes)]


def dir_bytes(path: Path, suffix: str = ".gguf") -> int:
    return sum(p.stat().st_size for p in path.rglob(f"*{suffix}") if p.is_file() and "vocab" not in p.name)


# ------------------------------------------------------------------------------------------ cgroups


@dataclass
class Cgroup:
    path: Path
    limit_file: str
    version: int

    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def read(self, name: str) -> str:
        try:
            return (self.path / name).read_text().strip()
        except OSError:
            return ""

    def statistics(self) -> dict[str, Any]:
        if self.version == 1:
            return {
                "limit_bytes": int(self.read("memory.limit_in_bytes") or 0),
                "max_usage_bytes": int(self.read("memory.max_usage_in_bytes") or 0),
                "failcnt": int(self.read("memory.failcnt") or 0),
                "oom_control": self.read("memory.oom_control").replace("\n", "; "),
            }
        return {
            "limit_bytes": int(self.read("memory.max") or 0),
            "peak_bytes": int(self.read("memory.peak") or 0),
            "events": self.read("memory.events").replace("\n", "; "),
        }

    def remove(self) -> None:
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def make_cgroup(name: str, limit_bytes: int) -> Cgroup | None:
    """A memory cgroup (v2 where it has the memory controller, else v1) with ``limit_bytes``; None if
    this machine will not give one (not root, no writable hierarchy)."""
    root = Path("/sys/fs/cgroup")
    for base, limit_file, version in (
        (root, "memory.max", 2),
        (root / "unified", "memory.max", 2),
        (root / "memory", "memory.limit_in_bytes", 1),
    ):
        if version == 2:
            controllers = base / "cgroup.controllers"
            if not controllers.is_file() or "memory" not in controllers.read_text().split():
                continue
        if not base.is_dir():
            continue
        path = base / name
        try:
            path.mkdir(exist_ok=True)
            (path / limit_file).write_text(str(limit_bytes))
            if version == 1:
                try:
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                except OSError:
                    pass
        except OSError:
            try:
                path.rmdir()
            except OSError:
                pass
            continue
        return Cgroup(path, limit_file, version)
    return None


def drop_page_cache() -> bool:
    """Write dirty pages out and drop the clean page cache (root only); whether it was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        return False
    return True


def in_cgroup(groups: dict[str, Cgroup]) -> Callable[[str, list[str]], list[str]]:
    """A ``Supervisor`` placement: a process whose name has a cgroup enters it before it execs."""

    def place(name: str, argv: list[str]) -> list[str]:
        group = groups.get(name)
        if group is None:
            return argv
        return ["sh", "-c", f'echo $$ > {group.procs_file()} && exec "$@"', "sh", *argv]

    return place


# ------------------------------------------------------------------------------------------ steps


def publish(model: Path, workdir: Path) -> tuple[Path, str]:
    """The model's manifest, to be served next to it: ``(manifest file, fingerprint)``."""
    served = workdir / "served"
    served.mkdir(parents=True, exist_ok=True)
    manifest = served / "model.gguf.manifest.json"
    t0 = time.monotonic()
    done = _run([*console_script("swarm-node"), "model", "manifest", str(model), "-o", str(manifest),
                 "--cache-dir", str(workdir / "local-cache")])  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"swarm-node model manifest failed: {done.stderr[-2000:]}")
    fingerprint = done.stderr.strip().split()[-1]
    print(
        f"manifest: {fingerprint} ({time.monotonic() - t0:.0f} s to hash {model.stat().st_size / 1e9:.2f} GB)"
    )
    return manifest, fingerprint


def fetch_ratios(
    server: RangeServer, url: str, spans: list[tuple[int, int]], workdir: Path
) -> list[dict[str, Any]]:
    picks = {"first": spans[0], "middle": spans[len(spans) // 2], "last": spans[-1]}
    out = []
    for label, (a, b) in picks.items():
        cache = workdir / f"fetch-{label}"
        shutil.rmtree(cache, ignore_errors=True)
        server.reset_counts()
        t0 = time.monotonic()
        done = _run([*console_script("swarm-node"), "shard", "extract", "--model", url,
                     "--layers", f"{a}:{b}", "--cache-dir", str(cache)])  # fmt: skip
        elapsed = time.monotonic() - t0
        if done.returncode != 0:
            raise RuntimeError(f"extract {label} failed: {done.stderr[-2000:]}")
        shard = dir_bytes(cache / "shards")
        sent = server.sent.get(URL_PATH, 0)
        row = {
            "shard": label,
            "layers": [a, b],
            "shard_bytes": shard,
            "bytes_sent": sent,
            "ratio": round(sent / shard, 4),
            "seconds": round(elapsed, 1),
        }
        print(f"fetch {label:6s} [{a},{b}): {sent / 1e6:8.1f} MB sent for a {shard / 1e6:8.1f} MB shard, "
              f"ratio {row['ratio']:.3f}, {elapsed:.0f} s")  # fmt: skip
        out.append(row)
        shutil.rmtree(cache, ignore_errors=True)
    return out


def _status(svc: Service) -> dict[str, Any]:
    return dict(httpx.get(f"http://127.0.0.1:{svc.admin_port}/status", timeout=10).json())


def join_times(url: str, span: tuple[int, int], fingerprint: str, workdir: Path) -> dict[str, Any]:
    sup = Supervisor(workdir / "join")
    a, b = span
    common = [*NODE_SETTINGS, "--no-benchmark", "--heartbeat-interval-s", "1"]
    try:
        tracker = sup.start_tracker().ready(60)
        out: dict[str, Any] = {"layers": [a, b]}
        for label, model in (("url", url), ("peer", fingerprint)):
            cache = workdir / f"join-cache-{label}"
            shutil.rmtree(cache, ignore_errors=True)
            # The second node knows only the model's fingerprint and the first node: no URL at all.
            extra = ["--peer", f"127.0.0.1:{out['url']['port']}"] if label == "peer" else []
            t0 = time.monotonic()
            node = sup.start_node(
                f"join-{label}", model=model, layers=f"{a}:{b}", tracker_url=tracker.url, cache_dir=cache,
                max_sessions=1, session_kv_tokens=512,
                extra_args=[*common, "--serve-span-bytes-per-s", "0", *extra],
            ).ready(3600)  # fmt: skip
            wall = time.monotonic() - t0
            join = _status(node)["join"]
            out[label] = {
                "seconds_to_serving": round(wall, 1),
                "join_s": join["join_s"],
                "bytes_by_source": join["fetched_bytes_by_source"],
                "shard_bytes": join["shard_bytes"],
                "port": node.port,
            }
            print(f"join from {label:4s}: serving after {wall:.1f} s (join {join['join_s']:.1f} s), "
                  f"{sum(join['fetched_bytes_by_source'].values()) / 1e6:.0f} MB from "
                  f"{', '.join(join['fetched_bytes_by_source'])}")  # fmt: skip
        return out
    finally:
        sup.stop_all()
        for label in ("url", "peer"):
            shutil.rmtree(workdir / f"join-cache-{label}", ignore_errors=True)


def _kv_bytes(model: Path, span: tuple[int, int]) -> int:
    from node.config import NodeConfig
    from node.fingerprint import local_manifest
    from node.joining import model_sizing
    from node.shard import model_meta, open_reader

    meta = model_meta(model, open_reader(model), fingerprint="0" * 64)
    cfg = NodeConfig(max_sessions=1, session_kv_tokens=512, batch_tokens=64)
    sizing = model_sizing(meta, local_manifest(model, None), model, cfg)
    return sum(sizing.kv_bytes_per_layer[span[0] : span[1]])


def _completion(base: str, model: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    return dict(r.json())


def swarm_run(
    model: Path, fingerprint: str, spans: list[tuple[int, int]], limit_mb: int, max_tokens: int, workdir: Path
) -> dict[str, Any]:
    cache = workdir / "swarm-cache"
    for a, b in spans:  # cut every shard first (the model is local here; the nodes then start fast)
        done = _run([*console_script("swarm-node"), "shard", "extract", "--model", str(model), "--layers",
                     f"{a}:{b}", "--cache-dir", str(cache)])  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
    # The shards were just written from this process's cgroup, so their pages sit in the page cache
    # charged to it: a node reading them would not be charged, and its cgroup's limit would bind on
    # less than the node really uses. Dropped (root only), each node's reads are charged to its own.
    page_cache_dropped = drop_page_cache()
    groups: dict[str, Cgroup] = {}
    for i in range(len(spans)):
        g = make_cgroup(f"swarm-bench-join-{os.getpid()}-n{i}", limit_mb * 2**20)
        if g is not None:
            groups[f"n{i}"] = g
    if not groups:
        print("no cgroups here (not root?): the swarm runs WITHOUT memory limits", file=sys.stderr)
    sup = Supervisor(workdir / "swarm", place=in_cgroup(groups))
    result: dict[str, Any] = {
        "memory_limit_mb": limit_mb,
        "cgroups": bool(groups),
        "page_cache_dropped": page_cache_dropped,
    }
    nodes: list[Service] = []
    try:
        tracker = sup.start_tracker().ready(60)
        for i, (a, b) in enumerate(spans):
            nodes.append(
                sup.start_node(
                    f"n{i}", model=model, layers=f"{a}:{b}", tracker_url=tracker.url, cache_dir=cache,
                    max_sessions=1, session_kv_tokens=512,
                    extra_args=[*NODE_SETTINGS, "--no-benchmark", "--heartbeat-interval-s", "1"],
                )
            )  # fmt: skip
        for n in nodes:
            n.ready(1800)
        gateway = sup.start_gateway(tracker_url=tracker.url).ready(120)
        deadline = time.monotonic() + 300
        while True:
            r = httpx.post(f"{tracker.url}/v1/routes", json={"model": fingerprint, "k": 1}, timeout=10)
            if r.status_code == 200 and r.json()["routes"]:
                break
            if time.monotonic() > deadline:
                raise LaunchError(f"no route: {r.text[:300]}")
            time.sleep(0.5)
        t0 = time.monotonic()
        answer = _completion(gateway.url, fingerprint, max_tokens)
        result["completion_s"] = round(time.monotonic() - t0, 1)
        result["completion"] = answer["choices"][0]
        per_node = []
        for i, (n, (a, b)) in enumerate(zip(nodes, spans, strict=True)):
            shard = dir_bytes(cache / "shards" / fingerprint[:16], f"-{a}-{b}.gguf")
            if a == 0:
                shard += (cache / "shards" / fingerprint[:16] / "token_embd.gguf").stat().st_size
            status = Path(f"/proc/{n.pid}/status").read_text()
            kib = {
                x.split(":")[0]: int(x.split()[1]) * 1024
                for x in status.splitlines()
                if x.startswith(("Vm", "Rss"))
            }
            hwm = kib["VmHWM"]
            kv = _kv_bytes(model, (a, b))
            goal = shard + kv + 150 * 10**6
            row = {
                "node": f"n{i}",
                "layers": [a, b],
                "shard_bytes": shard,
                "kv_bytes": kv,
                "rss_bytes": kib["VmRSS"],
                "peak_rss_bytes": hwm,
                "rss_anon_bytes": kib.get("RssAnon"),  # now: the node's own memory
                "rss_file_bytes": kib.get("RssFile"),  # now: mapped file pages (libraries, a mapped shard)
                "goal_bytes": goal,
                "peak_over_goal_bytes": hwm - goal,
                "cgroup": groups[f"n{i}"].statistics() if f"n{i}" in groups else None,
            }
            per_node.append(row)
            print(f"node n{i} [{a},{b}): peak RSS {hwm / 2**20:7.0f} MiB, shard {shard / 2**20:6.0f} MiB "
                  f"+ KV {kv / 2**20:4.0f} MiB + 150 MB = goal {goal / 2**20:6.0f} MiB "
                  f"({'within' if hwm <= goal else 'OVER by %.0f MiB' % ((hwm - goal) / 2**20)}); "
                  f"limit {limit_mb} MiB")  # fmt: skip
        result["nodes"] = per_node
        result["node_exit_codes"] = {}
    finally:
        sup.stop_all()
        result["node_exit_codes"] = {n.name: n.returncode for n in nodes}
        for g in groups.values():
            g.remove()
    return result


def reference_tokens(model: Path, max_tokens: int) -> tuple[list[str], list[float]]:
    from common.vocab import Vocabulary
    from node.engine import EngineConfig
    from node.reference import ReferenceModel

    settings = EngineConfig(threads=1, max_sessions=1, session_kv_tokens=512, batch_tokens=64)
    with Vocabulary(model) as vocab:
        prompt = vocab.tokenize(PROMPT, add_special=True)
        pieces: list[str] = []
        logprobs: list[float] = []
        with ReferenceModel(model, settings.context_settings()) as ref:
            logits = ref.prefill(prompt)
            pos = len(prompt)
            for _ in range(max_tokens):
                z = logits.astype(np.float64)
                lse = z.max() + math.log(np.exp(z - z.max()).sum())
                token = int(np.argmax(logits))
                logprobs.append(float(z[token] - lse))
                pieces.append(vocab.detokenize([token]))
                logits = ref.prefill([token], start=pos)
                pos += 1
    return pieces, logprobs


def rlimit_as_probe(
    model: Path, span: tuple[int, int], limit_mb: int, cache: Path, workdir: Path
) -> dict[str, Any]:
    if shutil.which("prlimit") is None:
        return {"ran": False, "why": "no prlimit"}
    sup = Supervisor(
        workdir / "rlimit", place=lambda _n, argv: ["prlimit", f"--as={limit_mb * 2**20}", "--", *argv]
    )
    a, b = span
    try:
        node = sup.start_node(
            "as", model=model, layers=f"{a}:{b}", tracker_url=None, cache_dir=cache, max_sessions=1,
            session_kv_tokens=512, extra_args=[*NODE_SETTINGS, "--no-benchmark", "--insecure-no-tickets"],
        )  # fmt: skip
        try:
            node.ready(600)
            status = Path(f"/proc/{node.pid}/status").read_text()
            vm = {x.split(":")[0]: x.split(":")[1].strip() for x in status.splitlines() if x.startswith("Vm")}
            return {"ran": True, "started": True, "vm": vm}
        except LaunchError as err:
            return {"ran": True, "started": False, "log_tail": str(err)[-1500:]}
    finally:
        sup.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: sim.big_model's cached model")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--memory-limit-mb", type=int, default=1536)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip", action="append", default=[], choices=["fetch", "join", "swarm", "rlimit"])
    args = parser.parse_args(argv)
    from node.shard import model_meta, open_reader
    from sim.big_model import ensure

    model = args.model or ensure()
    workdir = args.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / f"swarm-bench-join-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    meta = model_meta(model, open_reader(model), fingerprint="0" * 64)
    spans = spans_for(meta.n_layers, args.nodes)
    report: dict[str, Any] = {
        "model": {
            "path": str(model),
            "bytes": model.stat().st_size,
            "n_layers": meta.n_layers,
            "name": meta.name,
        },
        "spans": spans,
        "machine": {"cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total},
        "date": time.strftime("%Y-%m-%d"),
    }
    manifest, fingerprint = publish(model, workdir)
    report["fingerprint"] = fingerprint
    with RangeServer({URL_PATH: model, URL_PATH + ".manifest.json": manifest}) as server:
        url = server.url(URL_PATH)
        if "fetch" not in args.skip:
            report["fetch"] = fetch_ratios(server, url, spans, workdir)
        if "join" not in args.skip:
            report["join"] = join_times(url, spans[len(spans) // 2], fingerprint, workdir)
    if "swarm" not in args.skip:
        swarm = swarm_run(model, fingerprint, spans, args.memory_limit_mb, args.max_tokens, workdir)
        pieces, logprobs = reference_tokens(model, args.max_tokens)
        got = swarm["completion"]["logprobs"]
        swarm["reference"] = {"tokens": pieces, "token_logprobs": logprobs}
        swarm["tokens_equal"] = got["tokens"] == pieces
        swarm["text_equal"] = swarm["completion"]["text"] == "".join(pieces)
        swarm["max_logprob_difference"] = max(
            (abs(a - b) for a, b in zip(got["token_logprobs"], logprobs, strict=True)), default=0.0
        )
        print(f"swarm tokens equal the whole model's: {swarm['tokens_equal']} "
              f"(max logprob difference {swarm['max_logprob_difference']:.2e}); "
              f"{args.max_tokens} tokens in {swarm['completion_s']} s")  # fmt: skip
        report["swarm"] = swarm
    if "rlimit" not in args.skip:
        report["rlimit_as"] = rlimit_as_probe(
            model, spans[len(spans) // 2], args.memory_limit_mb, workdir / "swarm-cache", workdir
        )
        print(f"RLIMIT_AS at {args.memory_limit_mb} MiB: node started = {report['rlimit_as'].get('started')}")
    out = args.json or Path("docs/perf") / f"join-{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
