"""``swarm-gateway``: serve the OpenAI-compatible API in front of a swarm."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import click

from common.cli import EXIT_USAGE, TopicCommand, config_options, fail
from common.config import ConfigError, help_of
from gateway.config import ENV_PREFIX, FIELDS, GatewayConfig, load_config

PROG = "swarm-gateway"


def _config(config_file: str | None, **flags: Any) -> GatewayConfig:
    try:
        return load_config(file=config_file, flags=flags)
    except ConfigError as err:
        fail(PROG, str(err), EXIT_USAGE)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Swarm inference gateway: OpenAI-compatible API over Route Sessions."""


def _help(name: str) -> str:
    return help_of(FIELDS[name])


@main.command(cls=TopicCommand)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML file with gateway settings (top-level keys or a [gateway] table; also SWARM_GATEWAY_CONFIG).",
)
@config_options(GatewayConfig, ENV_PREFIX)
def serve(config_file: str | None, **flags: Any) -> None:
    """Run the gateway until SIGINT or SIGTERM.

    Every setting is an option below, a key of the config file and a SWARM_GATEWAY_<KEY> variable (one
    name each: --max-sessions, max_sessions, SWARM_GATEWAY_MAX_SESSIONS); an option beats the
    variable, which beats the file, which beats the default."""
    from common import logs
    from common.cli import run_service
    from common.keyfile import KeyFileError
    from gateway.server import SHUTDOWN_GRACE_S, serve_gateway

    config = _config(config_file, **flags)
    logs.configure(config.log_level)

    # Start-up failures (port taken, no tracker found, unreadable key) end with one clear line.
    run_service(
        PROG,
        functools.partial(serve_gateway, config),
        grace_s=SHUTDOWN_GRACE_S,
        clear_errors=(OSError, KeyFileError),
        usage_errors=(ConfigError,),
        listening=f"HTTP on {config.host}:{config.port}",
    )


@main.group()
def keys() -> None:
    """API keys: add (prints the key once), list, revoke. The gateway stores only their SHA-256."""


def _keys_options(f: Any) -> Any:
    f = click.option(
        "--keys-file",
        default=None,
        help="the key file (default: api_keys_file of the config, else <data_dir>/api-keys.jsonl)",
    )(f)
    f = click.option("--data-dir", default=None, help=_help("data_dir"))(f)
    return click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False),
        default=None,
        help="TOML settings.",
    )(f)


def _keys_path(config_file: str | None, data_dir: str | None, keys_file: str | None) -> Path:
    if keys_file:
        return Path(keys_file).expanduser()
    return _config(config_file, data_dir=data_dir).resolved_api_keys_file()


def _read_keys(path: Path) -> list[Any]:
    from common.keyfile import KeyFileError
    from gateway.api_keys import parse_key_file

    try:
        return parse_key_file(path.read_text(encoding="utf-8")) if path.exists() else []
    except (KeyFileError, OSError, UnicodeDecodeError) as err:
        fail(PROG, f"{path}: {err}", EXIT_USAGE)


def _write_keys(path: Path, records: list[Any]) -> None:
    from common.files import write_atomic_sync
    from gateway.api_keys import format_key_file

    write_atomic_sync(path, format_key_file(records).encode(), mode=0o600)


@keys.command("add")
@_keys_options
@click.option("--name", required=True, help="who the key is for (shown by list; 1-64 characters)")
@click.option("--max-sessions", type=int, default=0, help="requests running at once; 0 = no limit")
@click.option("--tokens-per-minute", type=int, default=0, help="prompt + completion tokens per minute")
@click.option("--max-tokens", type=int, default=0, help="completion tokens per request (and the default)")
def keys_add(
    config_file: str | None,
    data_dir: str | None,
    keys_file: str | None,
    name: str,
    max_sessions: int,
    tokens_per_minute: int,
    max_tokens: int,
) -> None:
    """Make a key and print it (once: only its hash is stored)."""
    import time

    from common.keyfile import KeyFileError
    from gateway.api_keys import Limits, make_record, new_key

    path = _keys_path(config_file, data_dir, keys_file)
    records = _read_keys(path)
    if any(r.name == name for r in records):
        fail(PROG, f"a key named {name!r} exists already (revoke it first)", EXIT_USAGE)
    key = new_key()
    try:
        record = make_record(key, name, int(time.time()), Limits(max_sessions, tokens_per_minute, max_tokens))
    except KeyFileError as err:
        fail(PROG, str(err), EXIT_USAGE)
    _write_keys(path, [*records, record])
    click.echo(key)
    click.echo(f"{record.id} {name}: store the key now, it is not shown again ({path})", err=True)


@keys.command("list")
@_keys_options
def keys_list(config_file: str | None, data_dir: str | None, keys_file: str | None) -> None:
    """Print the keys in force: id, name, limits (0 = none), created (UTC)."""
    import time

    for r in _read_keys(_keys_path(config_file, data_dir, keys_file)):
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.created)) if r.created else "-"
        limits = r.limits
        click.echo(
            f"{r.id}  {r.name}  max_sessions={limits.max_sessions} "
            f"tokens_per_minute={limits.tokens_per_minute} max_tokens={limits.max_tokens}  {created}"
        )


@keys.command("revoke")
@_keys_options
@click.argument("key_ref")
def keys_revoke(config_file: str | None, data_dir: str | None, keys_file: str | None, key_ref: str) -> None:
    """Remove a key (by id, name or id prefix); a running gateway stops accepting it within seconds."""
    from gateway.api_keys import find

    path = _keys_path(config_file, data_dir, keys_file)
    records = _read_keys(path)
    hits = find(records, key_ref)
    if len(hits) != 1:
        fail(PROG, f"{key_ref!r} matches {len(hits)} keys (give an id or a name)", EXIT_USAGE)
    _write_keys(path, [r for r in records if r is not hits[0]])
    click.echo(f"revoked {hits[0].id} {hits[0].name}")


if __name__ == "__main__":
    sys.exit(main())
