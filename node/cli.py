"""``swarm-node``: the volunteer's command line."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import click

from common.cli import TopicCommand, config_options, tracker_http_tls, tracker_tls_options
from common.config import ConfigError
from node.config import ENV_PREFIX, NodeConfig
from node.errors import NodeError

PROG = "swarm-node"


def default_cache_dir() -> Path:
    base = os.environ.get("SWARM_NODE_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "swarm-node"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Serve a shard of a language model to a swarm."""


@main.group()
def shard() -> None:
    """Prepare shard files."""


@shard.command("extract")
@click.option(
    "--model",
    "model_spec",
    required=True,
    help="Whole-model GGUF file, an http(s) URL of one, or a model name/fingerprint the tracker knows.",
)
@click.option("--layers", required=True, help="Half-open layer range START:END, e.g. 0:15.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Where shards are written.")
@click.option("--manifest", "manifest_arg", default="", help="The model's manifest (FILE or URL) for a URL.")
@click.option("--tracker", "tracker_url", default="", help="Tracker whose model registry resolves --model.")
@click.option(
    "--peer", "peers", multiple=True, help="A node (HOST:PORT) to fetch span bytes from (repeatable)."
)
@click.option("--stall-timeout-s", type=float, default=60.0, show_default=True, help="Give up a read after.")
@tracker_tls_options
def shard_extract(
    model_spec: str,
    layers: str,
    cache_dir: Path | None,
    manifest_arg: str,
    tracker_url: str,
    peers: tuple[str, ...],
    stall_timeout_s: float,
    tracker_tls_fingerprint: str,
    tracker_ca_file: str,
) -> None:
    """Write the partial GGUF holding layers START..END-1 of MODEL (fetching only those bytes for a URL)."""
    from node.assemble import is_url
    from node.progress import Progress
    from node.shard import extract_shard, parse_layers

    cache = cache_dir or default_cache_dir()
    local = Path(model_spec).expanduser()
    fetched = ""
    if local.is_file() or not (is_url(model_spec) or tracker_url or peers):
        try:
            files = extract_shard(local, *_layers_syntax(layers), cache, progress=Progress)
        except NodeError as err:
            raise click.ClickException(str(err)) from err
    else:
        from common.cli import run_once

        tls = tracker_http_tls(tracker_url, tracker_tls_fingerprint, tracker_ca_file)
        run = functools.partial(
            _extract_remote, model_spec, layers, cache, manifest_arg, tracker_url, peers, stall_timeout_s, tls
        )
        files, fetched = run_once(PROG, run, clear_errors=(NodeError, OSError))
    meta = files.model
    parse_layers(f"{files.start}:{files.end}", meta.n_layers, meta.split_points)
    click.echo(f"model        {meta.name} ({meta.architecture}, {meta.n_layers} layers, width {meta.n_embd})")
    click.echo(f"fingerprint  {meta.fingerprint}")
    size = files.size_bytes()
    click.echo(f"shard        [{files.start}, {files.end}) -> {files.path} ({size / 1e6:.1f} MB)")
    if files.embeddings_path:
        click.echo(f"embeddings   {files.embeddings_path}")
    if fetched:
        click.echo(f"fetched      {fetched}")


def _layers_syntax(spec: str) -> tuple[int, int]:
    from node.shard import parse_layers

    try:
        return parse_layers(spec, 1 << 30)
    except NodeError as err:
        raise click.ClickException(str(err)) from err


async def _extract_remote(
    spec: str,
    layers: str,
    cache: Path,
    manifest_arg: str,
    tracker_url: str,
    peers: tuple[str, ...],
    stall_timeout_s: float,
    tls: Any,
) -> tuple[Any, str]:
    import contextlib

    import nacl.signing

    from common.grpc_adapter import open_grpc
    from node.assemble import assemble_shard, byte_sources, http_client, prepare_remote, resolve
    from node.progress import Progress
    from node.shard import parse_layers

    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(http_client(stall_timeout_s))
        grpc_rt = await stack.enter_async_context(open_grpc())
        tracker = None
        if tracker_url:
            from common.tracker_client import TrackerClient

            # Registry reads are not signed: a throw-away key satisfies the client.
            tracker = await stack.enter_async_context(
                TrackerClient(tracker_url, nacl.signing.SigningKey.generate(), tls=tls)
            )
        source = await resolve(
            spec, cache_dir=cache, client=client, tracker=tracker, grpc_rt=grpc_rt,
            manifest_arg=manifest_arg, peers=list(peers),
        )  # fmt: skip
        sources = byte_sources(source, client, grpc_rt)
        prepared = await prepare_remote(source, cache, sources)
        start, end = parse_layers(layers, prepared.meta.n_layers, prepared.meta.split_points)
        done = await assemble_shard(
            source, start, end, cache, sources, progress=Progress, stall_timeout_s=stall_timeout_s
        )
        if done.statistics is None:
            return done.files, "nothing (already complete in the cache)"
        st = done.statistics
        by = ", ".join(f"{k}: {v / 1e6:.1f} MB" for k, v in st.bytes_by_source.items())
        return done.files, (
            f"{(st.bytes_needed - st.bytes_resumed) / 1e6:.1f} MB of tensors ({by or 'resumed'}) "
            f"in {st.elapsed_s:.1f} s; {st.bytes_resumed / 1e6:.1f} MB resumed; "
            f"{st.refetched_tensors} tensor(s) refused and fetched again"
        )


@main.group()
def model() -> None:
    """Model manifests (what identifies a model without its whole file)."""


@model.command("manifest")
@click.argument("model_path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--output", "-o", type=click.Path(path_type=Path), default=None, help="Write here (default stdout)."
)
@click.option(
    "--cache-dir", type=click.Path(path_type=Path), default=None, help="Reuse/keep the result here."
)
def model_manifest(model_path: Path, output: Path | None, cache_dir: Path | None) -> None:
    """Hash MODEL into its manifest (JSON); publish it next to the file as FILE.manifest.json.

    The model's fingerprint, printed on stderr, is the sha256 of these bytes.
    """
    from node.fingerprint import local_manifest
    from node.progress import Progress

    try:
        with Progress("verifying", model_path.stat().st_size, model_path.name) as bar:
            manifest = local_manifest(model_path, cache_dir or default_cache_dir(), bar.update)
    except NodeError as err:
        raise click.ClickException(str(err)) from err
    data = manifest.canonical_bytes()
    if output is None:
        click.echo(data.decode())
    else:
        from common.files import write_atomic_sync

        write_atomic_sync(output, data)
    click.echo(f"fingerprint {manifest.fingerprint()}", err=True)


@shard.command("vocab")
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path))
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None)
@click.option(
    "--fingerprint",
    default=None,
    help="The model's fingerprint (manifest digest); required when --model is a header-only copy.",
)
def shard_vocab(model_path: Path, cache_dir: Path | None, fingerprint: str | None) -> None:
    """Write the metadata-only GGUF a gateway tokenizes with."""
    from node.shard import extract_vocab

    try:
        path = extract_vocab(model_path, cache_dir or default_cache_dir(), fingerprint=fingerprint)
    except NodeError as err:
        raise click.ClickException(str(err)) from err
    click.echo(str(path))


def _load(config_file: str | None, flags: dict[str, Any]) -> Any:
    from common.cli import EXIT_USAGE, fail
    from node.config import load_config

    try:
        return load_config(file=config_file, flags=flags)
    except ConfigError as err:
        fail(PROG, str(err), EXIT_USAGE)


@main.command(cls=TopicCommand)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML file with node settings (top-level keys or a [node] table; also SWARM_NODE_CONFIG).",
)
@config_options(NodeConfig, ENV_PREFIX)
def start(config_file: str | None, **flags: Any) -> None:
    """Serve a shard: gRPC ShardService, admin HTTP, announce and heartbeats; until SIGINT/SIGTERM.

    Every setting is an option below, a key of the config file and a SWARM_NODE_<KEY> variable (one
    name each: --max-sessions, max_sessions, SWARM_NODE_MAX_SESSIONS); an option beats the
    variable, which beats the file, which beats the default."""

    from common import logs
    from common.cli import run_service
    from common.keyfile import KeyFileError
    from common.llama import LlamaError
    from node.daemon import run_node

    config = _load(config_file, flags)
    logs.configure(config.log_level)
    pid_file = _claim_pid_file(config.resolved_data_dir())

    # Start-up refusals (bad model file, layer range, key file, port in use) end with one clear line.
    try:
        run_service(
            PROG,
            functools.partial(run_node, config),
            grace_s=config.shutdown_grace_s,
            clear_errors=(NodeError, KeyFileError, LlamaError, OSError),
            usage_errors=(ConfigError,),
            listening=f"admin HTTP on {config.admin_host}:{config.admin_port}",  # gRPC names its own
        )
    finally:
        pid_file.unlink(missing_ok=True)


PID_FILE = "node.pid"


def _running_node(pid_file: Path) -> int | None:
    """The pid in ``pid_file`` if that process is alive and is a swarm node, else None."""
    import psutil

    try:
        pid = int(pid_file.read_text().strip())
        proc = psutil.Process(pid)
        cmdline = " ".join(proc.cmdline())
    except (OSError, ValueError, psutil.Error):
        return None
    if pid == os.getpid() or ("swarm-node" not in cmdline and "node.cli" not in cmdline):
        return None
    return pid


def _claim_pid_file(data_dir: Path) -> Path:
    """Write ``<data_dir>/node.pid`` for ``swarm-node stop``; refuse a second node on one data dir
    (it would share the first one's identity)."""
    path = data_dir / PID_FILE
    other = _running_node(path)
    if other is not None:
        raise click.ClickException(
            f"a node with this data directory is running already (pid {other}); "
            f"stop it with 'swarm-node stop --data-dir {data_dir}' or use another --data-dir"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(PID_FILE + ".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, path)
    return path


@main.command()
@click.option("--data-dir", default=None, help="Data directory of the node to stop (default ~/.swarm/node).")
@click.option("--timeout-s", type=float, default=60.0, show_default=True, help="How long to wait for it.")
def stop(data_dir: str | None, timeout_s: float) -> None:
    """Stop a running node gracefully: it tells the tracker it leaves, then drains its sessions."""
    import signal

    import psutil

    config = _load(None, {"data_dir": data_dir})
    path = config.resolved_data_dir() / PID_FILE
    pid = _running_node(path)
    if pid is None:
        path.unlink(missing_ok=True)
        raise click.ClickException(f"no running node with data directory {config.resolved_data_dir()}")
    os.kill(pid, signal.SIGTERM)
    click.echo(f"sent SIGTERM to node pid {pid}; waiting up to {timeout_s:g} s for it to drain ...", err=True)
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # Not our child: poll. A zombie (exited, not yet reaped by its parent) has stopped.
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        if time.monotonic() > deadline:
            raise click.ClickException(f"node pid {pid} still running after {timeout_s:g} s")
        time.sleep(0.1)
    click.echo("stopped")


def _first_clear_error(group: BaseExceptionGroup[BaseException]) -> Exception | None:
    for exc in group.exceptions:
        if isinstance(exc, NodeError | ConfigError | OSError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_clear_error(exc)
            if found is not None:
                return found
    return None


@main.command()
@click.option("--data-dir", default=None, help="Directory of the node key (default ~/.swarm/node).")
def keygen(data_dir: str | None) -> None:
    """Create the node key if it does not exist yet; print the node id."""
    from common.keyfile import KeyFileError
    from node.identity import load_or_create_key, node_id

    config = _load(None, {"data_dir": data_dir})
    try:
        key, created = load_or_create_key(config.resolved_data_dir())
    except KeyFileError as err:
        raise click.ClickException(str(err)) from err
    click.echo(node_id(key))
    click.echo(f"{'created' if created else 'exists '} {config.resolved_data_dir() / 'node.key'}", err=True)


@main.command("id")
@click.option("--data-dir", default=None, help="Directory of the node key (default ~/.swarm/node).")
def show_id(data_dir: str | None) -> None:
    """Print the node id (hex ed25519 public key); fails if there is no key yet."""
    from common.keyfile import KeyFileError, load_key_file
    from node.identity import key_path, node_id

    config = _load(None, {"data_dir": data_dir})
    path = key_path(config.resolved_data_dir())
    if not path.exists():
        raise click.ClickException(f"no node key at {path}; run 'swarm-node keygen' or 'swarm-node start'")
    try:
        click.echo(node_id(load_key_file(path)))
    except KeyFileError as err:
        raise click.ClickException(str(err)) from err


@main.command()
@click.option("--admin-url", default=None, help="Admin HTTP base URL (default http://127.0.0.1:7471).")
@click.option("--address", default=None, help="Ask a node's gRPC Info at HOST:PORT instead.")
@click.option("--timeout-s", type=float, default=5.0, show_default=True)
@tracker_tls_options
def status(
    admin_url: str | None,
    address: str | None,
    timeout_s: float,
    tracker_tls_fingerprint: str,
    tracker_ca_file: str,
) -> None:
    """Show a running node's state (admin /status, or gRPC Info with --address)."""
    import json

    if address:
        import trio
        from google.protobuf.json_format import MessageToDict

        from common.cli import run_once
        from common.grpc_adapter import UNPINNED, RpcError, open_grpc
        from proto.swarm.v1 import shard_service_pb2

        async def ask() -> bytes:
            async with open_grpc() as rt:
                with trio.fail_after(timeout_s):
                    request = shard_service_pb2.InfoRequest().SerializeToString()
                    # A look at a node, not trusted: TLS if it serves TLS, whatever its certificate.
                    return await rt.unary(address, "/swarm.v1.ShardService/Info", request, pin=UNPINNED)

        reply = run_once(PROG, ask, clear_errors=(RpcError, trio.TooSlowError))
        info = shard_service_pb2.NodeInfo.FromString(reply)
        click.echo(json.dumps(MessageToDict(info, preserving_proto_field_name=True), indent=2))
        return
    import httpx

    url = (admin_url or "http://127.0.0.1:7471").rstrip("/") + "/status"
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as err:
        raise click.ClickException(f"{url}: {err!r}") from err
    if response.status_code != 200:
        raise click.ClickException(f"{url}: HTTP {response.status_code}")
    body = response.json()
    if body.get("tracker") and body.get("node_id"):
        # The node's own pin unless told otherwise (its admin API is local; what it trusts, we trust).
        pin = tracker_tls_fingerprint or (
            "" if tracker_ca_file else str(body.get("tracker_tls_fingerprint") or "")
        )
        tls = tracker_http_tls(str(body["tracker"]), pin, tracker_ca_file)
        body["contribution"] = _contribution(str(body["tracker"]), str(body["node_id"]), timeout_s, tls)
    click.echo(json.dumps(body, indent=2))
    if isinstance(body.get("contribution"), dict) and "all_time" in body["contribution"]:
        c = body["contribution"]
        click.echo(
            f"contribution (usage ledger): {c['last_hour']['tokens']} tokens in the last hour, "
            f"{c['last_24h']['tokens']} in 24 h, {c['all_time']['tokens']} in all "
            f"({c['all_time']['requests']} requests)",
            err=True,
        )


@main.command()
@click.option("--tracker", "tracker_url", required=True, help="The tracker's URL.")
@click.option(
    "--data-dir", default="~/.swarm/node", show_default=True, help="The node's data directory (its key)."
)
@click.option("--node-id", default=None, help="Check another node's ledger (default: this data dir's node).")
@click.option(
    "--tracker-id",
    default=None,
    help="The tracker key receipts must carry (pin it); default: what the tracker says it is (unpinned).",
)
@click.option("--since", type=float, default=0.0, show_default=True, help="Rows from this UNIX time on.")
@click.option("--timeout-s", type=float, default=10.0, show_default=True)
@tracker_tls_options
def ledger(
    tracker_url: str,
    data_dir: str,
    node_id: str | None,
    tracker_id: str | None,
    since: float,
    timeout_s: float,
    tracker_tls_fingerprint: str,
    tracker_ca_file: str,
) -> None:
    """Fetch this node's usage ledger and check every row: the gateway's signed report lists the node
    with exactly its tokens, and the tracker signed a receipt of that report (proto.ledger).

    Prints a JSON summary; exits with status 1 when a row does not check out."""
    import json

    import httpx
    import nacl.signing
    import trio

    from common.cli import run_once
    from common.keyfile import load_key_file
    from common.tracker_client import TrackerClient, TrackerClientError
    from node.identity import key_path
    from node.identity import node_id as id_of
    from proto.ledger import LedgerError, verify_ledger_entry

    tls = tracker_http_tls(tracker_url, tracker_tls_fingerprint, tracker_ca_file)
    node = node_id or id_of(load_key_file(key_path(Path(data_dir).expanduser())))

    async def fetch() -> tuple[str, list[dict[str, Any]]]:
        # Reads only: a throw-away key satisfies the client.
        async with TrackerClient(tracker_url, nacl.signing.SigningKey.generate(), tls=tls) as client:
            with trio.fail_after(timeout_s):
                pinned = tracker_id or str((await client.healthz())["tracker_id"])
            rows: list[dict[str, Any]] = []
            cursor: float | None = since
            while cursor is not None and len(rows) < 1_000_000:
                with trio.fail_after(timeout_s):
                    body = await client.node_ledger(node, since_s=cursor, limit=1000)
                seen = {(r["gateway_id"], r["request_id"]) for r in rows}
                fresh = [r for r in body["entries"] if (r["gateway_id"], r["request_id"]) not in seen]
                rows += fresh
                cursor = body["next_since"] if fresh else None  # a page of nothing new: done
            return pinned, rows

    pinned, rows = run_once(
        PROG,
        fetch,
        clear_errors=(TrackerClientError, httpx.HTTPError, trio.TooSlowError, OSError, ValueError, KeyError),
    )
    by_gateway: dict[str, int] = {}
    failures = []
    for row in rows:
        try:
            report = verify_ledger_entry(row, node_id=node, tracker_public_key=pinned)
        except LedgerError as err:
            failures.append({"request_id": row.get("request_id"), "error": str(err)})
            continue
        by_gateway[report.gateway_id] = by_gateway.get(report.gateway_id, 0) + int(row["tokens"])
    summary = {
        "node_id": node,
        "tracker_id": pinned,
        "tracker_id_pinned": tracker_id is not None,
        "rows": len(rows),
        "verified": len(rows) - len(failures),
        "tokens_verified": sum(by_gateway.values()),
        "tokens_by_gateway": by_gateway,
        "failures": failures[:100],
    }
    click.echo(json.dumps(summary, indent=2))
    if failures:
        sys.exit(1)


def _contribution(tracker: str, node: str, timeout_s: float, tls: Any) -> dict[str, Any]:
    """What the tracker's ledger credits this node with (the first replica that answers)."""
    import httpx
    import nacl.signing
    import trio

    from common.tracker_client import TrackerClient, TrackerClientError

    async def ask() -> dict[str, Any]:
        async with TrackerClient(tracker, nacl.signing.SigningKey.generate(), tls=tls) as client:
            with trio.fail_after(timeout_s):
                return await client.node_usage(node)

    try:
        return trio.run(ask)
    except (TrackerClientError, httpx.HTTPError, trio.TooSlowError, OSError, ValueError) as err:
        return {"error": str(err)}


if __name__ == "__main__":
    sys.exit(main())
