"""Every exception the node raises on purpose.

    NodeError                      base; ``status`` names the wire status it maps to
    ├── ShardError                 shard extraction / loading refused (bad file, bad range, ...)
    │   ├── NotGGUFError           the file is not a GGUF model
    │   ├── UnsupportedArchitecture architecture not in SUPPORTED_ARCHITECTURES
    │   ├── LayerRangeError        empty range, or outside the model's layers
    │   ├── ManifestError          a model manifest that is malformed, or bytes that do not match it
    │   ├── FetchError             a source could not deliver the shard's bytes (says which and why)
    │   │   ├── RangeNotSupported  an HTTP server that ignores Range requests
    │   │   └── IntegrityError     a tensor's bytes kept failing their manifest digest
    │   ├── DiskSpaceError         not enough free disk in the cache for the shard
    │   └── CapacityError          the node's memory cannot hold even one layer of the model
    └── EngineError                the layer-range engine refused a piece of work
        ├── SessionLimitError      no free sequence slot (RESOURCE_EXHAUSTED)
        ├── KVBudgetError          the session would exceed its KV budget (RESOURCE_EXHAUSTED)
        ├── KVPoolExhaustedError   the node's KV pool has no free block for the work (RESOURCE_EXHAUSTED)
        ├── PositionError          work does not start at the session's KV length (POSITION_MISMATCH)
        ├── UnknownSessionError    no such session, or already released (UNKNOWN_SESSION)
        ├── InputShapeError        hidden states / tokens of the wrong shape or kind (SHAPE)
        └── DecodeError            llama.cpp failed a decode; the batch was rolled back (INTERNAL)

Errors about one session never affect other sessions: the engine validates a
whole batch before it touches any KV and rejects only the offending items.
"""

from __future__ import annotations


class NodeError(Exception):
    status = "INTERNAL"


class ShardError(NodeError):
    status = "BAD_SHARD"


class NotGGUFError(ShardError):
    pass


class UnsupportedArchitecture(ShardError):
    pass


class LayerRangeError(ShardError):
    pass


class ManifestError(ShardError):
    pass


class FetchError(ShardError):
    pass


class RangeNotSupported(FetchError):
    pass


class IntegrityError(FetchError):
    pass


class DiskSpaceError(ShardError):
    pass


class CapacityError(ShardError):
    pass


class EngineError(NodeError):
    status = "INTERNAL"


class SessionLimitError(EngineError):
    status = "RESOURCE_EXHAUSTED"


class KVBudgetError(EngineError):
    status = "RESOURCE_EXHAUSTED"


class KVPoolExhaustedError(EngineError):
    """The node's KV pool has no free block for this work now; other sessions' releases make room."""

    status = "RESOURCE_EXHAUSTED"


class PositionError(EngineError):
    status = "POSITION_MISMATCH"


class UnknownSessionError(EngineError):
    status = "UNKNOWN_SESSION"


class InputShapeError(EngineError):
    status = "SHAPE"


class DecodeError(EngineError):
    status = "INTERNAL"
