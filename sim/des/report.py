"""Writing a run's results: ``result.json`` plus PNG plots (matplotlib, Agg backend).

Per run: ``timeseries.png`` (throughput, sessions, queue, recovering, serving
nodes), ``coverage.png`` (shards per layer over time, per model). For a
comparison: ``compare.json`` (both results and the differences of the key
figures) and ``compare.png`` (the two policies' time series overlaid).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, imported only when a plot is drawn: a run with
    ``--no-plots`` never loads it (a first import on a fresh machine builds the font cache with
    ``fc-list``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")


def plot_run(result: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    ts = result["timeseries"]
    t = ts["t_s"]
    policy = result["policy"]
    title = f"{result['scenario']} ({policy['placement']} placement, {policy['routing']} routing)"
    plt = _pyplot()
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    axes[0].plot(t, ts["tokens_per_s"], color="tab:blue")
    axes[0].set_ylabel("tokens/s served")
    axes[1].plot(t, ts["active_sessions"], label="active sessions")
    axes[1].plot(t, ts["queued"], label="queued requests")
    axes[1].legend(loc="upper left")
    axes[1].set_ylabel("requests")
    axes[2].plot(t, ts["recovering"], color="tab:red")
    axes[2].set_ylabel("sessions recovering")
    axes[3].plot(t, ts["serving_nodes"], color="tab:green")
    axes[3].set_ylabel("serving nodes")
    axes[3].set_xlabel("simulated time (s)")
    fig.suptitle(title)
    fig.tight_layout()
    p1 = out_dir / "timeseries.png"
    fig.savefig(p1, dpi=90)
    plt.close(fig)

    models = ts["coverage_by_model"]
    plt = _pyplot()
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.5 * len(models)), squeeze=False)
    for row, (name, rows) in enumerate(models.items()):
        ax = axes[row][0]
        if rows:
            grid = list(map(list, zip(*rows, strict=True)))  # layers x time
            extent = (t[0], t[-1], len(grid) - 0.5, -0.5) if len(t) > 1 else None
            im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", extent=extent)
            fig.colorbar(im, ax=ax, label="serving shards")
        ax.set_title(f"{name}: shards per layer")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("layer")
        ax2 = axes[row][1]
        ax2.plot(t, [min(r) for r in rows], label="weakest layer")
        ax2.plot(t, [sum(r) / len(r) for r in rows], label="mean over layers")
        ax2.set_title(f"{name}: coverage")
        ax2.set_xlabel("simulated time (s)")
        ax2.legend(loc="upper left")
    fig.tight_layout()
    p2 = out_dir / "coverage.png"
    fig.savefig(p2, dpi=90)
    plt.close(fig)
    return [p1, p2]


_KEY_FIGURES = (
    ("throughput_tokens_per_s", ("metrics", "throughput_tokens_per_s")),
    ("success_rate", ("requests", "success_rate")),
    ("completed", ("requests", "completed")),
    ("failed", ("requests", "failed")),
    ("ttft_p50_s", ("metrics", "ttft_s", "p50")),
    ("ttft_p95_s", ("metrics", "ttft_s", "p95")),
    ("ttft_p99_s", ("metrics", "ttft_s", "p99")),
    ("token_p50_ms", ("metrics", "per_token_latency_ms", "p50")),
    ("token_p95_ms", ("metrics", "per_token_latency_ms", "p95")),
    ("token_p99_ms", ("metrics", "per_token_latency_ms", "p99")),
    ("recoveries", ("metrics", "recovery", "recoveries")),
    ("recovery_time_lost_s", ("metrics", "recovery", "time_lost_s")),
    ("utilization_gini", ("metrics", "load_balance", "utilization_gini")),
    ("utilization_max_over_mean", ("metrics", "load_balance", "utilization_max_over_mean")),
)


def key_figures(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, path in _KEY_FIGURES:
        v: Any = result
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        out[name] = v
    out["min_layer_coverage_mean"] = [c["min_layer_coverage_mean"] for c in result["metrics"]["coverage"]]
    return out


def comparison(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str) -> dict[str, Any]:
    return {
        "scenario": a["scenario"],
        "policies": {label_a: a["policy"], label_b: b["policy"]},
        "key_figures": {label_a: key_figures(a), label_b: key_figures(b)},
        "results": {label_a: a, label_b: b},
    }


def plot_compare(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for res, label in ((a, label_a), (b, label_b)):
        ts = res["timeseries"]
        t = ts["t_s"]
        axes[0][0].plot(t, ts["tokens_per_s"], label=label)
        axes[0][1].plot(t, ts["queued"], label=label)
        weakest = [
            min(min(r) for r in rows_at) for rows_at in zip(*ts["coverage_by_model"].values(), strict=True)
        ]
        axes[1][0].plot(t, weakest, label=label)
        axes[1][1].plot(t, ts["recovering"], label=label)
    for ax, ylabel in (
        (axes[0][0], "tokens/s served"),
        (axes[0][1], "queued requests"),
        (axes[1][0], "weakest layer coverage (shards)"),
        (axes[1][1], "sessions recovering"),
    ):
        ax.set_ylabel(ylabel)
        ax.set_xlabel("simulated time (s)")
        ax.legend(loc="upper left")
    fig.suptitle(f"{a['scenario']}: {label_a} vs {label_b}")
    fig.tight_layout()
    p = out_dir / "compare.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p
