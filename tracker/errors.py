"""The tracker's exception tree, in one place.

::

    TrackerError                 base; carries ``status_hint`` (an HTTP status) and a stable ``code``
    ├── BadRequest               400  malformed JSON, wrong types, values out of range
    │   └── SignatureRefused     401  forged signature, stale timestamp, replayed nonce, key/node mismatch
    │       │                         (raised as proto.signing.SignatureError and mapped to this)
    │       └── GatewaySignatureRequired 401  an unsigned route request to a tracker with registered gateways
    ├── Forbidden                403  the signer may not do this (one-line reason)
    │   ├── Banned               403  a banned node key, or a new key from a banned host
    │   ├── UnregisteredGateway  403  reports from a gateway the operator did not register
    │   └── NameBound            403  a registered model name announced with another fingerprint
    ├── NotFound                 404
    │   ├── UnknownModel         404  no model with that fingerprint or name
    │   └── UnknownNode          404  heartbeat from a node that never announced ("announce first")
    ├── PayloadTooLarge          413  request body over the configured limit
    ├── Conflict                 409  e.g. announce for a model whose layer count disagrees with the registry
    │   └── NoFittingSpan        409  no span of the model fits the capacity a joining node gave
    ├── RateLimited              429  a source address or signing key over its quota (``Retry-After``)
    └── StorageUnavailable       503  the database cannot be reached right now (retry later)

Pure module: imported by the routing and placement functions, so it imports
nothing but the standard library. The HTTP layer (``tracker.app``) maps these to
responses in exactly one place.
"""

from __future__ import annotations


class TrackerError(Exception):
    status_hint: int = 500
    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(TrackerError):
    status_hint = 400
    code = "bad_request"


class SignatureRefused(BadRequest):
    status_hint = 401
    code = "signature_refused"


class GatewaySignatureRequired(SignatureRefused):
    code = "gateway_signature_required"


class Forbidden(TrackerError):
    status_hint = 403
    code = "forbidden"


class Banned(Forbidden):
    code = "banned"


class UnregisteredGateway(Forbidden):
    code = "unregistered_gateway"


class NameBound(Forbidden):
    code = "model_name_bound"


class NotFound(TrackerError):
    status_hint = 404
    code = "not_found"


class UnknownModel(NotFound, LookupError):
    code = "unknown_model"


class UnknownNode(NotFound):
    code = "unknown_node"


class PayloadTooLarge(TrackerError):
    status_hint = 413
    code = "payload_too_large"


class Conflict(TrackerError):
    status_hint = 409
    code = "conflict"


class NoFittingSpan(Conflict):
    code = "no_fitting_span"


class RateLimited(TrackerError):
    status_hint = 429
    code = "rate_limited"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StorageUnavailable(TrackerError):
    status_hint = 503
    code = "storage_unavailable"
