"""Model manifests on the node: ``proto.manifest`` with the node's error type.

The manifest (its canonical JSON, the fingerprint as its digest, strict
parsing), the GGUF header scanner and the builder that hashes a local file
live in ``proto.manifest``, shared with the tracker's registry. Here the same
API raises :class:`~node.errors.ManifestError` (a ``ShardError``, so the
node's commands report it in one line) instead of
``proto.manifest.ManifestInvalid``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from node.errors import ManifestError
from proto import manifest as proto_manifest
from proto.manifest import MANIFEST_FORMAT as MANIFEST_FORMAT
from proto.manifest import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from proto.manifest import HeaderLayout as HeaderLayout
from proto.manifest import ManifestInvalid
from proto.manifest import NeedMoreBytes as NeedMoreBytes
from proto.manifest import TensorEntry as TensorEntry
from proto.manifest import TensorInfo as TensorInfo
from proto.manifest import tensor_nbytes as tensor_nbytes


@dataclass(frozen=True)
class Manifest(proto_manifest.Manifest):
    """``proto.manifest.Manifest`` whose refusals are the node's :class:`~node.errors.ManifestError`."""

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        try:
            return cast(Manifest, super().from_json(obj))
        except ManifestInvalid as err:
            raise ManifestError(str(err)) from err

    @classmethod
    def from_bytes(cls, data: bytes, expected_fingerprint: str | None = None) -> Manifest:
        try:
            return cast(Manifest, super().from_bytes(data, expected_fingerprint))
        except ManifestInvalid as err:
            raise ManifestError(str(err)) from err

    def check_header(self, header: bytes | memoryview) -> HeaderLayout:
        try:
            return super().check_header(header)
        except ManifestInvalid as err:
            raise ManifestError(str(err)) from err

    @classmethod
    def of(cls, m: proto_manifest.Manifest) -> Manifest:
        return cls(m.file_size, m.header_size, m.header_sha256, m.tensors)


def scan_header(buf: bytes | memoryview) -> HeaderLayout:
    try:
        return proto_manifest.scan_header(buf)
    except ManifestInvalid as err:
        raise ManifestError(str(err)) from err


def read_header_bytes(path: Path) -> bytes:
    try:
        return proto_manifest.read_header_bytes(path)
    except ManifestInvalid as err:
        raise ManifestError(str(err)) from err


def build_manifest(path: Path, on_bytes: Callable[[int], None] | None = None) -> Manifest:
    try:
        return Manifest.of(proto_manifest.build_manifest(path, on_bytes))
    except ManifestInvalid as err:
        raise ManifestError(str(err)) from err


def check_fingerprint(value: str) -> str:
    try:
        return proto_manifest.check_fingerprint(value)
    except ManifestInvalid as err:
        raise ManifestError(str(err)) from err
