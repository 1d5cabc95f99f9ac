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
  (``node.architectures``): per-layer metadata arrays are sliced to the range,
  and a sliding-window architecture's shard carries the explicit per-layer
  ``<arch>.attention.sliding_window_pattern`` of its absolute layers, so a
  shard starting at layer 7 treats each layer as the whole model does. A model
  that can only be cut at some boundaries (``ModelMeta.split_points``) refuses
  any other range.

Each written file records, under ``swarm.*`` keys, the source model's sha256,
the range and the source layer count, so a node can check at start-up that a
cached shard belongs to the model it was told to serve.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from node import architectures
from node.errors import LayerRangeError, NotGGUFError, ShardError, UnsupportedArchitecture
from node.fingerprint import model_fingerprint

# Architectures whose graphs have been checked to be split-exact (parity tests, see
# node/architectures.py). Others are refused with the reason and this list.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(architectures.SUPPORTED)
# 2: explicit per-layer sliding-window arrays, per-architecture metadata handling.
SHARD_FORMAT_VERSION = 2

KEY_FORMAT = "swarm.shard.format_version"
KEY_SOURCE_SHA256 = "swarm.source.sha256"
KEY_SOURCE_LAYERS = "swarm.source.block_count"
KEY_SOURCE_NAME = "swarm.source.name"
KEY_START = "swarm.shard.start"
KEY_END = "swarm.shard.end"
KEY_ROLE = "swarm.shard.role"  # "layers", "embeddings" or "vocab"

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelMeta:
    """What a node needs to know about the source model."""

    path: Path
    fingerprint: str
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


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_model_meta(path: Path, cache_dir: Path | None) -> ModelMeta:
    """Validate ``path`` as a whole model we can shard, and describe it."""
    reader = _open_gguf(path)
    return _model_meta(Path(path), reader, cache_dir)


def _model_meta(path: Path, reader: GGUFReader, cache_dir: Path | None) -> ModelMeta:
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
        path=path.resolve(),
        fingerprint=model_fingerprint(path, cache_dir),
        architecture=arch,
        name=str(_field(reader, "general.name", path.stem)),
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
        KEY_SOURCE_SHA256: (meta.fingerprint, GGUFValueType.STRING),
        KEY_SOURCE_LAYERS: (meta.n_layers, GGUFValueType.UINT32),
        KEY_SOURCE_NAME: (meta.name, GGUFValueType.STRING),
        KEY_START: (start, GGUFValueType.UINT32),
        KEY_END: (end, GGUFValueType.UINT32),
        KEY_ROLE: (role, GGUFValueType.STRING),
    }


def _add_raw(writer: GGUFWriter, name: str, tensor: Any) -> None:
    data = tensor.data
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        writer.add_tensor(name, np.asarray(data), raw_dtype=tensor.tensor_type)
    else:
        writer.add_tensor(name, np.asarray(data), raw_shape=data.shape, raw_dtype=tensor.tensor_type)


def _write_atomic(writer: GGUFWriter, tmp: Path, final: Path) -> None:
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, final)


def _existing_matches(path: Path, meta: ModelMeta, start: int, end: int, role: str) -> bool:
    if not path.is_file():
        return False
    try:
        reader = GGUFReader(path)
    except Exception:
        return False
    return (
        _field(reader, KEY_FORMAT) == SHARD_FORMAT_VERSION
        and _field(reader, KEY_SOURCE_SHA256) == meta.fingerprint
        and _field(reader, KEY_START) == start
        and _field(reader, KEY_END) == end
        and _field(reader, KEY_ROLE) == role
    )


def _source_identity(path: Path) -> dict[str, int]:
    st = Path(path).stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _manifest_path(cache_dir: Path, model_path: Path, start: int, end: int) -> Path:
    # Keyed by the source path so a restart finds it before hashing or parsing anything.
    import hashlib

    key = hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir) / "manifests" / f"{key}-{start}-{end}.json"


def _reuse_from_manifest(model_path: Path, start: int, end: int, cache_dir: Path) -> ShardFiles | None:
    """The shard written earlier for this very source file, if nothing changed since.

    Parsing a GGUF's metadata in Python takes seconds (tens of thousands of
    vocabulary strings) and hashing a big model takes minutes, so a restart
    trusts a manifest whose recorded source identity (size, mtime, inode) and
    shard file sizes still match.
    """
    manifest = _manifest_path(cache_dir, model_path, start, end)
    try:
        data = json.loads(manifest.read_text())
        if data.get("format") != SHARD_FORMAT_VERSION or data.get("source") != _source_identity(model_path):
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


def _write_manifest(files: ShardFiles, cache_dir: Path) -> None:
    manifest = _manifest_path(cache_dir, files.model.path, files.start, files.end)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "format": SHARD_FORMAT_VERSION,
        "source": _source_identity(files.model.path),
        "model": {**asdict(files.model), "path": str(files.model.path)},
        "path": str(files.path),
        "path_size": files.path.stat().st_size,
        "embeddings_path": str(files.embeddings_path) if files.embeddings_path else None,
        "embeddings_size": files.embeddings_path.stat().st_size if files.embeddings_path else None,
    }
    tmp = manifest.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, manifest)


def extract_shard(model_path: Path, start: int, end: int, cache_dir: Path) -> ShardFiles:
    """Write (or reuse) the partial GGUF of layers ``[start, end)`` in ``cache_dir``."""
    if not Path(model_path).is_file():
        raise NotGGUFError(f"{model_path}: no such file")
    reused = _reuse_from_manifest(model_path, start, end, cache_dir)
    if reused is not None:
        return reused
    reader = _open_gguf(model_path)
    meta = _model_meta(Path(model_path), reader, cache_dir)
    meta.check_range(start, end)
    out_dir = shard_dir(cache_dir, meta.fingerprint)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{meta.architecture}-{start}-{end}.gguf"
    embeddings_path = out_dir / "token_embd.gguf" if start == 0 else None

    if not _existing_matches(path, meta, start, end, "layers"):
        _write_layers(reader, meta, start, end, path)
    if embeddings_path is not None and not _existing_matches(
        embeddings_path, meta, 0, meta.n_layers, "embeddings"
    ):
        _write_embeddings(reader, meta, embeddings_path)
    files = ShardFiles(model=meta, start=start, end=end, path=path, embeddings_path=embeddings_path)
    _write_manifest(files, cache_dir)
    return files


def _write_layers(reader: GGUFReader, meta: ModelMeta, start: int, end: int, path: Path) -> None:
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

    tmp = path.with_suffix(f".tmp{os.getpid()}")
    writer = GGUFWriter(tmp, arch)
    array_overrides = {k: v for k, v in override.items() if v[1] == GGUFValueType.ARRAY}
    scalar_overrides = {k: v for k, v in override.items() if v[1] != GGUFValueType.ARRAY}
    _copy_kv(writer, reader, skip, scalar_overrides)
    for key, (values, _) in array_overrides.items():
        writer.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=array_types[key])

    for tensor in reader.tensors:
        name = tensor.name
        block = _BLOCK_RE.match(name)
        if block:
            index = int(block.group(1))
            if start <= index < end:
                _add_raw(writer, f"blk.{index - start}.{block.group(2)}", tensor)
        elif name == "token_embd.weight":
            if is_last:
                _add_raw(writer, name, tensor)  # the tied LM head needs every row
            else:
                writer.add_tensor(name, np.zeros((1, meta.n_embd), dtype=np.float32))
        elif name == "output.weight":
            if is_last:
                _add_raw(writer, name, tensor)
        else:  # output_norm and other global tensors (rope factors) every stage's graph loads
            _add_raw(writer, name, tensor)
    _write_atomic(writer, tmp, path)


def _write_embeddings(reader: GGUFReader, meta: ModelMeta, path: Path) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    writer = GGUFWriter(tmp, meta.architecture)
    for key, (value, vtype) in _swarm_kv(meta, 0, meta.n_layers, "embeddings").items():
        writer.add_key_value(key, value, vtype)
    writer.add_key_value(f"{meta.architecture}.embedding_length", meta.n_embd, GGUFValueType.UINT32)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    _add_raw(writer, tensor.name, tensor)
    _write_atomic(writer, tmp, path)


def extract_vocab(model_path: Path, cache_dir: Path) -> Path:
    """Write (or reuse) a metadata-only GGUF: loads with ``vocab_only=True`` for tokenizing."""
    reader = _open_gguf(model_path)
    meta = _model_meta(Path(model_path), reader, cache_dir)
    out_dir = shard_dir(cache_dir, meta.fingerprint)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "vocab.gguf"
    if _existing_matches(path, meta, 0, meta.n_layers, "vocab"):
        return path
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    writer = GGUFWriter(tmp, meta.architecture)
    _copy_kv(writer, reader, set(), _swarm_kv(meta, 0, meta.n_layers, "vocab"))
    _write_atomic(writer, tmp, path)
    return path
