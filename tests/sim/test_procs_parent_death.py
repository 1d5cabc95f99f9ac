"""The supervisor's parent-death signal (sim/procs.py): what it starts does not outlive it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from sim.procs import parent_death_prefix, wait_until

pytestmark = pytest.mark.slow  # starts supervisor processes

ROOT = Path(__file__).resolve().parents[2]
# A supervising process: starts `sleep` through the Supervisor (main thread, or a worker thread with
# "thread"), prints its pid and waits to be killed.
SUPERVISING = """
import sys, threading, time
from pathlib import Path
from sim.procs import Supervisor

sup = Supervisor(Path(sys.argv[1]))
started = []
def start():
    started.append(sup.spawn("sleeper", ["sleep", "120"]))
if sys.argv[2] == "thread":
    t = threading.Thread(target=start)
    t.start()
    t.join()
else:
    start()
print(started[0].pid, flush=True)
time.sleep(120)
"""


def _supervised_sleeper(tmp_path: Path, where: str) -> tuple[subprocess.Popen[str], psutil.Process]:
    parent = subprocess.Popen(
        [sys.executable, "-c", SUPERVISING, str(tmp_path), where], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line.strip().isdigit(), line
    return parent, psutil.Process(int(line))


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_supervisor_takes_its_processes_with_it(tmp_path: Path) -> None:
    parent, sleeper = _supervised_sleeper(tmp_path, "main")
    try:
        assert not _gone(sleeper)
        t0 = time.monotonic()
        parent.kill()  # SIGKILL: no Python code runs, no stop_all
        parent.wait(10)
        wait_until(lambda: _gone(sleeper), 10, "the sleeper to get its parent-death signal", interval_s=0.05)
        print(f"gone {time.monotonic() - t0:.2f} s after SIGKILL of its supervisor")
    finally:
        if not _gone(sleeper):
            sleeper.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_spawned_from_a_worker_thread_no_parent_death_signal(tmp_path: Path) -> None:
    """The signal follows the forking thread: none is asked for from a thread that may end first."""
    found: list[object] = []
    t = threading.Thread(target=lambda: found.append(parent_death_prefix()))
    t.start()
    t.join()
    assert found == [[]] and parent_death_prefix() != []
    parent, sleeper = _supervised_sleeper(tmp_path, "thread")
    try:
        time.sleep(0.5)  # the spawning thread has ended: the sleeper still runs
        assert not _gone(sleeper)
    finally:
        parent.kill()
        parent.wait(10)
        if not _gone(sleeper):
            sleeper.kill()
