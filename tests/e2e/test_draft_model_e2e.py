"""Speculation with a draft model (``--draft-model``) through a real 2-node SmolLM2 swarm.

Tracker, two nodes ([0,15) and [15,30), one llama.cpp thread each, both started with a Q4_0 copy
of the bundled SmolLM2 as their draft model; only the last stage drafts) and the gateway on
loopback, the official openai client. Shown here:

1. greedy text is identical with speculation on (drafts from the draft model) and off, streamed
   and not, on an editing prompt and an open chat; windows produced more than one token per pass,
   and the last stage's log shows the draft model's context was created (it drafted);
2. the request chooses the proposer (``extra_body={"speculation": "ngram" | "draft" | "off"}``):
   the same greedy text, the last stage counts a session per proposer (n-gram lookup where the
   request said so, although it has a draft model), and an unknown value is a 400 naming the field;
3. a node whose draft model has another vocabulary (Gemma 3 against SmolLM2) refuses to start,
   with an error naming the difference.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from node.draft_model import quantize
from node.testmodel import gemma3_model_path
from sim.launcher import LocalSwarm, start_local_swarm

pytestmark = pytest.mark.slow

EDIT = (
    "Repeat this code exactly, adding a docstring to each function:\n\n"
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
)
CHAT = "Tell me about the ocean."
N_NEW = 40


def metric(swarm: LocalSwarm, name: str) -> float:
    base = swarm.base_url.removesuffix("/v1")
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return quantize(model_path, tmp_path_factory.mktemp("draft") / "smol-q4_0.gguf", "q4_0")


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path, draft_path: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("draft-swarm"),
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        node_cache=node_cache,
        gateway_args=["--check-fraction", "0", "--probation-checks", "0", "--kv-keep-s", "0"],
        node_args=["--no-benchmark", "--draft-model", str(draft_path)],
    )
    yield s
    s.stop()


def node_metric(swarm: LocalSwarm, span: tuple[int, int], name: str, label: str) -> float:
    node = next(n for n in swarm.nodes if n.extra["span"] == span)
    text = httpx.get(f"http://127.0.0.1:{node.admin_port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f"{name}{{{label}}} "):
            return float(line.split()[-1])
    return 0.0


def chat(client: openai.OpenAI, model: str, content: str, *, spec: bool | str, stream: bool) -> str:
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=N_NEW,
        temperature=0,
        extra_body={"speculation": spec},
    )
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content or ""  # type: ignore[call-overload]
    parts = []
    for chunk in client.chat.completions.create(stream=True, **kw):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


def test_greedy_text_is_identical_with_the_draft_model(swarm: LocalSwarm) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="test", max_retries=0, timeout=120)
    plain = {q: chat(client, swarm.model_name, q, spec=False, stream=False) for q in (EDIT, CHAT)}
    windows = metric(swarm, "swarm_gateway_spec_windows_total")
    tokens = metric(swarm, "swarm_gateway_spec_window_tokens_total")
    for stream in (False, True):
        for q in (EDIT, CHAT):
            assert chat(client, swarm.model_name, q, spec=True, stream=stream) == plain[q]
    windows = metric(swarm, "swarm_gateway_spec_windows_total") - windows
    tokens = metric(swarm, "swarm_gateway_spec_window_tokens_total") - tokens
    per = tokens / max(1, windows)
    print(f"draft model: {windows:.0f} windows produced {tokens:.0f} tokens ({per:.2f} per pass)")
    assert windows > 0 and tokens > windows  # drafts were accepted
    hits = node_metric(swarm, (15, 30), "swarm_node_draft_lookahead_total", 'outcome="hit"')
    misses = node_metric(swarm, (15, 30), "swarm_node_draft_lookahead_total", 'outcome="miss"')
    print(f"draft model look-ahead: {hits:.0f} taken, {misses:.0f} dropped")
    last = next(n for n in swarm.nodes if n.extra["span"] == (15, 30))
    assert '"event":"draft_context_ready"' in last.log_text()  # the draft model drafted


def test_the_request_chooses_the_proposer(swarm: LocalSwarm) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="test", max_retries=0, timeout=120)
    plain = chat(client, swarm.model_name, EDIT, spec="off", stream=False)
    sessions = "swarm_node_spec_sessions_total"
    for proposer in ("ngram", "draft"):
        label = f'proposer="{proposer}"'
        before = node_metric(swarm, (15, 30), sessions, label)
        assert chat(client, swarm.model_name, EDIT, spec=proposer, stream=False) == plain
        assert node_metric(swarm, (15, 30), sessions, label) == before + 1, proposer
    assert chat(client, swarm.model_name, EDIT, spec="auto", stream=True) == plain
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, swarm.model_name, EDIT, spec="fast", stream=False)
    assert caught.value.status_code == 400 and "'speculation' must be" in str(caught.value)


def test_a_draft_model_with_another_vocabulary_is_refused(
    model_path: Path, node_cache: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "start",
            "--model",
            str(model_path),
            "--layers",
            "15:30",
            "--no-tracker",
            "--insecure-no-tickets",
            "--no-benchmark",
            "--threads",
            "1",
            "--port",
            "0",
            "--cache-dir",
            str(node_cache),
            "--draft-model",
            str(gemma3_model_path()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "vocabulary is not the target model's (262144 tokens, the target has 49152)" in done.stderr
