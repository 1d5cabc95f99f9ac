from proto.swarm.v1 import frame_pb2 as _frame_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServingStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATUS_UNSPECIFIED: _ClassVar[ServingStatus]
    SERVING_STATUS_SERVING: _ClassVar[ServingStatus]
    SERVING_STATUS_DRAINING: _ClassVar[ServingStatus]
    SERVING_STATUS_NOT_SERVING: _ClassVar[ServingStatus]
SERVING_STATUS_UNSPECIFIED: ServingStatus
SERVING_STATUS_SERVING: ServingStatus
SERVING_STATUS_DRAINING: ServingStatus
SERVING_STATUS_NOT_SERVING: ServingStatus

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("fingerprint", "name", "architecture", "n_layers", "n_embd", "n_vocab", "n_ctx_train")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_EMBD_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    N_CTX_TRAIN_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    name: str
    architecture: str
    n_layers: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    def __init__(self, fingerprint: _Optional[str] = ..., name: _Optional[str] = ..., architecture: _Optional[str] = ..., n_layers: _Optional[int] = ..., n_embd: _Optional[int] = ..., n_vocab: _Optional[int] = ..., n_ctx_train: _Optional[int] = ...) -> None: ...

class RuntimeRecipe(_message.Message):
    __slots__ = ("llama_cpp_build", "model_fingerprint", "kv_type", "flash_attention", "fingerprint", "backend", "cpu_features")
    LLAMA_CPP_BUILD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_TYPE_FIELD_NUMBER: _ClassVar[int]
    FLASH_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CPU_FEATURES_FIELD_NUMBER: _ClassVar[int]
    llama_cpp_build: str
    model_fingerprint: str
    kv_type: str
    flash_attention: bool
    fingerprint: str
    backend: str
    cpu_features: str
    def __init__(self, llama_cpp_build: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., kv_type: _Optional[str] = ..., flash_attention: _Optional[bool] = ..., fingerprint: _Optional[str] = ..., backend: _Optional[str] = ..., cpu_features: _Optional[str] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("active_sessions", "queued_steps", "kv_tokens_used", "kv_tokens_total", "decode_ms_per_token")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    queued_steps: int
    kv_tokens_used: int
    kv_tokens_total: int
    decode_ms_per_token: float
    def __init__(self, active_sessions: _Optional[int] = ..., queued_steps: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_total: _Optional[int] = ..., decode_ms_per_token: _Optional[float] = ...) -> None: ...

class NodeLimits(_message.Message):
    __slots__ = ("max_frame_bytes", "max_step_tokens", "max_sessions", "max_kv_tokens_per_session", "encodings", "min_schema_version", "max_schema_version")
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_TOKENS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    MIN_SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    max_frame_bytes: int
    max_step_tokens: int
    max_sessions: int
    max_kv_tokens_per_session: int
    encodings: _containers.RepeatedScalarFieldContainer[_frame_pb2.Encoding]
    min_schema_version: int
    max_schema_version: int
    def __init__(self, max_frame_bytes: _Optional[int] = ..., max_step_tokens: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_kv_tokens_per_session: _Optional[int] = ..., encodings: _Optional[_Iterable[_Union[_frame_pb2.Encoding, str]]] = ..., min_schema_version: _Optional[int] = ..., max_schema_version: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "model", "shard", "recipe", "load", "limits", "is_last", "serves_vocab", "tls_fingerprint")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    SERVES_VOCAB_FIELD_NUMBER: _ClassVar[int]
    TLS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model: ModelInfo
    shard: _frame_pb2.LayerRange
    recipe: RuntimeRecipe
    load: NodeLoad
    limits: NodeLimits
    is_last: bool
    serves_vocab: bool
    tls_fingerprint: str
    def __init__(self, node_id: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., shard: _Optional[_Union[_frame_pb2.LayerRange, _Mapping]] = ..., recipe: _Optional[_Union[RuntimeRecipe, _Mapping]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., limits: _Optional[_Union[NodeLimits, _Mapping]] = ..., is_last: _Optional[bool] = ..., serves_vocab: _Optional[bool] = ..., tls_fingerprint: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "uptime_ms", "load")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    status: ServingStatus
    uptime_ms: int
    load: NodeLoad
    def __init__(self, status: _Optional[_Union[ServingStatus, str]] = ..., uptime_ms: _Optional[int] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ...) -> None: ...

class VocabRequest(_message.Message):
    __slots__ = ("model_fingerprint", "max_chunk_bytes")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    max_chunk_bytes: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class VocabChunk(_message.Message):
    __slots__ = ("offset", "data", "total_size", "sha256", "model_fingerprint")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_size: int
    sha256: str
    model_fingerprint: str
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., sha256: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("model_fingerprint",)
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    def __init__(self, model_fingerprint: _Optional[str] = ...) -> None: ...

class ManifestReply(_message.Message):
    __slots__ = ("model_fingerprint", "manifest_json")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    manifest_json: bytes
    def __init__(self, model_fingerprint: _Optional[str] = ..., manifest_json: _Optional[bytes] = ...) -> None: ...

class TensorBytesRequest(_message.Message):
    __slots__ = ("model_fingerprint", "offset", "length", "max_chunk_bytes")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    offset: int
    length: int
    max_chunk_bytes: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class TensorBytesChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
