"""Is this vocabulary the model's? A downloaded vocabulary checked against the model's own header (pure).

A model's fingerprint is the digest of its manifest, and the manifest holds
the sha256 of the model file's header: every key/value of the GGUF, the
tokenizer and the chat template among them. So a gateway that has the
manifest (checked against the fingerprint) and the header bytes (checked
against the manifest) knows the model's real tokenizer, whichever node sent
them. The vocabulary file a node serves (``GetVocab``, a metadata-only GGUF)
must then say the same thing: :func:`check_vocab_against_header` refuses it
unless

* every key/value it carries (other than the swarm's own ``swarm.*``) is in
  the header with the same type and the same bytes, and
* every key/value that shapes tokenizing or prompting (``tokenizer.*``,
  ``general.architecture``) that the header has, it has too (dropping the chat
  template would make the gateway fall back to a built-in one).

:func:`read_kv` parses the key/values of a GGUF (v2/v3, little-endian) from
bytes without interpreting them: each value is kept as its type and its exact
encoded bytes. Bounded: at most :data:`MAX_KV` pairs, strings and arrays no
longer than the bytes given, arrays nested at most :data:`MAX_DEPTH` deep.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

MAX_KV = 1_000_000
MAX_DEPTH = 4
_MAGIC = b"GGUF"
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
SHAPING_PREFIXES = ("tokenizer.",)
SHAPING_KEYS = frozenset({"general.architecture"})
IGNORED_PREFIXES = ("swarm.",)


class VocabMismatch(ValueError):
    """The vocabulary does not match the model's header (or is not a readable GGUF)."""


@dataclass(frozen=True)
class KV:
    """One key/value: its GGUF type and the exact bytes that encode its value."""

    vtype: int
    raw: bytes


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise VocabMismatch("the GGUF ends inside its key/values")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def skip_value(self, vtype: int, depth: int = 0) -> None:
        if vtype in _FIXED:
            self.take(_FIXED[vtype])
        elif vtype == _STRING:
            self.take(self.u64())
        elif vtype == _ARRAY:
            if depth >= MAX_DEPTH:
                raise VocabMismatch("GGUF arrays nested too deep")
            etype, count = self.u32(), self.u64()
            if etype in _FIXED:
                self.take(_FIXED[etype] * count)
            else:
                if count > len(self.data):  # every element takes at least one byte
                    raise VocabMismatch("a GGUF array longer than the file")
                for _ in range(count):
                    self.skip_value(etype, depth + 1)
        else:
            raise VocabMismatch(f"unknown GGUF value type {vtype}")


def read_kv(data: bytes) -> dict[str, KV]:
    """The key/values of a GGUF given as bytes (the header suffices)."""
    r = _Reader(data)
    if bytes(r.take(4)) != _MAGIC:
        raise VocabMismatch("not a GGUF file")
    version = r.u32()
    if version not in (2, 3):
        raise VocabMismatch(f"GGUF version {version} is not supported")
    r.u64()  # tensor count
    n_kv = r.u64()
    if n_kv > MAX_KV:
        raise VocabMismatch(f"{n_kv} key/values (at most {MAX_KV})")
    out: dict[str, KV] = {}
    for _ in range(n_kv):
        key = bytes(r.take(r.u64())).decode("utf-8", "replace")
        vtype = r.u32()
        start = r.pos
        r.skip_value(vtype)
        if key in out:
            raise VocabMismatch(f"key {key!r} appears twice")
        out[key] = KV(vtype, bytes(r.data[start : r.pos]))
    return out


def _shaping(key: str) -> bool:
    return key in SHAPING_KEYS or key.startswith(SHAPING_PREFIXES)


def check_vocab_against_header(vocab: Mapping[str, KV], header: Mapping[str, KV]) -> int:
    """Refuse (:class:`VocabMismatch`) a vocabulary that differs from the header; returns how many
    key/values were compared."""
    compared = 0
    for key, kv in vocab.items():
        if key.startswith(IGNORED_PREFIXES):
            continue
        theirs = header.get(key)
        if theirs is None:
            raise VocabMismatch(f"the vocabulary has {key!r}, which the model's header does not")
        if theirs != kv:
            raise VocabMismatch(f"the vocabulary's {key!r} differs from the model's header")
        compared += 1
    missing = sorted(k for k in header if _shaping(k) and k not in vocab)
    if missing:
        raise VocabMismatch(f"the vocabulary lacks {missing[0]!r} of the model's header")
    return compared
