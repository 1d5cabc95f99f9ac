"""The runtime-recipe fingerprint every stage of a route must share (pure).

Two stages only compose into the whole model bit for bit if they run the same
llama.cpp build, the same source model, the same KV cache type, the same
attention kernel (flash attention on or off changed the whole test model's
greedy output after 12 tokens; docs/engine.md) and the same compute backend
(a GPU's kernels round differently from the CPU's). The fingerprint is sha256
over a canonical JSON object of exactly those fields, so every party computes
the same hex string without depending on protobuf serialization order.

``cpu_features`` names the instruction-set features the CPU kernels were
built and run with (llama.cpp's system info: ``avx2``, ``fma``, ``f16c``, the
``repack`` and ``llamafile`` kernels ...): an AVX2 build and one without it
pick other kernels and may round differently in the low-order bits. Stages
that differ only there still compose a correct route, so it is not part of
:meth:`Recipe.fingerprint` (what every stage of a route shares and frames
carry) but of :meth:`Recipe.check_fingerprint`: the identity under which two
nodes' answers are compared bit for bit (spot checks, the tracker's
challenge); across check fingerprints the gateway's checks use a tolerance
(gateway/checks.py, docs/security.md).

``backend`` is ``"cpu"`` for a node that offloads nothing, ``"<backend>"``
(``"cuda"``, ``"vulkan"``, ``"metal"`` ...) when every layer of its shard and
its output run on that device, and ``"<backend>+cpu"`` when only some do. It
enters the canonical JSON only when it is not ``"cpu"``, so CPU nodes keep
the fingerprints they had before the field existed.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from proto.swarm.v1 import shard_service_pb2

RECIPE_FORMAT = 1  # bump if the set of fields or their canonical form changes


@dataclass(frozen=True)
class Recipe:
    llama_cpp_build: str
    model_fingerprint: str
    kv_type: str
    flash_attention: bool
    backend: str = "cpu"
    cpu_features: str = ""  # e.g. "avx,avx2,f16c,fma,repack,sse3" (see cpu_features_from_system_info)

    def canonical_json(self) -> bytes:
        fields: dict[str, object] = {
            "format": RECIPE_FORMAT,
            "llama_cpp_build": self.llama_cpp_build,
            "model_fingerprint": self.model_fingerprint.lower(),
            "kv_type": self.kv_type.lower(),
            "flash_attention": self.flash_attention,
        }
        if self.backend.lower() != "cpu":
            fields["backend"] = self.backend.lower()
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    def fingerprint(self) -> str:
        """sha256 (lowercase hex) of :meth:`canonical_json`."""
        return hashlib.sha256(self.canonical_json()).hexdigest()

    def check_fingerprint(self) -> str:
        """What two nodes must share to be compared bit for bit: the fingerprint and the CPU
        features (the fingerprint itself where the features are not reported)."""
        if not self.cpu_features:
            return self.fingerprint()
        body = (
            self.canonical_json() + b"|cpu_features=" + self.cpu_features.lower().encode("ascii", "replace")
        )
        return hashlib.sha256(body).hexdigest()

    def to_wire(self) -> shard_service_pb2.RuntimeRecipe:
        return shard_service_pb2.RuntimeRecipe(
            llama_cpp_build=self.llama_cpp_build,
            model_fingerprint=self.model_fingerprint,
            kv_type=self.kv_type,
            flash_attention=self.flash_attention,
            fingerprint=self.fingerprint(),
            backend=self.backend,
            cpu_features=self.cpu_features,
        )

    @classmethod
    def from_wire(cls, message: shard_service_pb2.RuntimeRecipe) -> Recipe:
        """The recipe a peer described (its ``fingerprint`` field is not trusted: recompute it)."""
        return cls(
            llama_cpp_build=message.llama_cpp_build,
            model_fingerprint=message.model_fingerprint,
            kv_type=message.kv_type,
            flash_attention=message.flash_attention,
            backend=message.backend or "cpu",
            cpu_features=message.cpu_features,
        )


_FEATURE = re.compile(r"([A-Za-z0-9_]+)\s*=\s*1\b")


def cpu_features_from_system_info(text: str) -> str:
    """The CPU features llama.cpp reports on (``llama_print_system_info``'s ``CPU : AVX2 = 1 | ...``
    part): lowercase, sorted, comma-separated; "" when it names none."""
    features: set[str] = set()
    for line in text.splitlines():
        for part in line.split("CPU :")[1:]:
            features.update(m.group(1).lower() for m in _FEATURE.finditer(part.split(":")[0]))
    return ",".join(sorted(features))
