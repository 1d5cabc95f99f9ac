"""``swarm-sim``: command line of the simulated swarms.

``main`` is a click group; each tool adds its own subcommand (``run`` and
``compare`` live here; others register theirs with ``@main.command()`` in
their own module and import it below, or call ``main.add_command``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from sim.des.config import Scenario, ScenarioError, load_scenario, with_policy

POLICY_HELP = (
    "a policy: 'ours' (tracker placement and routing), 'blind-routing' (tracker routing without "
    "network coordinates, as before them), 'random-placement', 'nearest-routing', 'baseline' (both "
    "baselines), or 'placement=tracker|random,routing=tracker|blind|nearest'"
)

_NAMED = {
    "ours": ("tracker", "tracker"),
    "blind-routing": ("tracker", "blind"),
    "random-placement": ("random", "tracker"),
    "nearest-routing": ("tracker", "nearest"),
    "baseline": ("random", "nearest"),
}


def parse_policy(text: str) -> tuple[str, str]:
    """``(placement, routing)`` from a policy name or ``key=value,...`` list."""
    if text in _NAMED:
        return _NAMED[text]
    placement, routing = "tracker", "tracker"
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("placement", "routing"):
            raise click.BadParameter(f"{text!r}: expected {POLICY_HELP}")
        if key.strip() == "placement":
            placement = value.strip()
        else:
            routing = value.strip()
    return placement, routing


SET_HELP = "override a scenario key: table.key=VALUE (TOML value), repeatable"


def _load(path: str, seed: int | None, duration_s: float | None, overrides: tuple[str, ...] = ()) -> Scenario:
    try:
        sc = load_scenario(path, overrides)
    except (ScenarioError, OSError) as err:
        raise click.ClickException(str(err)) from err
    run = sc.run
    if seed is not None:
        run = dataclasses.replace(run, seed=seed)
    if duration_s is not None:
        run = dataclasses.replace(run, duration_s=duration_s)
    return dataclasses.replace(sc, run=run)


def _print_perf(label: str, result: dict[str, Any]) -> None:
    perf = result["performance"]
    req = result["requests"]
    m = result["metrics"]
    click.echo(
        f"{label}: {perf['events']} events in {perf['wall_time_s']:.1f} s wall "
        f"({perf['events_per_s']:.0f} events/s); {req['arrived']} requests: {req['completed']} completed, "
        f"{req['failed']} failed, {req['in_flight']} in flight; "
        f"{m['throughput_tokens_per_s']:.1f} tokens/s; per-token p50 {m['per_token_latency_ms']['p50']} ms; "
        f"{m['recovery']['recoveries']} recoveries"
    )


@click.group()
def main() -> None:
    """Simulated swarms: discrete-event runs of thousands of volunteer nodes."""


@main.command()
@click.argument("scenario", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="directory for result.json and plots (default: sim-out/<scenario name>)",
)
@click.option("--policy", default=None, help=POLICY_HELP + " (default: the scenario's [policy])")
@click.option("--seed", type=int, default=None, help="override the scenario's seed")
@click.option("--duration-s", type=float, default=None, help="override the simulated duration (s)")
@click.option("--no-plots", is_flag=True, help="write result.json only")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE", help=SET_HELP)
def run(
    scenario: str,
    out_dir: str | None,
    policy: str | None,
    seed: int | None,
    duration_s: float | None,
    no_plots: bool,
    overrides: tuple[str, ...],
) -> None:
    """Run SCENARIO.toml once and write result.json and PNG plots."""
    from sim.des.report import plot_run, write_json
    from sim.des.simulator import run as simulate

    sc = _load(scenario, seed, duration_s, overrides)
    if policy:
        try:
            sc = with_policy(sc, *parse_policy(policy))
        except ScenarioError as err:
            raise click.BadParameter(str(err)) from err
    out = Path(out_dir or Path("sim-out") / sc.run.name)
    result = simulate(sc)
    write_json(result, out / "result.json")
    if not no_plots:
        plot_run(result, out)
    _print_perf(sc.run.name, result)
    click.echo(f"wrote {out / 'result.json'}")


@main.command()
@click.argument("scenario", type=click.Path(exists=True, dir_okay=False))
@click.option("--policy-a", default="ours", show_default=True, help=POLICY_HELP)
@click.option("--policy-b", default="baseline", show_default=True, help=POLICY_HELP)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="directory for compare.json and plots (default: sim-out/<scenario name>-compare)",
)
@click.option("--seed", type=int, default=None, help="override the scenario's seed (same for both)")
@click.option("--duration-s", type=float, default=None, help="override the simulated duration (s)")
@click.option("--no-plots", is_flag=True, help="write compare.json only")
@click.option("--set", "overrides", multiple=True, metavar="TABLE.KEY=VALUE", help=SET_HELP)
@click.option(
    "--set-b",
    "overrides_b",
    multiple=True,
    metavar="TABLE.KEY=VALUE",
    help="override a scenario key for policy B's run only, after --set (e.g. gateway.data_plane='relay' "
    "compares with the data plane before direct push); repeatable",
)
def compare(
    scenario: str,
    policy_a: str,
    policy_b: str,
    out_dir: str | None,
    seed: int | None,
    duration_s: float | None,
    no_plots: bool,
    overrides: tuple[str, ...],
    overrides_b: tuple[str, ...],
) -> None:
    """Run SCENARIO.toml under two policies with the same seed and compare them."""
    from sim.des.report import comparison, key_figures, plot_compare, plot_run, write_json
    from sim.des.simulator import run as simulate

    bases = (
        _load(scenario, seed, duration_s, overrides),
        _load(scenario, seed, duration_s, overrides + overrides_b),
    )
    same = policy_a == policy_b
    labels = (f"A:{policy_a}", f"B:{policy_b}") if same or overrides_b else (policy_a, policy_b)
    results = []
    for base, text in zip(bases, (policy_a, policy_b), strict=True):
        try:
            sc = with_policy(base, *parse_policy(text))
        except ScenarioError as err:
            raise click.BadParameter(str(err)) from err
        results.append(simulate(sc))
    a, b = results
    out = Path(out_dir or Path("sim-out") / f"{bases[0].run.name}-compare")
    report = comparison(a, b, *labels)
    report["overrides"] = {"both": list(overrides), "b": list(overrides_b)}
    write_json(report, out / "compare.json")
    if not no_plots:
        plot_compare(a, b, *labels, out)
        for res, label in zip(results, labels, strict=True):
            plot_run(res, out / label.replace(":", "_").replace("=", "-").replace(",", "_"))
    for res, label in zip(results, labels, strict=True):
        _print_perf(label, res)
    fa, fb = key_figures(a), key_figures(b)
    width = max(len(k) for k in fa)
    if overrides_b:
        click.echo(f"{labels[1]} also ran with: {'; '.join(overrides_b)}")
    click.echo(f"{'':{width}}  {labels[0]:>20}  {labels[1]:>20}")
    for k in fa:
        click.echo(f"{k:{width}}  {fa[k]!s:>20}  {fb[k]!s:>20}")
    click.echo(f"wrote {out / 'compare.json'}")


# The local multi-process swarm (tracker, nodes, gateway as real processes).
from sim.launcher import up  # noqa: E402

main.add_command(up)

# The emulated WAN's own commands (check, cleanup, show).
from sim.wan.cli import wan  # noqa: E402

main.add_command(wan)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
