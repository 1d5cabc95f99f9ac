"""Joining with what you have, with real processes on loopback (issue 14).

* An operator registers the test model at a real tracker (``swarm-tracker
  model add FILE --source URL``, signed with the tracker's key); nodes start
  with ``--model NAME``: one fetches its span from the URL (a Range-capable
  HTTP server on loopback), one -- after the server went away -- from that
  node (``GetTensorBytes``, rate-limited), and a route through fetched shards
  gives exactly the whole model's greedy tokens. Shards fetched either way are
  byte-identical to the ones cut from the local file.
* Three nodes whose memory holds 10 of the 30 layers (``--memory-limit-mb``)
  each get at most 10 layers from ``--layers auto`` and together cover the
  model; a fourth node's capacity is 0 and it refuses to start, saying why.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.vocab import Vocabulary
from node.capacity import POOL_MARGIN, span_budget_bytes
from node.config import NodeConfig
from node.fingerprint import local_manifest
from node.joining import model_sizing
from node.reference import ReferenceModel
from node.shard import extract_shard, open_reader, read_model_meta
from sim.procs import LaunchError, Supervisor, console_script
from sim.range_server import RangeServer
from tests.node.loopback_client import RouteSession, Stage, node_info, ticket_bytes
from tests.node.test_daemon_e2e import http_json, start_node, wait_for_route

pytestmark = pytest.mark.slow
MODEL = "/m/smollm2.gguf"
NAME = "smollm2-test"


def status(svc: object) -> dict:
    return http_json(f"http://127.0.0.1:{svc.admin_port}/status")[1]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("joining")


def test_register_then_join_by_name_from_url_and_from_a_peer(
    workdir: Path, model_path: Path, node_cache: Path, reference: ReferenceModel, vocab: Vocabulary
) -> None:
    sup = Supervisor(workdir / "by-name")
    server = RangeServer({MODEL: model_path}).__enter__()
    try:
        tracker = sup.start_tracker().ready(60)
        add = subprocess.run(
            [*console_script("swarm-tracker"), "model", "add", str(model_path), "--name", NAME,
             "--source", server.url(MODEL), "--tracker", tracker.url, "--data-dir", str(tracker.data_dir)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert add.returncode == 0, add.stderr + add.stdout
        fingerprint = local_manifest(model_path, node_cache).fingerprint()
        assert f"fingerprint  {fingerprint}" in add.stdout
        entry = http_json(f"{tracker.url}/v1/registry/models/{NAME}")[1]
        assert entry["fingerprint"] == fingerprint and entry["sources"] == [server.url(MODEL)]

        # The first stage is cut from the local file; the middle one fetched by name from the URL.
        first = start_node(sup, "first", model_path, "0:10", tracker.url, node_cache, "--no-benchmark")
        t0 = time.monotonic()
        a = start_node(sup, "a", NAME, "10:20", tracker.url, workdir / "cache-a", "--no-benchmark")
        a.ready(120)
        url_join_s = time.monotonic() - t0
        first.ready(120)
        sa = status(a)["join"]
        assert sa["fetched"] and list(sa["fetched_bytes_by_source"]) == [server.url(MODEL)]
        sent_by_url = server.sent[MODEL]

        # The origin goes away: the next node gets the same span from node a (found in the registry).
        server.__exit__(None, None, None)
        t0 = time.monotonic()
        b = start_node(sup, "b", NAME, "10:20", tracker.url, workdir / "cache-b", "--no-benchmark",
                       "--fetch-stall-timeout-s", "5")  # fmt: skip
        b.ready(120)
        peer_join_s = time.monotonic() - t0
        sb = status(b)["join"]
        assert sb["fetched"] and all(k.startswith("peer ") for k in sb["fetched_bytes_by_source"]), sb
        from_a = sb["fetched_bytes_by_source"][f"peer 127.0.0.1:{a.port}"]
        assert from_a > 0.9 * sum(sb["fetched_bytes_by_source"].values())  # the others hold only the norm
        assert status(a)["join"]["serving_span_bytes"] >= from_a

        local = extract_shard(model_path, 10, 20, node_cache)
        for cache in ("cache-a", "cache-b"):
            fetched = workdir / cache / "shards" / fingerprint[:16] / local.path.name
            assert fetched.read_bytes() == local.path.read_bytes(), cache

        # The route: the first stage (cut locally), the peer-fetched node b, a last stage cut locally.
        assert a.stop() == 0  # so b is the only middle stage
        last = start_node(sup, "last", model_path, "20:30", tracker.url, node_cache, "--no-benchmark")
        last.ready(120)
        stages = [
            Stage(f"127.0.0.1:{svc.port}", node_info(f"127.0.0.1:{svc.port}")) for svc in (first, b, last)
        ]
        deadline = time.monotonic() + 30
        while True:
            route = wait_for_route(tracker.url, fingerprint)["routes"][0]
            if [h["node_id"] for h in route["hops"]] == [s.info.node_id for s in stages]:
                break
            assert time.monotonic() < deadline, route
            time.sleep(0.5)
        prompt = vocab.tokenize("The capital of France is", add_special=True)
        session = RouteSession(stages, ticket_bytes(route["ticket"]))
        try:
            tokens = session.generate(prompt, 12)
            session.release()
        finally:
            session.close()
        reference.clear()
        assert tokens == reference.greedy(prompt, 12)[0]
        print(
            f"\njoin by name: from the URL {url_join_s:.1f} s ({sent_by_url} bytes sent), "
            f"from a peer {peer_join_s:.1f} s (shard {local.size_bytes()} bytes)"
        )
    finally:
        sup.stop_all()
        try:
            server.__exit__(None, None, None)
        except Exception:  # already stopped
            pass


def _limit_for(model_path: Path, cfg: NodeConfig, layers: int) -> int:
    """The smallest memory limit (MiB) at which ``layers`` consecutive layers fit wherever they are."""
    meta = read_model_meta(model_path, None)
    open_reader(model_path)
    sizing = model_sizing(meta, local_manifest(model_path, None), model_path, cfg)
    worst = max(sizing.span_bytes(a, a + layers) for a in range(meta.n_layers - layers + 1))
    next_worst = max(sizing.span_bytes(a, a + layers + 1) for a in range(meta.n_layers - layers))
    # The automatic KV pool (the default) leaves POOL_MARGIN of the budget free: spans fit in the rest.
    share = 1 - POOL_MARGIN if cfg.kv_pool_tokens < 0 else 1
    limit = math.ceil(worst / share / 2**20)
    assert span_budget_bytes(limit * 2**20, auto_pool=cfg.kv_pool_tokens < 0) >= worst
    assert span_budget_bytes(limit * 2**20, auto_pool=cfg.kv_pool_tokens < 0) < next_worst, (
        "the test needs 11 layers not to fit"
    )
    return limit


def test_memory_limited_nodes_take_what_fits_and_cover_the_model(
    workdir: Path, model_path: Path, node_cache: Path
) -> None:
    settings = ["--max-sessions", "2", "--session-kv-tokens", "512", "--batch-tokens", "256"]
    cfg = NodeConfig(max_sessions=2, session_kv_tokens=512, batch_tokens=256)
    limit_mb = _limit_for(model_path, cfg, 10)
    sup = Supervisor(workdir / "memory")
    try:
        tracker = sup.start_tracker().ready(60)
        spans = []
        for i in range(3):
            node = sup.start_node(
                f"n{i}", model=model_path, layers="auto", tracker_url=tracker.url, max_sessions=2,
                session_kv_tokens=512, cache_dir=node_cache,
                extra_args=[*settings, "--heartbeat-interval-s", "1", "--no-benchmark",
                            "--memory-limit-mb", str(limit_mb)],
            ).ready(120)  # fmt: skip
            info = node_info(f"127.0.0.1:{node.port}")
            spans.append((info.shard.start, info.shard.end))
            join = status(node)["join"]
            assert join["capacity_layers"] == 10, join
            assert join["memory_budget_source"].startswith("memory_limit_mb"), join
            assert '"event":"kv_pool_sized"' in node.log_text()  # the margin it left holds a pool
            # The tracker must know this node before the next one asks where to go.
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                shards = {n["node_id"] for n in http_json(f"{tracker.url}/v1/swarm")[1]["nodes"]}
                if info.node_id in shards:
                    break
                time.sleep(0.2)
        assert all(b - a <= 10 for a, b in spans), spans
        covered = sorted(spans)
        assert covered[0][0] == 0 and covered[-1][1] == 30
        assert all(x[1] >= y[0] for x, y in zip(covered, covered[1:], strict=False)), covered
        wait_for_route(tracker.url, read_model_meta(model_path, node_cache).fingerprint)
        # A node whose memory cannot hold a single layer refuses to start, and says why.
        tiny = sup.start_node(
            "tiny", model=model_path, layers="auto", tracker_url=tracker.url, cache_dir=node_cache,
            extra_args=[*settings, "--no-benchmark", "--memory-limit-mb", "64"],
        )  # fmt: skip
        with pytest.raises(LaunchError, match="cannot hold even one layer"):
            tiny.ready(120)
        print(f"\nmemory limit {limit_mb} MiB holds 10 layers anywhere; spans {spans}")
    finally:
        sup.stop_all()


def test_cgroup_memory_limit_is_what_the_node_sizes_itself_to(tmp_path: Path) -> None:
    """A real cgroup memory limit (v2 memory.max or v1 memory.limit_in_bytes) is found and binds."""
    import os

    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    from node.capacity import cgroup_limit

    probe = (
        "import json; from node.capacity import memory_limits; "
        "print(json.dumps([[m.bytes, m.source] for m in memory_limits()]))"
    )
    group = _make_cgroup(f"swarm-join-test-{os.getpid()}", 512 * 2**20)
    if group is None:
        pytest.skip("no writable cgroup memory controller here")
    procs_file, cleanup = group
    try:
        cmd = ["sh", "-c", f'echo $$ > {procs_file} && exec "$0" -c "$1"', sys.executable, probe]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
        limits = json.loads(out)
        binding = limits[-1]
        assert binding[0] == 512 * 2**20 and "cgroup" in binding[1], limits
    finally:
        cleanup()
    assert cgroup_limit("0::/\n", tmp_path) is None  # no limit file: unlimited


def _make_cgroup(name: str, limit: int) -> tuple[str, object] | None:
    """A cgroup with a memory limit (v2 if it has the memory controller, else v1); its procs file."""
    root = Path("/sys/fs/cgroup")
    for base, limit_file, procs in (
        (root, "memory.max", "cgroup.procs"),
        (root / "unified", "memory.max", "cgroup.procs"),
        (root / "memory", "memory.limit_in_bytes", "cgroup.procs"),
    ):
        controllers = base / "cgroup.controllers"
        if limit_file == "memory.max" and (
            not controllers.is_file() or "memory" not in controllers.read_text()
        ):
            continue
        if not base.is_dir():
            continue
        group = base / name
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit))
        except OSError:
            try:
                group.rmdir()
            except OSError:
                pass
            continue

        def cleanup(group: Path = group) -> None:
            for _ in range(50):
                try:
                    group.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)

        return str(group / procs), cleanup
    return None
