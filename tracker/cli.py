"""``swarm-tracker``: serve, db (upgrade, downgrade, current), keygen, id, tls-fingerprint, model ..."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import click

from common.cli import (
    EXIT_FAILED,
    EXIT_USAGE,
    TopicCommand,
    config_options,
    fail,
    tracker_http_tls,
    tracker_tls_options,
)
from common.config import ConfigError
from tracker.config import ENV_PREFIX, TrackerConfig, load_config

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


@main.command(cls=TopicCommand)
@config_options(TrackerConfig, ENV_PREFIX)
@click.pass_context
def serve(ctx: click.Context, **flags: Any) -> None:
    """Run the tracker (a replica, when several share one PostgreSQL database) until SIGINT or SIGTERM.

    Every setting is an option below, a key of the config file (swarm-tracker --config FILE serve) and
    a SWARM_TRACKER_<KEY> variable (one name each: --heartbeat-timeout-s, heartbeat_timeout_s,
    SWARM_TRACKER_HEARTBEAT_TIMEOUT_S); an option beats the variable, which beats the file, which
    beats the default."""
    from sqlalchemy.exc import SQLAlchemyError

    from common import logs
    from common.cli import run_service
    from common.keyfile import KeyFileError
    from tracker.errors import TrackerError
    from tracker.server import SHUTDOWN_GRACE_S, serve_tracker

    config = _config(ctx, **flags)
    logs.configure(config.log_level)

    # Start-up failures (port taken, unreadable key, database unreachable) are operator errors.
    run_service(
        PROG,
        functools.partial(serve_tracker, config),
        grace_s=SHUTDOWN_GRACE_S,
        clear_errors=(OSError, KeyFileError, SQLAlchemyError, TrackerError),
        usage_errors=(ConfigError,),
        listening=f"{'HTTPS' if config.tls else 'HTTP'} on {config.host}:{config.port}",
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
    from common.keyfile import KeyFileError
    from tracker.keys import load_or_create_key

    config = _config(ctx, data_dir=data_dir)
    try:
        key = load_or_create_key(config.resolved_data_dir())
    except KeyFileError as err:
        raise click.ClickException(str(err)) from err
    click.echo(bytes(key.verify_key).hex())


@main.command("id")
@click.option("--data-dir", default=None)
@click.pass_context
def show_id(ctx: click.Context, data_dir: str | None) -> None:
    """Print the tracker id (hex public key); fails if no key exists yet."""
    from common.keyfile import KeyFileError, load_key_file
    from tracker.keys import KEY_FILE

    config = _config(ctx, data_dir=data_dir)
    path = config.resolved_data_dir() / KEY_FILE
    if not path.exists():
        click.echo(f"no key at {path}; run `swarm-tracker keygen`", err=True)
        sys.exit(1)
    try:
        key = load_key_file(path)
    except KeyFileError as err:
        raise click.ClickException(str(err)) from err
    click.echo(bytes(key.verify_key).hex())


@main.command("tls-fingerprint")
@click.option("--data-dir", default=None, help="The tracker's data directory (its self-signed certificate).")
@click.option("--tls-cert-file", default=None, help="A certificate given to the tracker instead.")
@click.pass_context
def tls_fingerprint(ctx: click.Context, data_dir: str | None, tls_cert_file: str | None) -> None:
    """Print the sha256 fingerprint of the tracker's TLS certificate (what --tracker-tls-fingerprint
    pins); fails if there is none yet (start the tracker once with --tls-self-signed)."""
    from common.tls import TlsError, fingerprint_pem

    config = _config(ctx, data_dir=data_dir)
    cert = Path(tls_cert_file).expanduser() if tls_cert_file else config.resolved_tls_files()[0]
    try:
        click.echo(fingerprint_pem(cert.read_bytes()))
    except FileNotFoundError:
        fail(PROG, f"no certificate at {cert}; start the tracker once with --tls-self-signed", EXIT_FAILED)
    except (OSError, TlsError) as err:
        fail(PROG, f"{cert}: {err}", EXIT_FAILED)


@main.group()
def model() -> None:
    """The model registry: models nodes can join by name, with their manifests and download URLs."""


def _signing_key(ctx: click.Context, data_dir: str | None, key_file: str | None) -> Any:
    from common.keyfile import KeyFileError, load_key_file

    config = _config(ctx, data_dir=data_dir, key_file=key_file)
    path = config.resolved_key_file()
    if not path.exists():
        raise click.ClickException(
            f"no signing key at {path}: registry changes are signed with the tracker's key (or a key in "
            "its registry_keys); give --key-file or --data-dir"
        )
    try:
        return load_key_file(path)
    except KeyFileError as err:
        raise click.ClickException(str(err)) from err


def _tracker_call(url: str, tls: Any, key: Any, call: str, *args: Any, timeout_s: float = 60.0) -> Any:
    import httpx
    import trio

    from common.cli import run_once
    from common.tracker_client import TrackerClient, TrackerClientError

    async def go() -> Any:
        async with TrackerClient(url, key, tls=tls) as client:
            with trio.fail_after(timeout_s):
                return await getattr(client, call)(*args)

    return run_once(PROG, go, clear_errors=(TrackerClientError, httpx.HTTPError, trio.TooSlowError, OSError))


@model.command("add")
@click.argument("source")
@click.option("--name", default=None, help="Name nodes join with (default: the GGUF's general.name).")
@click.option(
    "--source",
    "sources",
    multiple=True,
    help="A URL nodes fetch the file from (repeatable; a URL SOURCE is listed by default).",
)
@click.option("--replace", is_flag=True, default=False, help="Re-bind a name registered to another model.")
@click.option("--tracker", "tracker_url", default="http://127.0.0.1:7460", show_default=True)
@click.option("--data-dir", default=None, help="The tracker's data directory (for its key).")
@click.option("--key-file", default=None, help="The signing key (default <data-dir>/tracker.key).")
@tracker_tls_options
@click.pass_context
def model_add(
    ctx: click.Context,
    source: str,
    name: str | None,
    sources: tuple[str, ...],
    replace: bool,
    tracker_url: str,
    data_dir: str | None,
    key_file: str | None,
    tracker_tls_fingerprint: str,
    tracker_ca_file: str,
) -> None:
    """Register the model in SOURCE (a GGUF file or an http(s) URL of one): manifest, name, sources.

    A file is hashed once (its manifest); a URL is described by the manifest published next to it
    (URL.manifest.json) or, without one, by streaming the whole file once.
    """
    import httpx
    from tqdm import tqdm

    from tracker.model_add import ModelAddError, describe_file, describe_url, is_url, registration_payload

    tls = tracker_http_tls(tracker_url, tracker_tls_fingerprint, tracker_ca_file)
    key = _signing_key(ctx, data_dir, key_file)
    urls = list(dict.fromkeys([*([source] if is_url(source) else []), *sources]))
    try:
        if is_url(source):
            with httpx.Client(timeout=httpx.Timeout(60.0), follow_redirects=True) as client:
                bar = tqdm(unit="B", unit_scale=True, desc="hashing", disable=None)

                def seen(n: int, total: int) -> None:
                    bar.total = total
                    bar.update(n)

                described, streamed = describe_url(source, client, seen)
                bar.close()
        else:
            path = Path(source).expanduser()
            if not path.is_file():
                raise click.ClickException(f"{source}: no such file (or give an http(s) URL)")
            with tqdm(
                total=path.stat().st_size, unit="B", unit_scale=True, desc="hashing", disable=None
            ) as bar:
                described = describe_file(path, bar.update)
    except ModelAddError as err:
        raise click.ClickException(str(err)) from err
    payload = registration_payload(described, name, urls, replace)
    answer = _tracker_call(tracker_url, tls, key, "register_model", payload, described.manifest.to_json())
    click.echo(f"fingerprint  {answer['fingerprint']}")
    click.echo(f"name         {answer['name']} ({'new' if answer['created'] else 'updated'})")
    click.echo(
        f"model        {described.architecture}, {described.n_layers} layers, width {described.n_embd}"
    )
    click.echo(f"sources      {', '.join(urls) or '(none: nodes fetch from peers)'}")
    click.echo(
        f"join with    swarm-node start --model {answer['name']!r} --layers auto --tracker {tracker_url}"
        + (f" --tracker-tls-fingerprint {tracker_tls_fingerprint}" if tracker_tls_fingerprint else "")
    )


@model.command("list")
@click.option("--tracker", "tracker_url", default="http://127.0.0.1:7460", show_default=True)
@tracker_tls_options
def model_list(tracker_url: str, tracker_tls_fingerprint: str, tracker_ca_file: str) -> None:
    """Print the registered models (JSON)."""
    import json

    import nacl.signing

    tls = tracker_http_tls(tracker_url, tracker_tls_fingerprint, tracker_ca_file)
    models = _tracker_call(tracker_url, tls, nacl.signing.SigningKey.generate(), "registry_models")
    click.echo(json.dumps(models, indent=2))


@model.command("remove")
@click.argument("model_name")
@click.option("--tracker", "tracker_url", default="http://127.0.0.1:7460", show_default=True)
@click.option("--data-dir", default=None, help="The tracker's data directory (for its key).")
@click.option("--key-file", default=None, help="The signing key (default <data-dir>/tracker.key).")
@tracker_tls_options
@click.pass_context
def model_remove(
    ctx: click.Context,
    model_name: str,
    tracker_url: str,
    data_dir: str | None,
    key_file: str | None,
    tracker_tls_fingerprint: str,
    tracker_ca_file: str,
) -> None:
    """Drop the registration of MODEL_NAME (a name or fingerprint); nodes already serving it go on."""
    tls = tracker_http_tls(tracker_url, tracker_tls_fingerprint, tracker_ca_file)
    key = _signing_key(ctx, data_dir, key_file)
    answer = _tracker_call(tracker_url, tls, key, "unregister_model", model_name)
    click.echo(f"removed {answer['fingerprint']}")


if __name__ == "__main__":
    main()
