"""``swarm-tracker model add FILE|URL``: describe a model for the registry (the operator's side).

From a local GGUF: its manifest (every byte hashed once) and its metadata.
From a URL: the manifest published next to the file (``<url>.manifest.json``,
checked against the header it describes) or, without one, the whole file
streamed once through :class:`proto.manifest.ManifestBuilder` (nothing is
stored). The metadata (architecture, layers, width, name) comes from the
header, and the split points are computed exactly as nodes compute them
(``common.architectures``, pure), so the registry can tell placement where the
model may be cut. Unsupported architectures are refused here, before anything
is sent.

Blocking (a command-line tool): plain ``httpx`` calls and file reads.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from gguf import GGUFReader

from common import architectures
from proto.manifest import Manifest, ManifestBuilder, ManifestInvalid, build_manifest

MANIFEST_SUFFIX = ".manifest.json"
CHUNK_BYTES = 1024 * 1024


class ModelAddError(Exception):
    """The model cannot be described (unreadable, unsupported, no manifest); the message says why."""


@dataclass(frozen=True)
class Described:
    manifest: Manifest
    name: str
    architecture: str
    n_layers: int
    n_embd: int
    split_points: tuple[int, ...] | None


def _meta_from_file(path: Path, fallback_name: str) -> tuple[str, str, int, int, tuple[int, ...] | None]:
    reader = GGUFReader(path)

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise ModelAddError(f"{fallback_name}: the GGUF has no general.architecture")
    try:
        spec = architectures.spec_for(arch)
    except architectures.ArchitectureRefused as err:
        raise ModelAddError(f"{fallback_name}: {err}") from err
    if field("swarm.shard.role") is not None:
        raise ModelAddError(f"{fallback_name}: this is a swarm shard file, not a whole model")
    n_layers, n_embd = field(f"{arch}.block_count"), field(f"{arch}.embedding_length")
    if not isinstance(n_layers, int) or not isinstance(n_embd, int) or n_layers < 1:
        raise ModelAddError(f"{fallback_name}: missing {arch}.block_count / {arch}.embedding_length")
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}
    try:
        points = architectures.split_points(spec, arch, fields, n_layers)
    except ValueError as err:
        raise ModelAddError(f"{fallback_name}: {err}") from err
    name = field("general.name")
    return str(name or fallback_name), arch, n_layers, n_embd, points


def describe_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> Described:
    try:
        manifest = build_manifest(path, on_bytes)
    except (ManifestInvalid, OSError) as err:
        raise ModelAddError(f"{path}: {err}") from err
    name, arch, n_layers, n_embd, points = _meta_from_file(path, path.stem)
    return Described(manifest, name, arch, n_layers, n_embd, points)


def _header_meta(manifest: Manifest, header: bytes, label: str) -> Described:
    try:
        manifest.check_header(header)
    except ManifestInvalid as err:
        raise ModelAddError(f"{label}: {err}") from err
    with tempfile.TemporaryDirectory(prefix="swarm-model-add-") as tmp:
        sparse = Path(tmp) / "header.gguf"
        with open(sparse, "wb") as fh:
            fh.write(header)
            fh.truncate(manifest.file_size)  # a header-only copy the reader can parse
        name, arch, n_layers, n_embd, points = _meta_from_file(sparse, label)
    return Described(manifest, name, arch, n_layers, n_embd, points)


def describe_url(
    url: str, client: httpx.Client, on_bytes: Callable[[int, int], None] | None = None
) -> tuple[Described, bool]:
    """The model at ``url``; the flag says whether the whole file was streamed (no published manifest)."""
    label = url.rsplit("/", 1)[-1] or url
    try:
        published = client.get(url + MANIFEST_SUFFIX)
        if published.status_code == 200:
            manifest = Manifest.from_bytes(published.content)
            head = client.get(url, headers={"Range": f"bytes=0-{manifest.header_size - 1}"})
            if head.status_code != 206 or len(head.content) != manifest.header_size:
                raise ModelAddError(f"{url}: the server must honour Range requests (HTTP {head.status_code})")
            return _header_meta(manifest, head.content, label), False
        with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ModelAddError(f"{url}: HTTP {response.status_code}")
            size = int(response.headers.get("content-length", "0") or 0)
            if size <= 0:
                raise ModelAddError(f"{url}: the server does not say the file's size (Content-Length)")
            builder = ManifestBuilder(size)
            for chunk in response.iter_raw(CHUNK_BYTES):
                builder.feed(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk), size)
            manifest = builder.finish()
            header = builder.header
            assert header is not None  # finish() checked the whole file arrived
        return _header_meta(manifest, header, label), True
    except httpx.HTTPError as err:
        raise ModelAddError(f"{url}: {type(err).__name__}: {err}") from err
    except ManifestInvalid as err:
        raise ModelAddError(f"{url}: {err}") from err


def registration_payload(d: Described, name: str | None, sources: list[str], replace: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "fingerprint": d.manifest.fingerprint(),
        "name": name or d.name,
        "architecture": d.architecture,
        "n_layers": d.n_layers,
        "n_embd": d.n_embd,
        "sources": sources,
    }
    if d.split_points is not None:
        body["split_points"] = list(d.split_points)
    if replace:
        body["replace"] = True
    return body


def is_url(value: str) -> bool:
    return value.startswith(("http://", "https://"))


def exists(path: str) -> bool:
    return os.path.isfile(os.path.expanduser(path))
