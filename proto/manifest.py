"""Model manifests: the digest of a GGUF's header and of every tensor (pure; nodes and the tracker share it).

A manifest lists the digest of the GGUF header (every byte before the tensor
data: key/values, tensor infos, padding) and the digest, offset and size of
every tensor. A node that fetches only its span's tensors checks the header
and each tensor it received against it, and the model's **fingerprint** is the
sha256 of the manifest's canonical JSON, so a local file, a URL of the same
file and a peer's copy of a span all name the same model; the tracker's model
registry keeps manifests and checks that each hashes to its fingerprint.

Canonical JSON (what the fingerprint covers)::

    {"file_size":N,"format":1,"header":{"sha256":"..","size":H},
     "tensors":[{"name":"..","offset":O,"sha256":"..","size":S}, ...]}

keys sorted, no whitespace, ASCII, tensors in file order. ``offset`` is
absolute (from the start of the file), ``size`` the tensor's bytes without
padding. Parsing is strict (:class:`ManifestInvalid` names the first problem):
exactly these keys, unique names of at most :data:`MAX_NAME_CHARS`, tensors
that neither overlap nor run past the file, at most :data:`MAX_TENSORS`.

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MANIFEST_FORMAT = 1
MAX_TENSORS = 1_000_000
MAX_NAME_CHARS = 256

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


class ManifestInvalid(ValueError):
    """A manifest is malformed, does not hash to the fingerprint it should, or bytes do not match it."""


# --------------------------------------------------------------------------------------- the header

MAX_KV = 1_000_000
MAX_STRING_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 512 * 1024 * 1024
DEFAULT_ALIGNMENT = 32
HASH_CHUNK_BYTES = 8 * 1024 * 1024

_GGUF_MAGIC = b"GGUF"

# GGUF value types: fixed sizes (string = 8, array = 9 are variable).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class NeedMoreBytes(Exception):
    """The header continues past the bytes given; ``total`` is a lower bound on the bytes needed."""

    def __init__(self, total: int) -> None:
        super().__init__(f"need at least {total} bytes")
        self.total = total


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]  # GGUF order (ne0 first)
    offset: int  # absolute
    size: int  # bytes, no padding


@dataclass(frozen=True)
class HeaderLayout:
    version: int
    alignment: int
    header_size: int  # = the offset of the tensor data
    tensors: tuple[TensorInfo, ...]  # in header order


class _Cursor:
    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise NeedMoreBytes(end)
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack_from("<Q", self.take(8))[0])

    def string(self) -> str:
        n = self.u64()
        if n > MAX_STRING_BYTES:
            raise ManifestInvalid(f"GGUF header: a string of {n} bytes (more than {MAX_STRING_BYTES})")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.u64()
        if n > MAX_STRING_BYTES:
            raise ManifestInvalid(f"GGUF header: a string of {n} bytes (more than {MAX_STRING_BYTES})")
        self.take(n)


def _skip_value(cur: _Cursor, vtype: int, depth: int = 0) -> None:
    if vtype in _FIXED:
        cur.take(_FIXED[vtype])
    elif vtype == _STRING:
        cur.skip_string()
    elif vtype == _ARRAY:
        if depth > 4:
            raise ManifestInvalid("GGUF header: arrays nested too deeply")
        etype = cur.u32()
        count = cur.u64()
        if etype in _FIXED:
            cur.take(_FIXED[etype] * count)
        else:
            if count > MAX_STRING_BYTES:
                raise ManifestInvalid(f"GGUF header: an array of {count} entries")
            for _ in range(count):
                _skip_value(cur, etype, depth + 1)
    else:
        raise ManifestInvalid(f"GGUF header: unknown value type {vtype}")


def tensor_nbytes(ggml_type: int, dims: Iterable[int]) -> int:
    """Bytes of a tensor of this ggml type and shape (no padding)."""
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as err:
        raise ManifestInvalid(f"GGUF header: unknown tensor type {ggml_type}") from err
    n = 1
    for d in dims:
        n *= int(d)
    if n % block:
        raise ManifestInvalid(f"GGUF header: {n} elements are not a multiple of the block size {block}")
    return n // block * type_size


def scan_header(buf: bytes | bytearray | memoryview) -> HeaderLayout:
    """Walk a GGUF header (magic .. tensor infos); :class:`NeedMoreBytes` if ``buf`` ends inside it."""
    cur = _Cursor(buf)
    magic = bytes(cur.take(4))
    if magic != _GGUF_MAGIC:
        raise ManifestInvalid(f"not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    version = cur.u32()
    if version not in (2, 3):
        raise ManifestInvalid(f"GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise ManifestInvalid(f"GGUF header: {n_tensors} tensors / {n_kv} key-values is beyond the limits")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.u32()
        if key == "general.alignment" and vtype == 4:
            alignment = int(struct.unpack_from("<I", cur.take(4))[0])
            if alignment <= 0 or alignment & (alignment - 1):
                raise ManifestInvalid(f"GGUF header: general.alignment {alignment} is not a power of two")
        else:
            _skip_value(cur, vtype)
        if cur.pos > MAX_HEADER_BYTES:
            raise ManifestInvalid(f"GGUF header is larger than {MAX_HEADER_BYTES} bytes")
    raw: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.u32()
        if n_dims > 8:
            raise ManifestInvalid(f"GGUF header: tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cur.u64() for _ in range(n_dims))
        ggml_type = cur.u32()
        rel = cur.u64()
        raw.append((name, ggml_type, dims, rel))
    header_size = -(-cur.pos // alignment) * alignment
    if header_size > MAX_HEADER_BYTES:
        raise ManifestInvalid(f"GGUF header is larger than {MAX_HEADER_BYTES} bytes")
    tensors = tuple(
        TensorInfo(name, t, dims, header_size + rel, tensor_nbytes(t, dims)) for name, t, dims, rel in raw
    )
    return HeaderLayout(version=version, alignment=alignment, header_size=header_size, tensors=tensors)


# --------------------------------------------------------------------------------------- the manifest


@dataclass(frozen=True)
class TensorEntry:
    name: str
    offset: int  # absolute byte offset in the source file
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    file_size: int
    header_size: int
    header_sha256: str
    tensors: tuple[TensorEntry, ...]  # in file order

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "file_size": self.file_size,
            "header": {"size": self.header_size, "sha256": self.header_sha256},
            "tensors": [
                {"name": t.name, "offset": t.offset, "size": t.size, "sha256": t.sha256} for t in self.tensors
            ],
        }

    def canonical_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    def fingerprint(self) -> str:
        """The model's identity: sha256 (lowercase hex) of :meth:`canonical_bytes`."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise ManifestInvalid(f"the manifest has no tensor {name!r}")

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def layer_bytes(self, n_layers: int) -> list[int]:
        """Bytes of each layer's tensors ``blk.<i>.*``, ``i`` in ``0..n_layers-1``."""
        out = [0] * n_layers
        for t in self.tensors:
            m = _BLOCK_RE.match(t.name)
            if m and int(m.group(1)) < n_layers:
                out[int(m.group(1))] += t.size
        return out

    def global_bytes(self) -> dict[str, int]:
        """Bytes of the tensors outside the blocks (token embeddings, output head, norms)."""
        return {t.name: t.size for t in self.tensors if not _BLOCK_RE.match(t.name)}

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """Validate a decoded manifest; :class:`ManifestInvalid` names the first problem."""
        if not isinstance(obj, Mapping):
            raise ManifestInvalid("manifest must be a JSON object")
        if set(obj) != {"format", "file_size", "header", "tensors"}:
            raise ManifestInvalid(
                f"manifest keys must be format, file_size, header, tensors; got {sorted(obj)}"
            )
        if obj["format"] != MANIFEST_FORMAT:
            raise ManifestInvalid(f"manifest format {obj['format']!r} is not {MANIFEST_FORMAT}")
        file_size = _nonneg(obj["file_size"], "file_size")
        header = obj["header"]
        if not isinstance(header, Mapping) or set(header) != {"size", "sha256"}:
            raise ManifestInvalid("manifest header must be {size, sha256}")
        header_size = _nonneg(header["size"], "header.size")
        header_sha = _hex(header["sha256"], "header.sha256")
        items = obj["tensors"]
        if not isinstance(items, list) or len(items) > MAX_TENSORS:
            raise ManifestInvalid(f"manifest tensors must be a list of at most {MAX_TENSORS}")
        tensors: list[TensorEntry] = []
        names: set[str] = set()
        end = header_size
        for i, t in enumerate(items):
            where = f"tensors[{i}]"
            if not isinstance(t, Mapping) or set(t) != {"name", "offset", "size", "sha256"}:
                raise ManifestInvalid(f"manifest {where} must be {{name, offset, size, sha256}}")
            name = t["name"]
            if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS or name in names:
                raise ManifestInvalid(f"manifest {where}.name must be a unique string of 1..{MAX_NAME_CHARS}")
            entry = TensorEntry(
                name, _nonneg(t["offset"], f"{where}.offset"), _nonneg(t["size"], f"{where}.size"),
                _hex(t["sha256"], f"{where}.sha256"),
            )  # fmt: skip
            if entry.offset < end or entry.offset + entry.size > file_size:
                raise ManifestInvalid(f"manifest {where} ({name}) overlaps another tensor or the file's end")
            end = entry.offset + entry.size
            names.add(name)
            tensors.append(entry)
        if header_size > file_size:
            raise ManifestInvalid("manifest header is larger than the file")
        return cls(file_size, header_size, header_sha, tuple(tensors))

    @classmethod
    def from_bytes(cls, data: bytes, expected_fingerprint: str | None = None) -> Manifest:
        """Parse manifest JSON; with ``expected_fingerprint`` refuse anything whose digest differs."""
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise ManifestInvalid(f"manifest is not valid JSON: {err}") from err
        manifest = cls.from_json(obj)
        if expected_fingerprint is not None and manifest.fingerprint() != expected_fingerprint:
            got = manifest.fingerprint()
            raise ManifestInvalid(
                f"manifest digest {got} is not the model fingerprint {expected_fingerprint}"
            )
        return manifest

    def check_header(self, header: bytes | memoryview) -> HeaderLayout:
        """Verify header bytes against the manifest and that its tensor table agrees; return the layout."""
        if len(header) != self.header_size:
            raise ManifestInvalid(f"header is {len(header)} bytes, the manifest says {self.header_size}")
        digest = hashlib.sha256(header).hexdigest()
        if digest != self.header_sha256:
            raise ManifestInvalid(f"header bytes do not match the manifest (sha256 {digest}, expected "
                                f"{self.header_sha256})")  # fmt: skip
        layout = scan_header(header)
        if layout.header_size != self.header_size:
            raise ManifestInvalid("the header's data offset disagrees with the manifest")
        listed = {t.name: (t.offset, t.size) for t in self.tensors}
        described = {t.name: (t.offset, t.size) for t in layout.tensors}
        if listed != described:
            missing = sorted(set(described) ^ set(listed))[:3]
            raise ManifestInvalid(
                f"the manifest's tensor table disagrees with the header (e.g. {missing or '?'})"
            )
        return layout


def _nonneg(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 1 << 50:
        raise ManifestInvalid(f"manifest {what} must be a non-negative integer")
    return v


def _hex(v: Any, what: str) -> str:
    if not isinstance(v, str) or not _HEX64.match(v):
        raise ManifestInvalid(f"manifest {what} must be 64 lowercase hex characters")
    return v


def check_fingerprint(value: str) -> str:
    if not _HEX64.match(value):
        raise ManifestInvalid(f"model fingerprint {value!r} is not 64 lowercase hex characters")
    return value


# ------------------------------------------------------------------------------ building one from a file


def read_header_bytes(path: Path) -> bytes:
    """The header bytes of a local GGUF (grows the read until :func:`scan_header` is satisfied)."""
    want = 1 << 20
    with open(path, "rb") as fh:
        while True:
            fh.seek(0)
            buf = fh.read(want)
            try:
                layout = scan_header(buf)
            except NeedMoreBytes as more:
                if len(buf) < want:  # the file ended inside the header
                    raise ManifestInvalid(f"{path}: the file ends inside its GGUF header") from more
                want = max(more.total, want * 2)
                if want > MAX_HEADER_BYTES:
                    raise ManifestInvalid(
                        f"{path}: GGUF header larger than {MAX_HEADER_BYTES} bytes"
                    ) from more
                continue
            if len(buf) < layout.header_size:
                raise ManifestInvalid(f"{path}: the file ends inside its GGUF header")
            return buf[: layout.header_size]


def build_manifest(path: Path, on_bytes: Callable[[int], None] | None = None) -> Manifest:
    """Hash a local GGUF into its manifest (reads every byte once; ``on_bytes`` reports progress)."""
    path = Path(path)
    size = path.stat().st_size
    header = read_header_bytes(path)
    layout = scan_header(header)
    if on_bytes is not None:
        on_bytes(len(header))
    entries: list[TensorEntry] = []
    ordered = sorted(layout.tensors, key=lambda t: t.offset)
    with open(path, "rb") as fh:
        for t in ordered:
            if t.offset + t.size > size:
                raise ManifestInvalid(f"{path}: tensor {t.name} runs past the end of the file (truncated?)")
            fh.seek(t.offset)
            digest = hashlib.sha256()
            left = t.size
            while left:
                chunk = fh.read(min(HASH_CHUNK_BYTES, left))
                if not chunk:
                    raise ManifestInvalid(f"{path}: the file ended inside tensor {t.name}")
                digest.update(chunk)
                left -= len(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
            entries.append(TensorEntry(t.name, t.offset, t.size, digest.hexdigest()))
    return Manifest(size, len(header), hashlib.sha256(header).hexdigest(), tuple(entries))


class ManifestBuilder:
    """The manifest of a file whose bytes arrive in order (a download): memory bounded by the header."""

    def __init__(self, file_size: int) -> None:
        self.file_size = file_size
        self._head = bytearray()
        self._layout: HeaderLayout | None = None
        self._header_sha = ""
        self._pos = 0  # bytes seen
        self._ordered: list[TensorInfo] = []
        self._index = 0
        self._hasher: Any = None
        self._entries: list[TensorEntry] = []

    @property
    def header(self) -> bytes | None:
        """The header bytes once they have all arrived."""
        return bytes(self._head) if self._layout is not None else None

    def feed(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        if self._layout is None:
            self._head += view
            self._pos += len(view)
            try:
                layout = scan_header(self._head)
            except NeedMoreBytes:
                if len(self._head) > MAX_HEADER_BYTES:
                    raise ManifestInvalid(f"GGUF header larger than {MAX_HEADER_BYTES} bytes") from None
                return
            if len(self._head) < layout.header_size:
                return
            rest = bytes(self._head[layout.header_size :])
            del self._head[layout.header_size :]
            self._layout = layout
            self._header_sha = hashlib.sha256(self._head).hexdigest()
            self._ordered = sorted(layout.tensors, key=lambda t: t.offset)
            self._pos = layout.header_size
            view = memoryview(rest)
        while view:
            if self._index >= len(self._ordered):
                self._pos += len(view)
                return
            t = self._ordered[self._index]
            if self._pos < t.offset:  # padding
                skip = min(len(view), t.offset - self._pos)
                view = view[skip:]
                self._pos += skip
                continue
            if self._hasher is None:
                self._hasher = hashlib.sha256()
            take = min(len(view), t.offset + t.size - self._pos)
            self._hasher.update(view[:take])
            view = view[take:]
            self._pos += take
            if self._pos == t.offset + t.size:
                self._entries.append(TensorEntry(t.name, t.offset, t.size, self._hasher.hexdigest()))
                self._hasher = None
                self._index += 1

    def finish(self) -> Manifest:
        if self._layout is None or self._index < len(self._ordered) or self._pos != self.file_size:
            raise ManifestInvalid(
                f"the file ended after {self._pos} of {self.file_size} bytes, before every tensor arrived"
            )
        return Manifest(self.file_size, self._layout.header_size, self._header_sha, tuple(self._entries))
