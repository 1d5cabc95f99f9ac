"""How exact is the emulated WAN? Measured delays, round trips, jitter, loss and rates vs configured.

    python -m sim.wan.bench [--quick] [--out docs/perf/wan.json]

Needs root (it builds an emulation of two hosts, ``a`` and ``b``). Every
figure is measured side by side with what was configured, and the
configured-zero path is measured too (the cost of the real stack plus the
delayer's pass with no delay):

* one-way delay: UDP datagrams every 5 ms; the receiving kernel's arrival
  stamp minus the sender's clock just before ``sendto``; error = measured -
  configured (mean, median, p99, max, in microseconds);
* round trip: TCP ping-pong of 64 bytes over one connection (TCP_NODELAY),
  user space to user space, vs 2 x the configured one-way delay;
* jitter: the standard deviation of one-way delays vs that of the configured
  uniform distribution (jitter / sqrt 3);
* loss: share of datagrams lost vs configured;
* rate: TCP goodput over a rate-limited uplink vs the configured rate (goodput
  carries no TCP/IP headers: about 95 % of the wire rate at a 1500-byte MTU);
* the delayer's own figures: release error (verdict time vs due time) and
  the scheduler it got.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sim.wan import probes
from sim.wan.emulator import WanEmulator
from sim.wan.errors import WanUnavailable
from sim.wan.profile import parse_profile

ROOT = Path(__file__).resolve().parents[2]

PROFILE = parse_profile(
    {
        "profile": {"name": "bench", "description": "two hosts; links changed live"},
        "regions": {"lan": {}},
        "paths": [{"between": ["lan", "lan"], "delay_ms": 0}],
    }
)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary(errors: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(errors),
        "median": statistics.median(errors),
        "p99": _pct(errors, 99),
        "max": max(errors),
        "min": min(errors),
    }


def bench_one_way(wan: WanEmulator, delays_ms: list[float], count: int) -> list[dict[str, Any]]:
    rows = []
    for delay in delays_ms:
        wan.set_link("a", "b", delay_ms=delay, jitter_ms=0, loss_pct=0)
        result = probes.udp_one_way(wan, "a", "b", count, 0.005)
        errors_us = [(d - delay) * 1e3 for d in result.one_way_ms]
        rows.append({"configured_ms": delay, "samples": result.received, "error_us": _summary(errors_us)})
    return rows


def bench_rtt(wan: WanEmulator, delays_ms: list[float], budget_s: float) -> list[dict[str, Any]]:
    rows = []
    for delay in delays_ms:
        wan.set_link("a", "b", delay_ms=delay, jitter_ms=0, loss_pct=0)
        count = max(20, min(500, int(budget_s / max(2 * delay / 1e3, 0.001))))
        rtts = probes.tcp_rtts_ms(wan, "a", "b", count)
        errors = [r - 2 * delay for r in rtts]
        rows.append(
            {
                "configured_rtt_ms": 2 * delay,
                "samples": len(rtts),
                "measured_median_ms": statistics.median(rtts),
                "ratio_median": statistics.median(rtts) / (2 * delay) if delay else None,
                "error_ms": _summary(errors),
            }
        )
    return rows


def bench_jitter(wan: WanEmulator, delay_ms: float, jitter_ms: float, count: int) -> dict[str, Any]:
    wan.set_link("a", "b", delay_ms=delay_ms, jitter_ms=jitter_ms, loss_pct=0)
    result = probes.udp_one_way(wan, "a", "b", count, 0.005)
    d = result.one_way_ms
    return {
        "configured_ms": delay_ms,
        "configured_jitter_ms": jitter_ms,
        "samples": len(d),
        "mean_ms": statistics.fmean(d),
        "stdev_ms": statistics.stdev(d),
        "expected_stdev_ms": jitter_ms / math.sqrt(3),
        "min_ms": min(d),
        "max_ms": max(d),
    }


def bench_loss(wan: WanEmulator, losses_pct: list[float], count: int) -> list[dict[str, Any]]:
    rows = []
    for loss in losses_pct:
        wan.set_link("a", "b", delay_ms=1, jitter_ms=0, loss_pct=loss)
        result = probes.udp_one_way(wan, "a", "b", count, 0.0005)
        # The binomial standard deviation of the measured share, for judging the difference.
        sigma = 100 * math.sqrt(loss / 100 * (1 - loss / 100) / count)
        rows.append(
            {"configured_pct": loss, "sent": count, "measured_pct": result.loss_pct, "sigma_pct": sigma}
        )
    wan.set_link("a", "b", loss_pct=0)
    return rows


def bench_rate(
    wan: WanEmulator, cases: Sequence[tuple[float, float]], seconds: float
) -> list[dict[str, Any]]:
    """``cases``: (uplink Mbit/s, 0 = unlimited; one-way delay ms)."""
    rows = []
    for rate, delay_ms in cases:
        wan.set_link("a", "b", delay_ms=delay_ms, jitter_ms=0, loss_pct=0)
        wan.set_rate("a", uplink_mbit=rate)
        result = probes.tcp_bulk(wan, "a", "b", seconds)
        rows.append(
            {
                "configured_mbit": rate or None,
                "one_way_ms": delay_ms,
                "goodput_mbit": result.mbit_s,
                "ratio": result.mbit_s / rate if rate else None,
            }
        )
    wan.set_rate("a", uplink_mbit=0)
    return rows


def run(quick: bool) -> dict[str, Any]:
    n = 100 if quick else 400
    load_before = os.getloadavg()[0]  # other work on the machine shows in the tails
    with WanEmulator(PROFILE, {"a": "lan", "b": "lan"}) as wan:
        wan.reset_stats()
        t0 = time.monotonic()
        one_way = bench_one_way(wan, [0, 10, 25, 75] if not quick else [0, 25], n)
        rtt = bench_rtt(wan, [0, 10, 25, 75] if not quick else [0, 25], 3.0 if quick else 10.0)
        jitter = bench_jitter(wan, 20, 2, n)
        loss = bench_loss(wan, [1, 5, 20], 2000 if quick else 10000)
        rate_cases = [(20, 10), (100, 10), (500, 10), (0, 10), (0, 0)] if not quick else [(20, 10), (0, 0)]
        rate = bench_rate(wan, rate_cases, 2.0 if quick else 4.0)
        stats = wan.delayer_stats()
        elapsed = time.monotonic() - t0
    return {
        "benchmark": "wan",
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "load_average_1min_before": load_before,
            "load_average_1min_after": os.getloadavg()[0],
        },
        "quick": quick,
        "wall_s": elapsed,
        "one_way": one_way,
        "rtt": rtt,
        "jitter": jitter,
        "loss": loss,
        "rate": rate,
        "delayer": {
            "scheduler": stats.scheduler,
            "packets": stats.packets,
            "release_error_mean_us": stats.release_error_mean_us,
            "release_error_max_us": stats.release_error_max_us,
            "release_error_hist_edges_us": [20, 50, 100, 200, 500, 1000, 5000],
            "release_error_hist": list(stats.release_error_hist),
            "read_lag_mean_us": stats.read_lag_mean_us,
            "read_lag_max_us": stats.read_lag_max_us,
            "wake_late_us": stats.wake_late_us,
            "overflow": stats.overflow,
            "enobufs": stats.enobufs,
        },
    }


def print_report(r: dict[str, Any]) -> None:
    m = r["machine"]
    print(f"emulated WAN accuracy ({m['cpus']} CPUs, kernel {m['kernel']}, delayer scheduler "
          f"{r['delayer']['scheduler']}, load average {m['load_average_1min_before']:.1f} before, "
          f"{m['load_average_1min_after']:.1f} after)")  # fmt: skip
    print("\none-way delay (UDP, kernel arrival stamp), error = measured - configured, us")
    print(f"{'configured ms':>14} {'n':>6} {'mean':>8} {'median':>8} {'p99':>8} {'max':>8} {'min':>8}")
    for row in r["one_way"]:
        e = row["error_us"]
        print(f"{row['configured_ms']:>14g} {row['samples']:>6} {e['mean']:>8.1f} {e['median']:>8.1f} "
              f"{e['p99']:>8.1f} {e['max']:>8.1f} {e['min']:>8.1f}")  # fmt: skip
    print("\nround trip (TCP ping-pong, user space to user space), error = measured - configured, ms")
    head = ("configured ms", "n", "median", "ratio", "mean err", "p99 err", "max err")
    print("{:>14} {:>6} {:>9} {:>7} {:>9} {:>8} {:>8}".format(*head))
    for row in r["rtt"]:
        e = row["error_ms"]
        ratio = f"{row['ratio_median']:.4f}" if row["ratio_median"] else "-"
        print(f"{row['configured_rtt_ms']:>14g} {row['samples']:>6} {row['measured_median_ms']:>9.3f} "
              f"{ratio:>7} {e['mean']:>9.3f} {e['p99']:>8.3f} {e['max']:>8.3f}")  # fmt: skip
    j = r["jitter"]
    print(f"\njitter: {j['configured_ms']:g} ms +- {j['configured_jitter_ms']:g} ms uniform -> mean "
          f"{j['mean_ms']:.3f} ms, stdev {j['stdev_ms']:.3f} ms (uniform: {j['expected_stdev_ms']:.3f}), "
          f"range {j['min_ms']:.3f}..{j['max_ms']:.3f} ms")  # fmt: skip
    print("\nloss (UDP)")
    for row in r["loss"]:
        print(f"  configured {row['configured_pct']:g} % -> measured {row['measured_pct']:.2f} % "
              f"of {row['sent']} (binomial sigma {row['sigma_pct']:.2f} %)")  # fmt: skip
    print("\nrate (TCP goodput over the sender's uplink shaper)")
    for row in r["rate"]:
        conf = f"{row['configured_mbit']:g} Mbit/s" if row["configured_mbit"] else "unlimited"
        ratio = f" (ratio {row['ratio']:.3f})" if row["ratio"] else ""
        print(f"  {conf:>14}, {row['one_way_ms']:g} ms one way -> {row['goodput_mbit']:.1f} Mbit/s{ratio}")
    d = r["delayer"]
    print(f"\ndelayer: {d['packets']} packets; release error mean {d['release_error_mean_us']:.1f} us, "
          f"max {d['release_error_max_us']:.0f} us; read lag mean {d['read_lag_mean_us']:.1f} us "
          f"(compensated); learned wake-up lateness {d['wake_late_us']:.1f} us; "
          f"overflow {d['overflow']}, lost netlink messages {d['enobufs']}")  # fmt: skip
    print(f"({r['wall_s']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="accuracy of the emulated WAN")
    parser.add_argument("--quick", action="store_true", help="fewer samples (about 30 s)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "perf" / "wan.json")
    args = parser.parse_args(argv)
    try:
        result = run(args.quick)
    except WanUnavailable as err:
        print(f"cannot run: {err}", file=sys.stderr)
        return 2
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
