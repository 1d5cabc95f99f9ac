"""Start a real tracker and real ``swarm-node start`` processes on loopback for tests and benchmarks.

Every process binds port 0 and reports its port through a port file; every
process is stopped by its pid (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    ports: dict[str, int] = field(default_factory=dict)
    port_files: tuple[Path, Path] = (Path(), Path())

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return int(self.popen.returncode)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARM_NODE_", "SWARM_TRACKER_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _wait_port(proc: Proc, path: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text().strip()
            if text:
                return int(text)
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()}")
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} did not report its port within {timeout_s} s:\n{proc.log()}")


def start_tracker(workdir: Path, *, timeout_s: float = 60.0) -> Proc:
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "tracker.port"
    log_path = workdir / "tracker.log"
    cmd = [
        sys.executable,
        "-m",
        "tracker.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--data-dir",
        str(workdir / "tracker-data"),
        "--db-url",
        f"sqlite:///{workdir / 'tracker.sqlite3'}",
        "--no-zeroconf",
    ]
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    proc = Proc("tracker", popen, log_path)
    proc.ports["http"] = _wait_port(proc, port_file, timeout_s)
    return proc


def start_node(
    workdir: Path,
    name: str,
    model: Path,
    layers: str,
    *,
    tracker_url: str | None,
    cache_dir: Path,
    extra: list[str] | None = None,
    timeout_s: float = 180.0,
    wait: bool = True,
) -> Proc:
    workdir.mkdir(parents=True, exist_ok=True)
    port_file, admin_file = workdir / f"{name}.port", workdir / f"{name}.admin"
    log_path = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "node.cli",
        "start",
        "--model",
        str(model),
        "--layers",
        layers,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--admin-port",
        "0",
        "--admin-port-file",
        str(admin_file),
        "--threads",
        "1",
        "--heartbeat-interval-s",
        "1",
        "--max-sessions",
        "6",
        "--session-kv-tokens",
        "512",
        "--batch-tokens",
        "256",
        "--data-dir",
        str(workdir / f"{name}-data"),
        "--cache-dir",
        str(cache_dir),
    ]
    cmd += ["--tracker", tracker_url] if tracker_url else ["--no-tracker", "--insecure-no-tickets"]
    cmd += extra or []
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    proc = Proc(name, popen, log_path)
    proc.port_files = (port_file, admin_file)
    if wait:
        wait_node(proc, timeout_s)
    return proc


def wait_node(proc: Proc, timeout_s: float = 180.0) -> Proc:
    grpc_file, admin_file = proc.port_files
    proc.ports["grpc"] = _wait_port(proc, grpc_file, timeout_s)
    proc.ports["admin"] = _wait_port(proc, admin_file, 30)
    return proc


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 10.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def wait_for_route(tracker_url: str, model: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            status, body = http_json(f"{tracker_url}/v1/routes", {"model": model, "k": 1})
        except OSError as err:
            status, body = 0, repr(err)
        if status == 200 and body["routes"]:
            return dict(body)
        last = (status, body)
        time.sleep(0.2)
    raise RuntimeError(f"no route for {model} within {timeout_s} s: {last}")
