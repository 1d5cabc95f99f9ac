"""Start and stop the swarm's services as real processes on loopback.

Used by ``swarm-sim up``, the end-to-end tests and the benchmarks. Every
service binds port 0 and writes the port it got to a file; readiness is read
from the services' own health endpoints, never guessed with sleeps. Every wait
is bounded, and every process started here is stopped by its own pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class LaunchError(RuntimeError):
    pass


def _script(name: str) -> list[str]:
    """The console script next to this interpreter (works inside a venv without activating it)."""
    local = Path(sys.executable).with_name(name)
    if local.exists():
        return [str(local)]
    found = shutil.which(name)
    if found:
        return [found]
    module = {"swarm-node": "node.cli", "swarm-tracker": "tracker.cli", "swarm-gateway": "gateway.cli"}[name]
    return [sys.executable, "-m", module]


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log_path: Path
    port_file: Path
    port: int = 0
    admin_port_file: Path | None = None
    admin_port: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_port(self, timeout_s: float) -> int:
        self.port = _wait_port_file(self, self.port_file, timeout_s)
        if self.admin_port_file is not None:
            self.admin_port = _wait_port_file(self, self.admin_port_file, timeout_s)
        return self.port

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL: the node vanishes the way a volunteer's machine does."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def _wait_port_file(svc: Service, path: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not svc.alive():
            raise LaunchError(f"{svc.name} exited with code {svc.proc.returncode}:\n{svc.log_tail()}")
        try:
            text = path.read_text().strip()
            if text:
                return int(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise LaunchError(f"{svc.name} did not report its port within {timeout_s:.0f} s:\n{svc.log_tail()}")


def wait_http(svc: Service, url: str, timeout_s: float, ok=lambda r: r.status_code == 200) -> httpx.Response:
    """Poll ``url`` until ``ok(response)``; fail early if the process dies."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not svc.alive():
            raise LaunchError(f"{svc.name} exited with code {svc.proc.returncode}:\n{svc.log_tail()}")
        try:
            resp = httpx.get(url, timeout=2.0)
            if ok(resp):
                return resp
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as err:
            last = str(err)
        time.sleep(0.1)
    raise LaunchError(f"{svc.name}: {url} not ready within {timeout_s:.0f} s ({last}):\n{svc.log_tail()}")


class Supervisor:
    """Owns the processes of one local swarm; stops them all, newest first."""

    def __init__(
        self,
        workdir: Path,
        *,
        quiet_llama: bool = True,
        place: Callable[[str, list[str]], list[str]] | None = None,
    ) -> None:
        """``place(name, argv)`` may wrap each service's command line to run it elsewhere
        (the emulated WAN runs each service inside its own network namespace)."""
        self.place = place
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self.services: list[Service] = []
        self.quiet_llama = quiet_llama

    def _spawn(
        self, name: str, argv: list[str], port_file: Path, admin_port_file: Path | None = None
    ) -> Service:
        for f in (port_file, admin_port_file):
            if f is not None and f.exists():
                f.unlink()
        log_path = self.workdir / "logs" / f"{name}.log"
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.place is not None:
            argv = self.place(name, argv)
        fh = open(log_path, "ab")
        try:
            proc = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        finally:
            fh.close()
        svc = Service(name, proc, log_path, port_file, admin_port_file=admin_port_file)
        self.services.append(svc)
        return svc

    def start_tracker(
        self,
        *,
        db_url: str | None = None,
        heartbeat_timeout_s: float | None = None,
        port: int = 0,
        name: str = "tracker",
        host: str = "127.0.0.1",
    ) -> Service:
        """A tracker; ``port`` lets a restarted tracker come back where its nodes look for it."""
        data = self.workdir / "tracker"
        data.mkdir(exist_ok=True)
        argv = _script("swarm-tracker") + [
            "serve",
            "--host",
            host,
            "--port",
            str(port),
            "--port-file",
            str(data / "port"),
            "--data-dir",
            str(data),
            "--no-zeroconf",
            "--db-url",
            db_url or f"sqlite:///{data / 'tracker.db'}",
        ]
        if heartbeat_timeout_s is not None:
            argv += ["--heartbeat-timeout-s", str(heartbeat_timeout_s)]
        return self._spawn(name, argv, data / "port")

    def start_node(
        self,
        name: str,
        *,
        model: Path,
        layers: str,
        tracker_url: str,
        threads: int = 1,
        capacity_layers: int | None = None,
        max_sessions: int = 8,
        session_kv_tokens: int = 2048,
        cache_dir: Path | None = None,
        extra_args: list[str] | None = None,
        host: str = "127.0.0.1",
    ) -> Service:
        """A node listening on and announcing ``host``; its admin server stays on its own 127.0.0.1."""
        data = self.workdir / name
        data.mkdir(exist_ok=True)
        argv = _script("swarm-node") + [
            "start",
            "--model",
            str(model),
            "--layers",
            layers,
            "--tracker",
            tracker_url,
            "--host",
            host,
            "--advertise-host",
            host,
            "--port",
            "0",
            "--port-file",
            str(data / "port"),
            "--admin-port",
            "0",
            "--admin-port-file",
            str(data / "admin-port"),
            "--threads",
            str(threads),
            "--max-sessions",
            str(max_sessions),
            "--session-kv-tokens",
            str(session_kv_tokens),
            "--data-dir",
            str(data),
            "--cache-dir",
            str(cache_dir or (self.workdir / "node-cache")),
        ]
        if capacity_layers is not None:
            argv += ["--capacity-layers", str(capacity_layers)]
        argv += extra_args or []
        return self._spawn(name, argv, data / "port", data / "admin-port")

    def start_gateway(
        self, *, tracker_url: str, port: int = 0, host: str = "127.0.0.1", extra_args: list[str] | None = None
    ) -> Service:
        data = self.workdir / "gateway"
        data.mkdir(exist_ok=True)
        argv = (
            _script("swarm-gateway")
            + [
                "serve",
                "--tracker",
                tracker_url,
                "--host",
                host,
                "--port",
                str(port),
                "--port-file",
                str(data / "port"),
                "--data-dir",
                str(data),
            ]
            + (extra_args or [])
        )
        return self._spawn("gateway", argv, data / "port")

    def stop_all(self) -> None:
        for svc in reversed(self.services):
            try:
                svc.stop()
            except Exception:  # keep stopping the others
                svc.kill()
        self.services.clear()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
