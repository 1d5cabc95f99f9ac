"""Gemma 3 270M across three nodes, as a user starts it: ``swarm-sim up --model <gemma3 file> --nodes 3``.

The command runs as a subprocess (tracker, three nodes, gateway: real
processes on loopback, tracker placement); the official ``openai`` client asks
for chat and text completions, streamed and not, with short prompts and with
a prompt of about 1000 tokens (longer than the 512-position sliding window).
Every answer must be exactly the text llama-cpp-python's own ``Llama`` gives
for the whole model with the same settings (flash attention on, f16 KV,
greedy, no repetition penalty, one thread, its prompt cache reset before each
request, Gemma's chat format).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp
import openai
import pytest

from common.vocab import Vocabulary
from node.testmodel import gemma3_model_path

pytestmark = pytest.mark.slow

N_NEW = 24
QUESTION = "What is the capital of France?"
PROMPT = "The three primary colors are"
PARAGRAPH = (
    "The harbour town kept its records in a tall stone building by the quay. Every ship that came in was "
    "written down: its name, its captain, the goods it carried and the day it left again. "
)


class SimUp:
    """``python -m sim.cli up`` in a subprocess; its output is collected by a reader thread."""

    def __init__(self, args: list[str], workdir: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sim.cli", "up", *args, "--port", "0", "--workdir", str(workdir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-60:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._reader.join(timeout=10)


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_model_path()


@pytest.fixture(scope="module")
def swarm(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimUp]:
    up = SimUp(["--model", str(gemma_path), "--nodes", "3"], tmp_path_factory.mktemp("gemma-swarm"))
    try:
        up.wait_for(r"OpenAI base URL:\s+(\S+)", 900)
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def client(swarm: SimUp) -> openai.OpenAI:
    base = swarm.wait_for(r"OpenAI base URL:\s+(\S+)", 1).group(1)
    return openai.OpenAI(base_url=base, api_key="sk-e2e", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model_name(swarm: SimUp) -> str:
    return swarm.wait_for(r"^model:\s+(\S.*)$", 1).group(1).strip()


@pytest.fixture(scope="module")
def llm(gemma_path: Path) -> Iterator[llama_cpp.Llama]:
    # What a node computes: flash attention on, f16 KV, per-sequence KV of 2048 positions, one thread.
    model = llama_cpp.Llama(
        model_path=str(gemma_path),
        n_ctx=2048,
        n_batch=512,
        n_ubatch=512,
        n_threads=1,
        n_threads_batch=1,
        flash_attn=True,
        chat_format="gemma",
        verbose=False,
    )
    yield model
    model.close()


@pytest.fixture(scope="module")
def long_text(gemma_path: Path) -> str:
    with Vocabulary(gemma_path) as v:
        text = ""
        while len(v.tokenize(text + PARAGRAPH)) < 1000:
            text += PARAGRAPH
        n = len(v.tokenize(text))
    assert 950 <= n < 1000
    return text + "Which ships are written down, and what is recorded about each?"


def ref_chat(llm: llama_cpp.Llama, content: str) -> str:
    llm.reset()  # no prompt-cache reuse: the whole prompt is evaluated as a node does
    out = llm.create_chat_completion(
        messages=[{"role": "user", "content": content}], max_tokens=N_NEW, temperature=0.0, repeat_penalty=1.0
    )
    return out["choices"][0]["message"]["content"] or ""


def ref_completion(llm: llama_cpp.Llama, prompt: str) -> str:
    llm.reset()
    out = llm.create_completion(prompt, max_tokens=N_NEW, temperature=0.0, repeat_penalty=1.0)
    return out["choices"][0]["text"]


def chat(client: openai.OpenAI, model: str, content: str, stream: bool) -> str:
    kwargs = dict(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=N_NEW, temperature=0
    )
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    parts = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


def completion(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> str:
    kwargs = dict(model=model, prompt=prompt, max_tokens=N_NEW, temperature=0)
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def test_three_nodes_tile_the_model(swarm: SimUp) -> None:
    spans = sorted(
        (int(m.group(1)), int(m.group(2)))
        for line in swarm.lines
        if (m := re.search(r"node\d+\s+serving layers \[(\d+), (\d+)\)", line))
    )
    assert spans == [(0, 6), (6, 12), (12, 18)]
    tracker = swarm.wait_for(r"tracker\s+ready at (\S+)", 1).group(1)
    nodes = httpx.get(f"{tracker}/v1/swarm", timeout=10).json()["nodes"]
    assert sum(n["state"] == "live" for n in nodes) == 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_llama_cpp_python(client, model_name: str, llm, stream: bool) -> None:
    want = ref_chat(llm, QUESTION)
    assert want  # the reference says something
    assert chat(client, model_name, QUESTION, stream) == want


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_equals_llama_cpp_python(client, model_name: str, llm, stream: bool) -> None:
    want = ref_completion(llm, PROMPT)
    assert want
    assert completion(client, model_name, PROMPT, stream) == want


def test_a_1000_token_prompt_equals_llama_cpp_python(client, model_name: str, llm, long_text: str) -> None:
    want_chat, want_text = ref_chat(llm, long_text), ref_completion(llm, long_text)
    assert want_chat and want_text
    assert chat(client, model_name, long_text, True) == want_chat
    assert completion(client, model_name, long_text, False) == want_text


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write one sentence about the sea.",
    "What is two plus two?",
    "Who wrote Hamlet?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
]


def test_eight_concurrent_clients_get_the_whole_models_text(client, model_name: str, llm) -> None:
    """Under load every greedy answer is the whole model's: batch_isolation = auto (the gateway's
    default) computes every session of a Gemma 3 model in batches of its own (docs/security.md)."""
    from concurrent.futures import ThreadPoolExecutor

    want = [ref_chat(llm, q) for q in QUESTIONS]
    assert all(want)
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        got = list(pool.map(lambda q: chat(client, model_name, q, True), QUESTIONS * 2))
    assert got == want * 2
