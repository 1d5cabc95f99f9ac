"""The exceptions of the wire protocol, each carrying its wire status.

Exception tree::

    ProtocolError                    base; .status, .retry, .retry_after_ms, .session_closed
    ├── BadFrameError                STATUS_BAD_FRAME        not a Frame / missing field / phase-body mismatch
    ├── SchemaVersionError           STATUS_SCHEMA_VERSION
    ├── FingerprintMismatchError     STATUS_FINGERPRINT_MISMATCH
    ├── ChecksumError                STATUS_CHECKSUM
    ├── TooLargeError                STATUS_TOO_LARGE
    ├── ShapeError                   STATUS_SHAPE
    ├── DTypeError                   STATUS_DTYPE            dtype, byte order, encoding or checksum algorithm
    ├── PositionMismatchError        STATUS_POSITION_MISMATCH
    ├── UnknownSessionError          STATUS_UNKNOWN_SESSION
    ├── SessionClosedError           STATUS_SESSION_CLOSED
    ├── ResourceExhaustedError       STATUS_RESOURCE_EXHAUSTED
    ├── TicketInvalidError           STATUS_TICKET_INVALID
    ├── InternalError                STATUS_INTERNAL
    │   └── EncodeError              a local value cannot be encoded (e.g. NaN as int8)
    ├── SessionCancelledError        STATUS_CANCELLED
    ├── ShardMismatchError           STATUS_SHARD_MISMATCH
    ├── RouteEpochError              STATUS_ROUTE_EPOCH
    ├── StepConflictError            STATUS_STEP_CONFLICT
    ├── ChunkSequenceError           STATUS_CHUNK_SEQUENCE
    ├── ContextExceededError         STATUS_CONTEXT_EXCEEDED
    ├── UnavailableError             STATUS_UNAVAILABLE
    ├── DownstreamFailedError        STATUS_DOWNSTREAM_FAILED the next stage could not take a push
    ├── NoHistoryError               STATUS_NO_HISTORY       replay asked for outputs not kept
    ├── PreemptedError               STATUS_PREEMPTED        KV freed for an older session: re-prefill later
    └── RemoteError                  an Error frame received from the peer (any status)

Every class has the default retry hint that docs/protocol.md gives for its
status; a raiser may override it (and ``retry_after_ms``) per instance.

This is the one place where statuses map to exceptions and back:
:func:`error_body` turns an exception into the wire ``Error`` message and
:func:`error_from_body` turns a received ``Error`` into a :class:`RemoteError`.
Pure module: imports only the generated messages.
"""

from __future__ import annotations

from proto.swarm.v1 import status_pb2

# Longer messages are cut on the way out, so a receiver (limit 4096
# characters, proto.codec.FrameLimits.max_text_chars) never rejects an error.
MAX_MESSAGE_CHARS = 1024

Status = status_pb2.Status
RetryHint = status_pb2.RetryHint


class ProtocolError(Exception):
    """A frame or request that cannot be handled, with the status to report."""

    status: status_pb2.Status = status_pb2.STATUS_INTERNAL
    retry: status_pb2.RetryHint = status_pb2.RETRY_NONE
    # Default for "does the receiver drop the session because of this error".
    closes_session: bool = False

    def __init__(
        self,
        message: str,
        *,
        retry: status_pb2.RetryHint | None = None,
        retry_after_ms: int = 0,
        session_closed: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if retry is not None:
            self.retry = retry
        self.retry_after_ms = retry_after_ms
        self.session_closed = self.closes_session if session_closed is None else session_closed

    @property
    def status_name(self) -> str:
        return (
            status_pb2.Status.Name(self.status)
            if self.status in status_pb2.Status.values()
            else str(self.status)
        )

    def __str__(self) -> str:
        return f"{self.status_name}: {self.message}"


class BadFrameError(ProtocolError):
    status = status_pb2.STATUS_BAD_FRAME
    retry = status_pb2.RETRY_NONE


class SchemaVersionError(ProtocolError):
    status = status_pb2.STATUS_SCHEMA_VERSION
    retry = status_pb2.RETRY_REPLACE


class FingerprintMismatchError(ProtocolError):
    status = status_pb2.STATUS_FINGERPRINT_MISMATCH
    retry = status_pb2.RETRY_REPLACE


class ChecksumError(ProtocolError):
    status = status_pb2.STATUS_CHECKSUM
    retry = status_pb2.RETRY_SAME


class TooLargeError(ProtocolError):
    status = status_pb2.STATUS_TOO_LARGE
    retry = status_pb2.RETRY_NONE


class ShapeError(ProtocolError):
    status = status_pb2.STATUS_SHAPE
    retry = status_pb2.RETRY_NONE


class DTypeError(ProtocolError):
    status = status_pb2.STATUS_DTYPE
    retry = status_pb2.RETRY_NONE


class PositionMismatchError(ProtocolError):
    status = status_pb2.STATUS_POSITION_MISMATCH
    retry = status_pb2.RETRY_RESYNC


class UnknownSessionError(ProtocolError):
    status = status_pb2.STATUS_UNKNOWN_SESSION
    retry = status_pb2.RETRY_REOPEN
    closes_session = True


class SessionClosedError(ProtocolError):
    status = status_pb2.STATUS_SESSION_CLOSED
    retry = status_pb2.RETRY_REOPEN
    closes_session = True


class ResourceExhaustedError(ProtocolError):
    status = status_pb2.STATUS_RESOURCE_EXHAUSTED
    retry = status_pb2.RETRY_REPLACE


class TicketInvalidError(ProtocolError):
    status = status_pb2.STATUS_TICKET_INVALID
    retry = status_pb2.RETRY_REOPEN
    closes_session = True


class InternalError(ProtocolError):
    status = status_pb2.STATUS_INTERNAL
    retry = status_pb2.RETRY_REPLACE
    closes_session = True


class EncodeError(InternalError):
    """A local value cannot be put on the wire as asked (e.g. non-finite as int8).

    Raised to the caller that builds a frame; it is this side's problem, not
    the peer's.
    """

    retry = status_pb2.RETRY_NONE
    closes_session = False


class SessionCancelledError(ProtocolError):
    status = status_pb2.STATUS_CANCELLED
    retry = status_pb2.RETRY_NONE
    closes_session = True


class ShardMismatchError(ProtocolError):
    status = status_pb2.STATUS_SHARD_MISMATCH
    retry = status_pb2.RETRY_REPLACE


class RouteEpochError(ProtocolError):
    status = status_pb2.STATUS_ROUTE_EPOCH
    retry = status_pb2.RETRY_NONE


class StepConflictError(ProtocolError):
    status = status_pb2.STATUS_STEP_CONFLICT
    retry = status_pb2.RETRY_NONE


class ChunkSequenceError(ProtocolError):
    status = status_pb2.STATUS_CHUNK_SEQUENCE
    retry = status_pb2.RETRY_SAME


class ContextExceededError(ProtocolError):
    status = status_pb2.STATUS_CONTEXT_EXCEEDED
    retry = status_pb2.RETRY_NONE


class UnavailableError(ProtocolError):
    status = status_pb2.STATUS_UNAVAILABLE
    retry = status_pb2.RETRY_REPLACE


class DownstreamFailedError(ProtocolError):
    """A stage could not push to the next one: the *next* stage is the one to replace."""

    status = status_pb2.STATUS_DOWNSTREAM_FAILED
    retry = status_pb2.RETRY_REPLACE


class NoHistoryError(ProtocolError):
    """A replay was asked for outputs this node did not keep."""

    status = status_pb2.STATUS_NO_HISTORY
    retry = status_pb2.RETRY_NONE


class PreemptedError(ProtocolError):
    """The node freed this session's KV for an older session; resume it elsewhere or later by re-prefill."""

    status = status_pb2.STATUS_PREEMPTED
    retry = status_pb2.RETRY_RESUME
    closes_session = True


class RemoteError(ProtocolError):
    """The peer answered with an Error frame; ``status`` is what it reported."""

    def __init__(
        self,
        status: status_pb2.Status,
        message: str,
        *,
        retry: status_pb2.RetryHint,
        retry_after_ms: int = 0,
        session_closed: bool = False,
    ) -> None:
        self.status = status
        super().__init__(message, retry=retry, retry_after_ms=retry_after_ms, session_closed=session_closed)


_BY_STATUS: dict[int, type[ProtocolError]] = {
    cls.status: cls
    for cls in (
        BadFrameError,
        SchemaVersionError,
        FingerprintMismatchError,
        ChecksumError,
        TooLargeError,
        ShapeError,
        DTypeError,
        PositionMismatchError,
        UnknownSessionError,
        SessionClosedError,
        ResourceExhaustedError,
        TicketInvalidError,
        InternalError,
        SessionCancelledError,
        ShardMismatchError,
        RouteEpochError,
        StepConflictError,
        ChunkSequenceError,
        ContextExceededError,
        UnavailableError,
        DownstreamFailedError,
        NoHistoryError,
        PreemptedError,
    )
}


def error_class(status: int) -> type[ProtocolError]:
    """The exception class of a wire status (``InternalError`` for unknown ones)."""
    return _BY_STATUS.get(status, InternalError)


def default_retry(status: int) -> status_pb2.RetryHint:
    """The retry hint docs/protocol.md gives for ``status``."""
    return error_class(status).retry


def error_body(exc: ProtocolError) -> status_pb2.Error:
    """The wire ``Error`` message reporting ``exc``."""
    return status_pb2.Error(
        status=exc.status,
        message=exc.message[:MAX_MESSAGE_CHARS],
        retry=exc.retry,
        retry_after_ms=exc.retry_after_ms,
        session_closed=exc.session_closed,
    )


def error_from_body(body: status_pb2.Error) -> RemoteError:
    """A :class:`RemoteError` for a received ``Error`` message.

    A missing retry hint becomes the status's default; an unknown status is
    kept as a number (a newer peer) and treated like STATUS_INTERNAL by
    :func:`default_retry`.
    """
    retry = body.retry if body.retry != status_pb2.RETRY_UNSPECIFIED else default_retry(body.status)
    return RemoteError(
        body.status,
        body.message,
        retry=retry,
        retry_after_ms=int(body.retry_after_ms),
        session_closed=bool(body.session_closed),
    )
