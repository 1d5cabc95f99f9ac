"""Live rebalancing with real processes on loopback: demand shifts from one model to another,
a node moves, every request is served.

Two real models, both registered at the tracker with a Range-capable HTTP source (the
operator's path, ``swarm-tracker model add``): SmolLM2-135M (30 layers) and Gemma 3 270M
(18 layers). Three nodes, each serving a whole model cut from its local file:

* ``s1``: SmolLM2, not rebalancing (``rebalance_interval_s`` 0, the default);
* ``s2``: SmolLM2, asks every 2 s and may move to Gemma 3;
* ``g1``: Gemma 3, asks every 2 s and may move to SmolLM2.

The tracker counts a model's route look-ups as its demand (half-life 5 s) and lets a node
leave a layer that keeps one other holder (``rebalance_min_holders = 1``: with three nodes and
two models there is no spare for two holders each). Clients use the official ``openai``
client against the gateway, with no retries.

1. Demand on SmolLM2 (and a trickle on Gemma 3): nobody moves -- ``g1`` is Gemma's only
   holder, and SmolLM2 is where the demand is.
2. Demand shifts to Gemma 3 (SmolLM2 keeps a trickle of longer answers): ``s2`` is told to
   move, twice in a row (its confirmations), drains (1 s for its sessions to finish; what is
   still open is handed back and the gateway replays it on ``s1``), fetches Gemma 3's
   tensors from the registry's sources and rejoins as Gemma 3 [0, 18) on the same ports;
   requests of both models go on.
3. After the move it serves Gemma 3 requests; ``g1`` stayed (no thrash: the tracker's
   advice to everyone after the move is "stay"); not one request failed.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from node.testmodel import gemma3_model_path
from sim.procs import Service, Supervisor, console_script, wait_until
from sim.range_server import RangeServer

pytestmark = pytest.mark.slow

SMOL, GEMMA = "smollm2-rebalance", "gemma3-rebalance"
TRACKER_TOML = """
[tracker]
demand_half_life_s = 5.0
rebalance_min_holders = 1
rebalance_pending_s = 120.0
probation_checks = 0
heartbeat_interval_s = 2.0
heartbeat_timeout_s = 20.0
"""
NODE_TOML = """
[node]
rebalance_cooldown_s = 4.0
rebalance_confirmations = 2
rebalance_drain_s = 1.0
# Three nodes share this machine: each sizes its KV pool from this, not from the whole machine's memory
# (a pool of gigabytes made the move's load phase take 55 s, and the move past the 120 s wait).
memory_limit_mb = 2048
"""


def status(node: Service) -> dict:
    return httpx.get(f"http://127.0.0.1:{node.admin_port}/status", timeout=10).json()


def swarm_models(tracker_url: str) -> dict[str, str]:
    """node id -> the fingerprint of the model it serves (live nodes only)."""
    nodes = httpx.get(f"{tracker_url}/v1/swarm", timeout=10).json()["nodes"]
    return {n["node_id"]: n["shard"]["model_fingerprint"] for n in nodes if n["state"] == "live"}


def advice_events(node: Service) -> list[dict]:
    lines = node.log_path.read_text(errors="replace").splitlines()
    return [json.loads(x) for x in lines if '"rebalance_advice"' in x]


class Clients:
    """Two client threads (official openai client, no retries): one asks for the model with the
    demand as fast as answers come (6 tokens), the other for the other model (120 tokens)
    0.2 s after each answer."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.hot = SMOL
        self.stop = threading.Event()
        self.done: dict[str, int] = {SMOL: 0, GEMMA: 0}
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.counter = itertools.count()
        self.threads = [
            threading.Thread(target=self._run, args=(True,), daemon=True),
            threading.Thread(target=self._run, args=(False,), daemon=True),
        ]

    def _run(self, hot: bool) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key="test", max_retries=0, timeout=120)
        while not self.stop.is_set():
            model = self.hot if hot else (GEMMA if self.hot == SMOL else SMOL)
            try:
                # The other model's answers are longer, so a node that moves away from it is likely to
                # hold one of its sessions when it drains (handed back: the gateway replays it).
                n = 6 if hot else 120
                # A new prompt each time: a kept prefix would draw every request to one node.
                prompt = f"Note {next(self.counter)}: the sea is"
                r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
                assert r.choices[0].text, "empty answer"
                with self.lock:
                    self.done[model] += 1
            except Exception as err:  # every failure is a finding: the test fails on any
                with self.lock:
                    self.failures.append(f"{model}: {err!r}"[:300])
            if not hot:
                self.stop.wait(0.2)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rebalance")


@pytest.fixture(scope="module")
def sup(workdir: Path) -> Iterator[Supervisor]:
    s = Supervisor(workdir / "swarm")
    try:
        yield s
    finally:
        s.stop_all()


def _register(tracker: Service, path: Path, name: str, url: str) -> str:
    add = subprocess.run(
        [*console_script("swarm-tracker"), "model", "add", str(path), "--name", name, "--source", url,
         "--tracker", tracker.url, "--data-dir", str(tracker.data_dir)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert add.returncode == 0, add.stderr + add.stdout
    return str(httpx.get(f"{tracker.url}/v1/registry/models/{name}", timeout=10).json()["fingerprint"])


def test_demand_shift_moves_a_node_and_loses_no_request(
    sup: Supervisor, workdir: Path, model_path: Path, node_cache: Path
) -> None:
    gemma_path = gemma3_model_path()
    (workdir / "tracker.toml").write_text(TRACKER_TOML)
    (workdir / "node.toml").write_text(NODE_TOML)
    with RangeServer({"/smol.gguf": model_path, "/gemma.gguf": gemma_path}) as origin:
        tracker = sup.start_tracker(env={"SWARM_TRACKER_CONFIG": str(workdir / "tracker.toml")}).ready(60)
        smol_fp = _register(tracker, model_path, SMOL, origin.url("/smol.gguf"))
        gemma_fp = _register(tracker, gemma_path, GEMMA, origin.url("/gemma.gguf"))
        common = ["--no-benchmark", "--config", str(workdir / "node.toml")]
        moving = ["--rebalance-interval-s", "2"]
        s1 = sup.start_node(
            "s1", model=model_path, layers="0:30", tracker_url=tracker.url, cache_dir=node_cache,
            extra_args=common,
        )  # fmt: skip
        s2 = sup.start_node(
            "s2", model=model_path, layers="0:30", tracker_url=tracker.url, cache_dir=node_cache,
            extra_args=[*common, *moving, "--rebalance-models", GEMMA],
        )  # fmt: skip
        g1 = sup.start_node(
            "g1", model=gemma_path, layers="0:18", tracker_url=tracker.url, cache_dir=workdir / "gemma-cache",
            extra_args=[*common, *moving, "--rebalance-models", SMOL],
        )  # fmt: skip
        for node in (s1, s2, g1):
            node.ready(120)
        ids = {svc.name: status(svc)["node_id"] for svc in (s1, s2, g1)}
        wait_until(lambda: len(swarm_models(tracker.url)) == 3, 120, "three live nodes")
        gateway = sup.start_gateway(
            tracker_url=tracker.url,
            extra_args=["--route-ttl-s", "1", "--check-fraction", "0", "--probation-checks", "0"],
        ).ready(120)
        base = f"http://127.0.0.1:{gateway.port}/v1"

        with Clients(base) as clients:
            # 1. Demand on SmolLM2: nobody moves (several questions answered "stay").
            wait_until(lambda: clients.done[SMOL] >= 5 and clients.done[GEMMA] >= 1, 120, "phase-1 answers")
            wait_until(lambda: len(advice_events(s2)) >= 4, 60, "s2 asked four times")
            assert swarm_models(tracker.url)[ids["s2"]] == smol_fp
            assert all(e["advice"] == "stay" for e in advice_events(g1))

            # 2. Demand shifts to Gemma 3: s2 moves.
            clients.hot = GEMMA
            t0 = time.monotonic()
            moved = lambda: swarm_models(tracker.url).get(ids["s2"]) == gemma_fp  # noqa: E731
            wait_until(moved, 120, "s2 serving Gemma 3")
            moved_s = time.monotonic() - t0
            st = status(s2)
            assert st["node_id"] == ids["s2"] and st["model"]["fingerprint"] == gemma_fp
            assert st["shard"] == [0, 18]
            assert st["join"]["fetched"] and st["join"]["fetched_bytes_by_source"]
            served_before = st["tokens_processed"]
            # 3. It serves Gemma 3 requests; g1 stays; both models keep answering.
            wait_until(
                lambda: status(s2)["tokens_processed"] > served_before, 120, "s2 serving Gemma 3 requests"
            )
            done_at_move = dict(clients.done)
            wait_until(
                lambda: (
                    clients.done[SMOL] > done_at_move[SMOL] and clients.done[GEMMA] > done_at_move[GEMMA] + 3
                ),
                120,
                "both models answering after the move",
            )
        log = s2.log_text()
        drained = [json.loads(x) for x in log.splitlines() if '"rebalance_drained"' in x]
        print(
            f"rebalance: s2 moved SmolLM2 -> Gemma 3 {moved_s:.1f} s after the shift; drain {drained}; "
            f"answers {clients.done}; failures {len(clients.failures)}"
        )
        assert clients.failures == []
        final = swarm_models(tracker.url)
        assert final[ids["g1"]] == gemma_fp and final[ids["s1"]] == smol_fp
        assert len(drained) == 1  # one move, no back-and-forth
        assert all(e["advice"] == "stay" for e in advice_events(g1))
