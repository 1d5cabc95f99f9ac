"""The packet delayer (``delayer.c``): compiled at first use, run in the router namespace.

Why user space: these machines' kernels have no ``sch_netem`` (nor ``fq``), so
no qdisc can hold a packet for a given time. The delayer takes each forwarded
packet from an NFQUEUE, keeps only its id and due time (the packet stays in
the kernel) and gives the verdict at the due time, at real-time priority
(SCHED_FIFO) when the machine allows it. It starts a packet's delay at the
kernel's arrival stamp, not when it read the packet, and asks its timer to wake
it early by the wake-up lateness it has measured; docs/wan.md has the measured
error.

Compilation: ``cc -O2`` of the C source against the kernel's uapi headers
(package ``linux-libc-dev``), once per source and compiler, cached under
``~/.cache/swarm-inference/wan`` (or ``$SWARM_WAN_CACHE``).

The process lives as long as its stdin pipe: when the owner exits or crashes
the pipe closes, the delayer lets every held packet through and exits.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sim.wan.errors import WanSetupError, WanUnavailable
from sim.wan.profile import LinkParams

READY_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 10.0
COMMAND_CHUNK = 512  # control lines per exchange (~20 KiB): less than a pipe buffer either way
LATE_BUCKETS_US = (20, 50, 100, 200, 500, 1000, 5000)  # upper edges; the last bucket is >= 5 ms


def cache_dir() -> Path:
    env = os.environ.get("SWARM_WAN_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swarm-inference" / "wan"


def compile_delayer(out_dir: Path | None = None) -> Path:
    """Compile ``delayer.c`` once; return the executable. No compiler or headers: WanUnavailable."""
    source = resources.files("sim.wan").joinpath("delayer.c").read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise WanUnavailable("no C compiler (cc/gcc) on PATH to build the packet delayer")
    key = hashlib.sha256(source + cc.encode()).hexdigest()[:16]
    folder = out_dir or cache_dir()
    exe = folder / f"swarm-wan-delayer-{key}"
    if exe.is_file():
        return exe
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / "delayer.c"
        src.write_bytes(source)
        out = Path(tmp) / "delayer"
        proc = subprocess.run(
            [cc, "-O2", "-Wall", "-o", str(out), str(src)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise WanUnavailable(
                "compiling the packet delayer failed (needs the kernel headers, package linux-libc-dev): "
                + proc.stderr.strip()[:1500]
            )
        os.replace(out, exe)
    return exe


@dataclass(frozen=True)
class DelayerStats:
    """The delayer's own counters since start (or the last :meth:`Delayer.reset`)."""

    packets: int  # packets read from the queue
    accepted: int  # let through (after their delay)
    lost: int  # dropped by the configured loss
    overflow: int  # dropped because the delayer held max_packets already
    unmatched: int  # not between two emulated hosts (let through at once)
    enobufs: int  # netlink receive overflows (packets whose message was lost stay queued)
    held_now: int
    held_max: int
    release_error_mean_us: float  # |verdict time - due time|, mean over released packets
    release_error_max_us: float
    released_early: int  # packets released (at most half a wake-up latency) before their due time
    release_error_hist: tuple[int, ...]  # counts per LATE_BUCKETS_US bucket, then >= 5 ms
    stamped: int  # packets whose delay started at the kernel's arrival stamp
    read_lag_mean_us: float  # kernel arrival -> read by the delayer (compensated when stamped)
    read_lag_max_us: float
    wake_late_us: float  # the timer wake-up lateness it has learned and compensates
    scheduler: str  # "SCHED_FIFO" or "none" (then delays are less exact)

    @classmethod
    def from_json(cls, raw: dict, scheduler: str) -> DelayerStats:
        count = max(1, raw["late_count"])
        stamped = raw["stamped"]
        return cls(
            packets=raw["packets"],
            accepted=raw["accepted"],
            lost=raw["lost"],
            overflow=raw["overflow"],
            unmatched=raw["unmatched"],
            enobufs=raw["enobufs"],
            held_now=raw["held_now"],
            held_max=raw["held_max"],
            release_error_mean_us=raw["late_sum_ns"] / count / 1e3,
            release_error_max_us=raw["late_max_ns"] / 1e3,
            released_early=raw["early_count"],
            release_error_hist=tuple(raw["late_hist"]),
            stamped=stamped,
            read_lag_mean_us=raw["lag_sum_ns"] / max(1, stamped) / 1e3,
            read_lag_max_us=raw["lag_max_ns"] / 1e3,
            wake_late_us=raw["wake_late_ns"] / 1e3,
            scheduler=scheduler,
        )


class Delayer:
    """One delayer process and its control pipe; every method is thread-safe and time-bounded."""

    def __init__(
        self, argv_prefix: list[str], exe: Path, *, max_packets: int, rt_priority: int, seed: int
    ) -> None:
        self._lock = threading.Lock()
        argv = [
            *argv_prefix,
            str(exe),
            "--queue",
            "0",
            "--max-packets",
            str(max_packets),
            "--rt-priority",
            str(rt_priority),
            "--seed",
            str(seed),
        ]
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, bufsize=0
        )
        self._buf = b""
        ready = self._read_line(READY_TIMEOUT_S)
        if not ready.startswith("ready"):
            self.close()
            raise WanSetupError(f"the packet delayer did not start: {ready or self._stderr_text()}")
        fields = dict(part.split("=", 1) for part in ready.split()[1:])
        self.scheduler = fields.get("scheduler", "none")

    def _stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace").strip()[-2000:]

    def _read_line(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WanSetupError(f"the packet delayer did not answer within {timeout_s:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise WanSetupError(f"the packet delayer exited: {self._stderr_text()}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def _commands(self, lines: list[str]) -> list[str]:
        with self._lock:
            if self.proc.poll() is not None:
                raise WanSetupError(f"the packet delayer has exited: {self._stderr_text()}")
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("".join(line + "\n" for line in lines).encode())
            except BrokenPipeError as err:
                raise WanSetupError(f"the packet delayer has exited: {self._stderr_text()}") from err
            return [self._read_line(REPLY_TIMEOUT_S) for _ in lines]

    def set_links(self, links: dict[tuple[int, int], LinkParams]) -> None:
        """Program (source host index, destination host index) -> parameters, in one exchange."""
        lines = [
            f"link {src} {dst} {round(p.delay_ms * 1e3)} {round(p.jitter_ms * 1e3)} {round(p.loss_pct * 1e4)}"
            for (src, dst), p in links.items()
        ]
        # In chunks: both pipes hold 64 KiB, so a single huge exchange could block both ends.
        for start in range(0, len(lines), COMMAND_CHUNK):
            chunk = lines[start : start + COMMAND_CHUNK]
            for line, answer in zip(chunk, self._commands(chunk), strict=True):
                if answer != "ok":
                    raise WanSetupError(f"the packet delayer refused {line!r}: {answer}")

    def stats(self) -> DelayerStats:
        (answer,) = self._commands(["stats"])
        try:
            return DelayerStats.from_json(json.loads(answer), self.scheduler)
        except (ValueError, KeyError) as err:
            raise WanSetupError(f"unreadable delayer statistics {answer!r}") from err

    def reset(self) -> None:
        self._commands(["reset"])

    def close(self) -> None:
        """Close its stdin (it lets held packets through and exits); kill it if it lingers."""
        with self._lock:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()
                except BrokenPipeError:
                    pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._stderr.close()
