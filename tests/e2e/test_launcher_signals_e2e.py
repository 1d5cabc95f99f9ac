"""``swarm-sim up`` leaves nothing behind, however it is stopped (real processes, the bundled model).

The launcher runs on a pseudo-terminal of its own, as in a person's terminal
(it is the session leader and the terminal is its controlling terminal). Each
case starts a one-node swarm (tracker, node, gateway), notes every process the
launcher started (its descendants, the gateway's template workers included) and
every port they listen on, then stops the launcher one way:

- the terminal closes (the kernel sends SIGHUP, and the terminal is gone for
  the launcher's last writes);
- SIGHUP, SIGINT or SIGTERM sent to its pid by someone else;
- SIGKILL: the launcher can do nothing, the services' parent-death signal
  (sim/procs.py) stops them;
- SIGTERM while it is still starting the swarm (the node loading).

Within 10 s of the signal no process of the swarm may be left (a zombie
waiting for its reaper counts as gone: it runs nothing and holds no port) and
every port must refuse connections.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from node.testmodel import test_model_path
from sim.procs import wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0
READY_TIMEOUT_S = 120.0


@dataclass
class Launcher:
    proc: subprocess.Popen[bytes]
    master: int
    output: bytearray = field(default_factory=bytearray)
    closed: bool = False
    reader: threading.Thread | None = None
    services: list[psutil.Process] = field(default_factory=list)  # what it started, seen before the stop

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def read_until_closed(self) -> None:
        # Never blocked in read(): a read in progress would keep the terminal open past os.close.
        while not self.closed:
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: the launcher's side is closed
                return
            if not chunk:
                return
            self.output += chunk

    def close_terminal(self) -> None:
        """What closing a terminal window does: the master side goes away; the kernel hangs up."""
        if not self.closed:
            self.closed = True
            if self.reader is not None:
                self.reader.join(5)
            os.close(self.master)


@contextmanager
def launcher(workdir: Path) -> Iterator[Launcher]:
    master, slave = os.openpty()
    argv = [sys.executable, "-m", "sim.cli", "up", "--nodes", "1", "--port", "0", "--workdir", str(workdir)]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        # A session of its own with the terminal as its controlling terminal (setsid + TIOCSCTTY).
        preexec_fn=lambda: os.login_tty(slave),
    )
    os.close(slave)
    run = Launcher(proc, master)
    run.reader = threading.Thread(target=run.read_until_closed, daemon=True)
    run.reader.start()
    try:
        yield run
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        run.close_terminal()
        for p in run.services:  # a failed case leaves no orphans behind for the next one
            try:
                if p.is_running():
                    p.kill()
            except psutil.NoSuchProcess:
                pass


def _swarm_processes(root: int) -> list[psutil.Process]:
    try:
        return psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(procs: list[psutil.Process]) -> list[str]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
    return left


def _ports(workdir: Path) -> dict[str, int]:
    found = {}
    for name in ("tracker", "node1", "gateway"):
        for file in ("port", "admin-port"):
            path = workdir / name / file
            if path.is_file() and path.read_text().strip().isdigit():
                found[f"{name}/{file}"] = int(path.read_text())
    return found


def _listening(ports: dict[str, int]) -> list[str]:
    out = []
    for what, port in ports.items():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            out.append(f"{what}={port}")
        except OSError:
            continue
    return out


def _after_signal_nothing_left(run: Launcher, workdir: Path, stop: str, services: int) -> int:
    """Stop the launcher with ``stop`` once it has ``services`` children; check; its exit code."""

    def started() -> list[psutil.Process] | None:
        found = _swarm_processes(run.proc.pid)
        return found if len(found) >= services else None

    procs = run.services = wait_until(started, 30, f"the launcher's {services} services")
    ports = _ports(workdir)
    assert _listening(ports), ports  # the tracker at least
    t0 = time.monotonic()
    if stop == "close-terminal":
        run.close_terminal()
    else:
        os.kill(run.proc.pid, getattr(signal, stop))
    left = _running(procs)
    while left and time.monotonic() - t0 < GONE_WITHIN_S:
        time.sleep(0.1)
        left = _running(procs)
    gone_s = time.monotonic() - t0
    assert not left, f"{stop}: still running after {GONE_WITHIN_S:g} s: {left}\n{run.text()[-3000:]}"
    assert not _listening(ports), f"{stop}: ports still open: {_listening(ports)}"
    # The launcher itself ends too (SIGKILL: at once; otherwise once the services are stopped).
    code = run.proc.wait(GONE_WITHIN_S)
    print(f"{stop}: {len(procs)} processes gone {gone_s:.1f} s after the signal; launcher exit {code}")
    return code


@pytest.fixture(scope="module")
def model() -> Path:
    return test_model_path()


@pytest.mark.parametrize("stop", ["close-terminal", "SIGHUP", "SIGINT", "SIGTERM", "SIGKILL"])
def test_stopping_the_serving_launcher_leaves_nothing(tmp_path: Path, model: Path, stop: str) -> None:
    with launcher(tmp_path) as run:
        wait_until(
            lambda: "stops the swarm" in run.text() or run.proc.poll() is not None,
            READY_TIMEOUT_S,
            "the swarm to serve",
        )
        assert run.proc.poll() is None, run.text()
        # tracker, node, gateway (and the gateway's template workers, its children)
        code = _after_signal_nothing_left(run, tmp_path, stop, services=3)
    if stop == "SIGKILL":
        assert code == -signal.SIGKILL
    else:  # a requested stop: every service stopped by the launcher, which says so where it can
        assert code == 0, run.text()[-3000:]
        if stop != "close-terminal":
            assert f"stopped by {stop}." in run.text(), run.text()[-3000:]


def test_sigterm_while_starting_leaves_nothing(tmp_path: Path, model: Path) -> None:
    with launcher(tmp_path) as run:
        wait_until(
            lambda: "node1    loading" in run.text() or run.proc.poll() is not None,
            READY_TIMEOUT_S,
            "the node to be started",
        )
        assert run.proc.poll() is None, run.text()
        assert _after_signal_nothing_left(run, tmp_path, "SIGTERM", services=2) == 128 + signal.SIGTERM
        assert "start-up interrupted by SIGTERM" in run.text()
