"""Model fingerprints: sha256 of the source GGUF, cached by file identity.

Hashing a 40 GB model takes minutes, so the digest is cached in a small JSON
file keyed by the file's real path and validated against its size, mtime and
inode: a file that changed in any of those is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

_CHUNK_BYTES = 8 * 1024 * 1024
CACHE_FILE_NAME = "fingerprints.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def model_fingerprint(path: Path, cache_dir: Path | None) -> str:
    """sha256 (hex) of ``path``; reuses ``cache_dir/fingerprints.json`` when the file is unchanged."""
    path = Path(path).resolve()
    ident = _identity(path)
    if cache_dir is None:
        return sha256_file(path)
    cache_path = Path(cache_dir) / CACHE_FILE_NAME
    try:
        cache = json.loads(cache_path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(str(path))
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in ident.items()):
        digest = entry.get("sha256")
        if isinstance(digest, str) and len(digest) == 64:
            return digest
    digest = sha256_file(path)
    cache[str(path)] = {**ident, "sha256": digest}
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    # Write atomically: several nodes may share one cache directory.
    fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=".fingerprints.")
    with os.fdopen(fd, "w") as fh:
        json.dump(cache, fh, indent=1, sort_keys=True)
    os.replace(tmp, cache_path)
    return digest
