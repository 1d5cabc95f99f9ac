"""The swarm benchmark's bookkeeping: interleaving, summaries, ratios and gates (no processes started).

A tiny HTTP server on loopback stands in for a setup's OpenAI endpoint so the
driving code really streams SSE; what it measures is not asserted (timing).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sim import bench_swarm
from sim.bench_swarm import Setup, add_ratios, check_gates, run_interleaved

ORDER: list[str] = []


def _handler(name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ORDER.append(name)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(body["max_tokens"]):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def fake_setups() -> Iterator[list[Setup]]:
    servers = []
    setups = []
    for name in ("server:1", "swarm2"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(name))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        threads = 1 if name.startswith("server") else 2
        setups.append(
            Setup(
                name,
                f"http://127.0.0.1:{server.server_address[1]}/v1",
                "m",
                {},
                {"threads_total": threads},
                server.shutdown,
            )
        )
    ORDER.clear()
    yield setups
    for server in servers:
        server.shutdown()
        server.server_close()


def test_rounds_alternate_between_setups_and_every_request_is_counted(fake_setups: list[Setup]) -> None:
    out = run_interleaved(fake_setups, levels=[1, 2], rounds=3, max_tokens=5)
    warmups, driven = ORDER[:2], ORDER[2:]
    assert warmups == ["server:1", "swarm2"]
    # level 1: rounds start with server, swarm, server; level 2 (2 clients each) starts with swarm
    assert driven[:6] == ["server:1", "swarm2", "swarm2", "server:1", "server:1", "swarm2"]
    assert sorted(driven[6:]) == ["server:1"] * 6 + ["swarm2"] * 6
    assert driven[6:8] == ["swarm2", "swarm2"]
    for name in ("server:1", "swarm2"):
        levels = out[name]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        assert [lv["requests"] for lv in levels] == [3, 6]
        assert [lv["tokens"] for lv in levels] == [15, 30]


def test_ratios_use_the_baseline_with_the_same_threads_and_gates_fail_below_their_minimum() -> None:
    def level(agg: float, decode: float) -> dict:
        return {
            "concurrency": 1,
            "aggregate_tok_s": agg,
            "decode_tok_s_per_stream_p50": decode,
            "ttft_p50_s": 0.1,
        }

    report = {
        "cpu_count": 2,
        "setups": {
            "server:1": {"threads_total": 1, "levels": [level(40, 50)]},
            "server:2": {"threads_total": 2, "levels": [level(60, 80)]},
            "swarm2": {"threads_total": 2, "levels": [level(30, 40)]},
        },
    }
    add_ratios(report)
    swarm = report["setups"]["swarm2"]
    assert swarm["baseline"] == "server:2"
    (lv,) = swarm["levels"]
    assert lv["decode_ratio"] == pytest.approx(0.5) and lv["aggregate_ratio"] == pytest.approx(0.5)
    assert lv["vs"]["server:1"]["decode_ratio"] == pytest.approx(0.8)
    assert check_gates(report, ["swarm2.c1.decode_ratio=0.5"]) == []
    assert check_gates(report, ["swarm2.c1.decode_ratio=0.6"]) == ["swarm2.c1.decode_ratio = 0.500 < 0.6"]


def test_a_level_without_decode_figures_reports_nan_not_zero() -> None:
    empty = bench_swarm.summarize(1, [], 1.0)
    assert empty["requests"] == 0 and empty["aggregate_tok_s"] == 0
    assert math.isnan(empty["decode_tok_s_per_stream_p50"]) and math.isnan(empty["ttft_p50_s"])
    one = bench_swarm.summarize(1, [bench_swarm.RequestStats(0.1, 1.0, 1, None)], 1.0)
    assert one["tokens"] == 1 and math.isnan(one["decode_tok_s_per_stream_p50"])  # one token: no rate
