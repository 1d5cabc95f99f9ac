"""bench_swarm's stress mode and capacity probe, against a loopback stand-in for the gateway that
admits at most K requests at once (more get 503) and answers each request after a delay that grows
with the number in flight. What is asserted is the bookkeeping (where the ramp stops, rates, gates),
not timings, except where the stand-in's delays are made unmistakable."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sim.bench_swarm import ramp_gates, run_ramp


class FakeGateway:
    def __init__(self, admit: int, delay_per_inflight_s: float, broken_every: int = 0) -> None:
        self.admit = admit
        self.delay = delay_per_inflight_s
        self.broken_every = broken_every
        self.inflight = 0
        self.seen = 0
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        gw = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with gw.lock:
                    gw.seen += 1
                    broken = gw.broken_every and gw.seen % gw.broken_every == 0
                    refuse = gw.inflight >= gw.admit
                    if not refuse:
                        gw.inflight += 1
                    inflight = gw.inflight
                if refuse or broken:
                    status = 503 if refuse else 500
                    payload = b'{"error": {"message": "busy"}}'
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    if not refuse:
                        with gw.lock:
                            gw.inflight -= 1
                    return
                released = False
                try:
                    time.sleep(gw.delay * inflight)
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for i in range(body["max_tokens"]):
                        chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    # Free the slot before the client can see the end (and send its next request).
                    with gw.lock:
                        gw.inflight -= 1
                    released = True
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.close_connection = True
                finally:
                    if not released:
                        with gw.lock:
                            gw.inflight -= 1

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def gateway(request: pytest.FixtureRequest) -> Iterator[tuple[str, FakeGateway]]:
    admit, delay, broken = request.param
    fake = FakeGateway(admit, delay, broken)
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", fake
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("gateway", [(3, 0.05, 0)], indirect=True)
def test_stress_stops_where_refusals_pass_the_threshold(gateway: tuple[str, FakeGateway]) -> None:
    url, _ = gateway
    ramp = run_ramp(
        url,
        "m",
        [1, 2, 3, 8, 16],
        mode="stress",
        requests_per_client=2,
        max_tokens=3,
        refusal_threshold=0.05,
        ttft_slo_s=10.0,
        say=lambda _: None,
    )
    assert [r["concurrency"] for r in ramp["levels"]] == [1, 2, 3, 8]
    assert ramp["stopped_at"] == 8
    assert all(r["refusal_rate"] == 0 for r in ramp["levels"][:3])
    assert ramp["levels"][3]["refused"] > 0 and ramp["error_rate"] == 0
    assert ramp["capacity"] == 3
    assert (
        ramp_gates(ramp, max_error_rate=0.0, max_ttft_p95_s=None, gate_concurrency=None, min_capacity=3) == []
    )


@pytest.mark.parametrize("gateway", [(64, 0.15, 0)], indirect=True)
def test_capacity_is_the_last_level_within_the_ttft_slo(gateway: tuple[str, FakeGateway]) -> None:
    url, _ = gateway
    # TTFT grows by 0.15 s per request in flight: 1 and 2 clients stay under 0.5 s, 8 cannot.
    ramp = run_ramp(
        url,
        "m",
        [1, 2, 8, 16],
        mode="capacity",
        requests_per_client=1,
        max_tokens=2,
        refusal_threshold=0.05,
        ttft_slo_s=0.5,
        say=lambda _: None,
    )
    assert ramp["stopped_at"] == 8 and [r["concurrency"] for r in ramp["levels"]] == [1, 2, 8]
    assert ramp["capacity"] == 2
    failures = ramp_gates(ramp, max_error_rate=None, max_ttft_p95_s=0.5, gate_concurrency=8, min_capacity=4)
    assert len(failures) == 2 and "c=8" in failures[0] and "capacity 2 < 4" in failures[1]


@pytest.mark.parametrize("gateway", [(64, 0.0, 3)], indirect=True)
def test_errors_are_counted_apart_from_refusals_and_gate_the_run(gateway: tuple[str, FakeGateway]) -> None:
    url, _ = gateway
    ramp = run_ramp(
        url,
        "m",
        [1, 3],
        mode="stress",
        requests_per_client=3,
        max_tokens=2,
        refusal_threshold=0.05,
        ttft_slo_s=10.0,
        say=lambda _: None,
    )
    assert ramp["refusal_rate"] == 0 and ramp["stopped_at"] is None
    assert ramp["error_rate"] == pytest.approx(4 / 12)  # every third request answers 500
    (failure,) = ramp_gates(
        ramp, max_error_rate=0.01, max_ttft_p95_s=None, gate_concurrency=None, min_capacity=None
    )
    assert failure.startswith("error rate 0.333")
