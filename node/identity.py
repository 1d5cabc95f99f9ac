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

from common.keyfile import load_or_create_key_file
from proto.signing import public_key_hex

KEY_FILE = "node.key"


def key_path(data_dir: Path) -> Path:
    return data_dir / KEY_FILE


def load_or_create_key(data_dir: Path) -> tuple[nacl.signing.SigningKey, bool]:
    """The node's key, and whether it was created now (:class:`common.keyfile.KeyFileError` if unusable)."""
    return load_or_create_key_file(key_path(data_dir))


def node_id(key: nacl.signing.SigningKey) -> str:
    return public_key_hex(key)
