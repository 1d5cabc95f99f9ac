"""Fetching only a shard's bytes: HTTP(S) servers that honour ``Range``, and peer nodes.

A :class:`FetchJob` fills the ``.partial`` output files of a shard's plans
(``node.shard.OutputPlan``) with the source tensors they need, taking the
bytes from the first usable :class:`ByteSource` and checking every tensor
against the model's manifest before it counts as done. Nothing unverified is
ever published: the output files keep their ``.partial`` names until every
tensor in them has matched its digest, then they are fsynced and renamed.

Sources
    :class:`HttpSource` asks for byte ranges (``Range: bytes=a-b``) of the
    model file. A server answering 200 (the whole file) is refused at once
    with :class:`~node.errors.RangeNotSupported`, without reading the body;
    a ``Content-Range`` whose total differs from the manifest's file size
    (a truncated or different file) is refused with a clear message.
    :class:`PeerSource` asks a node's ``GetTensorBytes`` RPC for ranges of
    tensors in its span (at most :data:`PEER_REQUEST_BYTES` per call). A peer
    that does not hold a range answers ``NOT_FOUND`` and the next source is
    tried. Sources are tried in order, except that one measured slower than
    ``slow_bytes_per_s`` (after :data:`SLOW_AFTER_BYTES`) goes to the back.

Reads
    Adjacent tensors (gaps up to :data:`MERGE_GAP_BYTES`, alignment padding)
    are fetched in one HTTP range request; gap bytes are discarded. Bytes are
    hashed and written at their offsets in worker threads
    (``common.files.run_sync``) in batches of at most :data:`WRITE_BATCH_BYTES`;
    one batch at a time is in memory. A stalled read (no bytes for
    ``stall_timeout_s``) or a dropped connection is retried from where it
    stopped, at most ``max_attempts`` times per source and range.

Verification
    A tensor whose digest does not match is refused: its bytes are forgotten
    and it is fetched again (from the same or the next source) at most
    ``max_attempts`` times; then the job fails with
    :class:`~node.errors.IntegrityError` naming the tensor and the source.

Resume
    A small JSON state file next to the outputs records, for each tensor, the
    bytes written (and fsynced) and whether it verified; it is written after
    an fsync of the outputs every :data:`STATE_EVERY_BYTES` and when the job
    stops (an error, Ctrl-C). A killed fetch restarts where it stopped: verified
    tensors are kept, a partly written one is re-hashed from the disk and
    continued. The state is keyed by the plans' layout digests; a different
    plan starts afresh.

Disk
    A full disk while writing (``ENOSPC``) removes the ``.partial`` files and
    the state (there is nothing to resume into) and fails with
    :class:`~node.errors.DiskSpaceError`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import trio

from common.files import run_sync
from common.logs import event
from node.errors import DiskSpaceError, FetchError, IntegrityError, RangeNotSupported
from node.manifest import Manifest, TensorEntry
from node.shard import OutputPlan, open_partial, publish_partial

log = logging.getLogger("swarm.node.fetch")

MERGE_GAP_BYTES = 64 * 1024
PEER_REQUEST_BYTES = 4 * 1024 * 1024
PEER_CHUNK_BYTES = 1024 * 1024
WRITE_BATCH_BYTES = 4 * 1024 * 1024
STATE_EVERY_BYTES = 16 * 1024 * 1024
SLOW_AFTER_BYTES = 16 * 1024 * 1024
STATE_FORMAT = 1
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class SourceLacks(FetchError):
    """This source does not hold the bytes asked for (a peer outside its span): try another."""


class Transient(FetchError):
    """The read broke off (connection dropped, stalled, server busy): retrying may work."""


Sink = Callable[[bytes], Awaitable[None]]


class ByteSource(Protocol):
    name: str

    async def read(self, offset: int, length: int, sink: Sink) -> None:
        """Hand bytes ``[offset, offset + length)`` of the model file to ``sink``, in order (any chunking)."""
        ...


# ----------------------------------------------------------------------------------------- HTTP


class HttpSource:
    """A static file server that honours ``Range`` requests."""

    def __init__(self, url: str, client: httpx.AsyncClient, *, file_size: int | None = None) -> None:
        self.url = url
        self.name = url
        self.client = client
        self.file_size = file_size

    def _check_size(self, total: int) -> None:
        if self.file_size is not None and total != self.file_size:
            raise FetchError(
                f"{self.url} serves a file of {total} bytes, but the model's manifest says {self.file_size}: "
                "the file on the server is truncated or is another file"
            )

    async def read(self, offset: int, length: int, sink: Sink) -> None:
        if length <= 0:
            return
        headers = {"Range": f"bytes={offset}-{offset + length - 1}", "Accept-Encoding": "identity"}
        try:
            async with self.client.stream("GET", self.url, headers=headers) as response:
                if response.status_code == 200:
                    size = response.headers.get("content-length", "?")
                    raise RangeNotSupported(
                        f"{self.url}: the server ignores Range requests (it answered 200 with the whole "
                        f"file, {size} bytes); a node fetches only its shard's bytes and needs a server that "
                        "honours Range (nginx, Apache, Caddy, object stores and most CDNs do; "
                        "python -m http.server does not)"
                    )
                if response.status_code == 416:
                    raise FetchError(
                        f"{self.url}: bytes {offset}..{offset + length - 1} are past the end of the file "
                        "(HTTP 416): the file on the server is truncated or is another file"
                    )
                if response.status_code in (429, 502, 503, 504):
                    raise Transient(f"{self.url}: HTTP {response.status_code}")
                if response.status_code != 206:
                    raise FetchError(f"{self.url}: HTTP {response.status_code} for a range request")
                got = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
                if got is None:
                    raise RangeNotSupported(f"{self.url}: a 206 answer without a usable Content-Range header")
                first, last, total = int(got.group(1)), int(got.group(2)), got.group(3)
                if total != "*":
                    self._check_size(int(total))
                if first != offset or last != offset + length - 1:
                    raise FetchError(
                        f"{self.url}: asked for bytes {offset}-{offset + length - 1}, got {first}-{last}"
                    )
                left = length
                async for chunk in response.aiter_raw():
                    if len(chunk) > left:
                        raise FetchError(f"{self.url}: the server sent more than the range asked for")
                    left -= len(chunk)
                    await sink(chunk)
                if left:
                    raise Transient(f"{self.url}: the answer ended {left} bytes short")
        except (httpx.TransportError, httpx.StreamError) as err:
            raise Transient(f"{self.url}: {type(err).__name__}: {err}") from err


# ----------------------------------------------------------------------------------------- peers


class PeerSource:
    """A node serving its span's bytes over ``ShardService.GetTensorBytes``."""

    def __init__(self, address: str, grpc_rt: Any, fingerprint: str, *, call_timeout_s: float = 60.0) -> None:
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.name = f"peer {address}"
        self.grpc = grpc_rt
        self.fingerprint = fingerprint

    async def read(self, offset: int, length: int, sink: Sink) -> None:
        from common.grpc_adapter import UNPINNED, RpcError
        from proto.swarm.v1 import shard_service_pb2

        pos, end = offset, offset + length
        while pos < end:
            n = min(PEER_REQUEST_BYTES, end - pos)
            request = shard_service_pb2.TensorBytesRequest(
                model_fingerprint=self.fingerprint, offset=pos, length=n, max_chunk_bytes=PEER_CHUNK_BYTES
            ).SerializeToString()
            try:
                with trio.fail_after(self.call_timeout_s):
                    replies = await self.grpc.server_stream(
                        self.address,
                        "/swarm.v1.ShardService/GetTensorBytes",
                        request,
                        max_messages=n // PEER_CHUNK_BYTES + 2,
                        max_message_bytes=PEER_CHUNK_BYTES + 64 * 1024,
                        pin=UNPINNED,  # the bytes are checked by hash: the peer needs no authentication
                    )
            except trio.TooSlowError as err:
                raise Transient(f"{self.name}: no answer within {self.call_timeout_s:g} s") from err
            except RpcError as err:
                if err.code in ("NOT_FOUND", "UNIMPLEMENTED", "OUT_OF_RANGE"):
                    raise SourceLacks(f"{self.name} does not hold bytes {pos}..{pos + n - 1}: {err}") from err
                raise Transient(f"{self.name}: {err}") from err
            for raw in replies:
                chunk = shard_service_pb2.TensorBytesChunk.FromString(raw)
                if chunk.offset != pos or not chunk.data or pos + len(chunk.data) > end:
                    raise FetchError(f"{self.name} sent bytes out of order or outside the range asked for")
                pos += len(chunk.data)
                await sink(chunk.data)
            if not replies:
                raise Transient(f"{self.name} answered with no bytes")


# ----------------------------------------------------------------------------------------- the job


@dataclass
class _Target:
    """One source tensor being fetched and where its bytes go."""

    entry: TensorEntry
    dests: list[tuple[int, int]]  # (plan index, offset of the tensor's first byte in that output)
    done: int = 0  # bytes written (and, with the hasher, hashed) from the start of the tensor
    ok: bool = False
    attempts: int = 0
    hasher: Any = None
    lacking: set[str] = field(default_factory=set)  # sources that do not hold it (or keep failing)
    last_error: str = ""

    @property
    def left(self) -> int:
        return self.entry.size - self.done


@dataclass(frozen=True)
class FetchStatistics:
    tensors: int
    tensors_resumed: int
    bytes_needed: int
    bytes_resumed: int
    bytes_by_source: dict[str, int]
    refetched_tensors: int
    elapsed_s: float


class _DiskFull(Exception):
    pass


class _RunCursor:
    """Where a run's byte stream is: the file position and the batch not yet written."""

    def __init__(self, run: list[_Target], pos: int) -> None:
        self.run = run
        self.pos = pos
        self.index = 0
        self.batch: list[tuple[_Target, int, bytes]] = []
        self.batch_bytes = 0

    def target(self) -> _Target | None:
        while self.index < len(self.run):
            t = self.run[self.index]
            if self.pos < t.entry.offset + t.entry.size:
                return t
            self.index += 1
        return None


class FetchJob:
    """Fetch, verify and write the source tensors ``plans`` need; publish the plans when complete."""

    def __init__(
        self,
        manifest: Manifest,
        plans: Sequence[OutputPlan],
        state_path: Path,
        sources: Sequence[ByteSource],
        *,
        max_attempts: int = 3,
        stall_timeout_s: float = 60.0,
        slow_bytes_per_s: float = 0.0,
        retry_wait_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not sources:
            raise FetchError("no source to fetch the model's bytes from (no URL, no peer)")
        self.manifest = manifest
        self.plans = list(plans)
        self.state_path = state_path
        self.sources = list(sources)
        self.max_attempts = max_attempts
        self.stall_timeout_s = stall_timeout_s
        self.slow_bytes_per_s = slow_bytes_per_s
        self.retry_wait_s = retry_wait_s
        self.clock = clock
        entries = manifest.by_name()
        targets: dict[str, _Target] = {}
        for i, plan in enumerate(self.plans):
            for piece in plan.pieces:
                entry = entries.get(piece.source)
                if entry is None:
                    raise FetchError(f"the manifest has no tensor {piece.source!r} the shard needs")
                if entry.size != piece.size:
                    raise FetchError(
                        f"tensor {piece.source}: {piece.size} bytes in the plan, {entry.size} listed"
                    )
                targets.setdefault(piece.source, _Target(entry, [])).dests.append((i, piece.out_offset))
        self.targets = sorted(targets.values(), key=lambda t: t.entry.offset)
        self._fds: list[int] = []
        self._since_state = 0
        self._source_t: dict[str, float] = {}
        self._source_bytes: dict[str, int] = {}
        self.refetched = 0
        self.resumed_tensors = 0
        self.resumed_bytes = 0
        self._on_bytes: Callable[[int], None] = lambda n: None

    # -- public ------------------------------------------------------------------------------------

    @property
    def bytes_needed(self) -> int:
        return sum(t.entry.size for t in self.targets)

    async def prepare(self) -> int:
        """Open the ``.partial`` outputs and take over a previous run's progress; returns bytes left."""
        await run_sync(self._open_and_resume)
        return sum(t.left for t in self.targets if not t.ok)

    async def run(self, on_bytes: Callable[[int], None] | None = None) -> FetchStatistics:
        """Fetch everything (after :meth:`prepare`) and publish the outputs."""
        t0 = self.clock()
        if on_bytes is not None:
            self._on_bytes = on_bytes
        try:
            while True:
                pending = [t for t in self.targets if not t.ok]
                if not pending:
                    break
                progressed = False
                for source in self._ordered_sources():
                    wanted = [t for t in pending if not t.ok and source.name not in t.lacking]
                    if not wanted:
                        continue
                    await self._from_source(source, wanted)
                    progressed = True
                    break
                if not progressed:
                    stuck = [t for t in self.targets if not t.ok]
                    names = ", ".join(t.entry.name for t in stuck[:3]) + (" ..." if len(stuck) > 3 else "")
                    why = stuck[0].last_error or "no source holds it"
                    raise FetchError(
                        f"could not fetch tensor(s) {names} from "
                        f"{', '.join(s.name for s in self.sources)}: {why}"
                    )
            await run_sync(self._publish)
        except _DiskFull as full:
            await run_sync(self._discard)
            raise DiskSpaceError(
                f"the disk filled up while writing the shard ({full}); the partial files were removed: "
                "free some space or point --cache-dir at a larger disk, then start again"
            ) from None
        except BaseException:
            with trio.CancelScope(shield=True):
                await run_sync(self._close_keep)
            raise
        return FetchStatistics(
            tensors=len(self.targets),
            tensors_resumed=self.resumed_tensors,
            bytes_needed=self.bytes_needed,
            bytes_resumed=self.resumed_bytes,
            bytes_by_source=dict(self._source_bytes),
            refetched_tensors=self.refetched,
            elapsed_s=self.clock() - t0,
        )

    # -- sources -----------------------------------------------------------------------------------

    def _rate(self, name: str) -> float | None:
        got = self._source_bytes.get(name, 0)
        spent = self._source_t.get(name, 0.0)
        if got < SLOW_AFTER_BYTES or spent <= 0:
            return None
        return got / spent

    def _ordered_sources(self) -> list[ByteSource]:
        if self.slow_bytes_per_s <= 0:
            return list(self.sources)
        fast = [s for s in self.sources if (self._rate(s.name) or float("inf")) >= self.slow_bytes_per_s]
        slow = [s for s in self.sources if s not in fast]
        return fast + slow

    async def _from_source(self, source: ByteSource, wanted: list[_Target]) -> None:
        """Fetch ``wanted`` (in file order) from ``source`` run by run, until done, lacking or failed."""
        runs = self._runs(wanted, merge=isinstance(source, HttpSource))
        for run in runs:
            if self.slow_bytes_per_s > 0 and len(self.sources) > 1:
                rate = self._rate(source.name)
                if (
                    rate is not None
                    and rate < self.slow_bytes_per_s
                    and self._ordered_sources()[0] is not source
                ):
                    event(log, "fetch_source_slow", source=source.name, rate_bytes_per_s=round(rate))
                    return  # the caller picks the faster source for what is left
            await self._run_with_retries(source, run)

    @staticmethod
    def _runs(wanted: list[_Target], *, merge: bool) -> list[list[_Target]]:
        runs: list[list[_Target]] = []
        for t in wanted:
            if runs and merge:
                prev = runs[-1][-1]
                gap = t.entry.offset + t.done - (prev.entry.offset + prev.entry.size)
                if 0 <= gap <= MERGE_GAP_BYTES and t.done == 0:
                    runs[-1].append(t)
                    continue
            runs.append([t])
        return runs

    async def _run_with_retries(self, source: ByteSource, run: list[_Target]) -> None:
        tries = 0
        while True:
            todo = [t for t in run if not t.ok and source.name not in t.lacking]
            if not todo:
                return
            try:
                await self._read_run(source, todo)
                return
            except SourceLacks as err:
                self._give_up(source, todo, str(err))
                event(log, "fetch_source_lacks", source=source.name, error=str(err))
                return
            except Transient as err:
                tries += 1
                event(
                    log,
                    "fetch_retry",
                    level=logging.WARNING,
                    source=source.name,
                    attempt=tries,
                    error=str(err),
                )
                if tries >= self.max_attempts:
                    self._give_up(source, todo, f"{err} ({tries} attempts)")
                    return
                await trio.sleep(self.retry_wait_s * tries)

    @staticmethod
    def _give_up(source: ByteSource, targets: list[_Target], why: str) -> None:
        for t in targets:
            if not t.ok:
                t.lacking.add(source.name)
                t.last_error = why

    async def _read_run(self, source: ByteSource, run: list[_Target]) -> None:
        """One request for bytes from the first target's resume point to the last target's end."""
        first = run[0]
        start = first.entry.offset + first.done
        end = run[-1].entry.offset + run[-1].entry.size
        cursor = _RunCursor(run, start)

        async def sink(chunk: bytes) -> None:
            view = memoryview(chunk)
            while view:
                t = cursor.target()
                if t is None:
                    raise FetchError(f"{source.name}: more bytes than asked for")
                if cursor.pos < t.entry.offset:  # padding between tensors: discard
                    skip = min(len(view), t.entry.offset - cursor.pos)
                    view = view[skip:]
                    cursor.pos += skip
                    continue
                within = cursor.pos - t.entry.offset
                take = min(len(view), t.entry.size - within)
                cursor.batch.append((t, within, bytes(view[:take])))
                cursor.batch_bytes += take
                view = view[take:]
                cursor.pos += take
                if within + take == t.entry.size or cursor.batch_bytes >= WRITE_BATCH_BYTES:
                    batch, cursor.batch, cursor.batch_bytes = cursor.batch, [], 0
                    await self._flush(batch, source)

        t0 = self.clock()
        try:
            await source.read(start, end - start, sink)
            if cursor.batch:
                batch, cursor.batch, cursor.batch_bytes = cursor.batch, [], 0
                await self._flush(batch, source)
        finally:
            self._source_t[source.name] = self._source_t.get(source.name, 0.0) + (self.clock() - t0)
        if cursor.pos != end:
            raise Transient(f"{source.name}: the answer ended at byte {cursor.pos} of {end}")

    async def _flush(self, batch: list[tuple[_Target, int, bytes]], source: ByteSource) -> None:
        """Hash and write a batch (a worker thread), then settle tensors that completed."""
        n = sum(len(data) for _, _, data in batch)
        await run_sync(self._write_batch, batch)
        self._source_bytes[source.name] = self._source_bytes.get(source.name, 0) + n
        self._on_bytes(n)
        self._since_state += n
        completed = {id(t): t for t, within, data in batch if within + len(data) == t.entry.size}
        save = self._since_state >= STATE_EVERY_BYTES
        for t in completed.values():
            digest = t.hasher.hexdigest()
            if digest == t.entry.sha256:
                t.ok = True
            else:
                t.attempts += 1
                self.refetched += 1
                event(
                    log,
                    "tensor_refused",
                    level=logging.WARNING,
                    tensor=t.entry.name,
                    source=source.name,
                    got_sha256=digest,
                    expected_sha256=t.entry.sha256,
                    attempt=t.attempts,
                )
                t.done, t.hasher = 0, None
                if t.attempts >= self.max_attempts:
                    raise IntegrityError(
                        f"tensor {t.entry.name} from {source.name} does not match the model's manifest "
                        f"(sha256 {digest}, expected {t.entry.sha256}) after {t.attempts} attempts; "
                        "nothing was published"
                    )
        if save:
            await run_sync(self._save_state)

    # -- blocking parts (worker threads) ----------------------------------------------------------------

    def _write_batch(self, batch: list[tuple[_Target, int, bytes]]) -> None:
        for t, within, data in batch:
            if t.hasher is None:
                t.hasher = hashlib.sha256()
            if within != t.done:
                raise FetchError(f"tensor {t.entry.name}: bytes at {within} while {t.done} were written")
            t.hasher.update(data)
            for plan_index, out_offset in t.dests:
                self._pwrite(self._fds[plan_index], data, out_offset + within)
            t.done += len(data)

    @staticmethod
    def _pwrite(fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise _DiskFull(str(err)) from err
                raise
            view = view[n:]
            offset += n

    def _state_key(self) -> list[str]:
        return [p.digest() for p in self.plans]

    def _open_and_resume(self) -> None:
        state: dict[str, Any] = {}
        try:
            loaded = json.loads(self.state_path.read_text())
            if loaded.get("format") == STATE_FORMAT and loaded.get("plans") == self._state_key():
                state = loaded.get("tensors", {})
        except (OSError, ValueError, AttributeError):
            state = {}
        fresh = not state or not all(p.partial_path.is_file() for p in self.plans)
        if fresh:
            state = {}
        try:
            for plan in self.plans:
                if fresh:
                    plan.partial_path.unlink(missing_ok=True)
                self._fds.append(open_partial(plan))
        except OSError as err:
            self._close_keep()
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _DiskFull(str(err)) from err
            raise
        for t in self.targets:
            got = state.get(t.entry.name)
            if not isinstance(got, dict):
                continue
            done = got.get("done", 0)
            if not isinstance(done, int) or not 0 < done <= t.entry.size:
                continue
            # Re-hash what is on the disk (the first destination): verified bytes stay verified only if
            # they are still there, and a partial tensor's hash continues from them.
            plan_index, out_offset = t.dests[0]
            hasher = hashlib.sha256()
            left, pos = done, out_offset
            while left:
                data = os.pread(self._fds[plan_index], min(left, 8 * 1024 * 1024), pos)
                if not data:
                    break
                hasher.update(data)
                left -= len(data)
                pos += len(data)
            if left:
                continue
            if done == t.entry.size:
                if hasher.hexdigest() != t.entry.sha256:
                    continue
                t.ok = True
                self.resumed_tensors += 1
            t.done, t.hasher = done, hasher
            self.resumed_bytes += done
        if self.resumed_bytes:
            event(log, "fetch_resumed", tensors=self.resumed_tensors, bytes=self.resumed_bytes)

    def _save_state(self) -> None:
        for fd in self._fds:
            os.fsync(fd)
        self._write_state()
        self._since_state = 0

    def _publish(self) -> None:
        fds, self._fds = self._fds, []
        for plan, fd in zip(self.plans, fds, strict=True):
            publish_partial(plan, fd)
        self.state_path.unlink(missing_ok=True)

    def _close_keep(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)
        if any(t.done for t in self.targets):
            try:
                self._write_state()
            except OSError:
                pass

    def _write_state(self) -> None:
        data = {
            "format": STATE_FORMAT,
            "plans": self._state_key(),
            "tensors": {t.entry.name: {"done": t.done, "ok": t.ok} for t in self.targets if t.done},
        }
        tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.state_path)

    def _discard(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        for plan in self.plans:
            plan.partial_path.unlink(missing_ok=True)
        self.state_path.unlink(missing_ok=True)
