"""Network namespaces of the emulated WAN: names, commands, entering one, finding leftovers.

Naming. Every namespace of one emulation is ``swwan-<pid>-<seq>-<host>``
(the router is ``...-router``): ``pid`` is the owning process, ``seq`` counts
emulations inside it, so concurrent runs (CI jobs, several developers) never
collide. The owner also writes ``/run/swarm-wan/<pid>-<seq>.json`` with its
process start time, so a recycled pid is not mistaken for a live owner.

Nothing here touches the root namespace's interfaces, routes or firewall:
veths are created directly inside emulator namespaces, and every address
(10.77.h.x) exists only there. Deleting a namespace removes its veths, rules
and qdiscs with it; processes still inside are killed first.

Every command runs with a time limit (:data:`COMMAND_TIMEOUT_S`) and a failure
raises :class:`WanSetupError` carrying the command and its output.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sim.wan.errors import WanSetupError

PREFIX = "swwan"
NETNS_DIR = Path("/run/netns")
STATE_DIR = Path("/run/swarm-wan")
COMMAND_TIMEOUT_S = 20.0
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-([a-z][a-z0-9-]*)$")
_CLONE_NEWNET = 0x40000000

T = TypeVar("T")


def ns_name(pid: int, seq: int, host: str) -> str:
    return f"{PREFIX}-{pid}-{seq}-{host}"


def run(
    argv: list[str], *, timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True, stdin: str | None = None
) -> str:
    """Run a command; return its stdout. Non-zero exit (when ``check``) or a timeout: WanSetupError."""
    try:
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError as err:
        raise WanSetupError(f"{argv[0]}: not found") from err
    except subprocess.TimeoutExpired as err:
        raise WanSetupError(f"{' '.join(argv)}: no answer within {timeout_s:.0f} s") from err
    if check and proc.returncode != 0:
        out = (proc.stderr or proc.stdout).strip()
        raise WanSetupError(f"{' '.join(argv)}: exit {proc.returncode}: {out[:2000]}")
    return proc.stdout


def list_namespaces() -> list[str]:
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def our_namespaces() -> list[str]:
    """Every emulator namespace on this machine, of any run."""
    return [n for n in list_namespaces() if _NAME.match(n)]


def namespace_pids(name: str) -> list[int]:
    out = run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in out.split() if x.isdigit()]


def kill_namespace_processes(name: str, grace_s: float = 2.0) -> list[int]:
    """SIGTERM every process inside ``name``, SIGKILL what is left after ``grace_s``; return their pids."""
    pids = namespace_pids(name)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids_left = [p for p in pids if _alive(p)]
        if not pids_left:
            break
        time.sleep(0.05)
    for pid in namespace_pids(name):
        _signal(pid, signal.SIGKILL)
    return pids


def delete_namespace(name: str) -> None:
    kill_namespace_processes(name)
    if (NETNS_DIR / name).exists():
        run(["ip", "netns", "delete", name])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; it is the text between the first '(' and last ')'.
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def write_run_record(pid: int, seq: int) -> Path:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = STATE_DIR / f"{pid}-{seq}.json"
    path.write_text(json.dumps({"pid": pid, "seq": seq, "start_time": process_start_time(pid)}))
    return path


def _run_alive(pid: int, seq: int) -> bool:
    start = process_start_time(pid)
    if start is None:
        return False
    try:
        record = json.loads((STATE_DIR / f"{pid}-{seq}.json").read_text())
    except (OSError, ValueError):
        return True  # no record: a live pid is presumed to be the owner
    return record.get("start_time") in (None, start)


def cleanup_leftovers(*, include_live: bool = False, exclude_pid: int | None = None) -> list[str]:
    """Delete the namespaces (and processes inside) of emulations whose owner process is gone.

    ``include_live`` also removes those of running owners (``swarm-sim wan cleanup --all``);
    ``exclude_pid`` spares one owner regardless. Returns the namespaces removed.
    """
    removed: list[str] = []
    runs: set[tuple[int, int]] = set()
    names = our_namespaces()
    # Host namespaces first, the router last: its delayer keeps working while hosts go.
    names.sort(key=lambda n: n.endswith("-router"))
    for name in names:
        m = _NAME.match(name)
        assert m is not None  # our_namespaces() matched it
        pid, seq = int(m.group(1)), int(m.group(2))
        if pid == exclude_pid or (not include_live and _run_alive(pid, seq)):
            continue
        delete_namespace(name)
        removed.append(name)
        runs.add((pid, seq))
    for record in STATE_DIR.glob("*.json") if STATE_DIR.exists() else []:
        try:
            pid, seq = (int(x) for x in record.stem.split("-"))
        except ValueError:
            continue
        if pid == exclude_pid:
            continue
        if (pid, seq) in runs or not _run_alive(pid, seq) or include_live:
            record.unlink(missing_ok=True)
    return removed


_libc = ctypes.CDLL(None, use_errno=True)


def call_in_namespace(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a fresh thread that has entered namespace ``name``.

    Sockets the function opens live in that namespace (a network namespace is
    per thread). The thread ends with the call, so no thread of this process
    stays moved. Exceptions propagate; the call itself is bounded only by
    ``fn`` (give it a deadline).
    """
    result: dict[str, Any] = {}

    def body() -> None:
        try:
            fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            result["error"] = WanSetupError(f"no namespace {name}: {err}")
            return
        try:
            if _libc.setns(fd, _CLONE_NEWNET) != 0:
                errno_ = ctypes.get_errno()
                result["error"] = WanSetupError(f"setns({name}): {os.strerror(errno_)}")
                return
        finally:
            os.close(fd)
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as err:  # handed to the caller's thread
            result["error"] = err

    thread = threading.Thread(target=body, name=f"netns-{name}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
