"""``swarm-gateway``: serve the OpenAI-compatible API in front of a swarm."""

from __future__ import annotations

import functools
import sys
from typing import Any

import click

from common.cli import EXIT_USAGE, fail
from gateway.config import FIELDS, ConfigError, GatewayConfig, load_config

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
@click.option("--host", default=None, help=_help("host"))
@click.option("--port", type=int, default=None, help=_help("port"))
@click.option("--port-file", default=None, help=_help("port_file"))
@click.option("--data-dir", default=None, help=_help("data_dir"))
@click.option("--max-sessions", type=int, default=None, help=_help("max_sessions"))
@click.option("--max-queue", type=int, default=None, help=_help("max_queue"))
@click.option("--max-sessions-per-client", type=int, default=None, help=_help("max_sessions_per_client"))
@click.option("--queue-timeout-s", type=float, default=None, help=_help("queue_timeout_s"))
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
@click.option("--open-timeout-s", type=float, default=None, help=_help("open_timeout_s"))
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


if __name__ == "__main__":
    sys.exit(main())
