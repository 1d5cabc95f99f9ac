"""The gateway's exceptions, each carrying the HTTP status and OpenAI error type it maps to.

Exception tree::

    GatewayError                     base; .status, .type, .param, .code, .retry_after_s
    ├── InvalidRequest               400 invalid_request_error   bad JSON, bad or unsupported parameter
    │   └── ContextLengthExceeded    400 invalid_request_error   prompt (+ max_tokens) past the KV budget
    ├── AuthenticationFailed         401 authentication_error    wrong API key, or none where one is required
    ├── ModelNotFound                404 invalid_request_error   no such model in the swarm
    ├── NotFound                     404 invalid_request_error   unknown path
    ├── MethodNotAllowed             405 invalid_request_error
    ├── ClientStalled                408 invalid_request_error   stream reader idle for client_stall_s
    ├── ConversationConflict         409 invalid_request_error   conversation_full / conversation_gone
    ├── PayloadTooLarge              413 invalid_request_error   request body over max_request_bytes
    ├── RateLimited                  429 rate_limit_error        per-client or per-key quota
    ├── Overloaded                   503 server_error            no slot or queue room, or the wait timed out
    ├── NoRoute                      503 server_error            the tracker has no complete route right now
    ├── UpstreamFailed               502 server_error            a node or the tracker failed
    │   └── StageFailed              502 server_error            one node failed (.node_id, .remote)
    │       ├── StageBusy            503 server_error            one node is full (RESOURCE_EXHAUSTED)
    │       └── Unconfirmable        503 server_error            nodes on probation no other route can check
    └── InternalFailure              500 server_error            a bug in the gateway

Pure module: the standard library only. ``gateway.app`` turns any of these
into the OpenAI error body with :func:`error_body`, in exactly one place.

What a client reads never names the swarm's insides: :func:`public_message`
replaces the message of a node or tracker failure by a generic one carrying
the request id (the log line with that id has the node and its address), and
strips node ids and ``host:port`` from every other server-side (5xx) message.
"""

from __future__ import annotations

import re
from typing import Any


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.retry_after_s = retry_after_s


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    default_code = "context_length_exceeded"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    default_code = "model_not_found"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class ClientStalled(GatewayError):
    """Sent (as the stream's last event, if the client ever reads again) after its session was ended
    because the client stopped reading."""

    status = 408
    type = "invalid_request_error"
    default_code = "client_too_slow"

    def __init__(self, stall_s: float) -> None:
        super().__init__(
            f"The stream was stopped: the client read nothing for {stall_s:g} s and its session was ended."
        )


class ConversationConflict(GatewayError):
    """A conversation turn nothing can recover: the history is gone, or it cannot fit even compacted."""

    status = 409
    type = "invalid_request_error"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class Overloaded(GatewayError):
    status = 503
    type = "server_error"
    default_code = "overloaded"


class NoRoute(GatewayError):
    status = 503
    type = "server_error"
    default_code = "no_route"


class UpstreamFailed(GatewayError):
    status = 502
    type = "server_error"
    default_code = "upstream_failed"


class StageFailed(UpstreamFailed):
    """A node answered with an error, broke its stream or did not answer; ``node_id`` says which.

    ``remote`` is the node's wire error (``proto.errors.RemoteError``) when it sent one.
    ``answered``: the address answered at once, refusing (another certificate than announced): the
    route is replaced, but this is no silent or dead node to route around for a while.
    """

    def __init__(
        self,
        message: str,
        *,
        node_id: str,
        remote: object | None = None,
        retry_after_s: int | None = None,
        failed_nodes: frozenset[str] = frozenset(),
        answered: bool = False,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.node_id = node_id
        self.remote = remote
        self.answered = answered
        self.failed_nodes = failed_nodes | ({node_id} if node_id else set())  # every node the session lost


class StageBusy(StageFailed):
    status = 503
    default_code = "overloaded"

    def __init__(
        self, message: str, *, node_id: str, remote: object | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message, node_id=node_id, remote=remote, retry_after_s=retry_after_s)
        self.code = self.default_code


class Unconfirmable(StageFailed):
    """A route's nodes on probation (``failed_nodes``) cannot be checked by any other route: the
    request takes another route (a client sees this only where no route is left at all)."""

    status = 503
    default_code = "unconfirmable"

    def __init__(self, message: str, *, node_id: str, failed_nodes: frozenset[str] = frozenset()) -> None:
        super().__init__(message, node_id=node_id, failed_nodes=failed_nodes, retry_after_s=5)
        self.code = self.default_code


class InternalFailure(GatewayError):
    status = 500
    type = "server_error"
    default_code = "internal_error"


def error_body(err: GatewayError) -> dict[str, Any]:
    """The OpenAI-shaped error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


_ADDRESS = re.compile(
    r"(?:\[[0-9A-Fa-f:.]+\]|\b(?:\d{1,3}\.){3}\d{1,3}|\blocalhost|\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)"
    r"(?::\d{1,5})\b|\b(?:\d{1,3}\.){3}\d{1,3}\b|\brelay:[0-9a-f]+"
)
_NODE_ID = re.compile(r"\b[0-9a-f]{8,}\b")


def scrub(message: str) -> str:
    """``message`` without network addresses (``host:port``, IPv4, ``relay:<id>``) and node ids (runs
    of 8 or more lowercase hex digits; a model fingerprint looks the same and goes too)."""
    return _NODE_ID.sub("<id>", _ADDRESS.sub("<address>", message))


def public_message(err: GatewayError, request_id: str) -> str:
    """What the client reads for ``err`` (see the module docstring)."""
    if isinstance(err, StageBusy):
        text = "Every route tried is full right now; retry later."
    elif isinstance(err, StageFailed):
        text = "A node of the swarm failed while serving this request."
    elif isinstance(err, UpstreamFailed):
        text = (
            "The tracker cannot be reached right now."
            if "tracker" in err.message
            else "The swarm failed to serve this request."
        )
    elif err.status >= 500:
        text = scrub(err.message)
    else:
        return err.message
    return f"{text} (request id {request_id})"


def public_body(err: GatewayError, request_id: str) -> dict[str, Any]:
    """:func:`error_body` with :func:`public_message`."""
    body = error_body(err)
    body["error"]["message"] = public_message(err, request_id)
    return body
