"""Shard extraction: turn a whole GGUF model into the partial GGUF of layers [start, end).

A node never loads the whole model. It writes, once, a partial GGUF holding
only blocks ``start .. end-1`` renumbered from 0 (``<arch>.block_count =
end - start``), and llama.cpp mmaps only those weights. Quantized tensor bytes
are copied unchanged, so a split route computes exactly what the whole model
computes (see docs/engine.md).

* A stage that is not last gets a one-token dummy vocabulary
  (``tokenizer.ggml.model = "none"``, ``<arch>.vocab_size = 1`` and a
  ``[n_embd, 1]`` ``token_embd``): its LM head then costs one row.
* The first stage looks token embeddings up itself (``node.engine.TokenEmbeddings``),
  from a companion GGUF that holds only the source ``token_embd.weight`` (raw,
  still quantized), and feeds every stage through ``llama_batch.embd``.
* The last stage keeps the real vocabulary, ``output_norm`` and the LM head.
* Whatever llama.cpp decides by *absolute* layer index travels with the cut
  (``common.architectures``): per-layer metadata arrays are sliced to the range,
  and a sliding-window architecture's shard carries the explicit per-layer
  ``<arch>.attention.sliding_window_pattern`` of its absolute layers, so a
  shard starting at layer 7 treats each layer as the whole model does. A model
  that can only be cut at some boundaries (``ModelMeta.split_points``) refuses
  any other range.

Plans: every output file is first described by an :class:`OutputPlan` -- its
header bytes (built by ``gguf``'s own writer from the source's metadata) and
where each source tensor's bytes go (:class:`Piece`); everything else in the
file is zero padding. The same plan is filled from a local file here
(:func:`extract_shard`) and from fetched, verified bytes by ``node.assemble``
(URLs, peers), so a shard cut from a local file and one assembled from a URL
are byte-identical by construction. Outputs are written to ``<name>.partial``,
fsynced and renamed: a final name only ever holds a complete file.

Each written file records, under ``swarm.*`` keys, the source model's
fingerprint (its manifest digest, ``node.fingerprint``), the range and the
source layer count, so a node can check at start-up that a cached shard
belongs to the model it was told to serve.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from common import architectures
from node.errors import (
    DiskSpaceError,
    LayerRangeError,
    NotGGUFError,
    ShardError,
    UnsupportedArchitecture,
)
from node.fingerprint import local_manifest

# Architectures whose graphs have been checked to be split-exact (parity tests, see
# common/architectures.py). Others are refused with the reason and this list.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(architectures.SUPPORTED)
# 2: explicit per-layer sliding-window arrays, per-architecture metadata handling.
# 3: the source is named by its manifest fingerprint (swarm.source.fingerprint).
SHARD_FORMAT_VERSION = 3

KEY_FORMAT = "swarm.shard.format_version"
KEY_SOURCE_FINGERPRINT = "swarm.source.fingerprint"
KEY_SOURCE_LAYERS = "swarm.source.block_count"
KEY_SOURCE_NAME = "swarm.source.name"
KEY_START = "swarm.shard.start"
KEY_END = "swarm.shard.end"
KEY_ROLE = "swarm.shard.role"  # "layers", "embeddings" or "vocab"

PARTIAL_SUFFIX = ".partial"
# Free space kept on the cache's disk beyond what a shard needs (logs, the OS, other nodes).
DISK_MARGIN_BYTES = 64 * 1024 * 1024
_COPY_CHUNK_BYTES = 8 * 1024 * 1024

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelMeta:
    """What a node needs to know about the source model."""

    path: Path  # the whole model, or (fetched models) a header-only copy of it
    fingerprint: str  # manifest digest (node.fingerprint)
    architecture: str
    name: str
    n_layers: int
    n_embd: int
    n_vocab: int
    context_length: int
    tied_embeddings: bool
    # Layer boundaries a shard may start or end at; None: every boundary 0..n_layers.
    split_points: tuple[int, ...] | None = None

    def check_range(self, start: int, end: int) -> None:
        """Refuse ``[start, end)`` if it is empty, outside the model or cut where the model cannot be cut."""
        check_range(start, end, self.n_layers, self.split_points)


@dataclass(frozen=True)
class ShardFiles:
    model: ModelMeta
    start: int
    end: int
    path: Path  # the partial GGUF llama.cpp loads
    embeddings_path: Path | None  # token_embd-only GGUF, first stage only

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.model.n_layers

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def size_bytes(self) -> int:
        total = self.path.stat().st_size
        if self.embeddings_path is not None:
            total += self.embeddings_path.stat().st_size
        return total


@dataclass(frozen=True)
class Piece:
    """Where one source tensor's bytes go in an output file."""

    out_offset: int
    size: int
    source: str  # the source tensor's name


@dataclass(frozen=True)
class OutputPlan:
    """One output file: ``header`` at 0, each piece at its offset, zeros everywhere else."""

    path: Path
    role: str  # "layers" or "embeddings"
    header: bytes  # magic .. tensor infos, padded to the data alignment
    size: int
    pieces: tuple[Piece, ...]

    def digest(self) -> str:
        """Identity of the layout (for resuming a partial file only if it is the same plan)."""
        h = hashlib.sha256(self.header)
        h.update(json.dumps([self.size, [asdict(p) for p in self.pieces]]).encode())
        return h.hexdigest()

    @property
    def partial_path(self) -> Path:
        return self.path.with_name(self.path.name + PARTIAL_SUFFIX)


def _open_gguf(path: Path) -> GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise NotGGUFError(f"{path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != _GGUF_MAGIC:
        raise NotGGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    st = path.stat()
    return _parse_gguf(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=4)
def _parse_gguf(path: str, _size: int, _mtime_ns: int, _inode: int) -> GGUFReader:
    # Parsing metadata costs seconds for a big vocabulary: keep the last few readers,
    # keyed by the file's identity so a changed file is parsed again.
    try:
        return GGUFReader(path)
    except Exception as err:  # the reader raises bare ValueError/IndexError on damaged files
        raise NotGGUFError(f"{path}: damaged GGUF file: {err}") from err


def open_reader(path: Path) -> GGUFReader:
    """A (cached) reader of a GGUF's metadata and tensor table."""
    return _open_gguf(path)


def forget_readers() -> None:
    """Drop the cached readers. gguf-py builds a few objects per vocabulary string: a reader of a
    model with 49 152 tokens holds ~150 MB (measured), freed only here; a node calls this once it
    has joined, before its weights load."""
    _parse_gguf.cache_clear()


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_model_meta(path: Path, cache_dir: Path | None) -> ModelMeta:
    """Validate ``path`` as a whole model we can shard, and describe it (hashes it once: its manifest)."""
    reader = _open_gguf(path)
    meta = model_meta(Path(path), reader, fingerprint="0" * 64)  # validate before hashing gigabytes
    return replace(meta, fingerprint=local_manifest(Path(path), cache_dir).fingerprint())


def model_meta(path: Path, reader: GGUFReader, *, fingerprint: str) -> ModelMeta:
    """Describe the model whose metadata ``reader`` holds (refusing what cannot be served)."""
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise NotGGUFError(f"{path}: GGUF has no general.architecture")
    try:
        spec = architectures.spec_for(arch)
    except architectures.ArchitectureRefused as err:
        raise UnsupportedArchitecture(f"{path}: {err}") from err
    if _field(reader, KEY_ROLE) is not None:
        raise ShardError(f"{path}: this is already a swarm shard file, not a whole model")
    n_layers = _field(reader, f"{arch}.block_count")
    n_embd = _field(reader, f"{arch}.embedding_length")
    if not isinstance(n_layers, int) or not isinstance(n_embd, int) or n_layers <= 0:
        raise ShardError(f"{path}: missing {arch}.block_count / {arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ShardError(f"{path}: model has no token_embd.weight")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    n_vocab = int(embd.shape[1])
    fields = _arch_fields(reader, arch)
    try:
        points = architectures.split_points(spec, arch, fields, n_layers)
        architectures.swa_layers(spec, arch, fields, n_layers)  # validates an explicit pattern's length
    except ValueError as err:
        raise ShardError(f"{path}: {err}") from err
    if _field(reader, f"{arch}.nextn_predict_layers"):
        raise UnsupportedArchitecture(f"{path}: models with multi-token-prediction layers are not supported")
    return ModelMeta(
        path=Path(path).resolve(),
        fingerprint=fingerprint,
        architecture=arch,
        name=str(_field(reader, "general.name", Path(path).stem)),
        n_layers=n_layers,
        n_embd=n_embd,
        n_vocab=n_vocab,
        context_length=int(_field(reader, f"{arch}.context_length", 0) or 0),
        tied_embeddings="output.weight" not in names,
        split_points=points,
    )


def _arch_fields(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """The ``<arch>.*`` metadata, decoded (arrays as lists); the tokenizer's big arrays are not touched."""
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}


def parse_layers(spec: str, n_layers: int, split_points: tuple[int, ...] | None = None) -> tuple[int, int]:
    """Parse ``"a:b"`` (half-open) against a model of ``n_layers`` layers (and its split points)."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if not match:
        raise LayerRangeError(f"layer range {spec!r} is not of the form START:END (for example 0:15)")
    start, end = int(match.group(1)), int(match.group(2))
    check_range(start, end, n_layers, split_points)
    return start, end


def check_range(start: int, end: int, n_layers: int, split_points: tuple[int, ...] | None = None) -> None:
    if start >= end:
        raise LayerRangeError(f"layer range [{start}, {end}) is empty; END must be greater than START")
    if start < 0 or end > n_layers:
        raise LayerRangeError(f"layer range [{start}, {end}) is outside the model's layers [0, {n_layers})")
    why = architectures.split_refusal(start, end, n_layers, split_points)
    if why is not None:
        raise LayerRangeError(why)


def shard_dir(cache_dir: Path, fingerprint: str) -> Path:
    return Path(cache_dir) / "shards" / fingerprint[:16]


def _copy_kv(writer: GGUFWriter, reader: GGUFReader, skip: set[str], override: dict[str, Any]) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in skip:
            continue
        if key in override:
            continue
        main_type = field.types[0]
        value = field.contents()
        if main_type == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, main_type, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, main_type)
    for key, (value, vtype) in override.items():
        writer.add_key_value(key, value, vtype)


def _swarm_kv(meta: ModelMeta, start: int, end: int, role: str) -> dict[str, Any]:
    return {
        KEY_FORMAT: (SHARD_FORMAT_VERSION, GGUFValueType.UINT32),
        KEY_SOURCE_FINGERPRINT: (meta.fingerprint, GGUFValueType.STRING),
        KEY_SOURCE_LAYERS: (meta.n_layers, GGUFValueType.UINT32),
        KEY_SOURCE_NAME: (meta.name, GGUFValueType.STRING),
        KEY_START: (start, GGUFValueType.UINT32),
        KEY_END: (end, GGUFValueType.UINT32),
        KEY_ROLE: (role, GGUFValueType.STRING),
    }


class _Layout:
    """Tensor infos added to a GGUFWriter exactly as ``add_tensor`` would add them, and where each goes."""

    def __init__(self, writer: GGUFWriter) -> None:
        self.writer = writer
        self.entries: list[tuple[str, int, str | None]] = []  # (output name, bytes, source name or None)

    def raw(self, name: str, tensor: Any) -> None:
        # What GGUFWriter.add_tensor(name, tensor.data, raw_shape=..., raw_dtype=...) records; the bytes
        # are not read (for a fetched model they are not there yet).
        data = tensor.data
        self.writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=tensor.tensor_type)
        self.entries.append((name, int(data.nbytes), tensor.name))

    def zeros_f32(self, name: str, shape: tuple[int, ...]) -> None:
        nbytes = 4 * int(np.prod(shape))
        self.writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        self.entries.append((name, nbytes, None))

    def finish(self, path: Path, role: str) -> OutputPlan:
        """Render the header (gguf's own writer, into a scratch file) and place the tensors."""
        w = self.writer
        with tempfile.TemporaryDirectory(prefix="swarm-header-") as tmp:
            scratch = Path(tmp) / "header.gguf"
            w.write_header_to_file(scratch)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.close()
            raw = scratch.read_bytes()
        align = w.data_alignment
        header = raw + bytes(-len(raw) % align)
        offset = len(header)
        pieces = []
        for _name, nbytes, source in self.entries:
            if source is not None:
                pieces.append(Piece(offset, nbytes, source))
            offset += -(-nbytes // align) * align
        return OutputPlan(path=path, role=role, header=header, size=offset, pieces=tuple(pieces))


def _new_writer(reader: GGUFReader, arch: str, path: Path) -> GGUFWriter:
    writer = GGUFWriter(path, arch)
    writer.data_alignment = int(getattr(reader, "alignment", writer.data_alignment))
    return writer


def layers_plan(reader: GGUFReader, meta: ModelMeta, start: int, end: int, path: Path) -> OutputPlan:
    """The partial GGUF of layers ``[start, end)``."""
    arch = meta.architecture
    spec = architectures.spec_for(arch)
    is_last = end == meta.n_layers
    override: dict[str, Any] = {f"{arch}.block_count": (end - start, GGUFValueType.UINT32)}
    skip: set[str] = set()
    fields = _arch_fields(reader, arch)
    array_types: dict[str, GGUFValueType] = {}
    # Per-layer arrays (head counts, feed-forward widths, experts used) follow the range.
    for key, values in architectures.per_layer_arrays(arch, fields, meta.n_layers).items():
        skip.add(key)
        override[key] = (values[start:end], GGUFValueType.ARRAY)
        array_types[key] = reader.fields[key].types[-1]
    # Sliding-window layers are chosen by absolute index: write them out explicitly.
    swa = architectures.swa_layers(spec, arch, fields, meta.n_layers)
    if swa is not None:
        key = f"{arch}.{architectures.SWA_PATTERN_KEY}"
        skip.add(key)
        override[key] = (swa[start:end], GGUFValueType.ARRAY)
        array_types[key] = GGUFValueType.BOOL
    if not is_last:
        skip.update(k for k in reader.fields if k.startswith("tokenizer."))
        override["tokenizer.ggml.model"] = ("none", GGUFValueType.STRING)
        override[f"{arch}.vocab_size"] = (1, GGUFValueType.UINT32)
    override.update(_swarm_kv(meta, start, end, "layers"))

    writer = _new_writer(reader, arch, path)
    array_overrides = {k: v for k, v in override.items() if v[1] == GGUFValueType.ARRAY}
    scalar_overrides = {k: v for k, v in override.items() if v[1] != GGUFValueType.ARRAY}
    _copy_kv(writer, reader, skip, scalar_overrides)
    for key, (values, _) in array_overrides.items():
        writer.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=array_types[key])

    layout = _Layout(writer)
    for tensor in reader.tensors:
        name = tensor.name
        block = _BLOCK_RE.match(name)
        if block:
            index = int(block.group(1))
            if start <= index < end:
                layout.raw(f"blk.{index - start}.{block.group(2)}", tensor)
        elif name == "token_embd.weight":
            if is_last:
                layout.raw(name, tensor)  # the tied LM head needs every row
            else:
                layout.zeros_f32(name, (1, meta.n_embd))
        elif name == "output.weight":
            if is_last:
                layout.raw(name, tensor)
        else:  # output_norm and other global tensors (rope factors) every stage's graph loads
            layout.raw(name, tensor)
    return layout.finish(path, "layers")


def embeddings_plan(reader: GGUFReader, meta: ModelMeta, path: Path) -> OutputPlan:
    """The first stage's companion file: the source ``token_embd.weight`` alone."""
    writer = _new_writer(reader, meta.architecture, path)
    for key, (value, vtype) in _swarm_kv(meta, 0, meta.n_layers, "embeddings").items():
        writer.add_key_value(key, value, vtype)
    writer.add_key_value(f"{meta.architecture}.embedding_length", meta.n_embd, GGUFValueType.UINT32)
    layout = _Layout(writer)
    layout.raw("token_embd.weight", next(t for t in reader.tensors if t.name == "token_embd.weight"))
    return layout.finish(path, "embeddings")


def shard_plans(
    reader: GGUFReader, meta: ModelMeta, start: int, end: int, cache_dir: Path
) -> list[OutputPlan]:
    """Every file the shard ``[start, end)`` consists of (the layers, and embeddings for a first stage)."""
    meta.check_range(start, end)
    out_dir = shard_dir(cache_dir, meta.fingerprint)
    plans = [layers_plan(reader, meta, start, end, out_dir / f"{meta.architecture}-{start}-{end}.gguf")]
    if start == 0:
        plans.append(embeddings_plan(reader, meta, out_dir / "token_embd.gguf"))
    return plans


def shard_files(meta: ModelMeta, start: int, end: int, cache_dir: Path) -> ShardFiles:
    """The :class:`ShardFiles` naming the files :func:`shard_plans` writes."""
    out_dir = shard_dir(cache_dir, meta.fingerprint)
    return ShardFiles(
        model=meta,
        start=start,
        end=end,
        path=out_dir / f"{meta.architecture}-{start}-{end}.gguf",
        embeddings_path=out_dir / "token_embd.gguf" if start == 0 else None,
    )


def output_matches(path: Path, fingerprint: str, start: int, end: int, role: str) -> bool:
    """True when ``path`` is a complete shard file of this model, range and role."""
    if not path.is_file():
        return False
    try:
        reader = GGUFReader(path)
    except Exception:
        return False
    return (
        _field(reader, KEY_FORMAT) == SHARD_FORMAT_VERSION
        and _field(reader, KEY_SOURCE_FINGERPRINT) == fingerprint
        and _field(reader, KEY_START) == start
        and _field(reader, KEY_END) == end
        and _field(reader, KEY_ROLE) == role
    )


def plan_is_done(plan: OutputPlan, meta: ModelMeta, start: int, end: int) -> bool:
    if plan.role == "embeddings":
        return output_matches(plan.path, meta.fingerprint, 0, meta.n_layers, "embeddings")
    return output_matches(plan.path, meta.fingerprint, start, end, plan.role)


def check_free_disk(directory: Path, need_bytes: int, what: str) -> None:
    """Refuse (:class:`DiskSpaceError`) before writing when the disk cannot hold ``need_bytes`` more."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < need_bytes + DISK_MARGIN_BYTES:
        raise DiskSpaceError(
            f"not enough free disk for {what}: it needs {need_bytes / 1e6:.1f} MB "
            f"(+{DISK_MARGIN_BYTES / 1e6:.0f} MB margin) in {directory}, which has {free / 1e6:.1f} MB free; "
            "free some space or point --cache-dir at a larger disk"
        )


def open_partial(plan: OutputPlan) -> int:
    """Open (creating, header written, full size) the plan's ``.partial`` file; returns the fd."""
    fd = os.open(plan.partial_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != plan.size:
            os.ftruncate(fd, plan.size)
        os.pwrite(fd, plan.header, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def publish_partial(plan: OutputPlan, fd: int) -> None:
    """fsync the complete ``.partial`` file, close it and rename it to its final name."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(plan.partial_path, plan.path)
    _fsync_dir(plan.path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _copy_range(
    src: int, dst: int, src_off: int, dst_off: int, n: int, on_bytes: Callable[[int], None]
) -> None:
    while n > 0:
        step = min(n, _COPY_CHUNK_BYTES)
        try:
            done = os.copy_file_range(src, dst, step, src_off, dst_off)
        except OSError:
            done = 0
        if done <= 0:  # not supported here (or across filesystems on old kernels): copy through memory
            data = os.pread(src, step, src_off)
            if len(data) != step:
                raise ShardError(f"the source file ended early (read {len(data)} of {step} bytes)")
            done = os.pwrite(dst, data, dst_off)
        src_off += done
        dst_off += done
        n -= done
        on_bytes(done)


def write_from_local(
    plan: OutputPlan, reader: GGUFReader, source_path: Path, on_bytes: Callable[[int], None]
) -> None:
    """Fill ``plan`` from a local whole-model file and publish it."""
    by_name = {t.name: t for t in reader.tensors}
    src = os.open(source_path, os.O_RDONLY)
    try:
        fd = open_partial(plan)
        try:
            for piece in plan.pieces:
                tensor = by_name[piece.source]
                if int(tensor.n_bytes) != piece.size:
                    raise ShardError(f"{source_path}: tensor {piece.source} changed size while being cut")
                _copy_range(src, fd, int(tensor.data_offset), piece.out_offset, piece.size, on_bytes)
        except BaseException:
            os.close(fd)
            plan.partial_path.unlink(missing_ok=True)
            raise
        publish_partial(plan, fd)
    finally:
        os.close(src)


def _record_path(cache_dir: Path, key: str, start: int, end: int) -> Path:
    return Path(cache_dir) / "shard-records" / f"{key}-{start}-{end}.json"


def _path_key(model_path: Path) -> str:
    return hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:16]


def _source_identity(path: Path) -> dict[str, int]:
    st = Path(path).stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def read_shard_record(
    cache_dir: Path, key: str, start: int, end: int, source: dict[str, Any]
) -> ShardFiles | None:
    """The shard written earlier for this source, if nothing changed since (no parsing, no hashing).

    Parsing a GGUF's metadata in Python takes seconds (tens of thousands of
    vocabulary strings) and hashing a big model takes minutes, so a restart
    trusts a record whose source identity (a local file's size, mtime and
    inode; a fetched model's fingerprint) and shard file sizes still match.
    """
    try:
        data = json.loads(_record_path(cache_dir, key, start, end).read_text())
        if data.get("format") != SHARD_FORMAT_VERSION or data.get("source") != source:
            return None
        model = data["model"]
        points = model.get("split_points")
        meta = ModelMeta(
            **{
                **model,
                "path": Path(model["path"]),
                "split_points": tuple(points) if points is not None else None,
            }
        )
        path = Path(data["path"])
        if path.stat().st_size != data["path_size"]:
            return None
        emb = Path(data["embeddings_path"]) if data.get("embeddings_path") else None
        if emb is not None and emb.stat().st_size != data["embeddings_size"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ShardFiles(model=meta, start=start, end=end, path=path, embeddings_path=emb)


def write_shard_record(files: ShardFiles, cache_dir: Path, key: str, source: dict[str, Any]) -> None:
    record = _record_path(cache_dir, key, files.start, files.end)
    record.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "format": SHARD_FORMAT_VERSION,
        "source": source,
        "model": {**asdict(files.model), "path": str(files.model.path)},
        "path": str(files.path),
        "path_size": files.path.stat().st_size,
        "embeddings_path": str(files.embeddings_path) if files.embeddings_path else None,
        "embeddings_size": files.embeddings_path.stat().st_size if files.embeddings_path else None,
    }
    tmp = record.with_name(f".{record.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, record)


def extract_shard(
    model_path: Path,
    start: int,
    end: int,
    cache_dir: Path,
    *,
    progress: Callable[[str, int, str], Any] | None = None,
) -> ShardFiles:
    """Write (or reuse) the partial GGUF of layers ``[start, end)`` of a local model in ``cache_dir``.

    ``progress(phase, total_bytes, detail)`` returns a context manager with
    ``update(n)`` (``node.progress.Progress``) for hashing and copying.
    """
    model_path = Path(model_path)
    if not model_path.is_file():
        raise NotGGUFError(f"{model_path}: no such file")
    key = _path_key(model_path)
    source = _source_identity(model_path)
    reused = read_shard_record(cache_dir, key, start, end, source)
    if reused is not None:
        return reused
    reader = _open_gguf(model_path)
    meta = model_meta(model_path, reader, fingerprint="0" * 64)
    meta.check_range(start, end)
    meta = replace(meta, fingerprint=_hash_local(model_path, cache_dir, progress))
    plans = shard_plans(reader, meta, start, end, cache_dir)
    # Nodes sharing a cache may cut the same shard at once: one writes, the others wait and reuse it.
    with _cache_lock(plans[0].path.with_name(f".{plans[0].path.name}.lock")):
        todo = [p for p in plans if not plan_is_done(p, meta, start, end)]
        if todo:
            need = sum(p.size for p in todo)
            check_free_disk(plans[0].path.parent, need, f"the shard [{start}, {end}) of {meta.name}")
            with _progress(progress, "extracting", need, f"[{start}, {end})") as bar:
                for plan in todo:
                    bar.update(len(plan.header))
                    write_from_local(plan, reader, model_path, bar.update)
    files = shard_files(meta, start, end, cache_dir)
    write_shard_record(files, cache_dir, key, source)
    return files


@contextlib.contextmanager
def _cache_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created) across processes; released on exit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _hash_local(model_path: Path, cache_dir: Path, progress: Callable[[str, int, str], Any] | None) -> str:
    from node.fingerprint import is_local_manifest_cached

    if progress is None or is_local_manifest_cached(model_path, cache_dir):
        return local_manifest(model_path, cache_dir).fingerprint()
    with progress("verifying", model_path.stat().st_size, model_path.name) as bar:
        return local_manifest(model_path, cache_dir, bar.update).fingerprint()


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _progress(factory: Callable[[str, int, str], Any] | None, phase: str, total: int, detail: str) -> Any:
    return factory(phase, total, detail) if factory is not None else _NoProgress()


def extract_vocab(model_path: Path, cache_dir: Path, *, fingerprint: str | None = None) -> Path:
    """Write (or reuse) a metadata-only GGUF: loads with ``vocab_only=True`` for tokenizing.

    ``model_path`` may be a header-only copy of a fetched model; then
    ``fingerprint`` (its manifest digest) must be given.
    """
    reader = _open_gguf(model_path)
    meta = model_meta(Path(model_path), reader, fingerprint=fingerprint or "0" * 64)
    if fingerprint is None:
        meta = replace(meta, fingerprint=local_manifest(Path(model_path), cache_dir).fingerprint())
    out_dir = shard_dir(cache_dir, meta.fingerprint)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "vocab.gguf"
    if output_matches(path, meta.fingerprint, 0, meta.n_layers, "vocab"):
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(tmp, meta.architecture)
    _copy_kv(writer, reader, set(), _swarm_kv(meta, 0, meta.n_layers, "vocab"))
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path
