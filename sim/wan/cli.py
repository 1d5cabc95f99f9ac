"""``swarm-sim wan``: inspect profiles, check this machine, remove leftovers of crashed runs."""

from __future__ import annotations

import click

from sim.wan.errors import WanError


@click.group("wan")
def wan() -> None:
    """The emulated WAN (network namespaces and a packet delayer; see docs/wan.md)."""


@wan.command()
def check() -> None:
    """Say whether this machine can emulate a WAN, and if not, why."""
    from sim.wan.support import check_support

    try:
        support = check_support()
    except WanError as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"emulated WAN available: iptables={support.iptables}, delayer={support.delayer}")


@wan.command()
@click.option("--all", "include_live", is_flag=True, help="Also remove the emulations of running processes.")
def cleanup(include_live: bool) -> None:
    """Delete the namespaces (and the processes inside) left by emulations whose owner has died."""
    import os

    from sim.wan.netns import cleanup_leftovers

    if os.geteuid() != 0:
        raise click.ClickException("needs root (it deletes network namespaces)")
    try:
        removed = cleanup_leftovers(include_live=include_live, exclude_pid=os.getpid())
    except WanError as err:
        raise click.ClickException(str(err)) from err
    for name in removed:
        click.echo(f"removed {name}")
    click.echo(f"{len(removed)} namespace(s) removed")


@wan.command()
@click.argument("profile")
@click.option("--nodes", default=3, show_default=True, help="Nodes to place.")
def show(profile: str, nodes: int) -> None:
    """Print PROFILE (a file or a bundled name): regions, round trips, rates, placement."""
    from sim.wan.profile import load_profile

    try:
        p = load_profile(profile)
        hosts = p.place(nodes)
    except WanError as err:
        raise click.ClickException(str(err)) from err
    click.echo(f"{p.name}: {p.description}")
    names = list(p.regions)
    width = max(8, *(len(n) for n in names))
    click.echo("one-way delay ms (jitter, loss %), row -> column:")
    click.echo(" " * width + "".join(f"{n:>22}" for n in names))
    for a in names:
        cells = []
        for b in names:
            link = p.path(a, b)
            cells.append(f"{link.delay_ms:g} (±{link.jitter_ms:g}, {link.loss_pct:g}%)")
        click.echo(f"{a:<{width}}" + "".join(f"{c:>22}" for c in cells))
    for r in p.regions.values():
        up = f"{r.uplink_mbit:g} Mbit/s" if r.uplink_mbit else "unlimited"
        down = f"{r.downlink_mbit:g} Mbit/s" if r.downlink_mbit else "unlimited"
        click.echo(f"region {r.name}: uplink {up}, downlink {down}, shaper queue {r.queue_ms:g} ms")
    click.echo("placement: " + ", ".join(f"{h}={r}" for h, r in hosts.items()))
