"""Scheduling benchmark: the route cost with queueing against the latency-aware cost before it and
against routing blind to distance, in the discrete-event simulator, same scenarios, same seeds.

Usage::

    python3 -m sim.bench_sched --out docs/perf/sim-sched.json [--scenario world_1000 --scenario world_10k]
        [--runs-dir sim-out/sched] [--reuse] [--reference docs/perf/sim-world.json]

Policies (all with the tracker's placement and direct push; docs/simulation.md):

``queueing``
    today's ``tracker.routing`` cost (batch growth, the wait for a slot, the uplink queue) and
    gateways choosing among their pooled routes with ``tracker.routing.repriced_ms``;
``latency-aware``
    the cost model before it, run by the same code: ``occupancy_weight = 1`` and the queueing
    terms 0 (``decode * (1 + (active + queue) / max_sessions)``), gateways scaling a route's
    expected time by its busiest stage's occupancy;
``blind``
    the ``queueing`` policy on snapshots without network coordinates;
``light-legs``
    ``queueing`` with the gateway legs weighted 0.1 (``policy.gateway_leg_weight``): with direct
    push a token's interval is the ring through the stages, the legs to and from the gateway are
    paid once per request (its first token), so routes may sit away from the gateway;
``spread``
    ``light-legs`` plus the spreading term (``policy.recent_busy_ms = 100``: a node busy a share b
    of the last minute or so costs b x 100 ms more), to show what evening out the load costs.

Every run is ``swarm-sim run`` of the scenario with the policy's overrides (``runs-dir/<scenario>-
<policy>/result.json``; ``--reuse`` keeps results already there). ``--reference`` adds the figures
a file of earlier runs recorded (``docs/perf/sim-world.json``: the code before this comparison,
same seeds) under ``reference``. Prints a table, writes the JSON and ``<out>.png`` (per-token
median and p99, TTFT p99, load Gini per scenario and policy).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sim.cli import parse_policy  # noqa: E402
from sim.des.config import load_scenario, with_policy  # noqa: E402
from sim.des.report import write_json  # noqa: E402
from sim.des.simulator import Simulation  # noqa: E402

LEGACY = (
    "policy.batch_growth_per_session=0",
    "policy.queue_wait_weight=0",
    "policy.uplink_queue_share=0",
    "policy.occupancy_weight=1",
    "policy.max_occupancy=1000",
    "gateway.reprice_routes=false",
)
POLICIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "queueing": ("ours", ()),
    "latency-aware": ("ours", LEGACY),
    "blind": ("blind-routing", ()),
    "light-legs": ("ours", ("policy.gateway_leg_weight=0.1",)),
    "spread": ("ours", ("policy.gateway_leg_weight=0.1", "policy.recent_busy_ms=100")),
}
# The policies judged against the goals (the others are what they are judged against).
CANDIDATES = ("queueing", "light-legs", "spread")
# The same runs as shell commands (what the JSON records for reproduction).
COMMANDS = {
    "queueing": "swarm-sim run sim/scenarios/{s}.toml",
    "latency-aware": "swarm-sim run sim/scenarios/{s}.toml " + " ".join(f"--set {x}" for x in LEGACY),
    "blind": "swarm-sim run sim/scenarios/{s}.toml --policy blind-routing",
    "light-legs": "swarm-sim run sim/scenarios/{s}.toml --set policy.gateway_leg_weight=0.1",
    "spread": "swarm-sim run sim/scenarios/{s}.toml --set policy.gateway_leg_weight=0.1 "
    "--set policy.recent_busy_ms=100",
}


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The compared figures of one ``result.json`` (a run of ``swarm-sim run``)."""
    m = result.get("metrics", result)
    balance = m.get("load_balance", {})
    perf = result.get("performance", {})
    return {
        "per_token_ms_p50": m["per_token_latency_ms"]["p50"],
        "per_token_ms_p99": m["per_token_latency_ms"]["p99"],
        "ttft_s_p50": m["ttft_s"]["p50"],
        "ttft_s_p99": m["ttft_s"]["p99"],
        "throughput_tokens_per_s": m["throughput_tokens_per_s"],
        "completed": (result.get("requests") or {}).get("completed"),
        "failed": (result.get("requests") or {}).get("failed"),
        "load_gini": balance.get("utilization_gini"),
        "busiest_over_mean": balance.get("utilization_max_over_mean"),
        "wall_time_s": perf.get("wall_time_s"),
        "coordinates_wall_s": perf.get("coordinates_wall_s"),
        "route_selection_wall_s": perf.get("route_selection_wall_s"),
        "placement_wall_s": perf.get("placement_wall_s"),
    }


def run_one(scenario: str, policy: str, runs_dir: Path, reuse: bool) -> dict[str, Any]:
    out = runs_dir / f"{scenario}-{policy}" / "result.json"
    if reuse and out.exists():
        return json.loads(out.read_text())
    name, overrides = POLICIES[policy]
    sc = load_scenario(ROOT / "sim" / "scenarios" / f"{scenario}.toml", overrides)
    sc = with_policy(sc, *parse_policy(name))
    result = Simulation(sc).run()
    write_json(result, out)
    return result


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals for each candidate policy against latency-aware and blind, per scenario."""
    return {c: _goals(rows[c], rows.get("latency-aware"), rows.get("blind")) for c in CANDIDATES if c in rows}


def _goals(q: dict[str, Any], la: dict[str, Any] | None, bl: dict[str, Any] | None) -> dict[str, Any]:
    if not (la and bl):
        return {}
    return {
        "p99_per_token_le_blind": q["per_token_ms_p99"] <= bl["per_token_ms_p99"],
        "p99_per_token_le_0.8x_latency_aware": q["per_token_ms_p99"] <= 0.8 * la["per_token_ms_p99"],
        "p50_per_token_le_1.1x_latency_aware": q["per_token_ms_p50"] <= 1.1 * la["per_token_ms_p50"],
        "load_gini_le_0.6": (q["load_gini"] or 1.0) <= 0.6,
        "p99_ratio_to_latency_aware": round(q["per_token_ms_p99"] / la["per_token_ms_p99"], 3),
        "p50_ratio_to_latency_aware": round(q["per_token_ms_p50"] / la["per_token_ms_p50"], 3),
    }


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(results)
    policies = [p for p in POLICIES if any(p in rows for rows in results.values())]
    panels = [
        ("per_token_ms_p50", "per-token median (ms)"),
        ("per_token_ms_p99", "per-token p99 (ms)"),
        ("ttft_s_p99", "TTFT p99 (s)"),
        ("load_gini", "load Gini"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4))
    width = 0.8 / len(policies)
    for ax, (key, label) in zip(axes, panels, strict=True):
        for j, pol in enumerate(policies):
            xs = [i + j * width for i in range(len(scenarios))]
            ys = [results[s].get(pol, {}).get(key) or 0.0 for s in scenarios]
            ax.bar(xs, ys, width, label=pol)
        ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(scenarios))], scenarios)
        ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@click.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option(
    "--scenario", "scenarios", multiple=True, default=("world_1000", "world_10k"), show_default=True
)
@click.option("--runs-dir", default="sim-out/sched", show_default=True, type=click.Path(file_okay=False))
@click.option("--reuse", is_flag=True, help="Keep results already in --runs-dir instead of running again.")
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(list(POLICIES)),
    help="Only these policies (default: all); with --reuse, those already run are read.",
)
@click.option(
    "--reference",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="A JSON of earlier runs (docs/perf/sim-world.json) to record next to these.",
)
def main(
    out: str,
    scenarios: tuple[str, ...],
    runs_dir: str,
    reuse: bool,
    policies: tuple[str, ...],
    reference: str | None,
) -> None:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for s in scenarios:
        results[s] = {p: figures(run_one(s, p, Path(runs_dir), reuse)) for p in policies or POLICIES}
    doc: dict[str, Any] = {
        "benchmark": "sim-sched",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "commands": {p: c.format(s="<scenario>") for p, c in COMMANDS.items() if p in (policies or POLICIES)},
        "results": results,
        "goals": {s: goals(rows) for s, rows in results.items()},
    }
    if reference:
        ref = json.loads(Path(reference).read_text())
        doc["reference"] = {
            "file": reference,
            "runs": {
                s: {name: figures(run) for name, run in ref.get(s, {}).get("runs", {}).items()}
                for s in scenarios
                if s in ref
            },
        }
    print(
        f"{'scenario':<11} {'policy':<14} {'p50 ms':>8} {'p99 ms':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'tok/s':>8} {'Gini':>5} {'max/mean':>8} {'wall s':>7}"
    )
    for s, rows in results.items():
        for p, r in rows.items():
            print(
                f"{s:<11} {p:<14} {r['per_token_ms_p50']:>8.1f} {r['per_token_ms_p99']:>8.1f} "
                f"{r['ttft_s_p50']:>9.2f} {r['ttft_s_p99']:>9.2f} {r['throughput_tokens_per_s']:>8.0f} "
                f"{r['load_gini'] or 0:>5.2f} {r['busiest_over_mean'] or 0:>8.1f} "
                f"{r['wall_time_s'] or 0:>7.0f}"
            )
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
