"""The tracker's ed25519 identity, kept in its data directory (file mode 0600)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import nacl.signing

KEY_FILE = "tracker.key"


class KeyFileError(OSError):
    pass


def load_or_create_key(data_dir: Path) -> nacl.signing.SigningKey:
    """Read ``<data_dir>/tracker.key`` (hex seed), creating it atomically with mode 0600 if absent."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = data_dir / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_key(path)
    key = nacl.signing.SigningKey.generate()
    with os.fdopen(fd, "w") as fh:
        fh.write(bytes(key).hex() + "\n")
    return key


def load_key(path: Path) -> nacl.signing.SigningKey:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise KeyFileError(f"{path} has mode {mode:o}; a private key must not be readable by others (chmod 600)")
    text = path.read_text().strip()
    try:
        seed = bytes.fromhex(text)
    except ValueError as err:
        raise KeyFileError(f"{path} does not hold a hex ed25519 seed") from err
    if len(seed) != 32:
        raise KeyFileError(f"{path} must hold a 32-byte seed, found {len(seed)} bytes")
    return nacl.signing.SigningKey(seed)
