"""The one process supervisor: services as real subprocesses, for ``swarm-sim up``, benchmarks and tests.

A :class:`Supervisor` owns a work directory and every process it starts there.
``start_tracker``/``start_node``/``start_gateway`` run the real console scripts
(``swarm-tracker serve`` ...); :meth:`Supervisor.spawn` runs any other command
(a benchmark's baseline server, a helper process) under the same rules:

- **Readiness** is reported by the service, never guessed: each binds port 0
  and writes the port it got to a port file (``<workdir>/<name>/port``, a node
  also ``admin-port``); :meth:`Service.wait_port` reads it, :func:`wait_http`
  polls a health URL. Both fail early, with the log's tail, when the process
  exits, and give up after their ``timeout_s``.
- **Logs**: stdout and stderr of a service go to ``<workdir>/logs/<name>.log``
  (appended: a restarted service keeps its history).
- **Stopping** is by the process's own pid, never by name: SIGTERM, then
  SIGKILL after ``grace_s``; :meth:`Supervisor.stop_all` stops every process,
  newest first, also when one of them refuses. Every service runs in a session
  of its own, so a Ctrl-C in the terminal reaches the supervisor, not the
  services behind its back.
- **Dying with the supervisor**: on Linux every process started from the main
  thread asks the kernel for a parent-death signal (``prctl(PR_SET_PDEATHSIG,
  SIGTERM)``, set by a few lines of Python that then exec the service:
  :func:`parent_death_prefix`): when the supervising process ends -- SIGKILL included, with nobody left to
  call :meth:`Supervisor.stop_all` -- each service gets SIGTERM and stops the
  way it does on Ctrl-C (drains, leaves the tracker, closes its database), so
  no process or port outlives it. The signal follows the *thread* that forked,
  not the process: processes spawned from another thread (whose end would stop
  them) get none. A child whose parent died before the request took effect
  exits at once.
- **Environment** (:func:`service_env`), the same for every process started
  here: the caller's environment, minus the services' own settings
  (``SWARM_NODE_*``, ``SWARM_TRACKER_*``, ``SWARM_GATEWAY_*``: a stray one in a
  shell must not change a test or a local swarm; what a service should use is
  passed as flags, or explicitly with ``env=``), plus ``PYTHONUNBUFFERED=1``
  (log lines reach the file when written) and one thread for the numerical
  libraries' pools (``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``,
  ``NUMEXPR_NUM_THREADS`` = 1: the services do no BLAS work, and several
  services share this machine's cores). llama.cpp's compute threads are set
  per node with ``--threads`` (default 1 here), never through the environment.
  ``env=`` entries are applied last.
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from common.keyfile import load_or_create_key_file
from proto.signing import public_key_hex

STRIPPED_PREFIXES = ("SWARM_NODE_", "SWARM_TRACKER_", "SWARM_GATEWAY_")
# Gateway flags for a run that tests something else than spot checks and counts routes, sessions or
# steps: no request runs on a second route (checks are tested in tests/*/test_*checks*).
# The spot-check audit: ``SWARM_TEST_CHECK_FRACTION=1 pytest tests/e2e`` runs every gateway a test
# starts (unless the test sets its own fraction) with that check fraction, so the whole end-to-end
# suite shows whether honest nodes are ever accused (``python -m sim.check_audit`` reads the logs).
CHECK_AUDIT_ENV = "SWARM_TEST_CHECK_FRACTION"
# Every supervisor alive in this process (the test suite reports their services' problems on a failure).
LIVE_SUPERVISORS: weakref.WeakSet[Supervisor] = weakref.WeakSet()
NO_SPOT_CHECKS = ("--check-fraction", "0", "--probation-checks", "0")
FIXED_ENV = {
    "PYTHONUNBUFFERED": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
}
_MODULES = {"swarm-node": "node.cli", "swarm-tracker": "tracker.cli", "swarm-gateway": "gateway.cli"}
PARENT_DEATH_SIGNAL = signal.SIGTERM  # what a service gets when its supervising process is gone
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class LaunchError(RuntimeError):
    """A process did not start, died, or did not become ready in time (the message has its log tail)."""


def service_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every process started here (the policy is in the module docstring)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(STRIPPED_PREFIXES)}
    env.update(FIXED_ENV)
    env.update(extra or {})
    return env


# Run in the child in place of a ``preexec_fn``: ask for the parent-death signal, check the parent
# is still the one that started us, then exec the service. A ``preexec_fn`` would make subprocess
# fork() instead of vfork()/posix_spawn(), and a fork of a process whose gRPC threads are busy (the
# test process runs scripted nodes on gRPC) runs gRPC's fork handlers in the child, which abort it
# ("Check failed: next_worker->state == KICKED"). Isolated (-I -S): nothing but the standard library.
_PARENT_DEATH_EXEC = f"""
import ctypes, os, sys
parent, signum, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
prctl = ctypes.CDLL(None, use_errno=True).prctl
prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
if prctl({_PR_SET_PDEATHSIG}, signum, 0, 0, 0) != 0:
    sys.exit(126)  # refuse to run a service that could outlive its supervisor
if os.getppid() != parent:  # the parent died before the request took effect
    sys.exit(0)
os.execvp(argv[0], argv)
"""


def parent_death_prefix() -> list[str]:
    """The argv prefix that makes a child get :data:`PARENT_DEATH_SIGNAL` when the calling thread
    ends (it execs the real command, keeping its pid); empty where there is no such thing (not Linux,
    or not the main thread: see the module docstring)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return []
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _PARENT_DEATH_EXEC,
        str(os.getpid()),
        str(int(PARENT_DEATH_SIGNAL)),
    ]


def console_script(name: str) -> list[str]:
    """The console script next to this interpreter (works inside a venv without activating it)."""
    local = Path(sys.executable).with_name(name)
    if local.exists():
        return [str(local)]
    found = shutil.which(name)
    if found:
        return [found]
    return [sys.executable, "-m", _MODULES[name]]


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port_file: Path | None = None
    port: int = 0
    admin_port_file: Path | None = None
    admin_port: int = 0
    data_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tls_fingerprint(self) -> str:
        """The pin of a node's gRPC certificate (kept in its data dir); "" when it has none."""
        from common.tls import CERT_FILE, fingerprint_pem

        cert = self.data_dir / CERT_FILE if self.data_dir is not None else None
        return fingerprint_pem(cert.read_bytes()) if cert is not None and cert.is_file() else ""

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (the tracker's and gateway's HTTP API)."""
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_port(self, timeout_s: float) -> int:
        """Wait for the port file (and the admin port file, if any); return the port."""
        if self.port_file is not None:
            self.port = _wait_port_file(self, self.port_file, timeout_s)
        if self.admin_port_file is not None:
            self.admin_port = _wait_port_file(self, self.admin_port_file, timeout_s)
        return self.port

    def ready(self, timeout_s: float) -> Service:
        """:meth:`wait_port`, returning the service (``sup.start_tracker().ready(60)``)."""
        self.wait_port(timeout_s)
        return self

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout_s: float) -> int:
        """Wait for the process to exit; its exit code (negative: the signal that ended it)."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired as err:
            raise LaunchError(f"{self.name} still running after {timeout_s:g} s:\n{self.log_tail()}") from err

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL: the process vanishes the way a volunteer's machine does."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _wait_port_file(svc: Service, path: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit():
            return int(text)
        if not svc.alive():
            raise LaunchError(f"{svc.name} exited with code {svc.proc.returncode}:\n{svc.log_tail()}")
        time.sleep(0.05)
    raise LaunchError(f"{svc.name} did not report its port within {timeout_s:g} s:\n{svc.log_tail()}")


T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """``predicate()``'s first truthy value, polled every ``interval_s``; AssertionError after
    ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def wait_http(
    svc: Service,
    url: str,
    timeout_s: float,
    ok: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
    verify: ssl.SSLContext | bool = True,
) -> httpx.Response:
    """Poll ``url`` until ``ok(response)``; fail early if the process dies. ``verify``: how an
    https:// URL's certificate is checked (:func:`trust_only`)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not svc.alive():
            raise LaunchError(f"{svc.name} exited with code {svc.proc.returncode}:\n{svc.log_tail()}")
        try:
            resp = httpx.get(url, timeout=2.0, verify=verify)
            if ok(resp):
                return resp
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as err:
            last = str(err)
        time.sleep(0.1)
    raise LaunchError(f"{svc.name}: {url} not ready within {timeout_s:g} s ({last}):\n{svc.log_tail()}")


def trust_only(cert_file: Path) -> ssl.SSLContext:
    """A client context that trusts exactly the (self-signed) certificate in ``cert_file``, whatever
    host name it names: for polling a local HTTPS tracker from a harness."""
    context = ssl.create_default_context(cafile=str(cert_file))
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def _serve_argv(script: str, host: str, port: int, data: Path) -> list[str]:
    """``<script> serve`` on ``host:port``, its port file and data in ``data``."""
    return [
        *console_script(script),
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--port-file",
        str(data / "port"),
        "--data-dir",
        str(data),
    ]


def problem_lines(text: str, *, limit: int = 40) -> list[str]:
    """The last ``limit`` lines of a service log that report a problem (error or warning events,
    tracebacks and the lines that follow them)."""
    out: list[str] = []
    in_traceback = False
    for line in text.splitlines():
        if line.startswith("Traceback"):
            in_traceback = True
        elif in_traceback and line and not line.startswith((" ", "\t")):
            out.append(line)  # the exception line ends the traceback
            in_traceback = False
            continue
        if in_traceback or (
            ('"level":"error"' in line or '"level":"warning"' in line) and '"logger":"llama.cpp"' not in line
        ):
            out.append(line)
    return out[-limit:]


class Supervisor:
    """Owns the processes started in one work directory; stops them all, newest first.

    ``place(name, argv)`` may rewrite each command line to run it elsewhere (the
    emulated WAN runs each service inside its own network namespace).
    """

    def __init__(self, workdir: Path, *, place: Callable[[str, list[str]], list[str]] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self.place = place
        self.services: list[Service] = []
        # The public key of the tracker started last: gateways started here pin it (``--tracker-id``).
        self.tracker_id = ""
        LIVE_SUPERVISORS.add(self)

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        port_file: Path | None = None,
        admin_port_file: Path | None = None,
        data_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Service:
        """Start ``argv`` now (without waiting for it) under the rules in the module docstring."""
        for f in (port_file, admin_port_file):
            if f is not None:
                f.unlink(missing_ok=True)
        command = list(argv) if self.place is None else self.place(name, list(argv))
        command = [*parent_death_prefix(), *command]
        log_path = self.workdir / "logs" / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=service_env(env),
                cwd=cwd,
                start_new_session=True,
            )
        svc = Service(name, proc, log_path, port_file, admin_port_file=admin_port_file, data_dir=data_dir)
        self.services.append(svc)
        return svc

    def _data_dir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start_tracker(
        self,
        *,
        name: str = "tracker",
        data_dir_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        db_url: str | None = None,
        heartbeat_timeout_s: float | None = None,
        extra_args: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Service:
        """``swarm-tracker serve``; files in ``<workdir>/<data_dir_name or name>`` (a restart reuses
        them; ``port`` lets a restarted tracker come back where its nodes look for it)."""
        data = self._data_dir(data_dir_name or name)
        # The tracker's key is made here rather than by the tracker, so the gateways started after it
        # can be given its id without asking the tracker (which is what they check route tickets with).
        args = list(extra_args or ())
        key_file = Path(args[args.index("--key-file") + 1]) if "--key-file" in args else data / "tracker.key"
        self.tracker_id = public_key_hex(load_or_create_key_file(key_file)[0])
        argv = [
            *_serve_argv("swarm-tracker", host, port, data),
            "--no-zeroconf",
            "--db-url",
            db_url or f"sqlite:///{data / 'tracker.db'}",
        ]
        if heartbeat_timeout_s is not None:
            argv += ["--heartbeat-timeout-s", str(heartbeat_timeout_s)]
        if "--unregistered-names" not in args:
            # Every key of a harness swarm is the harness's own: names resolve as in a private swarm
            # unless a test asks for the default (trusted holders only; docs/security.md, Names).
            argv += ["--unregistered-names", "any"]
        argv += args
        svc = self.spawn(name, argv, port_file=data / "port", data_dir=data, env=env)
        svc.extra["tracker_id"] = self.tracker_id
        return svc

    def start_node(
        self,
        name: str,
        *,
        model: Path | str,  # a GGUF path, a URL, or a registered model name
        layers: str,
        tracker_url: str | None,
        host: str = "127.0.0.1",
        threads: int = 1,
        capacity_layers: int | None = None,
        max_sessions: int = 8,
        session_kv_tokens: int = 2048,
        cache_dir: Path | None = None,
        admin: bool = True,
        extra_args: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        tls: bool | None = None,
    ) -> Service:
        """``swarm-node start`` listening on and announcing ``host``; its admin server (unless
        ``admin=False``) stays on its own 127.0.0.1. ``tracker_url=None``: no tracker, no tickets.

        ``tls``: serve gRPC over TLS (the node's certificate in its data dir, see
        :meth:`Service.tls_fingerprint`) or ``--insecure-plaintext``; None = TLS with a tracker,
        plaintext without one (a loopback harness dialling the node itself)."""
        data = self._data_dir(name)
        admin_file = data / "admin-port" if admin else None
        argv = [
            *console_script("swarm-node"),
            "start",
            "--model",
            str(model),
            "--layers",
            layers,
            "--host",
            host,
            "--advertise-host",
            host,
            "--port",
            "0",
            "--port-file",
            str(data / "port"),
            "--admin-port",
            "0" if admin else "-1",
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
        if admin_file is not None:
            argv += ["--admin-port-file", str(admin_file)]
        argv += ["--tracker", tracker_url] if tracker_url else ["--no-tracker", "--insecure-no-tickets"]
        if capacity_layers is not None:
            argv += ["--capacity-layers", str(capacity_layers)]
        if not (tls if tls is not None else bool(tracker_url)):
            argv += ["--insecure-plaintext"]
        argv += extra_args or ()
        return self.spawn(
            name, argv, port_file=data / "port", admin_port_file=admin_file, data_dir=data, env=env
        )

    def start_gateway(
        self,
        *,
        tracker_url: str,
        name: str = "gateway",
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        tracker_id: str | None = None,
    ) -> Service:
        """``swarm-gateway serve`` with its key and vocabulary cache in ``<workdir>/<name>``; it pins
        ``tracker_id`` (default: the tracker started last here; "" = none, so pass it in ``extra_args``)."""
        data = self._data_dir(name)
        pin = self.tracker_id if tracker_id is None else tracker_id
        extra = list(extra_args or ())
        audit = os.environ.get(CHECK_AUDIT_ENV, "")
        if audit and "--check-fraction" not in extra:  # a test that sets its own fraction keeps it
            extra += ["--check-fraction", audit]
        argv = [
            *_serve_argv("swarm-gateway", host, port, data),
            "--tracker",
            tracker_url,
            *(("--tracker-id", pin) if pin else ()),
            *extra,
        ]
        return self.spawn(name, argv, port_file=data / "port", data_dir=data, env=env)

    def stop_all(self, grace_s: float = 15.0) -> None:
        """Stop every process, newest first; a Ctrl-C meanwhile kills the rest at once (none is left)."""
        try:
            for svc in reversed(self.services):
                try:
                    svc.stop(grace_s)
                except Exception:  # keep stopping the others
                    svc.kill()
        except KeyboardInterrupt:
            for svc in self.services:
                svc.kill()
            raise
        finally:
            self.services.clear()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
