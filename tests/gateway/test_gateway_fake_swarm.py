"""The whole gateway over real HTTP and real gRPC, with scripted nodes (no model) and a real tracker.

Four ``FakeNode`` servers ([0,15) and [15,30), twice: two data-parallel
routes), a ``swarm-tracker serve`` process and a ``swarm-gateway serve``
process; the official ``openai`` client talks to the gateway. The nodes
"sample" a fixed script, so the expected text is known exactly.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from fake_node import FAILURES
from swarm_fixtures import announce, metric_lines, recovered, scripted_nodes, url, wait_until

from common.vocab import Vocabulary
from proto.announce import ModelSpec
from sim.procs import Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

FINGERPRINT = "fa" * 32
MODEL = ModelSpec(fingerprint=FINGERPRINT, name="fake-model", architecture="llama", n_layers=30, n_embd=576)
SCRIPT_TEXT = "Hello world! Streaming through a fake swarm: é€😀 done."


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("fake-swarm")
    fake = scripted_nodes(
        model_path,
        tmp / "cache",
        SCRIPT_TEXT,
        FINGERPRINT,
        [(0, 15), (15, 30), (0, 15), (15, 30)],
        first_seed=10,
    )
    nodes, script, eos, expected = fake.nodes, fake.script, fake.eos, fake.expected
    sup = Supervisor(tmp)
    try:
        # Fake nodes: no engine to challenge. Spot checks are test_gateway_checks.py's subject: here
        # nothing is on probation and each request runs on one route.
        tracker = sup.start_tracker(extra_args=["--no-challenges", "--probation-checks", "0"]).ready(60)
        for node in nodes:
            announce(url(tracker), node.key, MODEL, node.start, node.end, node.port)
        gateway = sup.start_gateway(
            tracker_url=url(tracker),
            extra_args=[
                *("--max-sessions", "8", "--max-queue", "8"),
                *("--check-fraction", "0", "--probation-checks", "0"),
            ],
        ).ready(60)
        yield {
            "supervisor": sup,
            "nodes": nodes,
            "tracker": tracker,
            "gateway": gateway,
            "script": script,
            "eos": eos,
            "expected": expected,
        }
    finally:
        sup.stop_all()
        for node in nodes:
            node.stop()


@pytest.fixture
def client(swarm: dict) -> openai.OpenAI:
    # Nodes expire after 30 s without heartbeats: re-announce before each test.
    for node in swarm["nodes"]:
        announce(url(swarm["tracker"]), node.key, MODEL, node.start, node.end, node.port)
    return openai.OpenAI(base_url=url(swarm["gateway"]) + "/v1", api_key="sk-test", max_retries=0, timeout=30)


def no_sessions_left(swarm: dict) -> bool:
    return all(not n.state.sessions for n in swarm["nodes"])


def test_chat_non_streaming_and_streaming(client: openai.OpenAI, swarm: dict) -> None:
    messages = [{"role": "user", "content": "Say hello"}]
    full = client.chat.completions.create(model="fake-model", messages=messages, temperature=0)
    assert full.choices[0].message.content == swarm["expected"]
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len(swarm["script"]) + 1  # the end-of-generation token counts
    assert full.id.startswith("chatcmpl-") and full.system_fingerprint.startswith("swarm-")
    stream = client.chat.completions.create(
        model="fake-model",
        messages=messages,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == swarm["expected"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    wait_until(lambda: no_sessions_left(swarm), 5, "nodes to free every session")


def test_completions_length_logprobs_and_stop(client: openai.OpenAI, swarm: dict, model_path: Path) -> None:
    with Vocabulary(model_path) as vocab:
        first3 = vocab.detokenize(swarm["script"][:3])
    r = client.completions.create(
        model="fake-model", prompt="Once upon", max_tokens=3, temperature=0, logprobs=2
    )
    assert r.choices[0].text == first3 and r.choices[0].finish_reason == "length"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.token_logprobs == [-0.25] * 3 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == first3 and len(lp.top_logprobs[0]) == 2
    stopped = client.completions.create(
        model="fake-model", prompt="x", max_tokens=50, temperature=0, stop=["world", "zzz"]
    )
    assert stopped.choices[0].text == "Hello " and stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="fake-model", prompt="x", max_tokens=50, temperature=0, stop="fake", stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "Hello world! Streaming through a "
    chat = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=2,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and content[0].logprob == -0.25 and len(content[0].top_logprobs) == 2
    assert chat.choices[0].finish_reason == "length"


def test_models_health_metrics(client: openai.OpenAI, swarm: dict) -> None:
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    base = url(swarm["gateway"])
    health = httpx.get(base + "/healthz", timeout=10).json()
    assert health["status"] == "ok" and len(health["gateway_id"]) == 64
    assert metric_lines(base, "swarm_gateway_http_requests_total")


def _histogram_counts(base: str) -> dict[str, float]:
    """``<name>_count`` of every gateway histogram, from the scrape."""
    return {
        line.split()[0].removesuffix("_count"): float(line.split()[-1])
        for line in metric_lines(base, "swarm_gateway_")
        if line.split()[0].endswith("_count")
    }


def test_latency_histograms_move_by_one_request(client: openai.OpenAI, swarm: dict) -> None:
    """One request of 5 tokens on the two-stage route: one queue wait, one TTFT, one time per output
    token; a step time for each of the 4 decode steps (the first token comes from the prefill) and a
    hop share per stage and decode step."""
    base = url(swarm["gateway"])
    wait_until(lambda: no_sessions_left(swarm), 5, "nodes to be idle")
    before = _histogram_counts(base)
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    after = _histogram_counts(base)
    moved = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    assert moved["swarm_gateway_queue_wait_seconds"] == 1
    assert moved["swarm_gateway_time_to_first_token_seconds"] == 1
    assert moved["swarm_gateway_time_per_output_token_seconds"] == 1
    assert moved["swarm_gateway_session_seconds"] == 1
    assert moved["swarm_gateway_step_seconds"] == 4
    assert moved["swarm_gateway_hop_latency_seconds"] == 2 * 4


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"temperature": -1}, 400, "temperature"),
        ({"n": 17}, 400, "n"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"top_p": 2}, 400, "top_p"),
        ({"model": "no-such-model"}, 404, "model"),
        (
            {"messages": [{"role": "user", "content": "word " * 700}]},
            413,
            "messages",
        ),  # past the 512-token budget of every route: 413 prompt_too_long
        ({"max_tokens": 1000}, 413, "messages"),  # under the anonymous cap, past every route's budget
        ({"max_tokens": 100000}, 400, "max_tokens"),  # past the anonymous cap (anonymous_max_tokens)
    ],
)
def test_bad_requests_get_openai_errors(client: openai.OpenAI, kwargs: dict, status: int, param: str) -> None:
    args = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == status
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param
    if status == 413:
        assert body["code"] == "prompt_too_long" and "can serve now is 512 tokens" in body["message"]
    assert (
        client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "ok"}], max_tokens=2
        )
        .choices[0]
        .finish_reason
        == "length"
    )


def test_malformed_bodies_and_paths(swarm: dict) -> None:
    base = url(swarm["gateway"])
    with httpx.Client(base_url=base, timeout=10) as http:
        r = http.post(
            "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = http.post("/v1/completions", content=b"x" * (2 << 20))
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        r = http.get("/v1/nothing")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405
        assert http.get("/healthz").status_code == 200


def test_disconnect_cancels_every_stage(client: openai.OpenAI, swarm: dict) -> None:
    for node in swarm["nodes"]:
        node.step_delay_s = 0.05
    try:
        cancelled_before = sum(n.state.cancelled for n in swarm["nodes"])
        stream = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        it = iter(stream)
        next(it)
        next(it)
        assert not no_sessions_left(swarm)
        stream.close()  # the client goes away mid-generation
        wait_until(lambda: no_sessions_left(swarm), 10, "every stage to free the cancelled session")
        assert (
            sum(n.state.cancelled for n in swarm["nodes"]) - cancelled_before == 2
        )  # both stages of the route
        assert metric_lines(url(swarm["gateway"]), "swarm_gateway_client_disconnects_total")
    finally:
        for node in swarm["nodes"]:
            node.step_delay_s = 0.0


def test_concurrent_clients_spread_over_both_routes(client: openai.OpenAI, swarm: dict) -> None:
    for node in swarm["nodes"]:
        node.step_delay_s = 0.01
    results: list[str] = []
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            r = client.chat.completions.create(
                model="fake-model", temperature=0, messages=[{"role": "user", "content": f"client {i}"}]
            )
            results.append(r.choices[0].message.content or "")
        except BaseException as err:  # noqa: BLE001 - reported below
            failures.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for node in swarm["nodes"]:
            node.step_delay_s = 0.0
    assert not failures and results == [swarm["expected"]] * 8
    routes = [
        line
        for line in metric_lines(url(swarm["gateway"]), "swarm_gateway_route_sessions_total")
        if 'outcome="ok"' in line
    ]
    assert len(routes) == 2, routes
    assert all(n.state.opened > 0 for n in swarm["nodes"])
    wait_until(lambda: no_sessions_left(swarm), 5, "nodes to free every session")


def test_over_capacity_429_per_client_503_after_queue_wait_then_graceful_stop(swarm: dict) -> None:
    gateway = (
        swarm["supervisor"]
        .start_gateway(
            tracker_url=url(swarm["tracker"]),
            name="small-gateway",
            extra_args=[
                "--max-sessions",
                "1",
                "--max-queue",
                "1",
                "--max-sessions-per-client",
                "1",
                "--queue-timeout-s",
                "0.5",
            ],
        )
        .ready(60)
    )
    for node in swarm["nodes"]:
        announce(url(swarm["tracker"]), node.key, MODEL, node.start, node.end, node.port)
        node.step_delay_s = 0.1
    try:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        alice, bob = {"authorization": "Bearer alice"}, {"authorization": "Bearer bob"}
        with httpx.Client(base_url=url(gateway), timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body, headers=alice) as held:
                assert held.status_code == 200
                lines = held.iter_lines()  # keep a reference: a collected iterator closes the stream
                next(lines)
                r = http.post("/v1/chat/completions", json={**body, "stream": False}, headers=alice)
                assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
                r = http.post("/v1/chat/completions", json={**body, "stream": False}, headers=bob)
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "overloaded" and "0.5 s" in r.json()["error"]["message"]
            for node in swarm["nodes"]:
                node.step_delay_s = 0.0
            # The held stream's client went away: its slot frees once every stage confirmed the CANCEL.
            wait_until(lambda: http.get("/healthz").json()["sessions_active"] == 0, 10, "the slot to free")
            ok = http.post(
                "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2}, headers=bob
            )
            assert ok.status_code == 200, ok.text
            rejected = metric_lines(url(gateway), "swarm_gateway_rejections_total")
            assert any("overloaded" in line for line in rejected) and any(
                "rate_limit" in line for line in rejected
            )
    finally:
        for node in swarm["nodes"]:
            node.step_delay_s = 0.0
        code = gateway.stop()
    assert code == 0 and "gateway_stopped" in gateway.log_tail()
    wait_until(lambda: no_sessions_left(swarm), 10, "nodes to free every session")


def test_usage_reported_to_tracker(client: openai.OpenAI, swarm: dict) -> None:
    client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "count me"}], max_tokens=3
    )
    tracker = url(swarm["tracker"])

    def recorded() -> float:
        text = httpx.get(tracker + "/metrics", timeout=10).text
        values = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("swarm_tracker_usage_tokens_total")
        ]
        return sum(values)

    assert wait_until(recorded, 10, "the tracker to record usage") > 0
    assert json.loads(httpx.get(url(swarm["gateway"]) + "/healthz", timeout=10).text)["sessions_active"] == 0


def test_failure_mid_stream_recovers_on_the_other_route(client: openai.OpenAI, swarm: dict) -> None:
    FAILURES.update(left=1, after=4)  # one node error after 4 tokens: replayed elsewhere, the text is intact
    try:
        stream = client.chat.completions.create(
            model="fake-model", stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == swarm["expected"]
        assert FAILURES["left"] == 0
    finally:
        FAILURES.update(left=0)
    assert recovered(url(swarm["gateway"]))
    wait_until(lambda: no_sessions_left(swarm), 10, "every stage to free the failed and the replayed session")


def test_failure_mid_stream_that_persists_is_an_error_event(client: openai.OpenAI, swarm: dict) -> None:
    FAILURES.update(left=100, after=3)  # every route fails: after the recoveries, the client gets the error
    try:
        stream = client.chat.completions.create(
            model="fake-model", stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        texts: list[str] = []
        with pytest.raises(openai.APIError) as info:
            for chunk in stream:
                texts.append(chunk.choices[0].delta.content or "")
        assert info.value.message  # the error event names what stopped it (the node's error or no spare left)
        assert "".join(texts)  # the tokens before the failure were streamed
        with pytest.raises(openai.APIStatusError) as plain:
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
        assert plain.value.status_code in (502, 503), plain.value.body
    finally:
        FAILURES.update(left=0)
    wait_until(lambda: no_sessions_left(swarm), 10, "every stage to free the failed sessions")


def test_responses_and_ollama_text_and_failure_mid_stream(client: openai.OpenAI, swarm: dict) -> None:
    """The Responses and Ollama APIs carry the scripted text whole, and a failure that persists after the
    recoveries arrives in each API's own shape: ``error`` then ``response.failed``; an ``{"error"}`` line."""
    olla = ollama.Client(host=url(swarm["gateway"]), timeout=30)
    hi = [{"role": "user", "content": "hi"}]
    assert client.responses.create(model="fake-model", input="hi").output_text == swarm["expected"]
    assert olla.chat(model="fake-model", messages=hi).message.content == swarm["expected"]
    streamed = "".join(
        p.message.content or "" for p in olla.chat(model="fake-model", messages=hi, stream=True)
    )
    assert streamed == swarm["expected"]
    FAILURES.update(left=100, after=3)
    try:
        kinds, texts = [], []
        for event in client.responses.create(model="fake-model", input="hi", stream=True):
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                texts.append(event.delta)
            if event.type == "error":
                assert event.message and event.code
            if event.type == "response.failed":
                assert event.response.status == "failed" and event.response.error.message
        assert kinds[-2:] == ["error", "response.failed"] and "".join(texts)
        pieces: list[str] = []
        with pytest.raises(ollama.ResponseError) as info:
            for part in olla.chat(model="fake-model", messages=hi, stream=True):
                pieces.append(part.message.content or "")
        assert info.value.error and "".join(pieces)
    finally:
        FAILURES.update(left=0)
    wait_until(lambda: no_sessions_left(swarm), 10, "every stage to free the failed sessions")


def test_dead_node_before_open_moves_the_request_to_the_other_route(
    client: openai.OpenAI, swarm: dict
) -> None:
    """Last in the module: it stops a node for good. Concurrent requests reach both cached routes, so one of
    them meets the dead node at OPEN time and must be moved to a live route."""
    dead = swarm["nodes"][0]
    dead.stop()
    for node in swarm["nodes"]:
        node.step_delay_s = 0.01
    results: list[str] = []
    failures: list[BaseException] = []

    def one() -> None:
        try:
            r = client.chat.completions.create(
                model="fake-model", temperature=0, messages=[{"role": "user", "content": "hi"}]
            )
            results.append(r.choices[0].message.content or "")
        except BaseException as err:  # noqa: BLE001 - reported below
            failures.append(err)

    threads = [threading.Thread(target=one) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for node in swarm["nodes"]:
            node.step_delay_s = 0.0
    assert not failures and results == [swarm["expected"]] * 6
    failed = [
        line
        for line in metric_lines(url(swarm["gateway"]), "swarm_gateway_route_sessions_total")
        if 'outcome="open_failed"' in line
    ]
    assert failed and all(dead.node_id[:8] in line for line in failed), failed
