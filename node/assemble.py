"""Where a node's model comes from, and putting its shard together from there.

``--model`` takes a local path, an ``http(s)://`` URL of a GGUF file, a model
name the tracker's registry knows, or a model fingerprint (64 hex). Everything
but a local file is resolved to a :class:`ModelSource`: the model's manifest
(``node.manifest``), the URLs serving the file and the peer nodes serving
spans of it. Then :func:`assemble_shard` fetches the header (checked against
the manifest), writes a header-only copy of the model into the cache
(``<cache>/sources/<fingerprint prefix>/header.gguf``: a sparse file of the
model's size holding only its metadata, which the shard planner and the
vocabulary extraction read like the whole model) and has a
:class:`node.fetch.FetchJob` fetch and verify only the tensors of the span.

Where the manifest of a URL comes from, in order: ``--manifest FILE|URL``
(the operator vouches for it), the tracker's registry (a registered model
listing that URL as a source), or a file published next to the model,
``<url>.manifest.json`` (``swarm-node model manifest FILE`` writes it). A URL
with none of these is refused: without a manifest a node could not tell a
corrupted byte from a good one, and hashing the whole file would mean
downloading it.

A model name or fingerprint is resolved through the tracker's registry
(``GET /v1/registry/models/<name or fingerprint>``): the manifest (whose
digest must equal the registered fingerprint), its source URLs and the live
peers holding spans of it. ``--peer HOST:PORT`` adds peers by hand (with
``--model FINGERPRINT`` and no tracker, a peer is asked for the manifest,
which must hash to that fingerprint).

Every network wait here is bounded by the caller's ``trio.fail_after`` or by
the fetch job's stall timeout; blocking file work runs in
``common.files.run_sync`` threads.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import trio

from common.files import run_sync
from common.logs import event
from node.errors import FetchError, ManifestError, RangeNotSupported, ShardError
from node.fetch import ByteSource, FetchJob, FetchStatistics, HttpSource, PeerSource
from node.fingerprint import load_manifest, store_manifest
from node.manifest import Manifest, check_fingerprint
from node.shard import (
    ModelMeta,
    ShardFiles,
    check_free_disk,
    model_meta,
    open_reader,
    plan_is_done,
    read_shard_record,
    shard_files,
    shard_plans,
    write_shard_record,
)

log = logging.getLogger("swarm.node.assemble")
MANIFEST_SUFFIX = ".manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

ProgressFactory = Callable[[str, int, str], Any]


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def is_fingerprint(spec: str) -> bool:
    return bool(_HEX64.match(spec))


@dataclass(frozen=True)
class ModelSource:
    """A model to fetch: its manifest and where its bytes can be had."""

    spec: str  # what the volunteer gave
    manifest: Manifest
    fingerprint: str
    urls: tuple[str, ...]
    peers: tuple[str, ...]
    name: str = ""  # the registry's name, when it has one

    def describe(self) -> str:
        where = [*self.urls, *(f"peer {p}" for p in self.peers)]
        return f"{self.name or self.fingerprint[:16]} from {', '.join(where) or 'nowhere'}"


def header_path(cache_dir: Path, fingerprint: str) -> Path:
    return Path(cache_dir) / "sources" / fingerprint[:16] / "header.gguf"


def record_key(fingerprint: str) -> str:
    return f"fp-{fingerprint[:32]}"


# --------------------------------------------------------------------------------------- manifests


async def _get_bytes(client: httpx.AsyncClient, url: str, what: str) -> bytes | None:
    """A small file over HTTP (None for 404); bounded by :data:`MAX_MANIFEST_BYTES`."""
    try:
        async with client.stream("GET", url) as response:
            if response.status_code == 404:
                return None
            if response.status_code != 200:
                raise FetchError(f"{url}: HTTP {response.status_code} fetching {what}")
            out = bytearray()
            async for chunk in response.aiter_bytes():
                out += chunk
                if len(out) > MAX_MANIFEST_BYTES:
                    raise FetchError(f"{url}: {what} is larger than {MAX_MANIFEST_BYTES} bytes")
            return bytes(out)
    except httpx.HTTPError as err:
        raise FetchError(f"{url}: cannot fetch {what}: {type(err).__name__}: {err}") from err


async def read_manifest_arg(arg: str, client: httpx.AsyncClient) -> Manifest:
    """``--manifest FILE|URL``."""
    if is_url(arg):
        data = await _get_bytes(client, arg, "the manifest")
        if data is None:
            raise ManifestError(f"{arg}: no such manifest (HTTP 404)")
    else:
        try:
            data = await run_sync(lambda: Path(arg).expanduser().read_bytes())
        except OSError as err:
            raise ManifestError(f"{arg}: cannot read the manifest: {err}") from err
    return Manifest.from_bytes(data)


async def registry_lookup(
    tracker: Any, model: str | None = None, url: str | None = None
) -> dict[str, Any] | None:
    """The tracker registry's entry for a model name/fingerprint or a source URL (None if unknown)."""
    from common.tracker_client import TrackerClientError

    try:
        if model is not None:
            return await tracker.registry_model(model)
        found = await tracker.registry_models(source=url)
        return found[0] if found else None
    except TrackerClientError as err:
        if err.status == 404:
            return None
        raise FetchError(f"the tracker's registry refused the lookup: {err}") from err


def _manifest_from_entry(entry: dict[str, Any]) -> tuple[Manifest, str]:
    fingerprint = check_fingerprint(str(entry.get("fingerprint", "")))
    manifest = Manifest.from_json(entry.get("manifest"))
    if manifest.fingerprint() != fingerprint:
        raise ManifestError(
            f"the tracker's manifest for {fingerprint[:16]} does not hash to that fingerprint: refused"
        )
    return manifest, fingerprint


async def _peer_manifest(grpc_rt: Any, peer: str, fingerprint: str) -> Manifest:
    from common.grpc_adapter import UNPINNED, RpcError
    from proto.swarm.v1 import shard_service_pb2

    request = shard_service_pb2.ManifestRequest(model_fingerprint=fingerprint).SerializeToString()
    try:
        with trio.fail_after(30):
            # The manifest is checked against the fingerprint: the peer needs no authentication.
            reply = await grpc_rt.unary(
                peer,
                "/swarm.v1.ShardService/GetManifest",
                request,
                max_message_bytes=MAX_MANIFEST_BYTES,
                pin=UNPINNED,
            )
    except (RpcError, trio.TooSlowError) as err:
        raise FetchError(f"peer {peer} did not give the manifest of {fingerprint[:16]}: {err}") from err
    message = shard_service_pb2.ManifestReply.FromString(reply)
    return Manifest.from_bytes(message.manifest_json, fingerprint)


async def resolve(
    spec: str,
    *,
    cache_dir: Path,
    client: httpx.AsyncClient,
    tracker: Any = None,
    grpc_rt: Any = None,
    manifest_arg: str = "",
    peers: Sequence[str] = (),
) -> ModelSource:
    """``--model URL|NAME|FINGERPRINT`` -> a manifest and sources (local paths are not resolved here)."""
    peers = tuple(p for p in peers if p)
    if is_url(spec):
        parsed = urlparse(spec)
        if not parsed.netloc:
            raise FetchError(f"{spec}: not a usable URL")
        manifest: Manifest | None = None
        urls: tuple[str, ...] = (spec,)
        name = Path(parsed.path).name
        if manifest_arg:
            manifest = await read_manifest_arg(manifest_arg, client)
            how = f"--manifest {manifest_arg}"
        elif tracker is not None and (entry := await registry_lookup(tracker, url=spec)) is not None:
            manifest, _ = _manifest_from_entry(entry)
            urls = tuple(dict.fromkeys([spec, *entry.get("sources", [])]))
            peers = tuple(dict.fromkeys([*peers, *(p["address"] for p in entry.get("peers", []))]))
            name = str(entry.get("name") or name)
            how = "the tracker's registry"
        else:
            data = await _get_bytes(client, spec + MANIFEST_SUFFIX, "the manifest")
            if data is None:
                raise ManifestError(
                    f"{spec}: no manifest for this model: publish one next to the file "
                    f"(swarm-node model manifest FILE > FILE{MANIFEST_SUFFIX}), register the model at the "
                    "tracker (swarm-tracker model add), or pass --manifest FILE|URL"
                )
            manifest = Manifest.from_bytes(data)
            how = spec + MANIFEST_SUFFIX
        fingerprint = manifest.fingerprint()
        event(log, "manifest_resolved", model=spec, fingerprint=fingerprint, via=how)
        await run_sync(store_manifest, cache_dir, manifest)
        return ModelSource(spec, manifest, fingerprint, urls, peers, name)

    # A name or a fingerprint.
    entry = await registry_lookup(tracker, model=spec) if tracker is not None else None
    if entry is not None:
        manifest, fingerprint = _manifest_from_entry(entry)
        urls = tuple(entry.get("sources", []))
        peers = tuple(dict.fromkeys([*peers, *(p["address"] for p in entry.get("peers", []))]))
        event(log, "manifest_resolved", model=spec, fingerprint=fingerprint, via="the tracker's registry")
        await run_sync(store_manifest, cache_dir, manifest)
        return ModelSource(spec, manifest, fingerprint, urls, peers, str(entry.get("name", "")))
    if not is_fingerprint(spec):
        where = "the tracker's registry" if tracker is not None else "no tracker was given to look it up"
        raise ShardError(
            f"--model {spec!r} is not a file, not a URL, and not a model known to {where}; "
            "give a GGUF path, an http(s) URL, or a name registered with 'swarm-tracker model add'"
        )
    cached = await run_sync(load_manifest, cache_dir, spec)
    manifest_or_none = cached
    if manifest_or_none is None:
        if not peers or grpc_rt is None:
            raise ShardError(f"model {spec[:16]}...: no manifest known (no tracker entry, no --peer to ask)")
        manifest_or_none = await _peer_manifest(grpc_rt, peers[0], spec)
        await run_sync(store_manifest, cache_dir, manifest_or_none)
    return ModelSource(spec, manifest_or_none, spec, (), peers)


# --------------------------------------------------------------------------------------- assembly


async def ensure_header(source: ModelSource, cache_dir: Path, sources: Sequence[ByteSource]) -> Path:
    """The verified header-only copy of the model in the cache (fetched once)."""
    path = header_path(cache_dir, source.fingerprint)
    manifest = source.manifest

    def existing_ok() -> bool:
        try:
            if path.stat().st_size != manifest.file_size:
                return False
            with open(path, "rb") as fh:
                manifest.check_header(fh.read(manifest.header_size))
            return True
        except (OSError, ManifestError):
            return False

    if await run_sync(existing_ok):
        return path
    errors = []
    for s in sources:
        buf = bytearray()

        async def sink(chunk: bytes, buf: bytearray = buf) -> None:
            buf.extend(chunk)

        try:
            await s.read(0, manifest.header_size, sink)
            await run_sync(_write_header, path, bytes(buf), manifest)
            event(log, "header_fetched", source=s.name, bytes=len(buf), path=str(path))
            return path
        except ManifestError as err:
            errors.append(f"{s.name}: {err}")
        except RangeNotSupported:
            if len(sources) == 1:
                raise
            errors.append(f"{s.name}: the server ignores Range requests")
        except FetchError as err:
            errors.append(f"{s.name}: {err}")
    raise FetchError(f"could not get the model's header: {'; '.join(errors) or 'no source'}")


def _write_header(path: Path, header: bytes, manifest: Manifest) -> None:
    manifest.check_header(header)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(header)
            fh.truncate(manifest.file_size)  # sparse: the tensors are never stored here
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def source_meta(path: Path, fingerprint: str) -> ModelMeta:
    """The model's description from its header-only copy."""
    return model_meta(path, open_reader(path), fingerprint=fingerprint)


@dataclass(frozen=True)
class Assembled:
    files: ShardFiles
    statistics: FetchStatistics | None  # None when the shard was already complete
    shard_bytes: int


async def assemble_shard(
    source: ModelSource,
    start: int,
    end: int,
    cache_dir: Path,
    sources: Sequence[ByteSource],
    *,
    progress: ProgressFactory | None = None,
    stall_timeout_s: float = 60.0,
    slow_bytes_per_s: float = 0.0,
    max_attempts: int = 3,
) -> Assembled:
    """Fetch and verify the span's tensors into the shard files (reusing what is complete)."""
    key = record_key(source.fingerprint)
    ident = {"fingerprint": source.fingerprint}
    reused = await run_sync(read_shard_record, cache_dir, key, start, end, ident)
    if reused is not None:
        return Assembled(reused, None, await run_sync(reused.size_bytes))
    head = await ensure_header(source, cache_dir, sources)
    meta = await run_sync(source_meta, head, source.fingerprint)
    meta.check_range(start, end)
    plans = await run_sync(lambda: shard_plans(open_reader(head), meta, start, end, cache_dir))
    todo = [p for p in plans if not await run_sync(plan_is_done, p, meta, start, end)]
    stats = None
    if todo:
        job = FetchJob(
            source.manifest,
            todo,
            todo[0].path.with_name(todo[0].path.name + ".fetch.json"),
            sources,
            max_attempts=max_attempts,
            stall_timeout_s=stall_timeout_s,
            slow_bytes_per_s=slow_bytes_per_s,
        )
        # A resumed .partial file has its full size but only the blocks written so far on the disk.
        already = sum(p.partial_path.stat().st_blocks * 512 for p in todo if p.partial_path.exists())
        await run_sync(
            check_free_disk, todo[0].path.parent, max(0, sum(p.size for p in todo) - already),
            f"the shard [{start}, {end}) of {meta.name}",
        )  # fmt: skip
        left = await job.prepare()
        detail = f"[{start}, {end}) of {meta.name}"
        if progress is not None:
            with progress("fetching", left, detail) as bar:
                stats = await job.run(bar.update)
        else:
            stats = await job.run()
        event(
            log,
            "shard_fetched",
            model=meta.name,
            fingerprint=source.fingerprint,
            start=start,
            end=end,
            bytes_needed=stats.bytes_needed,
            bytes_resumed=stats.bytes_resumed,
            bytes_by_source=stats.bytes_by_source,
            refetched_tensors=stats.refetched_tensors,
            elapsed_s=round(stats.elapsed_s, 3),
        )
    files = shard_files(meta, start, end, cache_dir)
    await run_sync(write_shard_record, files, cache_dir, key, ident)
    return Assembled(files, stats, await run_sync(files.size_bytes))


def byte_sources(
    source: ModelSource, client: httpx.AsyncClient, grpc_rt: Any, *, peer_first: bool = False
) -> list[ByteSource]:
    """The URLs (first) and the peers of ``source``, as fetchable sources."""
    urls: list[ByteSource] = [HttpSource(u, client, file_size=source.manifest.file_size) for u in source.urls]
    peers: list[ByteSource] = (
        [PeerSource(p, grpc_rt, source.fingerprint) for p in source.peers] if grpc_rt is not None else []
    )
    return peers + urls if peer_first else urls + peers


def http_client(stall_timeout_s: float = 60.0) -> httpx.AsyncClient:
    """The HTTP client for model sources: redirects followed, a read that stalls fails (and is retried)."""
    timeout = httpx.Timeout(connect=30.0, read=stall_timeout_s, write=30.0, pool=30.0)
    return httpx.AsyncClient(timeout=timeout, follow_redirects=True, headers={"User-Agent": "swarm-node"})


@dataclass(frozen=True)
class Prepared:
    """A model ready to cut shards from: a local file, or a source to fetch from."""

    meta: ModelMeta
    source: ModelSource | None  # None: meta.path is the whole model on this disk
    header_file: Path  # the model's header (the whole file, or the header-only copy)


async def prepare_remote(source: ModelSource, cache_dir: Path, sources: Sequence[ByteSource]) -> Prepared:
    head = await ensure_header(source, cache_dir, sources)
    meta = await run_sync(source_meta, head, source.fingerprint)
    return Prepared(meta, source, head)
