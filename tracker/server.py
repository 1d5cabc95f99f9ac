"""``swarm-tracker serve``: one root nursery holding hypercorn, the periodic work, the dashboard feed
and zeroconf.

:func:`serve_tracker` is started with ``nursery.start`` and reports readiness
with the bound port (an int) once the socket listens, the schema is at head and
the port file is written; pass ``on_ready`` to also receive the
:class:`RunningTracker` (port, URL, the registry), e.g. in tests. Cancel the
surrounding scope, or set ``shutdown``, to stop it; hypercorn then drains
connections within its graceful timeout.

HTTPS (docs/tls.md, "The tracker over HTTPS"): with ``tls_cert_file``/``tls_key_file``, or
``tls_self_signed`` (a certificate made on first start in the data directory and
kept), hypercorn serves TLS itself on ``port``; the certificate's sha256 is
logged (``tracker_tls``) and, when the certificate was made now, printed.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import hypercorn.config
import hypercorn.trio
import nacl.signing
import trio

from common import files
from common.config import ConfigError
from common.discovery import advertise
from common.grpc_adapter import Grpc, open_grpc
from common.logs import event
from common.tls import ServerCert, TlsError, load_or_create_server_cert, load_server_cert
from tracker.app import create_app
from tracker.challenger import Challenger
from tracker.config import TLS_CERT_FILE, TLS_KEY_FILE, TrackerConfig
from tracker.dashboard import DashboardFeed
from tracker.keys import load_or_create_key_at
from tracker.service import Registry
from tracker.store import Store, make_engine

log = logging.getLogger("swarm.tracker")
SHUTDOWN_GRACE_S = 5.0  # how long open HTTP requests may drain after SIGINT/SIGTERM


@dataclass(frozen=True)
class RunningTracker:
    port: int
    url: str
    registry: Registry


def _open_store(config: TrackerConfig) -> tuple[Store, nacl.signing.SigningKey]:
    if not config.db_url:
        config.resolved_data_dir().mkdir(parents=True, exist_ok=True)
    key = load_or_create_key_at(config.resolved_key_file())
    engine = make_engine(config.resolved_db_url())
    return Store(engine), key


def load_tls(config: TrackerConfig) -> tuple[ServerCert, bool]:
    """The certificate the tracker serves HTTPS with, and whether it was made now (ConfigError if
    unusable). Blocking: call in a thread."""
    try:
        if config.tls_cert_file:
            return load_server_cert(*config.resolved_tls_files()), False
        return load_or_create_server_cert(
            config.resolved_data_dir(),
            cert_name=TLS_CERT_FILE,
            key_name=TLS_KEY_FILE,
            common_name="swarm-tracker",
        )
    except TlsError as err:
        raise ConfigError(f"tls: {err}") from err


def _announce_made(cert: ServerCert, cert_path: str) -> None:
    sys.stderr.write(
        f"swarm-tracker: made a self-signed TLS certificate {cert_path}\n"
        f"swarm-tracker: its sha256 fingerprint (nodes and gateways: --tracker-tls-fingerprint):\n"
        f"  {cert.fingerprint}\n"
    )
    sys.stderr.flush()


@asynccontextmanager
async def _grpc_if(wanted: bool) -> AsyncIterator[Grpc | None]:
    """The gRPC runtime the challenges need (tracker/challenger.py), only when challenges are on."""
    if not wanted:
        yield None
        return
    async with open_grpc() as grpc_rt:
        yield grpc_rt


async def serve_tracker(
    config: TrackerConfig,
    *,
    shutdown: trio.Event | None = None,
    on_ready: Callable[[RunningTracker], None] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with _grpc_if(config.challenge_nodes) as grpc_rt:
        await _serve_tracker(config, grpc_rt, shutdown, on_ready, task_status)


async def _serve_tracker(
    config: TrackerConfig,
    grpc_rt: Grpc | None,
    shutdown: trio.Event | None,
    on_ready: Callable[[RunningTracker], None] | None,
    task_status: trio.TaskStatus[int],
) -> None:
    store, key = await trio.to_thread.run_sync(_open_store, config)
    registry: Registry | None = None
    try:
        registry = Registry(store, config, key)
        await registry.start()
        if grpc_rt is not None:
            # Set before the socket listens: no announce goes live unchallenged.
            registry.challenger = Challenger(registry, grpc_rt)
        feed = (
            DashboardFeed(
                registry,
                push_interval_s=config.dashboard_push_interval_s,
                max_clients=config.dashboard_max_clients,
            )
            if config.dashboard
            else None
        )
        app = create_app(registry, feed)
        hc = hypercorn.config.Config()
        host = f"[{config.host}]" if ":" in config.host else config.host
        hc.bind = [f"{host}:{config.port}"]
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")  # through our JSON handler, not hypercorn's own
        hc.graceful_timeout = SHUTDOWN_GRACE_S
        scheme = "http"
        if config.tls:
            cert, made = await files.run_sync(load_tls, config)  # reads, or makes and writes, files
            cert_path, key_path = config.resolved_tls_files()
            hc.certfile, hc.keyfile = str(cert_path), str(key_path)
            scheme = "https"
            event(log, "tracker_tls", certificate=hc.certfile, fingerprint=cert.fingerprint, made_now=made)
            if made:
                _announce_made(cert, hc.certfile)
        async with trio.open_nursery() as nursery:
            trigger = shutdown.wait if shutdown is not None else None
            binds = await nursery.start(
                functools.partial(hypercorn.trio.serve, app, hc, shutdown_trigger=trigger)
            )
            port = int(binds[0].rsplit(":", 1)[1])
            url = f"{scheme}://{'127.0.0.1' if config.host in ('0.0.0.0', '') else host}:{port}"
            await registry.join(config.public_url or url)
            if config.port_file:
                await files.write_port_file(config.port_file, port)
            helpers = trio.CancelScope()

            async def run_helpers(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with helpers:
                    async with trio.open_nursery() as inner:
                        await inner.start(registry.run_periodic)
                        if registry.challenger is not None:
                            await inner.start(registry.challenger.run)
                        if feed is not None:
                            await inner.start(feed.run)
                        if config.zeroconf:
                            await inner.start(advertise, port, registry.tracker_id, config.host, scheme)
                        task_status.started()

            await nursery.start(run_helpers)
            event(
                log,
                "tracker_listening",
                port=port,
                url=url,
                binds=binds,
                tracker_id=registry.tracker_id,
                db=store.dialect,
                replica_id=registry.replica_id,
                dashboard=f"{url}/" if feed is not None else None,
                port_file=config.port_file or None,
            )
            if on_ready is not None:
                on_ready(RunningTracker(port=port, url=url, registry=registry))
            task_status.started(port)
            if shutdown is not None:
                await shutdown.wait()
                helpers.cancel()  # hypercorn drains and returns by itself once the trigger fired
    finally:
        with trio.CancelScope(shield=True):
            if registry is not None and registry.url:
                with trio.move_on_after(2):
                    try:
                        await registry.leave_cluster()
                    except Exception as err:  # the database may be what failed: never mask that
                        event(log, "replica_leave_failed", level=logging.WARNING, error=repr(err))
            await trio.to_thread.run_sync(store.close)
        event(log, "tracker_stopped")
