"""Progress people can see: a bar on a terminal, plain log lines elsewhere, structured events always.

One :class:`Progress` per phase of joining (``fetching``, ``verifying``,
``extracting``). On an interactive terminal (stderr is a TTY, or
``SWARM_PROGRESS=bar``) it draws a tqdm bar with bytes, rate and ETA. Either
way it emits a structured ``progress`` log event at most every
``log_interval_s`` seconds (``phase``, ``done_bytes``, ``total_bytes``,
``rate_bytes_per_s``, ``eta_s`` and a one-line ``summary`` such as
``fetching blk.10-19: 512.0 MB of 1.2 GB (41%), 80.0 MB/s, ETA 9 s``) and one
``<phase>_done`` (or ``_failed``) event at the end: a log file gets plain,
readable lines with the same figures as the bar.

``update`` may be called from one worker thread at a time (hashing,
copying: the calls of one phase are sequential); the state it touches is a
few integers, and tqdm and ``logging`` are thread-safe. Nothing here grows
with the bytes processed.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from types import TracebackType
from typing import Any

from common.logs import event

log = logging.getLogger("swarm.node.progress")
BAR_ENV = "SWARM_PROGRESS"  # "bar" forces the bar, "log" forces log lines


def _use_bar() -> bool:
    forced = os.environ.get(BAR_ENV, "")
    if forced in ("bar", "log"):
        return forced == "bar"
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - the loop returns


class Progress:
    """Bytes done out of a known total for one phase; use as a context manager."""

    def __init__(
        self,
        phase: str,
        total_bytes: int,
        detail: str = "",
        *,
        log_interval_s: float = 5.0,
        clock: Any = time.monotonic,
        bar: bool | None = None,
    ) -> None:
        self.phase = phase
        self.total_bytes = max(0, int(total_bytes))
        self.detail = detail
        self.done_bytes = 0
        self._clock = clock
        self._t0 = clock()
        self._last_report = self._t0
        self._interval = log_interval_s
        self._closed = False
        self._bar: Any = None
        if bar if bar is not None else _use_bar():
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc=f"{phase} {detail}".strip(),
                file=sys.stderr,
                leave=True,
                dynamic_ncols=True,
            )
        event(log, f"{phase}_started", total_bytes=self.total_bytes, detail=detail)

    def update(self, n: int) -> None:
        if n <= 0:
            return
        self.done_bytes += n
        now = self._clock()
        due = now - self._last_report >= self._interval
        if due:
            self._last_report = now
        if self._bar is not None:
            self._bar.update(n)
        if due:
            self._report(now)

    def figures(self, now: float | None = None) -> dict[str, Any]:
        now = self._clock() if now is None else now
        elapsed = max(now - self._t0, 1e-9)
        rate = self.done_bytes / elapsed
        left = max(0, self.total_bytes - self.done_bytes)
        return {
            "phase": self.phase,
            "done_bytes": self.done_bytes,
            "total_bytes": self.total_bytes,
            "rate_bytes_per_s": round(rate, 1),
            "eta_s": round(left / rate, 1) if rate > 0 else None,
            "elapsed_s": round(elapsed, 3),
        }

    def _report(self, now: float) -> None:
        f = self.figures(now)
        pct = 100.0 * f["done_bytes"] / self.total_bytes if self.total_bytes else 100.0
        eta = f"{f['eta_s']:.0f} s" if f["eta_s"] is not None else "?"
        summary = (
            f"{self.phase} {self.detail}: {human_bytes(f['done_bytes'])} of {human_bytes(self.total_bytes)} "
            f"({pct:.0f}%), {human_bytes(f['rate_bytes_per_s'])}/s, ETA {eta}"
        )
        event(log, "progress", detail=self.detail, summary=summary, **f)

    def close(self, ok: bool = True) -> dict[str, Any]:
        if self._closed:
            return self.figures()
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        f = self.figures()
        event(log, f"{self.phase}_done" if ok else f"{self.phase}_failed", detail=self.detail, **f)
        return f

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(ok=exc_type is None)
