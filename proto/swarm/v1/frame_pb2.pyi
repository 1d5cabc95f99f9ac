from proto.swarm.v1 import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_OPEN: _ClassVar[Phase]
    PHASE_PREFILL: _ClassVar[Phase]
    PHASE_DECODE: _ClassVar[Phase]
    PHASE_RELEASE: _ClassVar[Phase]
    PHASE_CANCEL: _ClassVar[Phase]
    PHASE_REPLAY: _ClassVar[Phase]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    ENCODING_F32: _ClassVar[Encoding]
    ENCODING_F16: _ClassVar[Encoding]
    ENCODING_INT8_BLOCK: _ClassVar[Encoding]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]

class ByteOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BYTE_ORDER_UNSPECIFIED: _ClassVar[ByteOrder]
    BYTE_ORDER_LITTLE: _ClassVar[ByteOrder]
    BYTE_ORDER_BIG: _ClassVar[ByteOrder]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_CRC32: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_BLAKE2B_128: _ClassVar[ChecksumAlgorithm]

class Proposer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_UNSPECIFIED: _ClassVar[Proposer]
    PROPOSER_NGRAM: _ClassVar[Proposer]
    PROPOSER_DRAFT: _ClassVar[Proposer]
PHASE_UNSPECIFIED: Phase
PHASE_OPEN: Phase
PHASE_PREFILL: Phase
PHASE_DECODE: Phase
PHASE_RELEASE: Phase
PHASE_CANCEL: Phase
PHASE_REPLAY: Phase
ENCODING_UNSPECIFIED: Encoding
ENCODING_F32: Encoding
ENCODING_F16: Encoding
ENCODING_INT8_BLOCK: Encoding
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
BYTE_ORDER_UNSPECIFIED: ByteOrder
BYTE_ORDER_LITTLE: ByteOrder
BYTE_ORDER_BIG: ByteOrder
CHECKSUM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_CRC32: ChecksumAlgorithm
CHECKSUM_BLAKE2B_128: ChecksumAlgorithm
PROPOSER_UNSPECIFIED: Proposer
PROPOSER_NGRAM: Proposer
PROPOSER_DRAFT: Proposer

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class PositionRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "encoding", "byte_order", "data", "scales", "block_size", "checksum_algorithm", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BYTE_ORDER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    encoding: Encoding
    byte_order: ByteOrder
    data: bytes
    scales: bytes
    block_size: int
    checksum_algorithm: ChecksumAlgorithm
    checksum: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., byte_order: _Optional[_Union[ByteOrder, str]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., block_size: _Optional[int] = ..., checksum_algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "count")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "penalty_last_n", "frequency_penalty", "presence_penalty", "n_top_logprobs", "logit_bias", "grammar", "completion_start", "choices", "proposer")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    N_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_START_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    penalty_last_n: int
    frequency_penalty: float
    presence_penalty: float
    n_top_logprobs: int
    logit_bias: _containers.RepeatedCompositeFieldContainer[TokenBias]
    grammar: str
    completion_start: int
    choices: int
    proposer: Proposer
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., penalty_last_n: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., n_top_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Iterable[_Union[TokenBias, _Mapping]]] = ..., grammar: _Optional[str] = ..., completion_start: _Optional[int] = ..., choices: _Optional[int] = ..., proposer: _Optional[_Union[Proposer, str]] = ...) -> None: ...

class TokenBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("session_id", "positions", "copy")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    positions: int
    copy: bool
    def __init__(self, session_id: _Optional[str] = ..., positions: _Optional[int] = ..., copy: _Optional[bool] = ...) -> None: ...

class PushTarget(_message.Message):
    __slots__ = ("node_id", "address", "hop_token", "shard", "recipe_fingerprint", "tls_fingerprint")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TLS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    hop_token: bytes
    shard: LayerRange
    recipe_fingerprint: str
    tls_fingerprint: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., hop_token: _Optional[bytes] = ..., shard: _Optional[_Union[LayerRange, _Mapping]] = ..., recipe_fingerprint: _Optional[str] = ..., tls_fingerprint: _Optional[str] = ...) -> None: ...

class KvBudget(_message.Message):
    __slots__ = ("max_tokens",)
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("route_ticket", "kv_budget", "sampling", "output_encoding", "output_block_size", "max_frame_bytes", "downstream", "upstream_token", "ring", "history_bytes", "kv_source", "gateway_proof", "isolated", "speculation")
    ROUTE_TICKET_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ENCODING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    HISTORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_PROOF_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    route_ticket: bytes
    kv_budget: KvBudget
    sampling: SamplingParams
    output_encoding: Encoding
    output_block_size: int
    max_frame_bytes: int
    downstream: PushTarget
    upstream_token: bytes
    ring: PushTarget
    history_bytes: int
    kv_source: KvSource
    gateway_proof: bytes
    isolated: bool
    speculation: Speculation
    def __init__(self, route_ticket: _Optional[bytes] = ..., kv_budget: _Optional[_Union[KvBudget, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., output_encoding: _Optional[_Union[Encoding, str]] = ..., output_block_size: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ..., downstream: _Optional[_Union[PushTarget, _Mapping]] = ..., upstream_token: _Optional[bytes] = ..., ring: _Optional[_Union[PushTarget, _Mapping]] = ..., history_bytes: _Optional[int] = ..., kv_source: _Optional[_Union[KvSource, _Mapping]] = ..., gateway_proof: _Optional[bytes] = ..., isolated: _Optional[bool] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("max_drafts",)
    MAX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    max_drafts: int
    def __init__(self, max_drafts: _Optional[int] = ...) -> None: ...

class OpenAck(_message.Message):
    __slots__ = ("node_id", "kv_tokens_granted", "max_frame_bytes", "max_step_tokens", "reattached")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_GRANTED_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REATTACHED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kv_tokens_granted: int
    max_frame_bytes: int
    max_step_tokens: int
    reattached: bool
    def __init__(self, node_id: _Optional[str] = ..., kv_tokens_granted: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ..., max_step_tokens: _Optional[int] = ..., reattached: _Optional[bool] = ...) -> None: ...

class Activation(_message.Message):
    __slots__ = ("token_ids", "tensors", "sample", "hop_token", "replay", "drafts", "window_gen")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    HOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_GEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    sample: bool
    hop_token: bytes
    replay: bool
    drafts: int
    window_gen: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., sample: _Optional[bool] = ..., hop_token: _Optional[bytes] = ..., replay: _Optional[bool] = ..., drafts: _Optional[int] = ..., window_gen: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "end_of_generation")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    END_OF_GENERATION_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    end_of_generation: bool
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., end_of_generation: _Optional[bool] = ...) -> None: ...

class ActivationResult(_message.Message):
    __slots__ = ("tensors", "sampled", "compute_us", "output_digest", "pushed", "drafts")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    compute_us: int
    output_digest: bytes
    pushed: bool
    drafts: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., compute_us: _Optional[int] = ..., output_digest: _Optional[bytes] = ..., pushed: _Optional[bool] = ..., drafts: _Optional[int] = ...) -> None: ...

class Replay(_message.Message):
    __slots__ = ("target", "end", "step_tokens")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    target: PushTarget
    end: int
    step_tokens: int
    def __init__(self, target: _Optional[_Union[PushTarget, _Mapping]] = ..., end: _Optional[int] = ..., step_tokens: _Optional[int] = ...) -> None: ...

class ReplayAck(_message.Message):
    __slots__ = ("steps", "positions")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    positions: int
    def __init__(self, steps: _Optional[int] = ..., positions: _Optional[int] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("keep_ms", "keep_positions")
    KEEP_MS_FIELD_NUMBER: _ClassVar[int]
    KEEP_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    keep_ms: int
    keep_positions: int
    def __init__(self, keep_ms: _Optional[int] = ..., keep_positions: _Optional[int] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Closed(_message.Message):
    __slots__ = ("freed_kv_tokens",)
    FREED_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    freed_kv_tokens: int
    def __init__(self, freed_kv_tokens: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("schema_version", "request_id", "session_id", "route_epoch", "model_fingerprint", "recipe_fingerprint", "shard", "phase", "positions", "step_id", "expected_kv_len", "kv_len", "chunk", "open", "open_ack", "activation", "result", "release", "cancel", "closed", "error", "replay", "replay_ack")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_KV_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_LEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    OPEN_ACK_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ACK_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    request_id: str
    session_id: str
    route_epoch: int
    model_fingerprint: str
    recipe_fingerprint: str
    shard: LayerRange
    phase: Phase
    positions: PositionRange
    step_id: int
    expected_kv_len: int
    kv_len: int
    chunk: Chunk
    open: OpenSession
    open_ack: OpenAck
    activation: Activation
    result: ActivationResult
    release: Release
    cancel: Cancel
    closed: Closed
    error: _status_pb2.Error
    replay: Replay
    replay_ack: ReplayAck
    def __init__(self, schema_version: _Optional[int] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., route_epoch: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., recipe_fingerprint: _Optional[str] = ..., shard: _Optional[_Union[LayerRange, _Mapping]] = ..., phase: _Optional[_Union[Phase, str]] = ..., positions: _Optional[_Union[PositionRange, _Mapping]] = ..., step_id: _Optional[int] = ..., expected_kv_len: _Optional[int] = ..., kv_len: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., open: _Optional[_Union[OpenSession, _Mapping]] = ..., open_ack: _Optional[_Union[OpenAck, _Mapping]] = ..., activation: _Optional[_Union[Activation, _Mapping]] = ..., result: _Optional[_Union[ActivationResult, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., closed: _Optional[_Union[Closed, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Error, _Mapping]] = ..., replay: _Optional[_Union[Replay, _Mapping]] = ..., replay_ack: _Optional[_Union[ReplayAck, _Mapping]] = ...) -> None: ...
