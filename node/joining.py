"""``swarm-node start``'s way to its shard: which model, how many layers, which ones, from where, on what.

:func:`join` is the start-up step between finding the tracker and loading the
engine. In order (each step logs one event):

1. the model: a local file is used in place (hashed once into its manifest,
   ``verifying``); anything else is resolved to a manifest and sources
   (``node.assemble``: URL, tracker registry, peers) and its header fetched;
2. the memory: ``node.capacity`` sizes the model for this node's settings
   (per-layer weights from the manifest, KV per layer from the metadata and
   ``max_sessions`` x ``session_kv_tokens``, first/last-stage extras, a fixed
   overhead) against the binding memory limit (``capacity`` event), plus the
   layers free GPU memory takes with ``gpu_layers = auto``;
3. the layers: ``START:END``, or with ``auto`` the tracker's recommendation
   for at most the layers that fit, checked with the exact cost of the span
   it returns (a first or last stage carries more) and asked again smaller
   until it fits -- ``auto`` never asks for more than the node holds;
4. the shard files: cut from the local file (``extracting``), or fetched and
   verified tensor by tensor (``fetching``); progress bars on a terminal,
   ``progress`` events in the log;
5. the offload: how many of the shard's layers go to the GPU;
6. the KV pool: with ``kv_pool_tokens = -1`` the least of what the span
   leaves of RAM and of each device holding offloaded layers
   (``kv_pool_sized`` names every bound and the one that bound it); a
   configured pool is checked against the same memories and refused at start
   when one cannot hold it.

An explicit range that does not fit the memory is served anyway (the
volunteer asked for it) with a ``shard_exceeds_memory`` warning.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from common.files import run_sync
from common.logs import event
from common.tls_http import pin_refusal
from node.assemble import (
    assemble_shard,
    byte_sources,
    http_client,
    is_fingerprint,
    is_url,
    prepare_remote,
    resolve,
)
from node.capacity import (
    GPU_MARGIN_BYTES,
    POOL_MARGIN,
    DeviceRoom,
    MemoryLimit,
    ModelShape,
    Sizing,
    memory_limits,
    pool_size,
    priced_positions,
    sizing_for,
    span_budget_bytes,
)
from node.config import NodeConfig
from node.errors import CapacityError, NotGGUFError
from node.fetch import FetchStatistics
from node.fingerprint import load_manifest, local_manifest
from node.hardware import llama_offload_targets, offload_rooms
from node.llama_runtime import Device, offload_devices
from node.manifest import Manifest
from node.progress import Progress
from node.shard import (
    ModelMeta,
    ShardFiles,
    extract_shard,
    model_meta,
    open_reader,
    parse_layers,
)

log = logging.getLogger("swarm.node.join")
TRACKER_CALL_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Joined:
    files: ShardFiles
    manifest: Manifest
    header_file: Path  # the model's header: the whole local file, or the fetched header-only copy
    fetched: bool  # the shard came from URLs / peers (not cut from a local file)
    statistics: FetchStatistics | None  # what this start fetched (None: nothing to fetch)
    capacity_layers: int  # what this node holds at most (0: not computed, explicit range)
    budget: MemoryLimit | None
    sizing: Sizing | None
    gpu_layers: int  # of the shard's layers, offloaded (llama.cpp's n_gpu_layers)
    device: Device | None
    join_s: float
    kv_pool_tokens: int = 0  # kv_pool_tokens = -1: the pool sized from the memory the span leaves
    kv_pool_bounds: dict[str, int] | None = None  # positions each memory holds (RAM, each device)
    kv_pool_bound_by: str = ""  # the memory that bound the automatic pool


def _memory_bytes(cfg: NodeConfig) -> int:
    return cfg.memory_limit_mb * 1024 * 1024


def model_sizing(meta: ModelMeta, manifest: Manifest, reader_path: Path, cfg: NodeConfig) -> Sizing:
    """Blocking (parses metadata): the sizing of ``meta`` at this node's settings."""
    reader = open_reader(reader_path)
    arch = meta.architecture
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}
    shape = ModelShape.from_fields(arch, fields, meta.n_vocab)
    return sizing_for(
        shape,
        manifest.layer_bytes(meta.n_layers),
        manifest.global_bytes(),
        max_sessions=cfg.max_sessions,
        session_kv_tokens=cfg.session_kv_tokens,
        n_batch=cfg.batch_tokens,
        overhead_bytes=cfg.memory_overhead_mb * 1024 * 1024,
        kv_positions=_priced(cfg),
    )


DeviceSource = Callable[[], list[Device]]  # ggml's devices and their free memory now (injected in tests)


def _mask_bytes(cfg: NodeConfig) -> int:
    """llama.cpp's attention mask over the priced positions (f32, one row per batch position): a
    device holding layers holds a copy of it."""
    return 4 * cfg.batch_tokens * _priced(cfg)


def _priced(cfg: NodeConfig) -> int:
    """The KV positions the node's sizing prices: an explicit pool's, else max_sessions sequences."""
    return priced_positions(cfg.max_sessions, cfg.session_kv_tokens, cfg.kv_pool_tokens)


def _gpu_device(cfg: NodeConfig, source: DeviceSource = offload_devices) -> Device | None:
    if cfg.gpu_layers == "0":
        return None
    devices = llama_offload_targets(source())
    if not devices:
        event(
            log,
            "no_gpu",
            level=logging.WARNING,
            gpu_layers=cfg.gpu_layers,
            message="no GPU in this llama.cpp build or on this machine: every layer runs on the CPU "
            "(README: build with CMAKE_ARGS for CUDA, Vulkan or Metal)",
        )
        return None
    return max(devices, key=lambda d: d.free_bytes)


def gpu_layer_count(
    cfg: NodeConfig, sizing: Sizing | None, start: int, end: int, device: Device | None
) -> int:
    """llama.cpp's ``n_gpu_layers`` for the shard ``[start, end)``."""
    if device is None:
        return 0
    n = end - start
    if cfg.gpu_layers == "all":
        return n + 1  # every layer and the output
    if cfg.gpu_layers == "auto":
        if sizing is None:
            return 0
        mask = _mask_bytes(cfg)
        k = sizing.split_gpu(start, end, device.free_bytes, mask)
        if k < n or end < sizing.n_layers:  # some layers stay on the CPU, or no LM head in the shard
            return n + 1 if k == n else k
        # Every layer fits: the output (the LM head) goes too when it fits beside them.
        used = sum(sizing.layer_bytes[il] + sizing.kv_bytes_per_layer[il] for il in range(start, end))
        left = device.free_bytes - GPU_MARGIN_BYTES - mask - used
        return n + 1 if left >= sizing.last_extra_bytes else n
    return min(int(cfg.gpu_layers), n + 1)


class _Joiner:
    def __init__(
        self, cfg: NodeConfig, key: Any, tracker_url: str, devices: DeviceSource = offload_devices
    ) -> None:
        self.cfg = cfg
        self.key = key
        self.tracker_url = tracker_url
        self.cache = cfg.resolved_cache_dir()
        self.devices = devices
        self.pool_bounds: dict[str, int] | None = None  # set by _pool_tokens
        self.pool_bound_by = ""

    @contextlib.asynccontextmanager
    async def _clients(self) -> AsyncIterator[tuple[httpx.AsyncClient, Any, Any]]:
        from common.grpc_adapter import open_grpc

        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(http_client(self.cfg.fetch_stall_timeout_s))
            grpc_rt = await stack.enter_async_context(open_grpc())
            tracker = None
            if self.tracker_url:
                from common.tracker_client import TrackerClient

                tracker = await stack.enter_async_context(
                    TrackerClient(self.tracker_url, self.key, tls=self.cfg.tracker_tls())
                )
            yield client, tracker, grpc_rt

    async def run(self) -> Joined:
        t0 = time.monotonic()
        cfg = self.cfg
        spec = cfg.model
        local = cfg.resolved_model_path()
        is_file = await run_sync(local.is_file)
        remote = not is_file and (
            is_url(spec) or is_fingerprint(spec) or bool(self.tracker_url) or bool(cfg.peer_addresses())
        )
        if not remote and not is_file:
            raise NotGGUFError(f"{local}: no such file (and not an http(s) URL or a model the tracker knows)")
        if not remote:
            return await self._local(local, t0)
        async with self._clients() as (client, tracker, grpc_rt):
            with trio.fail_after(TRACKER_CALL_TIMEOUT_S * 4):
                source = await resolve(
                    spec, cache_dir=self.cache, client=client, tracker=tracker, grpc_rt=grpc_rt,
                    manifest_arg=cfg.manifest, peers=cfg.peer_addresses(),
                )  # fmt: skip
            event(log, "model_source", model=source.describe(), fingerprint=source.fingerprint)
            sources = byte_sources(source, client, grpc_rt)
            prepared = await prepare_remote(source, self.cache, sources)
            meta = prepared.meta
            sizing, budget, capacity, device = None, None, 0, None
            if cfg.layers == "auto" or cfg.gpu_layers == "auto" or cfg.kv_pool_tokens != 0:
                sizing, budget, capacity, device = await self._size(
                    meta, source.manifest, prepared.header_file
                )
            if cfg.layers == "auto":
                start, end = await self._recommend(meta, capacity, sizing, budget, device)
            else:
                start, end = parse_layers(cfg.layers, meta.n_layers, meta.split_points)
            done = await assemble_shard(
                source, start, end, self.cache, sources, progress=Progress,
                stall_timeout_s=cfg.fetch_stall_timeout_s, slow_bytes_per_s=float(cfg.fetch_slow_bytes_per_s),
            )  # fmt: skip
        if device is None and cfg.gpu_layers not in ("0", "auto"):
            device = await run_sync(_gpu_device, cfg, self.devices)
        self._warn_if_too_big(sizing, budget, start, end, device)
        gpu_layers = gpu_layer_count(cfg, sizing, start, end, device)
        pool = self._pool_tokens(sizing, budget, start, end, gpu_layers, await self._rooms(gpu_layers))
        return Joined(
            files=done.files,
            manifest=source.manifest,
            header_file=prepared.header_file,
            fetched=True,
            statistics=done.statistics,
            capacity_layers=capacity,
            budget=budget,
            sizing=sizing,
            gpu_layers=gpu_layers,
            device=device,
            join_s=time.monotonic() - t0,
            kv_pool_tokens=pool,
            kv_pool_bounds=self.pool_bounds,
            kv_pool_bound_by=self.pool_bound_by,
        )

    async def _rooms(self, gpu_layers: int) -> list[DeviceRoom]:
        """The free memory of the devices the offloaded layers go to (none offloaded: none)."""
        if gpu_layers <= 0:
            return []
        return await run_sync(lambda: offload_rooms(self.devices()))

    def _pool_tokens(
        self,
        sizing: Sizing | None,
        budget: MemoryLimit | None,
        start: int,
        end: int,
        gpu_layers: int = 0,
        devices: list[DeviceRoom] | tuple[DeviceRoom, ...] = (),
    ) -> int:
        """The KV pool's positions: with kv_pool_tokens = -1 what the span leaves of RAM (the memory
        budget) and of each device its offloaded layers are on, the least of them; a configured pool,
        checked against the same memories (a clear error when one cannot hold it)."""
        cfg = self.cfg
        if cfg.kv_pool_tokens == 0:
            return 0
        if sizing is None or budget is None:
            if cfg.kv_pool_tokens > 0:
                return cfg.kv_pool_tokens
            raise CapacityError("kv_pool_tokens = -1 needs the node's memory sizing, which was not made")
        end = min(end, sizing.n_layers)
        explicit = cfg.kv_pool_tokens > 0
        size = pool_size(
            sizing, start, end, budget.bytes, _priced(cfg), cfg.batch_tokens,
            copies=2 if cfg.kv_pool_layout == "unified" else 1,  # the unified layout's compaction copy
            gpu_layers=gpu_layers, devices=devices, budget_source=budget.source,
            ram_margin=0.0 if explicit else POOL_MARGIN,  # a configured pool may use the whole budget
        )  # fmt: skip
        bounds = {b.memory: b.tokens for b in size.bounds}
        self.pool_bounds = bounds
        if explicit:
            short = [b for b in size.bounds if not b.holds(cfg.kv_pool_tokens)]
            if short:
                b = short[0]
                need_mib = cfg.kv_pool_tokens * b.bytes_per_position / 2**20
                raise CapacityError(
                    f"kv_pool_tokens = {cfg.kv_pool_tokens} does not fit {b.memory}: its KV there needs "
                    f"{need_mib:.0f} MiB and layers [{start}, {end}) "
                    f"leave {max(0.0, b.room_bytes) / 2**20:.0f} MiB (at most {b.tokens} positions): lower "
                    "kv_pool_tokens (-1 sizes it from the memory), serve fewer layers, or offload fewer"
                )
            event(log, "kv_pool_checked", kv_pool_tokens=cfg.kv_pool_tokens, fits=bounds)
            return cfg.kv_pool_tokens
        binding = size.binding
        self.pool_bound_by = binding.memory
        if size.tokens < 256:
            raise CapacityError(
                f"the memory left after layers [{start}, {end}) holds no KV pool: {binding.memory} has "
                f"{max(0.0, binding.room_bytes) / 2**20:.0f} MiB left "
                f"({budget.bytes / 2**20:.0f} MiB budget, from {budget.source}): serve fewer layers, "
                "offload fewer, or raise memory_limit_mb"
            )
        event(
            log,
            "kv_pool_sized",
            kv_pool_tokens=size.tokens,
            bound_by=binding.memory,
            bounds=bounds,
            gpu_layers=gpu_layers,
            budget_bytes=budget.bytes,
            budget_source=budget.source,
        )
        return size.tokens

    async def _local(self, path: Path, t0: float) -> Joined:
        cfg = self.cfg
        sizing, budget, capacity, device = None, None, 0, None
        meta: ModelMeta | None = None
        if cfg.layers == "auto" or cfg.gpu_layers == "auto" or cfg.kv_pool_tokens != 0:
            found, whole = await run_sync(self._local_meta, path)
            sizing, budget, capacity, device = await self._size(found, whole, path)
            meta = found
        if meta is not None and cfg.layers == "auto":
            start, end = await self._recommend(meta, capacity, sizing, budget, device)
        else:
            # Syntax only here; extract_shard checks the range against the model. A restart with
            # the same range reuses the shard's record without parsing or hashing the model.
            start, end = parse_layers(cfg.layers, 1 << 30)
        files = await run_sync(lambda: extract_shard(path, start, end, self.cache, progress=Progress))
        stored: Manifest | None = await run_sync(load_manifest, self.cache, files.model.fingerprint)
        manifest = stored if stored is not None else await run_sync(local_manifest, path, self.cache)
        if device is None and cfg.gpu_layers not in ("0", "auto"):
            device = await run_sync(_gpu_device, cfg, self.devices)
        self._warn_if_too_big(sizing, budget, start, end, device)
        gpu_layers = gpu_layer_count(cfg, sizing, start, end, device)
        pool = self._pool_tokens(sizing, budget, start, end, gpu_layers, await self._rooms(gpu_layers))
        return Joined(
            files=files,
            manifest=manifest,
            header_file=path,
            fetched=False,
            statistics=None,
            capacity_layers=capacity,
            budget=budget,
            sizing=sizing,
            gpu_layers=gpu_layers,
            device=device,
            join_s=time.monotonic() - t0,
            kv_pool_tokens=pool,
            kv_pool_bounds=self.pool_bounds,
            kv_pool_bound_by=self.pool_bound_by,
        )

    def _local_meta(self, path: Path) -> tuple[ModelMeta, Manifest]:
        reader = open_reader(path)
        meta = model_meta(path, reader, fingerprint="0" * 64)
        if self.cache:
            from node.fingerprint import is_local_manifest_cached

            if not is_local_manifest_cached(path, self.cache):
                with Progress("verifying", path.stat().st_size, path.name) as bar:
                    manifest = local_manifest(path, self.cache, bar.update)
            else:
                manifest = local_manifest(path, self.cache)
        from dataclasses import replace

        return replace(meta, fingerprint=manifest.fingerprint()), manifest

    async def _size(
        self, meta: ModelMeta, manifest: Manifest, reader_path: Path
    ) -> tuple[Sizing, MemoryLimit, int, Device | None]:
        cfg = self.cfg
        sizing = await run_sync(model_sizing, meta, manifest, reader_path, cfg)
        limits = await run_sync(memory_limits, _memory_bytes(cfg))
        budget = limits[-1]
        device = await run_sync(_gpu_device, cfg, self.devices) if cfg.gpu_layers == "auto" else None
        ram_layers = sizing.max_layers(span_budget_bytes(budget.bytes, auto_pool=cfg.kv_pool_tokens < 0))
        gpu_layers = 0
        if device is not None:
            gpu_layers = sizing.split_gpu(0, meta.n_layers, device.free_bytes, _mask_bytes(cfg))
        capacity = min(meta.n_layers, ram_layers + gpu_layers)
        if cfg.capacity_layers:
            capacity = min(capacity, cfg.capacity_layers)
        event(
            log,
            "capacity",
            layers=capacity,
            layers_in_ram=ram_layers,
            layers_on_gpu=gpu_layers,
            budget_bytes=budget.bytes,
            budget_source=budget.source,
            limits={m.source: m.bytes for m in limits},
            layer_bytes_max=max(sizing.layer_bytes),
            kv_bytes_per_layer_max=max(sizing.kv_bytes_per_layer),
            first_extra_bytes=sizing.first_extra_bytes,
            last_extra_bytes=sizing.last_extra_bytes,
            fixed_bytes=sizing.fixed_bytes,
            capacity_layers_setting=cfg.capacity_layers,
            gpu=device.description if device else None,
        )
        if capacity < 1 and (cfg.layers == "auto" or cfg.gpu_layers == "auto" or cfg.kv_pool_tokens < 0):
            need = sizing.fixed_bytes + min(
                sizing.layer_bytes[i] + sizing.kv_bytes_per_layer[i] for i in range(sizing.n_layers)
            )
            raise CapacityError(
                f"this node's memory ({budget.bytes / 2**20:.0f} MiB, from {budget.source}) cannot hold even "
                f"one layer of {meta.name} (one layer with its KV and the node's fixed overhead needs "
                f"{need / 2**20:.0f} MiB): lower "
                + ("kv_pool_tokens" if cfg.kv_pool_tokens > 0 else "max_sessions or session_kv_tokens")
                + ", or raise memory_limit_mb"
            )
        return sizing, budget, capacity, device

    def _fits(
        self, sizing: Sizing | None, budget: MemoryLimit | None, a: int, b: int, device: Device | None
    ) -> bool:
        if sizing is None or budget is None:
            return True
        on_gpu = sizing.split_gpu(a, b, device.free_bytes, _mask_bytes(self.cfg)) if device is not None else 0
        ram = sizing.span_bytes(a, b) - sum(
            sizing.layer_bytes[i] + sizing.kv_bytes_per_layer[i] for i in range(b - on_gpu, b)
        )
        return ram <= span_budget_bytes(budget.bytes, auto_pool=self.cfg.kv_pool_tokens < 0)

    async def _recommend(
        self,
        meta: ModelMeta,
        capacity: int,
        sizing: Sizing | None,
        budget: MemoryLimit | None,
        device: Device | None,
    ) -> tuple[int, int]:
        from common.tracker_client import TrackerClient, TrackerClientError

        cap = capacity or meta.n_layers
        memory = None
        if sizing is not None and budget is not None and device is None:
            memory = max(0, budget.bytes - sizing.fixed_bytes)
        async with TrackerClient(self.tracker_url, self.key, tls=self.cfg.tracker_tls()) as client:
            while True:
                try:
                    with trio.fail_after(TRACKER_CALL_TIMEOUT_S):
                        start, end = await client.recommend(
                            meta.fingerprint,
                            cap,
                            memory_bytes=memory,
                            kv_bytes_per_layer=max(sizing.kv_bytes_per_layer) if sizing else None,
                        )
                except TrackerClientError as err:
                    if err.status == 404:  # a model the swarm does not know yet: start at layer 0
                        start, end = 0, min(cap, meta.n_layers)
                    elif err.status == 409 and cap > 1:  # nothing of that many layers fits there
                        cap -= 1
                        continue
                    else:
                        raise
                except (httpx.TransportError, trio.TooSlowError) as err:
                    refused = pin_refusal(err)
                    if refused is not None:  # another certificate than the pinned one: nothing was sent
                        event(log, "tracker_tls_refused", level=logging.ERROR, error=str(refused))
                    else:
                        event(log, "tracker_unreachable", level=logging.WARNING, error=repr(err))
                    await trio.sleep(self.cfg.tracker_retry_s)
                    continue
                if self._fits(sizing, budget, start, end, device):
                    event(log, "span_recommended", start=start, end=end, capacity_layers=cap)
                    return start, end
                # A first or last stage costs more than a middle one: ask for fewer layers.
                event(log, "span_too_big", start=start, end=end, capacity_layers=cap)
                cap = min(cap, end - start) - 1
                if cap < 1:
                    raise CapacityError(
                        f"no span of {meta.name} the tracker recommends fits this node's memory "
                        f"({budget.bytes / 2**20 if budget else 0:.0f} MiB)"
                    )

    def _warn_if_too_big(
        self, sizing: Sizing | None, budget: MemoryLimit | None, start: int, end: int, device: Device | None
    ) -> None:
        if sizing is not None and budget is not None and not self._fits(sizing, budget, start, end, device):
            event(
                log,
                "shard_exceeds_memory",
                level=logging.WARNING,
                start=start,
                end=end,
                needs_bytes=sizing.span_bytes(start, end),
                budget_bytes=budget.bytes,
                budget_source=budget.source,
            )


async def join(cfg: NodeConfig, *, key: Any, tracker_url: str) -> Joined:
    """Find, size, choose, fetch or cut the shard this node serves (see the module docstring)."""
    return await _Joiner(cfg, key, tracker_url).run()
