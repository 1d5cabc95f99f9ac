"""The CLI shell (common/cli.py) as an operator meets it: the real console scripts, run as subprocesses.

Start-up errors end with ONE line ``<prog>: error: <message>`` on stderr (no
traceback, no exception group) and exit 1 (2 for bad settings); Ctrl-C stops a
node that is still waiting for its tracker; SIGINT/SIGTERM stop a serving
service gracefully with exit 0; a second signal ends the process at once. The
last group runs the shell itself around small services written for the test.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.procs import Service, Supervisor, console_script, service_env

pytestmark = pytest.mark.slow


def run_cli(prog: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*console_script(prog), *args],
        env=service_env(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def shell_lines(stderr: str) -> list[str]:
    """What is on stderr besides the JSON log lines (and grpcio's own C-core log lines, ``E1201 ...``)."""
    out = []
    for line in stderr.splitlines():
        if not line.strip():
            continue
        try:
            json.loads(line)
            continue
        except ValueError:
            pass
        if len(line) > 5 and line[0] in "DIWEF" and line[1:5].isdigit():
            continue
        out.append(line)
    return out


def assert_one_line(done: subprocess.CompletedProcess[str], prog: str, code: int, *needles: str) -> str:
    lines = shell_lines(done.stderr)
    assert done.returncode == code, done.stderr[-3000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: error: "), lines
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr, done.stderr[-3000:]
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# ------------------------------------------------------------------------- start-up errors, one line


@pytest.mark.parametrize(
    ("prog", "args"),
    [
        ("swarm-tracker", ["--no-zeroconf"]),
        ("swarm-gateway", ["--tracker", "http://127.0.0.1:9", "--tracker-id", "ab" * 32]),
    ],
)
def test_http_port_in_use(tmp_path: Path, taken_port: int, prog: str, args: list[str]) -> None:
    serve = ["serve", "--host", "127.0.0.1", "--port", str(taken_port), "--data-dir", str(tmp_path)]
    done = run_cli(prog, *serve, *args)
    assert_one_line(done, prog, 1, "address already in use", f"HTTP on 127.0.0.1:{taken_port}")


def test_tracker_database_unreachable(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    done = run_cli(
        "swarm-tracker",
        "serve",
        "--port",
        "0",
        "--data-dir",
        str(tmp_path),
        "--no-zeroconf",
        "--db-url",
        f"postgresql+psycopg://swarm@127.0.0.1:{closed}/swarm",
    )
    assert_one_line(done, "swarm-tracker", 1, str(closed))


def test_gateway_finds_no_tracker(tmp_path: Path) -> None:
    done = run_cli(
        "swarm-gateway",
        "serve",
        "--port",
        "0",
        "--data-dir",
        str(tmp_path),
        "--tracker-id",
        "ab" * 32,
        env={"SWARM_GATEWAY_DISCOVERY_TIMEOUT_S": "0.5"},
    )
    assert_one_line(done, "swarm-gateway", 2, "no tracker_url given and none found")


def node_args(tmp_path: Path, model: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "start",
        "--model",
        str(model),
        "--layers",
        "0:10",
        "--host",
        "127.0.0.1",
        "--admin-port",
        "-1",
        "--threads",
        "1",
        "--no-benchmark",
        "--data-dir",
        str(tmp_path / "node"),
        "--cache-dir",
        str(cache),
        *extra,
    ]


def test_node_grpc_port_in_use(tmp_path: Path, model_path: Path, node_cache: Path, taken_port: int) -> None:
    args = node_args(tmp_path, model_path, node_cache, "--no-tracker", "--insecure-no-tickets")
    done = run_cli("swarm-node", *args, "--port", str(taken_port))
    assert_one_line(done, "swarm-node", 1, str(taken_port))


def test_node_model_file_missing(tmp_path: Path, node_cache: Path) -> None:
    args = node_args(tmp_path, tmp_path / "missing.gguf", node_cache, "--no-tracker", "--insecure-no-tickets")
    done = run_cli("swarm-node", *args)
    assert_one_line(done, "swarm-node", 1, "missing.gguf")


def test_node_key_file_readable_by_others(tmp_path: Path, model_path: Path, node_cache: Path) -> None:
    key = tmp_path / "node" / "node.key"
    key.parent.mkdir(mode=0o700)
    key.write_text(secrets.token_hex(32))
    key.chmod(0o644)
    args = node_args(tmp_path, model_path, node_cache, "--no-tracker", "--insecure-no-tickets")
    done = run_cli("swarm-node", *args)
    assert_one_line(done, "swarm-node", 1, str(key))


def test_node_status_of_an_unreachable_node() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    done = run_cli("swarm-node", "status", "--address", f"127.0.0.1:{closed}", "--timeout-s", "5")
    assert_one_line(done, "swarm-node", 1, "UNAVAILABLE", str(closed))


@pytest.mark.parametrize(
    ("prog", "args", "env", "needle"),
    [
        ("swarm-node", ["start", "--max-sessions", "0"], {}, "max_sessions"),
        ("swarm-node", ["start"], {"SWARM_NODE_MAX_SESIONS": "3"}, "SWARM_NODE_MAX_SESIONS"),
        ("swarm-tracker", ["serve", "--heartbeat-timeout-s", "-1"], {}, "heartbeat_timeout_s"),
        ("swarm-gateway", ["serve", "--max-sessions", "0"], {}, "max_sessions must be >= 1"),
        ("swarm-gateway", ["serve", "--tracker", "localhost:7460"], {}, "http://"),
        ("swarm-gateway", ["serve"], {"SWARM_GATEWAY_MAX_SESIONS": "3"}, "SWARM_GATEWAY_MAX_SESIONS"),
        ("swarm-gateway", ["serve", "--tracker", "http://127.0.0.1:9"], {}, "tracker_id is not set"),
        ("swarm-gateway", ["serve", "--tracker-id", "AB" * 32], {}, "tracker_id must be 64 lowercase hex"),
    ],
)
def test_bad_settings_exit_2(
    tmp_path: Path, prog: str, args: list[str], env: dict[str, str], needle: str
) -> None:
    done = run_cli(prog, *args, "--data-dir", str(tmp_path), env=env)
    assert_one_line(done, prog, 2, needle)


def test_node_without_a_model_is_a_settings_error(tmp_path: Path) -> None:
    args = ["start", "--layers", "0:5", "--no-tracker", "--insecure-no-tickets", "--data-dir", str(tmp_path)]
    done = run_cli("swarm-node", *args)
    assert_one_line(done, "swarm-node", 2, "model is required")


# ------------------------------------------------------------------------- signals on the real services


def wait_log(svc: Service, needle: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while needle not in svc.log_text():
        assert svc.alive(), svc.log_tail()
        assert time.monotonic() < deadline, f"no {needle!r} in {svc.name}'s log:\n{svc.log_tail()}"
        time.sleep(0.05)


@pytest.mark.parametrize("waiting", ["zeroconf", "unreachable"])
def test_ctrl_c_while_the_node_waits_for_its_tracker(
    tmp_path: Path, model_path: Path, node_cache: Path, waiting: str
) -> None:
    """Discovery finds no tracker (one pinned to an id nobody has), or ``--layers auto`` asks a tracker
    that is not there: the node keeps trying; one SIGINT ends it, cleanly."""
    with Supervisor(tmp_path) as sup:
        if waiting == "zeroconf":
            extra = ["--tracker-id", secrets.token_hex(32)]
            marker = '"event":"node_identity"'
        else:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                closed = sock.getsockname()[1]
            extra = ["--tracker", f"http://127.0.0.1:{closed}", "--layers", "auto"]
            marker = '"event":"tracker_unreachable"'
        argv = [*console_script("swarm-node"), *node_args(tmp_path, model_path, node_cache, *extra)]
        waiter = sup.spawn("waiting-node", argv)
        wait_log(waiter, marker, 120)
        time.sleep(0.5)  # inside the discovery / retry wait by now
        waiter.signal(signal.SIGINT)
        assert waiter.wait(20) == 0, waiter.log_tail()
        assert '"event":"stopping"' in waiter.log_text()
        assert "Traceback" not in waiter.log_text()


def test_sigint_stops_a_serving_gateway_and_tracker_gracefully(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as sup:
        tracker = sup.start_tracker().ready(60)
        gateway = sup.start_gateway(tracker_url=tracker.url).ready(60)
        for svc, stopped in ((gateway, "gateway_stopped"), (tracker, "tracker_stopped")):
            svc.signal(signal.SIGINT)
            assert svc.wait(30) == 0, svc.log_tail()
            assert f'"event":"{stopped}"' in svc.log_text()
            assert shell_lines(svc.log_text()) == [], svc.log_tail()


# ------------------------------------------------------------------------- the shell around test services

SERVICE = """
import sys, time, trio
from common import logs
from common.cli import run_service

logs.configure("info")
behaviour = sys.argv[1]

async def main(shutdown, *, task_status):
    if behaviour == "crash-at-start":
        1 / 0
    task_status.started()
    print("started", file=sys.stderr, flush=True)
    if behaviour == "return":
        return
    await shutdown.wait()
    if behaviour == "busy":
        time.sleep(60)  # the trio thread is stuck (as in a long call into C)
    elif behaviour == "ignore":
        await trio.sleep_forever()

run_service("test-service", main, grace_s=0.5)
"""


def start_test_service(sup: Supervisor, behaviour: str) -> Service:
    return sup.spawn(behaviour, [sys.executable, "-c", textwrap.dedent(SERVICE), behaviour])


def test_service_that_returns_exits_0(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as sup:
        svc = start_test_service(sup, "return")
        assert svc.wait(30) == 0, svc.log_tail()


def test_second_signal_ends_the_process_at_once_even_while_the_trio_thread_is_busy(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as sup:
        svc = start_test_service(sup, "busy")
        wait_log(svc, "started", 30)
        svc.signal(signal.SIGTERM)
        wait_log(svc, '"event":"stopping"', 10)
        time.sleep(0.2)
        svc.signal(signal.SIGINT)
        assert svc.wait(10) == -signal.SIGINT


def test_service_that_does_not_drain_is_cancelled_after_the_grace_period(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as sup:
        svc = start_test_service(sup, "ignore")
        wait_log(svc, "started", 30)
        svc.signal(signal.SIGTERM)
        assert svc.wait(30) == 1
        assert shell_lines(svc.log_text()) == [
            "started",
            "test-service: error: did not stop within 5.5 s of the signal; cancelled",
        ]


def test_unexpected_error_is_one_line_with_the_traceback_in_the_log(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as sup:
        svc = start_test_service(sup, "crash-at-start")
        assert svc.wait(30) == 1
        text = svc.log_text()
        assert shell_lines(text) == [
            "test-service: error: internal error: ZeroDivisionError: division by zero"
            " (traceback in the log above)"
        ]
        logged = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert any("ZeroDivisionError" in entry.get("exception", "") for entry in logged)
