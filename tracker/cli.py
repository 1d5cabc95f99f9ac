"""``swarm-tracker``: serve, db upgrade|downgrade|current, keygen, id."""

from __future__ import annotations

import functools
import sys
from typing import Any

import click

from common.cli import EXIT_USAGE, fail
from tracker.config import ConfigError, TrackerConfig, load_config

PROG = "swarm-tracker"


def _config(ctx: click.Context, **flags: Any) -> TrackerConfig:
    try:
        return load_config(file=ctx.obj.get("config_file"), flags=flags)
    except ConfigError as err:
        fail(PROG, str(err), EXIT_USAGE)


@click.group()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML file with tracker settings (also SWARM_TRACKER_CONFIG).",
)
@click.pass_context
def main(ctx: click.Context, config_file: str | None) -> None:
    """Swarm inference tracker: registry of nodes, shards and models; route selection."""
    ctx.ensure_object(dict)
    ctx.obj["config_file"] = config_file


@main.command()
@click.option("--host", default=None, help="Interface to listen on (default 0.0.0.0).")
@click.option("--port", type=int, default=None, help="TCP port; 0 picks a free one (default 7460).")
@click.option("--db-url", default=None, help="SQLAlchemy URL (default: SQLite file in the data dir).")
@click.option("--data-dir", default=None, help="Directory for the key and the SQLite database.")
@click.option("--port-file", default=None, help="Write the bound port to this file once listening.")
@click.option(
    "--key-file", default=None, help="Signing key (replicas share one); default <data-dir>/tracker.key."
)
@click.option(
    "--public-url", default=None, help="This replica's URL as others reach it (dashboard, replicas)."
)
@click.option(
    "--heartbeat-interval-s", type=float, default=None, help="How often nodes are told to heartbeat."
)
@click.option("--heartbeat-timeout-s", type=float, default=None, help="Expire nodes silent this long.")
@click.option(
    "--no-dashboard", "no_dashboard", is_flag=True, default=False, help="Do not serve the dashboard."
)
@click.option(
    "--no-zeroconf", "no_zeroconf", is_flag=True, default=False, help="Do not advertise on the LAN."
)
@click.option(
    "--registered-gateways",
    default=None,
    help="Hex public keys (comma separated) of the gateways whose usage, statistics, spot checks and "
    "evidence are accepted; empty: any gateway (private swarms only).",
)
@click.option(
    "--probation-checks", type=int, default=None, help="Spot checks a node must pass to leave probation."
)
@click.option("--ban-node-s", type=float, default=None, help="How long a node caught lying is banned.")
@click.option(
    "--ban-host-s", type=float, default=None, help="How long new keys from a liar's hosts are refused."
)
@click.option(
    "--no-challenges",
    "no_challenges",
    is_flag=True,
    default=False,
    help="Route to announced nodes without challenging them first (trusted, private swarms).",
)
@click.option("--log-level", default=None, help="debug, info, warning or error.")
@click.pass_context
def serve(
    ctx: click.Context, no_zeroconf: bool, no_dashboard: bool, no_challenges: bool, **flags: Any
) -> None:
    """Run the tracker (a replica, when several share one PostgreSQL database) until SIGINT or SIGTERM."""
    from sqlalchemy.exc import SQLAlchemyError

    from common import logs
    from common.cli import run_service
    from tracker.errors import TrackerError
    from tracker.server import SHUTDOWN_GRACE_S, serve_tracker

    if no_zeroconf:
        flags["zeroconf"] = False
    if no_dashboard:
        flags["dashboard"] = False
    if no_challenges:
        flags["challenge_nodes"] = False
    config = _config(ctx, **flags)
    logs.configure(config.log_level)

    # Start-up failures (port taken, unreadable key, database unreachable) are operator errors
    # (tracker.keys.KeyFileError is an OSError).
    run_service(
        PROG,
        functools.partial(serve_tracker, config),
        grace_s=SHUTDOWN_GRACE_S,
        clear_errors=(OSError, SQLAlchemyError, TrackerError),
        usage_errors=(ConfigError,),
        listening=f"HTTP on {config.host}:{config.port}",
    )


@main.group()
def db() -> None:
    """Database schema (alembic migrations)."""


def _engine(ctx: click.Context, url: str | None) -> Any:
    from tracker.store import make_engine

    config = _config(ctx, db_url=url)
    if not config.db_url:
        config.resolved_data_dir().mkdir(parents=True, exist_ok=True)
    return make_engine(config.resolved_db_url())


@db.command()
@click.option("--url", default=None, help="Database URL (default: the configured one).")
@click.option("--revision", default="head", show_default=True)
@click.pass_context
def upgrade(ctx: click.Context, url: str | None, revision: str) -> None:
    """Apply migrations up to REVISION."""
    from tracker import migrate

    engine = _engine(ctx, url)
    try:
        migrate.upgrade(engine, revision)
        click.echo(f"database at revision {migrate.current_revision(engine)}")
    finally:
        engine.dispose()


@db.command()
@click.option("--url", default=None, help="Database URL (default: the configured one).")
@click.option("--revision", default="-1", show_default=True, help='Target; "base" removes every table.')
@click.pass_context
def downgrade(ctx: click.Context, url: str | None, revision: str) -> None:
    """Revert migrations down to REVISION."""
    from tracker import migrate

    engine = _engine(ctx, url)
    try:
        migrate.downgrade(engine, revision)
        click.echo(f"database at revision {migrate.current_revision(engine)}")
    finally:
        engine.dispose()


@db.command()
@click.option("--url", default=None, help="Database URL (default: the configured one).")
@click.pass_context
def current(ctx: click.Context, url: str | None) -> None:
    """Print the database's revision and the newest one."""
    from tracker import migrate

    engine = _engine(ctx, url)
    try:
        click.echo(f"current {migrate.current_revision(engine)} head {migrate.head_revision()}")
    finally:
        engine.dispose()


@main.command()
@click.option("--data-dir", default=None)
@click.pass_context
def keygen(ctx: click.Context, data_dir: str | None) -> None:
    """Create the tracker key (if absent) and print its id (hex public key)."""
    from tracker.keys import load_or_create_key

    config = _config(ctx, data_dir=data_dir)
    key = load_or_create_key(config.resolved_data_dir())
    click.echo(bytes(key.verify_key).hex())


@main.command("id")
@click.option("--data-dir", default=None)
@click.pass_context
def show_id(ctx: click.Context, data_dir: str | None) -> None:
    """Print the tracker id (hex public key); fails if no key exists yet."""
    from tracker.keys import KEY_FILE, KeyFileError, load_key

    config = _config(ctx, data_dir=data_dir)
    path = config.resolved_data_dir() / KEY_FILE
    if not path.exists():
        click.echo(f"no key at {path}; run `swarm-tracker keygen`", err=True)
        sys.exit(1)
    try:
        key = load_key(path)
    except KeyFileError as err:
        raise click.ClickException(str(err)) from err
    click.echo(bytes(key.verify_key).hex())


if __name__ == "__main__":
    main()
