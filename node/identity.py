"""The node's ed25519 identity, kept in its data directory.

``<data_dir>/node.key`` holds the 32-byte seed as hex, created on first use
with mode 0600 (atomically: ``O_CREAT | O_EXCL``); a key file readable by
group or others is refused. The node id is the hex of the public (verify)
key, which is what the tracker expects as ``node_id`` in signed announces
(``proto.signing``: signer id == public key).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import nacl.signing

from node.errors import NodeError
from proto.signing import public_key_hex

KEY_FILE = "node.key"


class KeyFileError(NodeError):
    status = "INTERNAL"


def key_path(data_dir: Path) -> Path:
    return data_dir / KEY_FILE


def load_or_create_key(data_dir: Path) -> tuple[nacl.signing.SigningKey, bool]:
    """The node's key, and whether it was created now."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = key_path(data_dir)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_key(path), False
    key = nacl.signing.SigningKey.generate()
    with os.fdopen(fd, "w") as fh:
        fh.write(bytes(key).hex() + "\n")
    return key, True


def load_key(path: Path) -> nacl.signing.SigningKey:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        text = path.read_text().strip()
    except OSError as err:
        raise KeyFileError(f"cannot read the node key {path}: {err}") from err
    if mode & 0o077:
        raise KeyFileError(
            f"{path} has mode {mode:o}; a private key must not be readable by others (chmod 600)"
        )
    try:
        seed = bytes.fromhex(text)
    except ValueError as err:
        raise KeyFileError(f"{path} does not hold a hex ed25519 seed") from err
    if len(seed) != 32:
        raise KeyFileError(f"{path} must hold a 32-byte seed, found {len(seed)} bytes")
    return nacl.signing.SigningKey(seed)


def node_id(key: nacl.signing.SigningKey) -> str:
    return public_key_hex(key)
