"""``swarm-gateway``: serve the OpenAI-compatible API in front of a swarm."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import click

from common.cli import EXIT_USAGE, fail
from common.config import ConfigError
from gateway.config import FIELDS, GatewayConfig, load_config

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
    return str(FIELDS[name].metadata["doc"])


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML file with gateway settings (also SWARM_GATEWAY_CONFIG).",
)
@click.option("--tracker", "tracker_url", default=None, help=_help("tracker_url"))
@click.option("--tracker-id", default=None, help=_help("tracker_id"))
@click.option("--tracker-tls-fingerprint", default=None, help=_help("tracker_tls_fingerprint"))
@click.option("--tracker-ca-file", default=None, help=_help("tracker_ca_file"))
@click.option(
    "--trust-tracker-on-first-use",
    is_flag=True,
    default=None,
    help=_help("trust_tracker_on_first_use"),
)
@click.option("--host", default=None, help=_help("host"))
@click.option("--port", type=int, default=None, help=_help("port"))
@click.option("--port-file", default=None, help=_help("port_file"))
@click.option("--data-dir", default=None, help=_help("data_dir"))
@click.option("--max-sessions", type=int, default=None, help=_help("max_sessions"))
@click.option("--max-queue", type=int, default=None, help=_help("max_queue"))
@click.option("--max-sessions-per-client", type=int, default=None, help=_help("max_sessions_per_client"))
@click.option("--queue-timeout-s", type=float, default=None, help=_help("queue_timeout_s"))
@click.option("--kv-wait-s", type=float, default=None, help=_help("kv_wait_s"))
@click.option("--max-kv-waiters", type=int, default=None, help=_help("max_kv_waiters"))
@click.option("--max-preemptions", type=int, default=None, help=_help("max_preemptions"))
@click.option("--api-keys-file", default=None, help=_help("api_keys_file"))
@click.option(
    "--allow-anonymous/--no-anonymous", "allow_anonymous", default=None, help=_help("allow_anonymous")
)
@click.option("--anonymous-max-tokens", type=int, default=None, help=_help("anonymous_max_tokens"))
@click.option(
    "--anonymous-tokens-per-minute", type=int, default=None, help=_help("anonymous_tokens_per_minute")
)
@click.option("--client-stall-s", type=float, default=None, help=_help("client_stall_s"))
@click.option("--client-send-buffer-bytes", type=int, default=None, help=_help("client_send_buffer_bytes"))
@click.option("--routes-k", type=int, default=None, help=_help("routes_k"))
@click.option("--route-ttl-s", type=float, default=None, help=_help("route_ttl_s"))
@click.option("--prefill-step-tokens", type=int, default=None, help=_help("prefill_step_tokens"))
@click.option("--max-frame-bytes", type=int, default=None, help=_help("max_frame_bytes"))
@click.option("--data-plane", type=click.Choice(["push", "relay"]), default=None, help=_help("data_plane"))
@click.option("--allow-plaintext-nodes", is_flag=True, default=None, help=_help("allow_plaintext_nodes"))
@click.option("--tls-cert-file", default=None, help=_help("tls_cert_file"))
@click.option("--tls-key-file", default=None, help=_help("tls_key_file"))
@click.option("--tls-port", type=int, default=None, help=_help("tls_port"))
@click.option("--tls-port-file", default=None, help=_help("tls_port_file"))
@click.option(
    "--activation-encoding",
    type=click.Choice(["f32", "f16", "int8", "auto"]),
    default=None,
    help=_help("activation_encoding"),
)
@click.option("--auto-f32-min-mbit-s", type=float, default=None, help=_help("auto_f32_min_mbit_s"))
@click.option("--auto-int8-below-mbit-s", type=float, default=None, help=_help("auto_int8_below_mbit_s"))
@click.option("--prefill-pipeline-steps", type=int, default=None, help=_help("prefill_pipeline_steps"))
@click.option("--check-fraction", type=float, default=None, help=_help("check_fraction"))
@click.option("--probation-checks", type=int, default=None, help=_help("probation_checks"))
@click.option(
    "--batch-isolation",
    type=click.Choice(["auto", "off", "checked", "all"]),
    default=None,
    help=_help("batch_isolation"),
)
@click.option("--open-timeout-s", type=float, default=None, help=_help("open_timeout_s"))
@click.option("--dial-timeout-s", type=float, default=None, help=_help("dial_timeout_s"))
@click.option("--avoid-unreachable-s", type=float, default=None, help=_help("avoid_unreachable_s"))
@click.option("--prefill-step-timeout-s", type=float, default=None, help=_help("prefill_step_timeout_s"))
@click.option("--decode-step-timeout-s", type=float, default=None, help=_help("decode_step_timeout_s"))
@click.option(
    "--no-usage-reports", "no_usage", is_flag=True, default=False, help="Do not report usage to the tracker."
)
@click.option("--stats-interval-s", type=float, default=None, help=_help("stats_interval_s"))
@click.option("--public-url", default=None, help=_help("public_url"))
@click.option("--rtt-probe-interval-s", type=float, default=None, help=_help("rtt_probe_interval_s"))
@click.option("--kv-keep-s", type=float, default=None, help=_help("kv_keep_s"))
@click.option("--prefix-min-tokens", type=int, default=None, help=_help("prefix_min_tokens"))
@click.option("--prefix-exact/--prefix-inexact", "prefix_exact", default=None, help=_help("prefix_exact"))
@click.option("--responses-store-max", type=int, default=None, help=_help("responses_store_max"))
@click.option("--responses-store-ttl-s", type=float, default=None, help=_help("responses_store_ttl_s"))
@click.option("--responses-store-max-chars", type=int, default=None, help=_help("responses_store_max_chars"))
@click.option("--model-alias", default=None, help=_help("model_alias"))
@click.option("--cors-origins", default=None, help=_help("cors_origins"))
@click.option("--log-level", default=None, help=_help("log_level"))
def serve(config_file: str | None, no_usage: bool, **flags: Any) -> None:
    """Run the gateway until SIGINT or SIGTERM."""
    from common import logs
    from common.cli import run_service
    from common.keyfile import KeyFileError
    from gateway.server import SHUTDOWN_GRACE_S, serve_gateway

    if no_usage:
        flags["report_usage"] = False
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
