"""Process helpers for tests and demos: start services on port 0, learn their ports, stop them by pid.

Every wait has a deadline; every process is stopped (SIGTERM, then SIGKILL)
by its own pid in :meth:`Proc.stop`. Nothing here is used by the gateway at
run time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class StartError(RuntimeError):
    pass


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=timeout_s)


def _clean_env() -> dict[str, str]:
    """The caller's environment without service settings, so a stray SWARM_GATEWAY_* cannot change a test."""
    prefixes = ("SWARM_GATEWAY_", "SWARM_NODE_", "SWARM_TRACKER_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def start_process(
    name: str,
    argv: list[str],
    port_file: Path,
    log_dir: Path,
    *,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> Proc:
    """Run ``argv`` (which must write its bound port to ``port_file``), wait for the port, return it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    port_file.unlink(missing_ok=True)
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**_clean_env(), **(env or {})},
            start_new_session=True,
        )
    proc = Proc(name, popen, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise StartError(f"{name} exited with {popen.returncode}:\n{proc.log_tail()}")
        try:
            text = port_file.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit():
            proc.port = int(text)
            return proc
        time.sleep(0.05)
    proc.stop()
    raise StartError(f"{name} did not report a port within {timeout_s:g} s:\n{proc.log_tail()}")


def console_script(name: str) -> list[str]:
    """The console script next to this interpreter (``swarm-tracker``...), or ``python -m`` fallback."""
    candidate = Path(sys.executable).with_name(name)
    if candidate.exists():
        return [str(candidate)]
    module = {"swarm-tracker": "tracker.cli", "swarm-node": "node.cli", "swarm-gateway": "gateway.cli"}[name]
    return [sys.executable, "-m", module]


def start_tracker(tmp: Path, *, timeout_s: float = 60.0) -> Proc:
    port_file = tmp / "tracker.port"
    return start_process(
        "tracker",
        [
            *console_script("swarm-tracker"),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--db-url",
            f"sqlite:///{tmp / 'tracker.db'}",
            "--data-dir",
            str(tmp / "tracker-data"),
            "--no-zeroconf",
            "--log-level",
            "warning",
        ],
        port_file,
        tmp / "logs",
        timeout_s=timeout_s,
    )


def start_gateway(
    tmp: Path, tracker_url: str, *extra: str, timeout_s: float = 60.0, name: str = "gateway"
) -> Proc:
    port_file = tmp / f"{name}.port"
    return start_process(
        name,
        [
            *console_script("swarm-gateway"),
            "serve",
            "--tracker",
            tracker_url,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--data-dir",
            str(tmp / f"{name}-data"),
            *extra,
        ],
        port_file,
        tmp / "logs",
        timeout_s=timeout_s,
    )


def start_node(
    tmp: Path, name: str, model: Path, layers: str, tracker_url: str, *extra: str, timeout_s: float = 180.0
) -> Proc:
    port_file = tmp / f"{name}.port"
    return start_process(
        name,
        [
            *console_script("swarm-node"),
            "start",
            "--model",
            str(model),
            "--layers",
            layers,
            "--tracker",
            tracker_url,
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--threads",
            "1",
            *extra,
        ],
        port_file,
        tmp / "logs",
        timeout_s=timeout_s,
    )
