"""The gateway under attack (issue "hardening against a hostile internet"), on a real swarm.

One swarm for the module: a tracker, two SmolLM2 nodes ([0,15) and [15,30), one
llama.cpp thread each, 8 KV slots each) and a gateway, all real processes on
loopback; clients are the official ``openai`` client, ``httpx`` and raw sockets.
Every attack runs while a legitimate client keeps getting the correct text (the
greedy answer computed on the intact swarm first). In file order:

1. bad input that used to give 500 (nested JSON, lone surrogates, wrong types)
   gets 400 with an ``X-Request-Id``; garbage on the socket writes no traceback;
2. a relay message over the documented size closes the socket (1009);
3. API keys on a second gateway (started with a key file and no anonymous
   access, its first tracker URL dead): 401 without or with a wrong key, the
   per-key limits (sessions at once, tokens per minute, max_tokens) as 429/400
   with ``Retry-After``, revocation taking effect on the running gateway, and
   no key material in ``/metrics``;
4. 8 streaming clients that never read hold every slot of both stages; a
   client meanwhile gets a 503 naming no node or address; the non-readers
   lose their sessions and connections after ``client_stall_s`` (KV freed on
   every stage) and the client then gets the right text;
5. the tracker killed for ``SWARM_TEST_OUTAGE_S`` (60 s, the issue's minute):
   every request meanwhile succeeds from the cached routes and tickets; the
   tracker back on its port, the gateway refreshes its routes from it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from sim.launcher import LocalSwarm, start_local_swarm
from sim.procs import wait_http
from tests.e2e.swarm_helpers import live_nodes

pytestmark = pytest.mark.slow

QUESTION = "Name three colors."
N_NEW = 12
STALL_S = 5.0
OUTAGE_S = float(os.environ.get("SWARM_TEST_OUTAGE_S", "60"))
NODE_SLOTS = 8  # start_local_swarm's --max-sessions per node


def metric(base: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    key = f"{name}{{{want}}}" if labels else name
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(key + " "):
            total += float(line.split()[-1])
    return total


def node_status(node) -> dict:  # type: ignore[no-untyped-def]
    return httpx.get(f"http://127.0.0.1:{node.admin_port}/status", timeout=10).json()


@pytest.fixture(scope="module")
def swarm(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, node_cache: Path
) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("attacks"),
        model=model_path,
        n_nodes=2,
        layers=["0:15", "15:30"],
        node_cache=node_cache,
        gateway_args=[
            *("--client-stall-s", str(STALL_S), "--client-send-buffer-bytes", "16384"),
            *("--max-sessions", "16", "--route-ttl-s", "2"),
            *("--check-fraction", "0", "--probation-checks", "0", "--kv-keep-s", "0"),
            # With every slot taken the nodes announce no free KV: a request waits for KV at most 1 s,
            # then 503 kv_exhausted (the refusal the non-reader test expects, not a wait for them).
            *("--kv-wait-s", "1"),
        ],
        node_args=["--no-benchmark"],
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(swarm: LocalSwarm) -> str:
    return swarm.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(swarm: LocalSwarm) -> openai.OpenAI:
    # This gateway has no key file: every request is anonymous, whatever token it carries.
    return openai.OpenAI(base_url=swarm.base_url, api_key="anonymous", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, model: str, **extra: object) -> str:
    params: dict = {"max_tokens": N_NEW, "temperature": 0, **extra}
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], **params
    )
    return out.choices[0].message.content or ""


@pytest.fixture(scope="module")
def expected(swarm: LocalSwarm, client: openai.OpenAI) -> str:
    text = ask(client, swarm.model_name)
    assert text
    return text


def internal_names(swarm: LocalSwarm) -> list[str]:
    """What a client must never read: node ids (short and long) and the nodes' host:port."""
    names: list[str] = []
    for n in httpx.get(swarm.tracker_url + "/v1/swarm", timeout=10).json()["nodes"]:
        names += [n["node_id"], n["node_id"][:8]]
    names += [f":{node.port}" for node in swarm.nodes]
    return names


# --------------------------------------------------------------------------- 1. bad input


def test_bad_input_is_a_400_with_a_request_id_and_writes_no_traceback(
    swarm: LocalSwarm, base: str, client: openai.OpenAI, expected: str
) -> None:
    url = base + "/v1/chat/completions"
    bodies = {
        "nested": b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "nested_within_json_limit": b'{"model": "m", "messages": ' + b"[" * 200 + b"]" * 200 + b"}",
        "lone_surrogate": b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
        "surrogate_key": b'{"model": "m", "\\udfff": 1, "messages": []}',
        "messages_not_list": b'{"model": "m", "messages": {"role": "user"}}',
        "content_number": b'{"model": "m", "messages": [{"role": "user", "content": 5}]}',
        "stop_dict": b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": {"a": 1}}',
        "body_not_object": b"[1, 2, 3]",
        "invalid_utf8": b'{"model": "\xff\xfe"}',
    }
    for name, body in bodies.items():
        resp = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert resp.status_code == 400, (name, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert resp.headers.get("x-request-id"), name
    # Garbage on the socket: the connection is refused, the gateway writes no traceback about it.
    for garbage in (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
        b"GET / HTTP/9.9\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", swarm.gateway.port), timeout=10) as sock:
            sock.sendall(garbage)
            sock.settimeout(10)
            try:
                sock.recv(4096)
            except OSError:
                pass
    time.sleep(0.5)
    assert "Traceback" not in swarm.gateway.log_text()
    assert ask(client, swarm.model_name) == expected


# --------------------------------------------------------------------------- 2. relay size


def test_relay_messages_over_the_documented_size_close_the_socket(swarm: LocalSwarm, base: str) -> None:
    url = base.replace("http://", "ws://") + "/v1/relay"

    async def send(size: int) -> str:
        async with open_websocket_url(url, max_message_size=1 << 20) as ws:
            await ws.get_message()  # the challenge
            try:
                await ws.send_message("x" * size)
                with trio.fail_after(20):
                    reply = await ws.get_message()
            except ConnectionClosed as closed:
                return f"closed {closed.reason.code if closed.reason else None}"
            return f"reply {str(reply)[:60]}"

    # A hello over 256 KiB but under the message limit is read and refused by the handshake.
    assert trio.run(send, 1024 * 1024).startswith("reply")
    # 5 MiB: over max_frame_bytes (4 MiB) + 64 KiB: hypercorn closes with 1009 before the app sees it.
    assert trio.run(send, 5 * 1024 * 1024) == "closed 1009"


# --------------------------------------------------------------------------- 3. API keys


def keys_cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_api_keys_and_per_key_quotas(swarm: LocalSwarm, expected: str, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.jsonl"
    alice = keys_cli(
        "add", "--keys-file", str(keys_file), "--name", "alice", "--max-sessions", "1", "--max-tokens", "16"
    )
    bob = keys_cli("add", "--keys-file", str(keys_file), "--name", "bob", "--tokens-per-minute", "60")
    assert alice.startswith("sk-swarm-") and alice not in keys_file.read_text()
    assert "alice" in keys_cli("list", "--keys-file", str(keys_file))
    # A second gateway whose first tracker URL is dead: it fails over to the second.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    gw = swarm.supervisor.start_gateway(
        name="gateway_keys",
        tracker_url=f"{dead_url},{swarm.tracker_url}",
        extra_args=[
            *("--api-keys-file", str(keys_file), "--no-anonymous"),
            *("--check-fraction", "0", "--probation-checks", "0", "--kv-keep-s", "0"),
        ],
    )
    gw.wait_port(120)
    gw_base = f"http://127.0.0.1:{gw.port}"
    wait_http(gw, gw_base + "/healthz", 120)

    def as_(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=gw_base + "/v1", api_key=key, max_retries=0, timeout=120)

    missing = httpx.post(
        gw_base + "/v1/chat/completions",
        json={"model": swarm.model_name, "messages": [{"role": "user", "content": QUESTION}]},
        timeout=30,
    )
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    assert missing.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(openai.AuthenticationError) as wrong:
        ask(as_(alice + "x"), swarm.model_name)
    assert wrong.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    assert httpx.get(gw_base + "/v1/models", timeout=30).status_code == 401

    assert ask(as_(alice), swarm.model_name) == expected  # through the second tracker URL
    with pytest.raises(openai.BadRequestError) as too_many:
        ask(as_(alice), swarm.model_name, max_tokens=17)
    assert too_many.value.body["param"] == "max_tokens"  # type: ignore[index]

    # One session at once for alice: a second stream while the first runs is a 429 with Retry-After.
    stream = as_(alice).chat.completions.create(
        model=swarm.model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as busy:
        ask(as_(alice), swarm.model_name)
    assert int(busy.value.response.headers["retry-after"]) >= 1
    stream.close()

    # Bob: 60 tokens per minute; a request of ~40 tokens leaves the bucket near zero, the next
    # overdraws it, and the one after that waits for the refill.
    refusals = []
    for _ in range(4):
        try:
            assert ask(as_(bob), swarm.model_name) == expected
        except openai.RateLimitError as err:
            refusals.append(int(err.response.headers["retry-after"]))
    assert refusals and all(1 <= r <= 60 for r in refusals), refusals

    # Revoked: refused by the running gateway within seconds.
    keys_cli("revoke", "--keys-file", str(keys_file), "alice")
    deadline = time.monotonic() + 30
    while True:
        try:
            ask(as_(alice), swarm.model_name, max_tokens=1)
        except openai.AuthenticationError:
            break
        assert time.monotonic() < deadline, "a revoked key was still accepted after 30 s"
        time.sleep(0.5)

    text = httpx.get(gw_base + "/metrics", timeout=10).text
    ids = [line.split()[0] for line in keys_cli("list", "--keys-file", str(keys_file)).splitlines()]
    assert ids and alice not in text and bob not in text and not any(i in text for i in ids)
    assert metric(gw_base, "swarm_gateway_auth_total", outcome="invalid_api_key") >= 2
    assert metric(gw_base, "swarm_gateway_quota_rejections_total", limit="sessions") >= 1
    assert metric(gw_base, "swarm_gateway_quota_rejections_total", limit="tokens_per_minute") >= 1
    log = gw.log_text()
    assert alice not in log and bob not in log
    gw.stop()


# --------------------------------------------------------------------------- 4. non-reading clients


def open_non_reader(port: int, model: str) -> socket.socket:
    """A streaming request whose client never reads: long output (end of generation banned), wide
    chunks (20 logprobs per token), a small receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "max_tokens": 1000,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
            "logit_bias": {"0": -100, "1": -100, "2": -100},
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def test_clients_that_stop_reading_lose_their_sessions(
    swarm: LocalSwarm, base: str, client: openai.OpenAI, expected: str
) -> None:
    # A non-reader is cut by whichever notices first: the kernel (TCP_USER_TIMEOUT closes the
    # connection: counted as a disconnect) or the gateway (its events waited client_stall_s: a stall).
    def cut() -> float:
        return metric(base, "swarm_gateway_client_stalls_total") + metric(
            base, "swarm_gateway_client_disconnects_total"
        )

    cut_before = cut()
    sockets = [open_non_reader(swarm.gateway.port, swarm.model_name) for _ in range(NODE_SLOTS)]
    try:
        t0 = time.monotonic()
        while min(node_status(n)["sessions"] for n in swarm.nodes) < NODE_SLOTS:
            assert time.monotonic() - t0 < 120, [node_status(n) for n in swarm.nodes]
            time.sleep(0.1)
        held_at = time.monotonic()
        # Every slot of both stages is taken: a client is refused, in words that name no node.
        with pytest.raises(openai.APIStatusError) as full:
            ask(client, swarm.model_name)
        assert full.value.status_code == 503
        message = str(full.value.body)
        assert "request id" in message
        for name in internal_names(swarm):
            assert name not in message, (name, message)
        # The non-readers lose their sessions; both stages free the KV.
        while any(node_status(n)["sessions"] for n in swarm.nodes):
            assert time.monotonic() - held_at < 150, [node_status(n) for n in swarm.nodes]
            time.sleep(0.2)
        freed_s = time.monotonic() - held_at
        assert [node_status(n)["kv_tokens_used"] for n in swarm.nodes] == [0, 0]
        assert cut() == cut_before + NODE_SLOTS
        print(f"\n8 non-reading clients held every slot for {freed_s:.1f} s (client_stall_s {STALL_S:g})")
        assert ask(client, swarm.model_name) == expected
        # Their connections are gone too (TCP_USER_TIMEOUT = client_stall_s: the kernel closes a
        # connection whose window stayed shut): what was buffered drains, then EOF or a reset.
        for sock in sockets:
            sock.settimeout(30)
            received = b""
            try:
                while chunk := sock.recv(65536):
                    received += chunk
            except ConnectionResetError:
                pass
            assert b"data: [DONE]" not in received
        assert "Traceback" not in swarm.gateway.log_text()
    finally:
        for sock in sockets:
            sock.close()


# --------------------------------------------------------------------------- 5. tracker outage


def test_tracker_down_for_a_minute_requests_keep_succeeding_then_routes_refresh(
    swarm: LocalSwarm, base: str, client: openai.OpenAI, expected: str
) -> None:
    port = swarm.tracker.port
    assert ask(client, swarm.model_name) == expected  # routes and tickets are fresh
    swarm.tracker.kill()
    down_at = time.monotonic()
    done: list[float] = []
    failures: list[str] = []
    while time.monotonic() - down_at < OUTAGE_S:
        try:
            text = ask(client, swarm.model_name)
            (done if text == expected else failures).append(time.monotonic() - down_at)
        except openai.APIError as err:
            failures.append(repr(err))
        time.sleep(2.0)
    assert not failures, failures
    assert done and done[-1] > OUTAGE_S - 10, done
    assert metric(base, "swarm_gateway_tracker_route_requests_total", outcome="stale") >= 1
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 200  # the last list
    print(f"\ntracker down {OUTAGE_S:g} s: {len(done)} requests, all correct")

    # Back on the same port (same database): the gateway asks it again and takes fresh routes.
    tracker = swarm.supervisor.start_tracker(port=port)
    tracker.wait_port(60)
    wait_http(tracker, f"http://127.0.0.1:{port}/healthz", 60)
    swarm.tracker = tracker
    # A tracker that was down longer than its heartbeat timeout expires the nodes it has not heard
    # from yet right after it starts; they re-announce at their next heartbeat. Meanwhile its answer
    # "no complete route" is the truth the gateway passes on (a 503 no_route, never another error).
    ok_before = metric(base, "swarm_gateway_tracker_route_requests_total", outcome="ok")
    deadline = time.monotonic() + 120
    no_route = 0
    while True:
        assert time.monotonic() < deadline, swarm.gateway.log_tail()
        try:
            text = ask(client, swarm.model_name)
        except openai.InternalServerError as err:
            assert err.status_code == 503 and err.body["code"] == "no_route", err  # type: ignore[index]
            no_route += 1
            time.sleep(1.0)
            continue
        assert text == expected
        if metric(base, "swarm_gateway_tracker_route_requests_total", outcome="ok") > ok_before:
            break
        time.sleep(1.0)
    assert len(live_nodes(swarm.tracker_url)) == len(swarm.nodes)
    assert ask(client, swarm.model_name) == expected
    assert re.search(r'"routes_refreshed"', swarm.gateway.log_text())
    print(f"tracker back: routes refreshed ({no_route} no_route answers while the nodes re-announced)")
