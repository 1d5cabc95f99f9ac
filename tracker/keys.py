"""The tracker's ed25519 identity, kept in its data directory (file mode 0600; common.keyfile's rules
and its :class:`common.keyfile.KeyFileError`)."""

from __future__ import annotations

from pathlib import Path

import nacl.signing

from common.keyfile import load_or_create_key_file

KEY_FILE = "tracker.key"


def load_or_create_key(data_dir: Path) -> nacl.signing.SigningKey:
    """Read ``<data_dir>/tracker.key`` (hex seed), creating it atomically with mode 0600 if absent."""
    return load_or_create_key_at(data_dir / KEY_FILE)


def load_or_create_key_at(path: Path) -> nacl.signing.SigningKey:
    """The key at ``path`` (hex seed), created atomically with mode 0600 if absent."""
    return load_or_create_key_file(path)[0]
