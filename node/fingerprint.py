"""Model fingerprints: the digest of a model's manifest (``node.manifest``), cached.

A model's fingerprint is the sha256 of its manifest's canonical JSON (the
header digest plus every tensor's digest), so a local file and a URL or a
peer serving the same file give the same identity without anyone needing the
whole file. Building the manifest of a local file reads every byte once
(minutes for a 40 GB model), so:

* manifests are kept by content in ``<cache>/manifests/<fingerprint>.json``
  (the file's name is the digest of its bytes; a file that does not hash to
  its name is ignored);
* a local file's fingerprint is remembered in ``<cache>/manifests/local.json``
  keyed by the file's real path and checked against its size, mtime and
  inode: a file that changed in any of those is hashed again.

Before manifests the fingerprint was the sha256 of the whole file, cached in
``<cache>/fingerprints.json``. That file is no longer read (a whole-file
digest cannot be turned into a manifest digest); the first start after the
upgrade hashes the model once more, and shards cut under the old fingerprint
(``<cache>/shards/<old prefix>/``) are not reused and can be deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from node.errors import ManifestError
from node.manifest import Manifest, build_manifest

_CHUNK_BYTES = 8 * 1024 * 1024
MANIFEST_DIR = "manifests"
LOCAL_INDEX = "local.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _write_json_atomic(path: Path, data: bytes) -> None:
    # Several nodes may share one cache directory: write a temporary file and rename it.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def manifest_path(cache_dir: Path, fingerprint: str) -> Path:
    return Path(cache_dir) / MANIFEST_DIR / f"{fingerprint}.json"


def store_manifest(cache_dir: Path, manifest: Manifest) -> str:
    """Keep ``manifest`` in the content-addressed store; return its fingerprint."""
    fingerprint = manifest.fingerprint()
    path = manifest_path(cache_dir, fingerprint)
    if not path.is_file():
        _write_json_atomic(path, manifest.canonical_bytes())
    return fingerprint


def load_manifest(cache_dir: Path, fingerprint: str) -> Manifest | None:
    """The stored manifest with this fingerprint, or None (absent, or not hashing to its name)."""
    try:
        data = manifest_path(cache_dir, fingerprint).read_bytes()
    except OSError:
        return None
    try:
        return Manifest.from_bytes(data, fingerprint)
    except ManifestError:
        return None


def local_manifest(
    path: Path, cache_dir: Path | None, on_bytes: Callable[[int], None] | None = None
) -> Manifest:
    """The manifest of a local GGUF, hashed once and then reused while the file is unchanged."""
    path = Path(path).resolve()
    if cache_dir is None:
        return build_manifest(path, on_bytes)
    ident = _identity(path)
    index_path = Path(cache_dir) / MANIFEST_DIR / LOCAL_INDEX
    try:
        index = json.loads(index_path.read_text())
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(path))
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in ident.items()):
        known = load_manifest(cache_dir, str(entry.get("fingerprint", "")))
        if known is not None and known.file_size == ident["size"]:
            return known
    manifest = build_manifest(path, on_bytes)
    fingerprint = store_manifest(cache_dir, manifest)
    # Re-read the index: another node on this cache may have added entries meanwhile.
    try:
        fresh = json.loads(index_path.read_text())
        index = fresh if isinstance(fresh, dict) else {}
    except (OSError, ValueError):
        index = {}
    index[str(path)] = {**ident, "fingerprint": fingerprint}
    _write_json_atomic(index_path, json.dumps(index, indent=1, sort_keys=True).encode())
    return manifest


def is_local_manifest_cached(path: Path, cache_dir: Path) -> bool:
    """True when :func:`local_manifest` would not hash the file (for progress messages)."""
    try:
        path = Path(path).resolve()
        index = json.loads((Path(cache_dir) / MANIFEST_DIR / LOCAL_INDEX).read_text())
        entry = index.get(str(path))
        return (
            isinstance(entry, dict)
            and all(entry.get(k) == v for k, v in _identity(path).items())
            and manifest_path(cache_dir, str(entry.get("fingerprint", ""))).is_file()
        )
    except (OSError, ValueError, AttributeError):
        return False


def model_fingerprint(path: Path, cache_dir: Path | None) -> str:
    """The fingerprint (manifest digest, hex) of a local GGUF."""
    return local_manifest(path, cache_dir).fingerprint()
