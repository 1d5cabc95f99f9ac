"""The model registry's messages and what the tracker derives from a manifest (pure).

An operator registers a model with ``swarm-tracker model add FILE|URL``: a
signed :class:`ModelRegistration` (kind ``model_registration``, signer field
``signer_id``) plus the model's manifest (``proto.manifest``), sent to
``POST /v1/registry/models``. The tracker accepts it when the signature is
valid, the signer is the tracker's own key or one of its ``registry_keys``,
and the manifest hashes to the registration's fingerprint. It then serves the
manifest, the source URLs and the live peers of the model to joining nodes
(``GET /v1/registry/models/<name or fingerprint>``), and uses the manifest's
per-layer bytes in placement (:func:`profile`).

Names are bound to one fingerprint: registering a name already bound to
another fingerprint is refused unless the registration says ``replace``
(then the old binding is dropped). This is the hook for trusting model names
(announces and routes can require a registered fingerprint for a name).

Standard library only (plus ``proto``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from proto.announce import ENVELOPE_FIELDS, PayloadError
from proto.manifest import Manifest

KIND = "model_registration"
REMOVAL_KIND = "model_removal"
SIGNER_FIELD = "signer_id"
MAX_SOURCES = 16
MAX_URL_CHARS = 2048
MAX_NAME_CHARS = 200
MAX_LAYERS = 100_000
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_REG_KEYS = (
    frozenset(
        {
            "fingerprint",
            "name",
            "architecture",
            "n_layers",
            "n_embd",
            "sources",
            "split_points",
            "replace",
            SIGNER_FIELD,
        }
    )
    | ENVELOPE_FIELDS
)


def check_name(name: Any, where: str = "name") -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS or name != name.strip():
        raise PayloadError(f"{where} must be 1..{MAX_NAME_CHARS} characters without surrounding spaces")
    if _HEX64.match(name):
        raise PayloadError(f"{where} must not look like a fingerprint (64 hex characters)")
    if any(c in name for c in "\n\r\t?#"):
        raise PayloadError(f"{where} must not contain control characters, '?' or '#'")
    return name


def check_source(url: Any) -> str:
    if not isinstance(url, str) or len(url) > MAX_URL_CHARS:
        raise PayloadError(f"sources must be URLs of at most {MAX_URL_CHARS} characters")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise PayloadError(f"source {url!r} is not an http(s) URL")
    return url


@dataclass(frozen=True)
class ModelRegistration:
    fingerprint: str
    name: str
    architecture: str
    n_layers: int
    n_embd: int
    sources: tuple[str, ...]
    split_points: tuple[int, ...] | None = None
    replace: bool = False  # re-bind a name registered to another fingerprint

    @classmethod
    def from_json(cls, obj: Any) -> ModelRegistration:
        w = "registration"
        if not isinstance(obj, Mapping):
            raise PayloadError(f"{w} must be a JSON object")
        extra = set(obj) - _REG_KEYS
        if extra:
            raise PayloadError(f"{w}: unknown field(s) {sorted(extra)}")
        fp = obj.get("fingerprint")
        if not isinstance(fp, str) or not _HEX64.match(fp):
            raise PayloadError(f"{w}.fingerprint must be 64 lowercase hex characters")
        arch = obj.get("architecture")
        if not isinstance(arch, str) or not 1 <= len(arch) <= 64:
            raise PayloadError(f"{w}.architecture must be a string of 1..64 characters")
        n_layers, n_embd = obj.get("n_layers"), obj.get("n_embd")
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers <= MAX_LAYERS:
            raise PayloadError(f"{w}.n_layers must be an integer in 1..{MAX_LAYERS}")
        if isinstance(n_embd, bool) or not isinstance(n_embd, int) or not 1 <= n_embd <= 1 << 20:
            raise PayloadError(f"{w}.n_embd must be a positive integer")
        sources = obj.get("sources", [])
        if not isinstance(sources, list) or len(sources) > MAX_SOURCES:
            raise PayloadError(f"{w}.sources must be a list of at most {MAX_SOURCES} URLs")
        points = obj.get("split_points")
        if points is not None:
            if (
                not isinstance(points, list)
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in points)
                or sorted(set(points)) != points
                or not points
                or points[0] != 0
                or points[-1] != n_layers
            ):
                raise PayloadError(f"{w}.split_points must be increasing layer boundaries from 0 to n_layers")
        replace = obj.get("replace", False)
        if not isinstance(replace, bool):
            raise PayloadError(f"{w}.replace must be true or false")
        return cls(
            fingerprint=fp,
            name=check_name(obj.get("name"), f"{w}.name"),
            architecture=arch,
            n_layers=n_layers,
            n_embd=n_embd,
            sources=tuple(check_source(u) for u in sources),
            split_points=tuple(points) if points is not None else None,
            replace=replace,
        )

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "name": self.name,
            "architecture": self.architecture,
            "n_layers": self.n_layers,
            "n_embd": self.n_embd,
            "sources": list(self.sources),
        }
        if self.split_points is not None:
            body["split_points"] = list(self.split_points)
        if self.replace:
            body["replace"] = True
        return body


@dataclass(frozen=True)
class ModelProfile:
    """Bytes a span of the model needs for its weights, from the manifest."""

    layer_bytes: tuple[int, ...]
    first_extra_bytes: int  # the token-embedding table (a first stage's companion file)
    last_extra_bytes: int  # the LM head (output.weight, or the tied token table) and the output norm


def profile(manifest: Manifest, n_layers: int) -> ModelProfile:
    layers = [0] * n_layers
    globals_: dict[str, int] = {}
    for t in manifest.tensors:
        m = _BLOCK_RE.match(t.name)
        if m:
            if int(m.group(1)) < n_layers:
                layers[int(m.group(1))] += t.size
        else:
            globals_[t.name] = t.size
    embd = globals_.get("token_embd.weight", 0)
    head = globals_.get("output.weight", embd)
    norms = sum(v for k, v in globals_.items() if k not in ("token_embd.weight", "output.weight"))
    return ModelProfile(tuple(layers), embd, head + norms)
