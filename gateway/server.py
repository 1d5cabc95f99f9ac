"""``swarm-gateway serve``: one root nursery holding the service (jobs, usage reporter) and hypercorn.

:func:`serve_gateway` is started with ``nursery.start`` and reports the bound
port (an int) once the socket listens and the port file is written; pass
``on_ready`` to also get the :class:`RunningGateway` (port, URL, service), e.g.
in tests. Set ``shutdown`` (or cancel the surrounding scope) to stop it:
hypercorn drains connections within its graceful timeout, then every gRPC
channel and the tracker client are closed.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hypercorn.config
import hypercorn.trio
import nacl.signing
import trio

from common import files
from common.config import ConfigError
from common.grpc_adapter import open_grpc
from common.keyfile import KeyFileError, load_or_create_key_file
from common.logs import event
from common.tls import TlsError, fingerprint_pem
from common.tracker_client import TrackerClient
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.relay import RelayChannels, RelayHub, carry_challenges_loop, install_relay
from gateway.serving import GatewayService
from gateway.tracker_key import TrackerKey, resolve_tracker_key
from proto.signing import public_key_hex

log = logging.getLogger("swarm.gateway")
SHUTDOWN_GRACE_S = 5.0  # how long open HTTP responses may drain after SIGINT/SIGTERM
KEY_FILE = "gateway.key"


class _HypercornConfig(hypercorn.config.Config):
    """Hypercorn's config, with socket options on the listening sockets (accepted connections
    inherit them):

    * a bounded kernel send buffer: a client that stops reading fills it after
      ``send_buffer_bytes`` and the gateway notices (``client_stall_s``) instead of queueing
      megabytes for it;
    * ``TCP_USER_TIMEOUT`` (Linux) of ``unacked_timeout_s``: a connection whose sent data stays
      unacknowledged that long -- a peer gone, or one that stopped reading and keeps its window
      closed -- is closed by the kernel. Hypercorn writes under a shielded cancel scope and has no
      write timeout of its own, so without this a stalled client would keep its connection.
    """

    send_buffer_bytes = 0
    unacked_timeout_s = 0.0

    def create_sockets(self) -> hypercorn.config.Sockets:
        sockets = super().create_sockets()
        for sock in [*sockets.secure_sockets, *sockets.insecure_sockets]:
            if self.send_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
            if self.unacked_timeout_s > 0 and user_timeout is not None and sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, user_timeout, int(self.unacked_timeout_s * 1000))
        return sockets


@dataclass(frozen=True)
class RunningGateway:
    port: int
    url: str
    service: GatewayService


def load_or_create_key(data_dir: Path) -> nacl.signing.SigningKey:
    """The gateway's ed25519 identity (signs usage reports): ``<data_dir>/gateway.key``, mode 0600."""
    try:
        return load_or_create_key_file(data_dir / KEY_FILE)[0]
    except KeyFileError as err:
        raise ConfigError(str(err)) from err


async def _tracker_url(config: GatewayConfig, tracker_id: str) -> str:
    if config.tracker_url:
        return config.tracker_url
    from common.discovery import discover_tracker_async

    # With the key known, only the tracker that holds it counts (its tickets are all we accept).
    url = await discover_tracker_async(config.discovery_timeout_s, tracker_id or None)
    if url is None:
        raise ConfigError(
            f"no tracker_url given and none found on the LAN within {config.discovery_timeout_s:g} s"
        )
    return url


async def _cert_pin(cert_file: str) -> str:
    """sha256 of the (first) certificate in ``cert_file``: what nodes pin as relay_tls_fingerprint."""
    try:
        pem = await files.run_sync(Path(cert_file).read_bytes)
        return fingerprint_pem(pem)
    except (OSError, TlsError) as err:
        raise ConfigError(f"tls_cert_file: {err}") from err


async def serve_gateway(
    config: GatewayConfig,
    *,
    shutdown: trio.Event | None = None,
    on_ready: Callable[[RunningGateway], None] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    key = await files.run_sync(load_or_create_key, config.resolved_data_dir())
    tracker_key = await resolve_tracker_key(config)
    tracker_url = await _tracker_url(config, tracker_key.known)
    relay = RelayHub(public_key_hex(key), max_frame_bytes=config.max_frame_bytes)
    tracker = TrackerClient(tracker_url, key, tls=config.tracker_tls())
    try:
        async with open_grpc() as grpc_rt:
            channels = RelayChannels(
                grpc_rt,
                max_frame_bytes=config.max_frame_bytes,
                relay=relay,
                allow_plaintext=config.allow_plaintext_nodes,
            )
            service = _service(config, tracker, key, channels, tracker_key)
            await _serve(
                config, service, channels, tracker, relay, tracker_url, shutdown, on_ready, task_status
            )
    finally:
        with trio.CancelScope(shield=True):
            await tracker.aclose()
        event(log, "gateway_stopped")


def _service(
    config: GatewayConfig,
    tracker: TrackerClient,
    key: nacl.signing.SigningKey,
    channels: RelayChannels,
    tracker_key: TrackerKey,
) -> GatewayService:
    try:
        return GatewayService(config, tracker, key, channels, tracker_key=tracker_key)
    except (KeyFileError, UnicodeDecodeError) as err:
        raise ConfigError(f"api keys file {config.resolved_api_keys_file()}: {err}") from err


async def _serve(
    config: GatewayConfig,
    service: GatewayService,
    channels: RelayChannels,
    tracker: TrackerClient,
    relay: RelayHub,
    tracker_url: str,
    shutdown: trio.Event | None,
    on_ready: Callable[[RunningGateway], None] | None,
    task_status: trio.TaskStatus[int],
) -> None:
    service.vocabs.registry = tracker  # registered models' vocabularies need a proof (vocab_store.py)
    app = create_app(service)
    install_relay(app, relay)  # /v1/relay: nodes behind NAT dial in (gateway/relay.py)
    hc = _HypercornConfig()
    hc.send_buffer_bytes = config.client_send_buffer_bytes
    hc.unacked_timeout_s = config.client_stall_s
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = SHUTDOWN_GRACE_S
    # Relay sockets (/v1/relay) may sit idle for minutes: pings keep NAT mappings on the node's side open.
    hc.websocket_ping_interval = 20.0
    if config.tls_cert_file:  # HTTPS, and wss:// for the relay (docs/tls.md)
        hc.certfile, hc.keyfile = config.tls_files()
        if config.tls_port >= 0:  # HTTPS on its own port, plain HTTP stays on port
            hc.insecure_bind, hc.bind = hc.bind, [f"{host}:{config.tls_port}"]
        event(log, "gateway_tls", certificate=hc.certfile, fingerprint=await _cert_pin(hc.certfile))
    # Relay messages are single frames: bounded like the frames a node may send (hypercorn's default
    # would accept 16 MiB); the node's side allows the same margin (node/relay_client.py).
    hc.websocket_max_message_size = config.max_frame_bytes + 64 * 1024
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        if config.stats_interval_s > 0:
            from gateway.stats_report import report_stats_loop

            rtt = None
            if config.rtt_probe_interval_s > 0:  # pings of the routes' nodes, reported with the statistics
                from common.rtt import RttSampler, RttSettings

                rtt = RttSampler(
                    channels.health,
                    service.routes.peers,
                    RttSettings(interval_s=config.rtt_probe_interval_s),
                    own_id=service.gateway_id,
                )
                await nursery.start(rtt.run)
            nursery.start_soon(
                functools.partial(
                    report_stats_loop,
                    service,
                    tracker,
                    interval_s=config.stats_interval_s,
                    timeout_s=config.tracker_timeout_s,
                    url=config.public_url,
                    rtt=rtt,
                )
            )
        from gateway.trust_report import report_trust_loop  # spot checks and verdicts to the tracker

        nursery.start_soon(
            functools.partial(report_trust_loop, service, tracker, timeout_s=config.tracker_timeout_s)
        )
        # Join challenges of the nodes relayed here, carried for the tracker (gateway/relay.py).
        nursery.start_soon(
            functools.partial(carry_challenges_loop, relay, tracker, timeout_s=config.tracker_timeout_s)
        )
        trigger = shutdown.wait if shutdown is not None else None
        async with trio.open_nursery() as http:
            binds = await http.start(
                functools.partial(hypercorn.trio.serve, app, hc, shutdown_trigger=trigger)
            )
            ports = {b.split("://", 1)[0]: int(b.rsplit(":", 1)[1]) for b in reversed(binds)}
            tls_port = ports.get("https") if config.tls_port >= 0 else None
            scheme = "https" if config.tls_cert_file and config.tls_port < 0 else "http"
            port = ports[scheme]
            url = f"{scheme}://{'127.0.0.1' if config.host in ('0.0.0.0', '') else host}:{port}"
            if config.port_file:
                await files.write_port_file(config.port_file, port)
            if config.tls_port_file and tls_port is not None:
                await files.write_port_file(config.tls_port_file, tls_port)
            event(
                log,
                "gateway_listening",
                port=port,
                url=url,
                tracker_url=tracker_url,
                gateway_id=service.gateway_id,
                port_file=config.port_file or None,
                tls_port=tls_port,
            )
            if on_ready is not None:
                on_ready(RunningGateway(port=port, url=url, service=service))
            task_status.started(port)
        # hypercorn returned: the shutdown trigger fired and open responses drained (or were cut
        # after graceful_timeout, which cancelled their jobs: their stages got CANCEL).
        nursery.cancel_scope.cancel()
