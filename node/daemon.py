"""``swarm-node start``: one trio run, one root nursery, readiness through ``nursery.start``.

Start-up, in order (each step logs one event):

1. identity (``node.key`` in the data dir, created on first start);
2. the tracker: ``tracker_url`` or zeroconf discovery;
3. the model, its layers and the shard files (``node.joining``): a local file
   or a URL / registry name (only the span's bytes fetched and verified),
   ``layers=auto`` sized to this node's memory and asked of the tracker, the
   GPU offload; then the vocabulary file;
4. the engine, then a short benchmark of it, then the hardware probe;
5. the scheduler, the lease timer, the gRPC server (port written to
   ``port_file``; it also serves the span's bytes to joining nodes), the
   admin HTTP server;
6. announce + heartbeats in the background (retrying while the tracker is away).

:func:`run_node` reports a :class:`NodeReady` once the gRPC port serves.
Shutdown (``shutdown`` event, or SIGINT/SIGTERM in the CLI, or ``swarm-node
stop``): heartbeats stop and a signed leave tells the tracker (at most
``LEAVE_TIMEOUT_S``), which stops routing to the node at once; new sessions are
refused, every session's KV is freed, gRPC streams get ``shutdown_grace_s`` to
finish, the engine is closed. A node killed without that expires at the
tracker after its heartbeat timeout.

The tracker URL may list several replicas (commas); calls fail over between them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import math
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import trio

from common.files import read_bytes, write_port_file
from common.grpc_adapter import open_grpc
from common.logs import event
from common.rtt import RttSampler, RttSettings, parse_hints
from common.tls_http import pin_refusal
from node import failpoints
from node.admin import AdminServer
from node.config import ConfigError, NodeConfig
from node.drafting import max_drafts_for
from node.hub import Hub
from node.identity import load_or_create_key, node_id
from node.metrics import Metrics, TimedBackend, timed_outcomes
from node.push import PushLinks
from node.rtt import node_sampler
from node.session_machine import FrameServer, ServingSpec, StepOutcome, kv_announcement
from node.tickets import TicketVerifier
from proto import codec
from proto.announce import Announce, Heartbeat, Leave, ModelSpec
from proto.swarm.v1 import frame_pb2, shard_service_pb2

if TYPE_CHECKING:
    from node.draft_model import DraftModel

log = logging.getLogger("swarm.node")
TRACKER_CALL_TIMEOUT_S = 15.0
LEAVE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class NodeReady:
    node_id: str
    grpc_port: int
    admin_port: int | None
    shard_start: int
    shard_end: int
    model_fingerprint: str
    recipe_fingerprint: str
    tls_fingerprint: str = ""  # "" = serving plaintext (insecure_plaintext)


def software_version() -> str:
    try:
        return importlib.metadata.version("swarm-inference")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a plain checkout
        return "0.0.0"


def advertise_address(config: NodeConfig, port: int) -> str:
    host = config.advertise_host
    if not host:
        host = config.host
        if host in ("", "0.0.0.0", "::"):
            host = _first_lan_ipv4() or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _first_lan_ipv4() -> str | None:
    try:
        import psutil

        for entries in psutil.net_if_addrs().values():
            for e in entries:
                if e.family == socket.AF_INET and not e.address.startswith("127."):
                    return str(e.address)
    except Exception:  # pragma: no cover - best effort
        return None
    return None


@dataclass
class _Counters:
    started_s: float = field(default_factory=time.monotonic)
    tokens_at_last_heartbeat: int = 0
    announces: int = 0
    heartbeats: int = 0
    tracker_failures: int = 0


class NodeDaemon:
    """Everything one running node holds; built by :func:`run_node`."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.counters = _Counters()
        self.ready: NodeReady | None = None
        self.tracker_url = ""
        self.draining = False
        self.metrics = Metrics()
        self._tracker_scope = trio.CancelScope()
        self.left_tracker = False
        self._tracker_client: Any = None  # the heartbeat loop's TrackerClient, for /status
        self.tensors: Any = None  # node.peer_serve.TensorServer once the span's bytes can be served
        self.rtt: RttSampler | None = None  # round trips to peers, for the tracker's coordinates
        self.draft: DraftModel | None = None  # the draft model (draft_model), the last stage's proposer

    # -- start-up ----------------------------------------------------------------------------------

    async def run(self, shutdown: trio.Event, *, task_status: trio.TaskStatus[NodeReady]) -> None:
        from node.backend import EngineBackend
        from node.engine import EngineConfig, ShardEngine
        from node.grpc_server import GrpcSettings, ShardService
        from node.hardware import probe
        from node.joining import join
        from node.scheduler import Scheduler
        from node.startup_bench import run_benchmark

        cfg = self.config
        if not cfg.model:
            raise ConfigError("model is required: --model FILE|URL|NAME (or model = ... in the config file)")
        # Test-only lying (node/failpoints.py): refused here, before anything loads, outside a test.
        self.failpoints = failpoints.from_environment()
        if self.failpoints.active:
            event(log, "failpoints_active", level=logging.WARNING, kinds=sorted(self.failpoints.kinds))
        key, created = load_or_create_key(cfg.resolved_data_dir())
        self.key = key
        self.node_id = node_id(key)
        event(
            log, "node_identity", node_id=self.node_id, created=created, data_dir=str(cfg.resolved_data_dir())
        )
        self.server_cert, made = cfg.server_cert()
        self.tls_fingerprint = self.server_cert.fingerprint if self.server_cert is not None else ""
        if self.server_cert is None:
            event(
                log,
                "grpc_plaintext",
                level=logging.WARNING,
                message="insecure_plaintext: activations and tickets travel readable; never on a network",
            )
        else:
            event(log, "tls_certificate", fingerprint=self.tls_fingerprint, created=made)
        cache = cfg.resolved_cache_dir()
        if not cfg.no_tracker:
            self.tracker_url = await self._find_tracker()
        # The model, the layers (sized to this node's memory with layers=auto), the shard files (cut or
        # fetched and verified), the GPU offload: node/joining.py.
        joined = await join(cfg, key=key, tracker_url=self.tracker_url)
        self.joined = joined
        files = joined.files
        start, end = files.start, files.end
        meta = files.model
        self.meta = meta
        stats = joined.statistics
        event(
            log,
            "shard_ready",
            model=meta.name,
            fingerprint=meta.fingerprint,
            start=start,
            end=end,
            n_layers=meta.n_layers,
            auto=cfg.layers == "auto",
            path=str(files.path),
            shard_bytes=files.size_bytes(),
            fetched=joined.fetched,
            fetched_bytes=(stats.bytes_needed - stats.bytes_resumed) if stats else 0,
            capacity_layers=joined.capacity_layers,
            gpu_layers=joined.gpu_layers,
            join_s=round(joined.join_s, 3),
        )
        vocab = await self._vocab(joined.header_file, cache, meta.fingerprint)
        engine_config = EngineConfig(
            threads=cfg.resolved_threads(),
            max_sessions=cfg.max_sessions,
            session_kv_tokens=(
                (cfg.max_session_kv_tokens or 1 << 30) if cfg.kv_pool_tokens else cfg.session_kv_tokens
            ),
            kv_pool_tokens=joined.kv_pool_tokens,
            kv_pool_layout=cfg.kv_pool_layout,
            batch_tokens=cfg.batch_tokens,
            n_gpu_layers=joined.gpu_layers,
            load_mode=cfg.load_mode,
        )
        engine = await trio.to_thread.run_sync(ShardEngine, files, engine_config, cache)
        try:
            if cfg.benchmark:
                bench = await trio.to_thread.run_sync(run_benchmark, engine)
                self.decode_ms, self.prefill_tps = bench.decode_ms_per_token, bench.prefill_tokens_per_s
            else:
                self.decode_ms, self.prefill_tps = (
                    cfg.unmeasured_decode_ms,
                    1000.0,
                )  # placeholders, not measured
            event(
                log,
                "benchmark",
                decode_ms_per_token=round(self.decode_ms, 3),
                prefill_tokens_per_s=round(self.prefill_tps, 1),
                measured=cfg.benchmark,
            )
            offload = engine.backend if joined.gpu_layers > 0 and engine.backend != "cpu" else None
            self.hardware = await trio.to_thread.run_sync(probe, cache, offload)
            if cfg.serve_span_bytes_per_s >= 0:
                from node.peer_serve import build_tensor_server

                self.tensors = await build_tensor_server(
                    meta.fingerprint,
                    joined.manifest,
                    files,
                    joined.header_file,
                    max_streams=cfg.serve_span_streams,
                    bytes_per_s=float(cfg.serve_span_bytes_per_s),
                )
            event(log, "hardware", **self.hardware.to_json())
            self.engine = engine
            limits = codec.FrameLimits(max_frame_bytes=cfg.max_frame_bytes)
            self.spec = ServingSpec(
                node_id=self.node_id,
                model_fingerprint=meta.fingerprint,
                recipe_fingerprint=engine.recipe_fingerprint,
                shard_start=start,
                shard_end=end,
                n_embd=meta.n_embd,
                n_vocab=meta.n_vocab,
                is_first=engine.is_first,
                is_last=engine.is_last,
                max_sessions=cfg.max_sessions,
                session_kv_tokens=engine.session_kv_limit,
                n_ctx_train=meta.context_length or engine.session_kv_limit,
                kv_pool_tokens=engine.pool.total_blocks * 16 if engine.pool is not None else 0,
                max_queued_steps=cfg.max_queued_steps,
                idle_lease_s=cfg.idle_lease_s,
                reattach_window_s=cfg.reattach_window_s,
                max_kept_sessions=cfg.max_kept_sessions,
                max_kept_kv_tokens=cfg.max_kept_kv_tokens,
                max_keep_s=cfg.max_keep_s,
                max_preemptions=cfg.max_preemptions,
                limits=limits,
                max_draft_tokens=max_drafts_for(meta.architecture),
                windows_in_flight=cfg.speculate_windows_in_flight,
            )
            self.verifier = TicketVerifier(
                node_id=self.node_id,
                model_fingerprint=meta.fingerprint,
                shard=(start, end),
                tracker_public_key=cfg.tracker_id or None,
                insecure_accept_all=cfg.insecure_no_tickets,
            )
            if cfg.insecure_no_tickets:
                event(
                    log,
                    "tickets_not_verified",
                    level=logging.WARNING,
                    message="insecure_no_tickets: any OPEN is accepted; never use this on a network",
                )
            draft = await self._draft_model(cfg, cache, meta.fingerprint)
            self.machine = FrameServer(
                self.spec,
                self.verifier,
                None
                if draft is None
                else functools.partial(draft.proposer, lookahead=not cfg.no_draft_lookahead),
                cfg.draft_model_choice,
            )
            self.hub = Hub(
                self.machine,
                reply_buffer_bytes=cfg.reply_buffer_bytes,
                stream_idle_timeout_s=cfg.stream_idle_timeout_s,
                max_idle_streams_per_address=cfg.resolved_idle_streams_per_address(),
            )
            on_outcome = self.hub.on_outcome
            if self.failpoints.active:
                liar = failpoints.Liar(
                    dataclasses.replace(self.failpoints, n_vocab=meta.n_vocab), random.Random(0)
                )

                def on_outcome(outcome: StepOutcome) -> None:
                    self.hub.on_outcome(liar(outcome))

            self.scheduler = Scheduler(
                TimedBackend(EngineBackend(engine), self.metrics),
                timed_outcomes(on_outcome, self.metrics),
                max_batch_tokens=cfg.batch_tokens,
                prefill_chunk_tokens=min(cfg.prefill_chunk_tokens, cfg.batch_tokens),
            )
            async with open_grpc() as grpc_rt, trio.open_nursery() as nursery:
                self.pushes = PushLinks(
                    functools.partial(
                        grpc_rt.open_stream,
                        method=codec.SESSION_METHOD,
                        max_message_bytes=cfg.max_frame_bytes + 64 * 1024,
                        max_buffered_bytes=4 * cfg.max_frame_bytes,
                    ),
                    self.hub.on_push_failed,
                    allow_plaintext=cfg.insecure_plaintext,
                )
                self.hub.attach(self.scheduler, self.pushes)
                await nursery.start(self.pushes.run)
                if self.tracker_url and cfg.rtt_probe_interval_s > 0:
                    self.rtt = node_sampler(
                        grpc_rt, self.pushes, self.node_id, RttSettings(interval_s=cfg.rtt_probe_interval_s)
                    )
                    await nursery.start(self.rtt.run)
                await nursery.start(self.scheduler.run)
                await nursery.start(self.hub.run_leases, cfg.lease_check_interval_s)
                self.grpc = ShardService(
                    self.hub,
                    GrpcSettings(
                        cfg.host,
                        cfg.port,
                        cfg.max_frame_bytes,
                        lambda: vocab,
                        meta.fingerprint,
                        cfg.shutdown_grace_s,
                        tensors=lambda: self.tensors,
                        tls=self.server_cert,
                    ),
                    self.info,
                    self.health,
                )
                port = await nursery.start(self.grpc.serve, grpc_rt)
                self.address = advertise_address(cfg, port)
                if cfg.port_file:
                    await write_port_file(cfg.port_file, port)
                admin_port = None
                if cfg.admin_port >= 0:
                    admin = AdminServer(
                        cfg.admin_host,
                        cfg.admin_port,
                        health=self.healthz,
                        metrics=self.metrics_text,
                        status=self.status,
                    )
                    admin_port = await nursery.start(admin.serve)
                    if cfg.admin_port_file:
                        await write_port_file(cfg.admin_port_file, admin_port)
                self.relay = None
                use_relay = bool(cfg.relay_url)
                if use_relay and cfg.relay_auto:
                    use_relay = not await self._reachable(port)
                if use_relay:
                    from node.relay_client import RelayClient

                    self.relay = RelayClient(
                        cfg.relay_url,
                        self.hub,
                        key,
                        self.info,
                        max_frame_bytes=cfg.max_frame_bytes,
                        tls_fingerprint=cfg.relay_tls_fingerprint,
                        ca_file=cfg.relay_ca_file,
                    )
                    await nursery.start(self.relay.run)
                if self.tracker_url:
                    nursery.start_soon(self._tracker_loop)
                self.ready = NodeReady(
                    self.node_id,
                    port,
                    admin_port,
                    start,
                    end,
                    meta.fingerprint,
                    engine.recipe_fingerprint,
                    self.tls_fingerprint,
                )
                event(
                    log,
                    "node_serving",
                    node_id=self.node_id,
                    grpc_port=port,
                    admin_port=admin_port,
                    address=self.address,
                    shard=[start, end],
                    tracker=self.tracker_url or None,
                )
                task_status.started(self.ready)
                await shutdown.wait()
                await self._stop(nursery)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(engine.close)
                if self.draft is not None:
                    self.draft.close()
            event(log, "node_stopped", node_id=self.node_id)

    async def _draft_model(self, cfg: NodeConfig, cache: Path, fingerprint: str) -> DraftModel | None:
        """The draft model (``draft_model``), its vocabulary checked against the target's, or None."""
        if not cfg.draft_model:
            return None
        from node.draft_model import DraftModel
        from node.shard import shard_dir

        vocab = shard_dir(cache, fingerprint) / "vocab.gguf"
        self.draft = await trio.to_thread.run_sync(
            functools.partial(
                DraftModel,
                cfg.draft_model,
                vocab,
                slots=self.spec.speculate_max_sessions,
            )
        )
        event(log, "draft_model_ready", path=str(self.draft.path), n_vocab=self.draft.n_vocab)
        return self.draft

    async def _vocab(self, header_file: Path, cache: Path, fingerprint: str) -> bytes:
        """The vocabulary file gateways tokenize with; written on the first start.

        Before the weights load, and the model's parsed header is dropped afterwards: written in
        the background (as before), its parse (~300 MB transient for 49 152 tokens, half of it kept
        by the reader cache) came on top of a loaded shard, and got the last node of
        ``sim.bench_join``'s memory-limited swarm OOM-killed at its cgroup's 1.5 GiB.
        """
        from node.shard import extract_vocab, forget_readers, shard_dir

        path = shard_dir(cache, fingerprint) / "vocab.gguf"
        try:
            if not path.is_file():
                path = await trio.to_thread.run_sync(
                    functools.partial(extract_vocab, header_file, cache, fingerprint=fingerprint)
                )
                event(log, "vocab_ready", path=str(path), bytes=path.stat().st_size)
        finally:
            forget_readers()
        return await read_bytes(path)

    async def _stop(self, nursery: trio.Nursery) -> None:
        self.draining = True
        stats = self.machine.statistics()
        event(log, "node_stopping", sessions=stats.sessions, kv_tokens_used=stats.kv_tokens_used)
        with trio.CancelScope(shield=True):
            await self.leave_tracker()
        with trio.move_on_after(self.config.shutdown_grace_s + 5) as scope:
            scope.shield = True
            await self.hub.drain()
        nursery.cancel_scope.cancel()  # the gRPC server stops with its grace period as it unwinds

    # -- tracker ----------------------------------------------------------------------------------------

    async def _find_tracker(self) -> str:
        if self.config.tracker_url:
            return self.config.tracker_url.rstrip("/")
        from common.discovery import discover_tracker_async

        while True:
            url = await discover_tracker_async(
                self.config.discovery_timeout_s, self.config.tracker_id or None
            )
            if url:
                event(log, "tracker_discovered", url=url)
                return url
            event(log, "tracker_not_found", level=logging.WARNING, retry_s=self.config.tracker_retry_s)
            await trio.sleep(self.config.tracker_retry_s)

    async def leave_tracker(self) -> None:
        """Stop heartbeats and tell the tracker we are going (once; a rebalancing move leaves early)."""
        self._tracker_scope.cancel()  # no heartbeat may follow the goodbye
        if self.tracker_url and not self.left_tracker:
            await self._leave()

    async def _leave(self) -> None:
        """Tell the tracker we are going (signed), so it stops routing to us now, not at expiry."""
        from common.tracker_client import TrackerClient, TrackerClientError

        try:
            with trio.fail_after(LEAVE_TIMEOUT_S):
                async with TrackerClient(self.tracker_url, self.key, tls=self.config.tracker_tls()) as client:
                    await client.leave(Leave(node_id=self.node_id, reason="shutdown"))
            self.left_tracker = True
            self.metrics.inc("swarm_node_tracker_calls_total", kind="leave", outcome="ok")
            event(log, "left_tracker", tracker=self.tracker_url)
        except (TrackerClientError, httpx.HTTPError, trio.TooSlowError) as err:
            self.metrics.inc("swarm_node_tracker_calls_total", kind="leave", outcome="failed")
            event(log, "leave_failed", level=logging.WARNING, error=repr(err), note="the tracker expires us")

    async def _reachable(self, port: int) -> bool:
        """Ask the tracker to dial our gRPC port from outside (tracker/reachability.py).

        No answer counts as unreachable: the relay works whenever the gateway does.
        """
        from common.tracker_client import TrackerClient, TrackerClientError

        reachable = False
        if self.tracker_url:
            try:
                with trio.fail_after(TRACKER_CALL_TIMEOUT_S):
                    async with TrackerClient(
                        self.tracker_url, self.key, tls=self.config.tracker_tls()
                    ) as client:
                        reachable = await client.reachable(port)
            except (TrackerClientError, httpx.HTTPError, ValueError, trio.TooSlowError) as err:
                event(log, "reachability_unknown", level=logging.WARNING, error=repr(err))
        event(log, "reachability", port=port, reachable=reachable, relay=not reachable)
        return reachable

    def _announce(self) -> Announce:
        meta = self.meta
        relay = getattr(self, "relay", None)
        return Announce(
            node_id=self.node_id,
            # A relayed node is reached only through its gateway: no address to dial.
            addresses=() if relay is not None else (self.address,),
            relay=relay is not None,
            relay_via=relay.gateway_id if relay is not None else None,
            hardware=self.hardware,
            software_version=software_version(),
            model=ModelSpec(
                meta.fingerprint,
                (meta.name or meta.path.stem)[:200],
                meta.architecture,
                meta.n_layers,
                meta.n_embd,
            ),
            shard_start=self.spec.shard_start,
            shard_end=self.spec.shard_end,
            decode_ms_per_token=self.failpoints.announced_decode_ms(self.decode_ms),
            prefill_tokens_per_s=self.prefill_tps,
            max_sessions=self.spec.max_sessions,
            region=self.config.region,
            capacity_layers=min(meta.n_layers, self.joined.capacity_layers or self.config.capacity_layers),
            uplink_mbit_s=self.config.uplink_mbit_s or None,
            tls_fingerprint=self.tls_fingerprint,
        )

    def _heartbeat(self) -> Heartbeat:
        stats = self.machine.statistics()
        kv = kv_announcement(stats, self.spec)
        tokens = self.scheduler.statistics().tokens_processed
        served = tokens - self.counters.tokens_at_last_heartbeat
        self.counters.tokens_at_last_heartbeat = tokens
        return Heartbeat(
            node_id=self.node_id,
            active_sessions=stats.sessions,
            queue_depth=self.scheduler.queue_depth,
            kv_free_tokens=kv.free_tokens,
            tokens_served=max(0, served),
            kv_used_tokens=stats.kv_tokens_used,
            rtt_samples=self.rtt.take_samples() if self.rtt is not None else (),
            kv_pool_tokens=kv.pool_tokens,
            kv_session_max_tokens=kv.session_max_tokens,
            # Since start, as the node's /metrics counts them (swarm_node_kv_preemptions_total,
            # swarm_node_kv_pool_refusals_total: the machine's refusals and the engine's).
            kv_preemptions=stats.preemptions,
            kv_refusals=stats.kv_refusals + self.engine.pool_refusals,
            # Heads of the KV block chains its kept sessions hold (node.prefix_blocks): prefix-aware
            # route choice matches a prompt's heads against them.
            prefix_heads=tuple(self.machine.prefix_heads()),
        )

    def _pool_metrics(
        self, one: Callable[[float], dict[tuple[tuple[str, str], ...], float]]
    ) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        engine = self.engine
        pool = engine.pool if engine is not None else None
        layout: dict[tuple[tuple[str, str], ...], float] = {
            (("layout", engine.layout_name if engine is not None else "none"),): 1.0
        }
        if engine is None or pool is None:
            return {
                "swarm_node_kv_pool_blocks": one(0),
                "swarm_node_kv_pool_free_blocks": one(0),
                "swarm_node_kv_layout": layout,
            }
        stats = self.machine.statistics()
        joined = getattr(self, "joined", None)
        bounds: dict[tuple[tuple[str, str], ...], float] = {}
        if joined is not None:
            for memory, n in (joined.kv_pool_bounds or {}).items():
                bound = "1" if memory == joined.kv_pool_bound_by else "0"
                bounds[(("memory", str(memory)[:120]), ("bound", bound))] = float(n)
        # Plain int reads of what the compute thread updates (no iteration over its dicts).
        return {
            "swarm_node_kv_pool_bound_tokens": bounds,
            "swarm_node_kv_pool_blocks": one(pool.total_blocks),
            "swarm_node_kv_pool_used_blocks": one(pool.used_blocks),
            "swarm_node_kv_pool_free_blocks": one(pool.free_blocks),
            "swarm_node_kv_pool_reserved_blocks": one(stats.kv_blocks_reserved),
            "swarm_node_kv_pool_refusals_total": one(engine.pool_refusals + stats.kv_refusals),
            "swarm_node_kv_preemptions_total": one(stats.preemptions),
            "swarm_node_kv_pool_compactions_total": one(engine.pool_compactions),
            "swarm_node_kv_layout": layout,
        }

    async def _tracker_loop(self) -> None:
        with self._tracker_scope:
            await self._tracker_calls()

    async def _tracker_calls(self) -> None:
        from common.tracker_client import TrackerClient, TrackerClientError

        async with TrackerClient(self.tracker_url, self.key, tls=self.config.tracker_tls()) as client:
            self._tracker_client = client
            announced = False
            interval = self.config.heartbeat_interval_s or 10.0
            relay = getattr(self, "relay", None)
            announced_via: str | None = None
            while True:
                if relay is not None:
                    await relay.ready.wait()  # announce as relayed only once a gateway accepted us
                    if announced and relay.gateway_id != announced_via:
                        announced = False  # reconnected through another gateway: tell the tracker
                try:
                    with trio.fail_after(TRACKER_CALL_TIMEOUT_S):
                        if not announced:
                            announced_via = relay.gateway_id if relay is not None else None
                            answer = await client.announce(self._announce())
                            self.counters.announces += 1
                            self.metrics.inc("swarm_node_tracker_calls_total", kind="announce", outcome="ok")
                            announced = True
                            tracker_id = str(answer.get("tracker_id", ""))
                            if self.config.tracker_id and tracker_id != self.config.tracker_id:
                                event(
                                    log,
                                    "tracker_key_mismatch",
                                    level=logging.ERROR,
                                    pinned=self.config.tracker_id,
                                    answered=tracker_id,
                                )
                            elif tracker_id:
                                self.verifier.trust(tracker_id)
                            if not self.config.heartbeat_interval_s:
                                interval = float(answer.get("heartbeat_interval_s", interval))
                            event(
                                log,
                                "announced",
                                tracker=self.tracker_url,
                                tracker_id=tracker_id,
                                state=answer.get("state"),
                                heartbeat_interval_s=interval,
                            )
                            # The announce carries no load or KV figures (the tracker clears them):
                            # the first heartbeat follows at once, so gateways do not admit on "not
                            # known" (every request let through, the pools overrun) for a whole
                            # interval after a join, a move or a re-announce.
                            continue
                        else:
                            answer = await client.heartbeat(self._heartbeat())
                            if self.rtt is not None:  # whom the tracker wants measured next
                                self.rtt.hint(parse_hints(answer.get("probe")))
                            self.counters.heartbeats += 1
                            self.metrics.inc("swarm_node_tracker_calls_total", kind="heartbeat", outcome="ok")
                    await trio.sleep(interval)
                except TrackerClientError as err:
                    self.counters.tracker_failures += 1
                    kind = "announce" if not announced else "heartbeat"
                    self.metrics.inc("swarm_node_tracker_calls_total", kind=kind, outcome="refused")
                    if err.status == 404:
                        announced = False  # the tracker forgot us (restart, new database): announce again
                    event(
                        log,
                        "tracker_refused",
                        level=logging.WARNING,
                        status=err.status,
                        code=err.code,
                        reason=err.reason,
                        message=str(err),
                    )
                    await trio.sleep(self.config.tracker_retry_s)
                except (httpx.TransportError, trio.TooSlowError) as err:
                    self.counters.tracker_failures += 1
                    kind = "announce" if not announced else "heartbeat"
                    refused = pin_refusal(err)
                    outcome = "unreachable" if refused is None else "tls_refused"
                    self.metrics.inc("swarm_node_tracker_calls_total", kind=kind, outcome=outcome)
                    if refused is not None:  # another certificate than the pinned one: nothing was sent
                        event(log, "tracker_tls_refused", level=logging.ERROR, error=str(refused))
                    else:
                        event(log, "tracker_unreachable", level=logging.WARNING, error=repr(err))
                    await trio.sleep(self.config.tracker_retry_s)

    # -- introspection -----------------------------------------------------------------------------------

    def _load(self) -> shard_service_pb2.NodeLoad:
        stats = self.machine.statistics()
        sched = self.scheduler.statistics()
        decode_ms = sched.decode_ms_per_token if not math.isnan(sched.decode_ms_per_token) else self.decode_ms
        return shard_service_pb2.NodeLoad(
            active_sessions=stats.sessions,
            queued_steps=sched.queued_jobs,
            kv_tokens_used=stats.kv_tokens_used,
            kv_tokens_total=stats.kv_tokens_capacity,
            decode_ms_per_token=decode_ms,
        )

    def info(self) -> shard_service_pb2.NodeInfo:
        meta, spec = self.meta, self.spec
        return shard_service_pb2.NodeInfo(
            node_id=self.node_id,
            model=shard_service_pb2.ModelInfo(
                fingerprint=meta.fingerprint,
                name=meta.name,
                architecture=meta.architecture,
                n_layers=meta.n_layers,
                n_embd=meta.n_embd,
                n_vocab=meta.n_vocab,
                n_ctx_train=meta.context_length,
            ),
            shard=frame_pb2.LayerRange(start=spec.shard_start, end=spec.shard_end),
            recipe=self.engine.recipe.to_wire(),
            load=self._load(),
            limits=shard_service_pb2.NodeLimits(
                max_frame_bytes=spec.limits.max_frame_bytes,
                max_step_tokens=spec.limits.max_step_tokens,
                max_sessions=spec.max_sessions,
                max_kv_tokens_per_session=spec.session_kv_tokens,
                encodings=[frame_pb2.ENCODING_F32, frame_pb2.ENCODING_F16, frame_pb2.ENCODING_INT8_BLOCK],
                min_schema_version=codec.SCHEMA_VERSION,
                max_schema_version=codec.SCHEMA_VERSION,
            ),
            is_last=spec.is_last,
            serves_vocab=True,
            tls_fingerprint=self.tls_fingerprint,
        )

    def health(self) -> shard_service_pb2.HealthResponse:
        status = (
            shard_service_pb2.SERVING_STATUS_DRAINING
            if self.draining
            else shard_service_pb2.SERVING_STATUS_SERVING
        )
        return shard_service_pb2.HealthResponse(
            status=status,
            uptime_ms=int((time.monotonic() - self.counters.started_s) * 1000),
            load=self._load(),
        )

    def healthz(self) -> tuple[int, dict[str, Any]]:
        body = {"status": "draining" if self.draining else "serving", "node_id": self.node_id}
        return (503 if self.draining else 200), body

    def status(self) -> dict[str, Any]:
        stats = self.machine.statistics()
        sched = self.scheduler.statistics()
        return {
            "node_id": self.node_id,
            "address": self.address,
            "model": {
                "name": self.meta.name,
                "fingerprint": self.meta.fingerprint,
                "n_layers": self.meta.n_layers,
            },
            "shard": [self.spec.shard_start, self.spec.shard_end],
            "recipe_fingerprint": self.spec.recipe_fingerprint,
            "is_first": self.spec.is_first,
            "is_last": self.spec.is_last,
            "tracker": self.tracker_url or None,
            # The pin it reaches the tracker with (public: `swarm-node status` uses it too).
            "tracker_tls_fingerprint": self.config.tracker_tls_fingerprint or None,
            "tracker_key_known": self.verifier.tracker_public_key is not None
            or self.verifier.insecure_accept_all,
            "draining": self.draining,
            "uptime_s": round(time.monotonic() - self.counters.started_s, 1),
            "sessions": stats.sessions,
            "max_sessions": self.spec.max_sessions,
            "queued_steps": sched.queued_jobs,
            "kv_tokens_used": stats.kv_tokens_used,
            "kv_tokens_granted": stats.kv_tokens_granted,
            "kv_tokens_capacity": stats.kv_tokens_capacity,
            "tokens_processed": sched.tokens_processed,
            "decode_ms_per_token_startup": round(self.decode_ms, 3),
            "prefill_tokens_per_s_startup": round(self.prefill_tps, 1),
            "errors_by_status": stats.errors_by_status,
            "connections": dataclasses.asdict(self.hub.statistics()),
            "announces": self.counters.announces,
            "heartbeats": self.counters.heartbeats,
            "tracker_failures": self.counters.tracker_failures,
            "tracker_in_use": self._tracker_client.url if self._tracker_client is not None else None,
            "tracker_failovers": self._tracker_client.failovers if self._tracker_client is not None else 0,
            "region": self.config.region,
            "rtt": dataclasses.asdict(self.rtt.statistics()) if self.rtt is not None else None,
            "relay": self._relay_status(),
            "join": self._join_status(),
        }

    def _join_status(self) -> dict[str, Any]:
        j = self.joined
        stats = j.statistics
        return {
            "fetched": j.fetched,
            "fetched_bytes_by_source": stats.bytes_by_source if stats else {},
            "shard_bytes": j.files.size_bytes(),
            "capacity_layers": j.capacity_layers,
            "memory_budget_bytes": j.budget.bytes if j.budget else None,
            "memory_budget_source": j.budget.source if j.budget else None,
            "gpu_layers": j.gpu_layers,
            "gpu": j.device.description if j.device else None,
            # The pool's positions each memory holds (RAM, each device) and the one that bound it.
            "kv_pool_bounds": j.kv_pool_bounds,
            "kv_pool_bound_by": j.kv_pool_bound_by or None,
            "backend": self.engine.backend,
            "join_s": round(j.join_s, 3),
            "serving_span_bytes": self.tensors.statistics().bytes_sent if self.tensors is not None else None,
        }

    def _relay_status(self) -> dict[str, Any] | None:
        relay = getattr(self, "relay", None)
        return dataclasses.asdict(relay.statistics()) if relay is not None else None

    def metrics_text(self) -> str:
        return self.metrics.render(self.scrape())

    def scrape(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Scrape-time values of the node's gauges and statistics counters (node/metrics.py)."""
        stats = self.machine.statistics()
        sched = self.scheduler.statistics()
        hub = self.hub.statistics()
        tps = sched.tokens_processed / sched.compute_s if sched.compute_s > 0 else 0.0

        def one(value: float) -> dict[tuple[tuple[str, str], ...], float]:
            return {(): float(value)}

        return {
            "swarm_node_sessions": one(stats.sessions),
            "swarm_node_sessions_max": one(self.spec.max_sessions),
            "swarm_node_busy_sessions": one(stats.busy_sessions),
            "swarm_node_queue_depth": one(sched.queued_jobs),
            "swarm_node_connections": one(stats.connections),
            "swarm_node_kv_tokens_used": one(stats.kv_tokens_used),
            "swarm_node_kv_tokens_granted": one(stats.kv_tokens_granted),
            "swarm_node_kept_sessions": one(stats.kept_sessions),
            "swarm_node_kept_kv_tokens": one(stats.kept_kv_tokens),
            "swarm_node_prefix_cached_blocks": one(stats.prefix_cached_blocks),
            "swarm_node_prefix_lookups_total": {
                (("outcome", "hit"),): float(stats.prefix_lookups_hit),
                (("outcome", "miss"),): float(stats.prefix_lookups_miss),
            },
            "swarm_node_prefix_reused_tokens_total": one(stats.reused_positions),
            "swarm_node_prefix_hit_ratio": one(
                stats.reused_positions / max(1, stats.reused_positions + sched.prefill_tokens)
            ),
            "swarm_node_kv_tokens_capacity": one(stats.kv_tokens_capacity),
            **self._pool_metrics(one),
            "swarm_node_tokens_per_second": one(tps),
            "swarm_node_decode_ms_per_token": one(sched.decode_ms_per_token),
            "swarm_node_draining": one(1.0 if self.draining else 0.0),
            "swarm_node_tokens_processed_total": {
                (("phase", "decode"),): float(sched.decode_tokens),
                (("phase", "prefill"),): float(sched.prefill_tokens),
            },
            "swarm_node_engine_seconds_total": one(sched.compute_s),
            "swarm_node_batches_total": one(sched.batches),
            "swarm_node_multi_session_batches_total": one(sched.multi_session_batches),
            "swarm_node_isolated_batches_total": one(sched.isolated_batches),
            "swarm_node_inline_rounds_total": one(sched.inline_rounds),
            "swarm_node_frames_total": {
                (("direction", "in"),): float(stats.frames_in),
                (("direction", "out"),): float(stats.frames_out),
            },
            "swarm_node_replays_total": one(stats.replays),
            "swarm_node_draft_lookahead_total": {
                (("outcome", "hit"),): float(0 if self.draft is None else self.draft.lookahead_hits),
                (("outcome", "miss"),): float(0 if self.draft is None else self.draft.lookahead_misses),
            },
            "swarm_node_spec_sessions_total": {
                (("proposer", k),): float(v) for k, v in sorted(stats.spec_proposers.items())
            },
            "swarm_node_evictions_total": one(stats.evictions),
            "swarm_node_refusals_total": {
                (("status", k),): float(v) for k, v in sorted(stats.errors_by_status.items())
            },
            "swarm_node_tickets_total": {
                (("outcome", "accepted"),): float(self.verifier.accepted),
                (("outcome", "refused"),): float(self.verifier.refused),
            },
            "swarm_node_bound_tickets_total": one(self.verifier.bound),
            "swarm_node_streams_total": {
                (("outcome", "opened"),): float(self.grpc.streams_opened),
                (("outcome", "refused"),): float(self.grpc.streams_refused),
            },
            "swarm_node_unproven_connections": one(hub.unproven_connections),
            "swarm_node_idle_streams_closed_total": one(hub.idle_streams_closed),
            "swarm_node_slow_readers_dropped_total": one(hub.dropped_slow_connections),
            "swarm_node_replays_suppressed_total": one(hub.replays_suppressed),
            "swarm_node_reply_bytes_queued": one(hub.reply_bytes_queued),
            "swarm_node_tracker_failures_total": one(self.counters.tracker_failures),
        }


async def run_node(
    config: NodeConfig,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[NodeReady] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a node until ``shutdown`` is set (or the surrounding scope is cancelled); with
    ``rebalance_interval_s`` > 0, one that moves when the tracker advises it (node/rebalancing.py)."""
    if config.rebalance_interval_s > 0 and not config.no_tracker:
        from node.rebalancing import run_moving_node

        await run_moving_node(config, trio.Event() if shutdown is None else shutdown, task_status=task_status)
        return
    daemon = NodeDaemon(config)
    await daemon.run(trio.Event() if shutdown is None else shutdown, task_status=task_status)
