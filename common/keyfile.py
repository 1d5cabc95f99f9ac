"""ed25519 key files, the same for nodes, trackers and gateways.

A key file holds the 32-byte seed as hex. It is created on first use with
mode 0600, atomically (``O_CREAT | O_EXCL``: two processes starting at once
cannot both write one), inside a directory created with mode 0700. A key file
that group or others can read is refused: a leaked key is a stolen identity.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import nacl.signing


class KeyFileError(ValueError):
    """A key file cannot be used: a service's ed25519 key, or the gateway's API keys file
    (gateway.api_keys, the line number in the message); the message says which file, why and what
    to do."""


def load_or_create_key_file(path: Path) -> tuple[nacl.signing.SigningKey, bool]:
    """The key in ``path`` and whether it was created now."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_key_file(path), False
    key = nacl.signing.SigningKey.generate()
    with os.fdopen(fd, "w") as fh:
        fh.write(bytes(key).hex() + "\n")
    return key, True


def load_key_file(path: Path) -> nacl.signing.SigningKey:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        text = path.read_text().strip()
    except OSError as err:
        raise KeyFileError(f"cannot read the key file {path}: {err}") from err
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
