"""The node's ed25519 identity, kept in its data directory.

``<data_dir>/node.key`` holds the 32-byte seed as hex, created on first use
with mode 0600 (atomically: ``O_CREAT | O_EXCL``); a key file readable by
group or others is refused. The node id is the hex of the public (verify)
key, which is what the tracker expects as ``node_id`` in signed announces
(``proto.signing``: signer id == public key).
"""

from __future__ import annotations

from pathlib import Path

import nacl.signing

from common import keyfile
from common.keyfile import load_key_file, load_or_create_key_file
from node.errors import NodeError
from proto.signing import public_key_hex

KEY_FILE = "node.key"


class KeyFileError(NodeError):
    status = "INTERNAL"


def key_path(data_dir: Path) -> Path:
    return data_dir / KEY_FILE


def load_or_create_key(data_dir: Path) -> tuple[nacl.signing.SigningKey, bool]:
    """The node's key, and whether it was created now."""
    try:
        return load_or_create_key_file(key_path(data_dir))
    except keyfile.KeyFileError as err:
        raise KeyFileError(str(err)) from err


def load_key(path: Path) -> nacl.signing.SigningKey:
    try:
        return load_key_file(path)
    except keyfile.KeyFileError as err:
        raise KeyFileError(str(err)) from err


def node_id(key: nacl.signing.SigningKey) -> str:
    return public_key_hex(key)
