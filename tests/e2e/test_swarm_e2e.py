"""A whole local swarm as `swarm-sim up` starts it: real tracker, node and gateway processes on loopback.

Checked through the official `openai` client: the text equals the whole model's greedy output;
concurrent clients; a node that joins late is used by routing; a tracker restarted on its kept
SQLite file gets its nodes back and loses nothing from the usage ledger.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from sim.launcher import LocalSwarm, start_local_swarm
from sim.procs import wait_http
from tests.e2e.swarm_helpers import Reference, live_nodes, node_load

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]
N_NEW = 24


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    # Placement by the tracker (no fixed layers), routes refreshed every second so a late node is seen.
    s = start_local_swarm(
        tmp_path_factory.mktemp("swarm"),
        model=model_path,
        n_nodes=2,
        node_cache=node_cache,
        gateway_args=["--route-ttl-s", "1"],
        node_args=["--no-benchmark"],
    )
    yield s
    s.stop()


def chat(client: openai.OpenAI, model: str, question: str, stream: bool) -> str:
    kwargs = dict(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=N_NEW, temperature=0
    )
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    return "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )


def test_tracker_placed_the_two_nodes_to_tile_the_model(swarm: LocalSwarm) -> None:
    assert sorted(n.extra["span"] for n in swarm.nodes) == [(0, 15), (15, 30)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_text_equals_the_whole_models_greedy_output(
    swarm: LocalSwarm, reference: Reference, stream: bool
) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    for q in QUESTIONS[:2]:
        assert chat(client, swarm.model_name, q, stream) == reference.chat(q, N_NEW)


def test_concurrent_clients_all_correct_and_no_kv_left(swarm: LocalSwarm, reference: Reference) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    want = {q: reference.chat(q, N_NEW) for q in QUESTIONS}
    with ThreadPoolExecutor(6) as pool:
        jobs = [
            (q, pool.submit(chat, client, swarm.model_name, q, i % 2 == 0))
            for i, q in enumerate(QUESTIONS * 2)
        ]
        for q, job in jobs:
            assert job.result() == want[q]
    for node in swarm.nodes:
        load = node_load(node.port)
        assert load.active_sessions == 0 and load.kv_tokens_used == 0


def test_a_node_joining_late_is_picked_up_by_routing(
    swarm: LocalSwarm, node_cache: Path, model_path: Path, reference: Reference
) -> None:
    late = swarm.supervisor.start_node(
        "late",
        model=model_path,
        layers="0:30",
        tracker_url=swarm.tracker_url,
        cache_dir=node_cache,
        extra_args=["--no-benchmark"],
    )
    late.wait_port(120)
    wait_http(
        late,
        f"{swarm.tracker_url}/v1/swarm",
        120,
        ok=lambda r: any(str(late.port) in " ".join(n["addresses"]) for n in r.json()["nodes"]),
    )
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    # Two data-parallel routes now exist (the split pair, and the late whole-model node); concurrent
    # requests spread over both. Keep asking until the late node has served a session.
    deadline = time.monotonic() + 120
    served = False
    while time.monotonic() < deadline and not served:
        with ThreadPoolExecutor(4) as pool:
            for out in pool.map(lambda q: chat(client, swarm.model_name, q, False), QUESTIONS):
                assert out in {reference.chat(q, N_NEW) for q in QUESTIONS}
        status = httpx.get(f"http://127.0.0.1:{late.admin_port}/status", timeout=10).json()
        served = status["tokens_processed"] > 0  # started with --no-benchmark: only routed work counts
    assert served, "the late node never served a session"


def test_tracker_restart_keeps_ledger_and_routing_resumes(swarm: LocalSwarm, reference: Reference) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="sk-e2e", max_retries=0, timeout=120)
    assert chat(client, swarm.model_name, QUESTIONS[0], False) == reference.chat(QUESTIONS[0], N_NEW)
    db = swarm.supervisor.workdir / "tracker" / "tracker.db"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _ledger(db) == 0:
        time.sleep(0.2)  # usage reports are sent after the response
    rows_before = _ledger(db)
    assert rows_before > 0
    port = swarm.tracker.port
    swarm.tracker.stop()
    restarted = swarm.supervisor.start_tracker(port=port, name="tracker-restarted", data_dir_name="tracker")
    restarted.wait_port(60)
    swarm.tracker = restarted
    wait_http(restarted, f"{swarm.tracker_url}/healthz", 60)
    # Nodes keep heartbeating; they are live again once the tracker hears from them.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(live_nodes(swarm.tracker_url)) < len(swarm.nodes):
        time.sleep(0.5)
    assert len(live_nodes(swarm.tracker_url)) >= len(swarm.nodes)
    assert chat(client, swarm.model_name, QUESTIONS[1], True) == reference.chat(QUESTIONS[1], N_NEW)
    assert _ledger(db) >= rows_before


def _ledger(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM usage").fetchone()[0]


def test_swarm_sim_up_check_serves_a_completion(tmp_path: Path) -> None:
    """The README's first command, as a user runs it (with --check so it stops by itself)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sim.cli", "up", "--check", "--port", "0", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OpenAI base URL:  http://127.0.0.1:" in proc.stdout
    assert "answer:" in proc.stdout and "curl -s http://127.0.0.1:" in proc.stdout
