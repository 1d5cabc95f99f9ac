"""End to end on loopback, real model: openai client -> swarm-gateway -> swarm-node x4 (+ swarm-tracker).

Two data-parallel routes: nodes A1, A2 serve layers [0,15), B1, B2 serve
[15,30). At temperature 0 the text must equal the whole model's greedy
output (``node.reference.ReferenceModel`` with the nodes' context settings,
the same chat template and tokenizer). Afterwards no node may hold KV for a
finished or abandoned request (checked through each node's gRPC ``Info``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from swarm_fixtures import metric_lines, recovered, url, wait_until

from common.vocab import Vocabulary
from gateway.chat_template import ChatTemplate
from node.engine import EngineConfig
from node.reference import ReferenceModel
from proto.swarm.v1 import shard_service_pb2, shard_service_pb2_grpc
from sim.procs import NO_SPOT_CHECKS, Service, Supervisor
from tests.node.loopback_client import node_channel

pytestmark = pytest.mark.slow

# The nodes' engine settings; the reference must use the same context settings (flash attention, f16 KV).
MAX_SESSIONS, SESSION_KV, BATCH = 6, 512, 256
ENGINE = EngineConfig(threads=1, max_sessions=MAX_SESSIONS, session_kv_tokens=SESSION_KV, batch_tokens=BATCH)
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]
N_NEW = 20


def start_node(
    sup: Supervisor, name: str, model_path: Path, layers: str, tracker: Service, cache: Path
) -> Service:
    return sup.start_node(
        name,
        model=model_path,
        layers=layers,
        tracker_url=url(tracker),
        max_sessions=MAX_SESSIONS,
        session_kv_tokens=SESSION_KV,
        cache_dir=cache,
        admin=False,
        # A session grows in the node's KV pool up to SESSION_KV positions: the context the 413 names.
        extra_args=[
            "--batch-tokens",
            str(BATCH),
            "--max-session-kv-tokens",
            str(SESSION_KV),
            "--no-benchmark",
        ],
    )


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path) -> Iterator[dict]:
    sup = Supervisor(tmp_path_factory.mktemp("e2e"))
    try:
        tracker = sup.start_tracker().ready(60)
        # The first node writes the shard files into the shared cache; the others start in parallel.
        nodes = [start_node(sup, "a1", model_path, "0:15", tracker, node_cache).ready(120)]
        more = [
            start_node(sup, name, model_path, layers, tracker, node_cache)
            for name, layers in (("b1", "15:30"), ("a2", "0:15"), ("b2", "15:30"))
        ]
        nodes += [node.ready(120) for node in more]

        def two_routes() -> bool:
            body = httpx.post(
                url(tracker) + "/v1/routes", json={"model": model_name(tracker), "k": 2}, timeout=10
            ).json()
            return len(body.get("routes", [])) == 2

        wait_until(two_routes, 60, "two node-disjoint routes at the tracker", interval_s=0.25)
        gateway = sup.start_gateway(
            tracker_url=url(tracker),
            extra_args=["--max-sessions", "8", "--max-queue", "16", "--routes-k", "2", *NO_SPOT_CHECKS],
        ).ready(60)
        yield {
            "supervisor": sup,
            "tracker": tracker,
            "nodes": nodes,
            "gateway": gateway,
            "model": model_name(tracker),
        }
    finally:
        sup.stop_all()


def model_name(tracker: Service) -> str:
    models = httpx.get(url(tracker) + "/v1/models", timeout=10).json()["models"]
    assert len(models) == 1, models
    return str(models[0]["name"])


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Iterator[tuple[ReferenceModel, Vocabulary]]:
    with ReferenceModel(model_path, ENGINE.context_settings()) as ref, Vocabulary(model_path) as vocab:
        yield ref, vocab


def greedy_text(
    reference: tuple[ReferenceModel, Vocabulary], prompt_ids: list[int], n_new: int, step: int | None = None
) -> str:
    """The whole model's greedy text. ``step``: prefill in steps of that many positions, like the gateway
    (llama.cpp's low-order bits depend on how a prompt is split into batches)."""
    ref, vocab = reference
    ref.clear()
    if step is None:
        tokens, _ = ref.greedy(prompt_ids, n_new)
    else:
        for a in range(0, len(prompt_ids), step):
            logits = ref.prefill(prompt_ids[a : a + step], 0, start=a)
        tokens = [int(logits.argmax())]
        while len(tokens) < n_new:
            ref.decode([0], [len(prompt_ids) + len(tokens) - 1], [tokens[-1]], [True])
            tokens.append(int(ref.logits(0).argmax()))
    out: list[int] = []
    for t in tokens:
        if vocab.is_eog(t):
            break
        out.append(t)
    return vocab.detokenize(out)


def chat_reference(
    reference: tuple[ReferenceModel, Vocabulary], question: str, n_new: int, step: int | None = None
) -> str:
    _, vocab = reference
    template = ChatTemplate(vocab.chat_template)
    text = template.render([{"role": "user", "content": question}], add_generation_prompt=True)
    return greedy_text(reference, vocab.tokenize(text, add_special=False), n_new, step)


def route_counts(swarm: dict) -> dict[str, float]:
    """Finished sessions per route, from the gateway's metrics."""
    out: dict[str, float] = {}
    for line in metric_lines(url(swarm["gateway"]), "swarm_gateway_route_sessions_total"):
        if 'outcome="ok"' in line:
            out[line.split('route="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def hidden_relays(swarm: dict) -> float:
    """Hidden-state frames the gateway relayed between stages."""
    lines = metric_lines(url(swarm["gateway"]), "swarm_gateway_hidden_relays_total")
    return sum(float(line.split()[-1]) for line in lines)  # no line before the first session


def node_load(proc: Service) -> shard_service_pb2.NodeLoad:
    with node_channel(f"127.0.0.1:{proc.port}") as channel:
        return (
            shard_service_pb2_grpc.ShardServiceStub(channel)
            .Info(shard_service_pb2.InfoRequest(), timeout=10)
            .load
        )


def no_kv_held(swarm: dict) -> bool:
    loads = [node_load(p) for p in swarm["nodes"]]
    return all(load.active_sessions == 0 and load.kv_tokens_used == 0 for load in loads)


@pytest.fixture
def client(swarm: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=url(swarm["gateway"]) + "/v1", api_key="sk-e2e", max_retries=0, timeout=120)


def test_openai_client_gets_the_whole_models_greedy_text(
    client: openai.OpenAI, swarm: dict, reference
) -> None:
    question = QUESTIONS[0]
    want = chat_reference(reference, question, N_NEW)
    messages = [{"role": "user", "content": question}]
    relays_before = hidden_relays(swarm)
    full = client.chat.completions.create(
        model=swarm["model"], messages=messages, temperature=0, max_tokens=N_NEW
    )
    assert full.choices[0].message.content == want
    # Direct push: stage 0 sent every step's hidden states to stage 1 itself and the last stage sent each
    # next decode step to stage 0 itself; nothing passed through the gateway.
    assert hidden_relays(swarm) - relays_before == 0
    stream = client.chat.completions.create(
        model=swarm["model"],
        messages=messages,
        temperature=0,
        max_tokens=N_NEW,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    prompt = "The three most important inventions of the last century are"
    _, vocab = reference
    want_completion = greedy_text(reference, vocab.tokenize(prompt, add_special=True), N_NEW)
    done = client.completions.create(model=swarm["model"], prompt=prompt, temperature=0, max_tokens=N_NEW)
    assert done.choices[0].text == want_completion
    streamed = client.completions.create(
        model=swarm["model"], prompt=prompt, temperature=0, max_tokens=N_NEW, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want_completion
    wait_until(lambda: no_kv_held(swarm), 10, "every node to free the finished sessions")


def test_eight_concurrent_clients_on_two_routes(client: openai.OpenAI, swarm: dict, reference) -> None:
    wants = {q: chat_reference(reference, q, 16) for q in QUESTIONS}
    results: dict[int, str] = {}
    failures: list[BaseException] = []

    def one(i: int) -> None:
        q = QUESTIONS[i % len(QUESTIONS)]
        try:
            r = client.chat.completions.create(
                model=swarm["model"], temperature=0, max_tokens=16, messages=[{"role": "user", "content": q}]
            )
            results[i] = r.choices[0].message.content or ""
        except BaseException as err:  # noqa: BLE001 - reported below
            failures.append(err)

    before = route_counts(swarm)
    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    elapsed = time.monotonic() - started
    assert not failures, failures
    assert {i: results[i] for i in range(8)} == {i: wants[QUESTIONS[i % 4]] for i in range(8)}
    after = route_counts(swarm)
    used = {r: n - before.get(r, 0) for r, n in after.items() if n > before.get(r, 0)}
    assert sum(used.values()) == 8 and len(used) >= 2, used  # spread over the data-parallel routes
    print(
        f"\n8 concurrent chat requests x 16 tokens: {elapsed:.1f} s, "
        f"{8 * 16 / elapsed:.1f} tokens/s aggregate"
    )
    wait_until(lambda: no_kv_held(swarm), 10, "every node to free the finished sessions")


def test_disconnect_frees_kv_on_every_stage(client: openai.OpenAI, swarm: dict) -> None:
    stream = client.chat.completions.create(
        model=swarm["model"],
        max_tokens=300,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": "Tell me a very long story."}],
    )
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert not no_kv_held(swarm)
    stream.close()
    wait_until(lambda: no_kv_held(swarm), 15, "every stage to free the abandoned session")
    assert metric_lines(url(swarm["gateway"]), "swarm_gateway_client_disconnects_total")


def test_bad_input_and_over_capacity_on_the_real_swarm(client: openai.OpenAI, swarm: dict) -> None:
    cases = [
        ({"model": "no-such-model"}, 404),
        ({"n": 17}, 400),
        ({"temperature": -1}, 400),
        ({"max_tokens": 0}, 400),
        ({"messages": [{"role": "user", "content": "word " * 600}]}, 413),  # past every route
    ]
    for extra, status in cases:
        args = {
            "model": swarm["model"],
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            **extra,
        }
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(**args)
        assert info.value.status_code == status, (extra, info.value.body)
        assert set(info.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.APIStatusError) as too_long:
        client.chat.completions.create(
            model=swarm["model"], messages=[{"role": "user", "content": "word " * 600}]
        )
    assert too_long.value.status_code == 413
    assert too_long.value.body["code"] == "prompt_too_long" and str(SESSION_KV) in too_long.value.message
    small = (
        swarm["supervisor"]
        .start_gateway(
            tracker_url=url(swarm["tracker"]),
            name="small-gateway",
            extra_args=["--max-sessions", "1", "--max-queue", "0", *NO_SPOT_CHECKS],
        )
        .ready(60)
    )
    try:
        body = {
            "model": swarm["model"],
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 200,
            "stream": True,
        }
        with httpx.Client(base_url=url(small), timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as held:
                assert held.status_code == 200
                lines = held.iter_lines()  # keep a reference: a collected iterator closes the stream
                next(lines)
                r = http.post("/v1/chat/completions", json={**body, "stream": False})
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    finally:
        small.stop()
    ok = client.chat.completions.create(
        model=swarm["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
    wait_until(lambda: no_kv_held(swarm), 15, "every node to free every session")


def test_single_stream_speed(client: openai.OpenAI, swarm: dict) -> None:
    """Not a pass/fail figure: prints time to first token and decode tokens/s through the gateway."""
    started = time.monotonic()
    first = None
    n = 0
    for chunk in client.completions.create(
        model=swarm["model"],
        prompt="Once upon a time",
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.monotonic()
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    end = time.monotonic()
    assert first is not None and n > 1
    print(
        f"\nsingle stream: TTFT {first - started:.3f} s, "
        f"{(n - 1) / (end - first):.1f} tokens/s decode ({n} tokens)"
    )


def test_long_prompt_in_many_steps_and_small_frames(swarm: dict, reference) -> None:
    """Prefill in 64-token steps, hidden states relayed in 64 KiB chunks (about 27 rows): same greedy text."""
    gateway = (
        swarm["supervisor"]
        .start_gateway(
            tracker_url=url(swarm["tracker"]),
            name="chunky-gateway",
            extra_args=["--prefill-step-tokens", "64", "--max-frame-bytes", "131072", *NO_SPOT_CHECKS],
        )
        .ready(60)
    )
    try:
        client = openai.OpenAI(base_url=url(gateway) + "/v1", api_key="sk-e2e", max_retries=0, timeout=120)
        question = "Summarize this: " + " ".join(
            f"item {i} is {'red' if i % 2 else 'blue'};" for i in range(60)
        )
        want = chat_reference(reference, question, 12, step=64)
        got = client.chat.completions.create(
            model=swarm["model"],
            temperature=0,
            max_tokens=12,
            messages=[{"role": "user", "content": question}],
        )
        assert got.usage.prompt_tokens > 256  # several prefill steps, each relayed in several chunks
        assert got.choices[0].message.content == want
    finally:
        gateway.stop()
    wait_until(lambda: no_kv_held(swarm), 10, "every node to free the session")


def test_node_killed_mid_stream_the_stream_continues_on_the_other_route(
    client: openai.OpenAI, swarm: dict, reference
) -> None:
    """Last in the module: SIGKILL one node of the route serving a stream; the gateway replays the tokens so
    far on the other route and the client still gets the whole model's greedy text."""
    question = "Explain why the sky is blue."
    want = chat_reference(reference, question, 40)
    stream = client.chat.completions.create(
        model=swarm["model"],
        temperature=0,
        max_tokens=40,
        stream=True,
        messages=[{"role": "user", "content": question}],
    )
    it = iter(stream)
    texts = [next(it).choices[0].delta.content or "" for _ in range(4)]
    busy = [p for p in swarm["nodes"] if node_load(p).active_sessions > 0]
    assert len(busy) == 2, "one route (two nodes) serves the stream"
    victim = busy[0]
    victim.kill()
    for chunk in it:
        if chunk.choices:
            texts.append(chunk.choices[0].delta.content or "")
    assert "".join(texts) == want
    assert recovered(url(swarm["gateway"]))
    survivors = {**swarm, "nodes": [p for p in swarm["nodes"] if p is not victim]}
    wait_until(lambda: no_kv_held(survivors), 15, "the surviving nodes to free every session")
