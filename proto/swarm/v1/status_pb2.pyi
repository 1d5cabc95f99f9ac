from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[Status]
    STATUS_OK: _ClassVar[Status]
    STATUS_BAD_FRAME: _ClassVar[Status]
    STATUS_SCHEMA_VERSION: _ClassVar[Status]
    STATUS_FINGERPRINT_MISMATCH: _ClassVar[Status]
    STATUS_CHECKSUM: _ClassVar[Status]
    STATUS_TOO_LARGE: _ClassVar[Status]
    STATUS_SHAPE: _ClassVar[Status]
    STATUS_DTYPE: _ClassVar[Status]
    STATUS_POSITION_MISMATCH: _ClassVar[Status]
    STATUS_UNKNOWN_SESSION: _ClassVar[Status]
    STATUS_SESSION_CLOSED: _ClassVar[Status]
    STATUS_RESOURCE_EXHAUSTED: _ClassVar[Status]
    STATUS_TICKET_INVALID: _ClassVar[Status]
    STATUS_INTERNAL: _ClassVar[Status]
    STATUS_CANCELLED: _ClassVar[Status]
    STATUS_SHARD_MISMATCH: _ClassVar[Status]
    STATUS_ROUTE_EPOCH: _ClassVar[Status]
    STATUS_STEP_CONFLICT: _ClassVar[Status]
    STATUS_CHUNK_SEQUENCE: _ClassVar[Status]
    STATUS_CONTEXT_EXCEEDED: _ClassVar[Status]
    STATUS_UNAVAILABLE: _ClassVar[Status]
    STATUS_DOWNSTREAM_FAILED: _ClassVar[Status]
    STATUS_NO_HISTORY: _ClassVar[Status]
    STATUS_PREEMPTED: _ClassVar[Status]

class RetryHint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETRY_UNSPECIFIED: _ClassVar[RetryHint]
    RETRY_NONE: _ClassVar[RetryHint]
    RETRY_SAME: _ClassVar[RetryHint]
    RETRY_RESYNC: _ClassVar[RetryHint]
    RETRY_REOPEN: _ClassVar[RetryHint]
    RETRY_REPLACE: _ClassVar[RetryHint]
    RETRY_RESUME: _ClassVar[RetryHint]
STATUS_UNSPECIFIED: Status
STATUS_OK: Status
STATUS_BAD_FRAME: Status
STATUS_SCHEMA_VERSION: Status
STATUS_FINGERPRINT_MISMATCH: Status
STATUS_CHECKSUM: Status
STATUS_TOO_LARGE: Status
STATUS_SHAPE: Status
STATUS_DTYPE: Status
STATUS_POSITION_MISMATCH: Status
STATUS_UNKNOWN_SESSION: Status
STATUS_SESSION_CLOSED: Status
STATUS_RESOURCE_EXHAUSTED: Status
STATUS_TICKET_INVALID: Status
STATUS_INTERNAL: Status
STATUS_CANCELLED: Status
STATUS_SHARD_MISMATCH: Status
STATUS_ROUTE_EPOCH: Status
STATUS_STEP_CONFLICT: Status
STATUS_CHUNK_SEQUENCE: Status
STATUS_CONTEXT_EXCEEDED: Status
STATUS_UNAVAILABLE: Status
STATUS_DOWNSTREAM_FAILED: Status
STATUS_NO_HISTORY: Status
STATUS_PREEMPTED: Status
RETRY_UNSPECIFIED: RetryHint
RETRY_NONE: RetryHint
RETRY_SAME: RetryHint
RETRY_RESYNC: RetryHint
RETRY_REOPEN: RetryHint
RETRY_REPLACE: RetryHint
RETRY_RESUME: RetryHint

class Error(_message.Message):
    __slots__ = ("status", "message", "retry", "retry_after_ms", "session_closed")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_CLOSED_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    retry: RetryHint
    retry_after_ms: int
    session_closed: bool
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ..., retry: _Optional[_Union[RetryHint, str]] = ..., retry_after_ms: _Optional[int] = ..., session_closed: _Optional[bool] = ...) -> None: ...
