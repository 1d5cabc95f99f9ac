"""The tracker's ed25519 identity, kept in its data directory (file mode 0600)."""

from __future__ import annotations

from pathlib import Path

import nacl.signing

from common import keyfile
from common.keyfile import load_key_file, load_or_create_key_file

KEY_FILE = "tracker.key"


class KeyFileError(OSError):
    pass


def load_or_create_key(data_dir: Path) -> nacl.signing.SigningKey:
    """Read ``<data_dir>/tracker.key`` (hex seed), creating it atomically with mode 0600 if absent."""
    try:
        return load_or_create_key_file(data_dir / KEY_FILE)[0]
    except keyfile.KeyFileError as err:
        raise KeyFileError(str(err)) from err


def load_or_create_key_at(path: Path) -> nacl.signing.SigningKey:
    """The key at ``path`` (hex seed), created atomically with mode 0600 if absent."""
    try:
        return load_or_create_key_file(path)[0]
    except keyfile.KeyFileError as err:
        raise KeyFileError(str(err)) from err


def load_key(path: Path) -> nacl.signing.SigningKey:
    try:
        return load_key_file(path)
    except keyfile.KeyFileError as err:
        raise KeyFileError(str(err)) from err
