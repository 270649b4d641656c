"""Every error the gateway answers with, one class per SPEC section 5 code.

    GatewayError                      status, code, title; rendered as problem+json by middleware
    ├── InvalidRequest                400 invalid_request
    ├── InvalidResource               400 invalid_resource
    ├── InvalidFence                  400 invalid_fence
    ├── InvalidIdempotencyKey         400 invalid_idempotency_key
    ├── Unauthenticated               401 unauthenticated
    ├── Forbidden                     403 forbidden
    ├── ResourceNotAllowed            403 resource_not_allowed
    ├── FenceNotIssued                403 fence_not_issued
    ├── NotLeaseHolder                403 not_lease_holder
    ├── BadFenceSignature             403 bad_fence_signature
    ├── NotFound                      404 not_found
    ├── NoRoute                       404 no_route
    ├── MethodNotAllowed              405 method_not_allowed
    ├── RequestTimeout                408 request_timeout
    ├── StaleFence                    409 stale_fence
    ├── LeaseExpired                  409 lease_expired
    ├── OwnerMismatch                 409 owner_mismatch
    ├── LeaseHeld                     409 lease_held            (+ holder, expires_at)
    ├── LeaseLost                     409 lease_lost
    ├── IdempotencyInFlight           409 idempotency_in_flight (+ receipt_id)
    ├── OutcomeUnknown                409 outcome_unknown       (+ receipt_id)
    ├── AlreadyCompleted              409 already_completed     (+ receipt_id)
    ├── NotReconcilable               409 not_reconcilable
    ├── BodyTooLarge                  413 body_too_large
    ├── IdempotencyKeyReused          422 idempotency_key_reused
    ├── MissingResource               428 missing_resource
    ├── MissingFence                  428 missing_fence
    ├── MissingIdempotencyKey         428 missing_idempotency_key
    ├── HeadersTooLarge               431 headers_too_large
    ├── UpgradeNotSupported           501 upgrade_not_supported
    ├── UpstreamUnreachable           502 upstream_unreachable
    ├── UpstreamOutcomeUnknown        502 upstream_outcome_unknown
    ├── ResourceBusy                  503 resource_busy
    ├── StoreUnavailable              503 store_unavailable
    └── UpstreamTimeout               504 upstream_timeout

Errors carry only what the client may see: never the current fence or a holder's token.
"""

from __future__ import annotations

from typing import Any, ClassVar


class GatewayError(Exception):
    """An error the gateway answers itself; `extra` fields join the problem document."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    title: ClassVar[str] = "Internal error"

    def __init__(self, detail: str | None = None, *, retry_after: int | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.retry_after = retry_after
        self.headers = headers or {}  # e.g. X-Receipt-Id of the call this error answers
        self.extra = extra


def _error(name: str, status: int, code: str, title: str) -> type[GatewayError]:
    cls = type(name, (GatewayError,), {"status": status, "code": code, "title": title,
                                        "__doc__": f"{status} {code}: {title}."})
    cls.__module__ = __name__
    return cls


InvalidRequest = _error("InvalidRequest", 400, "invalid_request", "Invalid request")
InvalidResource = _error("InvalidResource", 400, "invalid_resource", "Invalid resource")
InvalidFence = _error("InvalidFence", 400, "invalid_fence", "Invalid fencing token")
InvalidIdempotencyKey = _error("InvalidIdempotencyKey", 400, "invalid_idempotency_key",
                               "Invalid idempotency key")
Unauthenticated = _error("Unauthenticated", 401, "unauthenticated", "Unauthenticated")
Forbidden = _error("Forbidden", 403, "forbidden", "Forbidden")
ResourceNotAllowed = _error("ResourceNotAllowed", 403, "resource_not_allowed",
                            "Resource not allowed")
FenceNotIssued = _error("FenceNotIssued", 403, "fence_not_issued", "Fence was never issued")
NotLeaseHolder = _error("NotLeaseHolder", 403, "not_lease_holder", "Not the lease holder")
BadFenceSignature = _error("BadFenceSignature", 403, "bad_fence_signature",
                           "Bad fence signature")
NotFound = _error("NotFound", 404, "not_found", "Not found")
NoRoute = _error("NoRoute", 404, "no_route", "No route")
MethodNotAllowed = _error("MethodNotAllowed", 405, "method_not_allowed", "Method not allowed")
RequestTimeout = _error("RequestTimeout", 408, "request_timeout", "Request timeout")
StaleFence = _error("StaleFence", 409, "stale_fence", "Stale fencing token")
LeaseExpired = _error("LeaseExpired", 409, "lease_expired", "Lease expired")
OwnerMismatch = _error("OwnerMismatch", 409, "owner_mismatch", "Owner mismatch")
LeaseHeld = _error("LeaseHeld", 409, "lease_held", "Lease held")
LeaseLost = _error("LeaseLost", 409, "lease_lost", "Lease lost")
IdempotencyInFlight = _error("IdempotencyInFlight", 409, "idempotency_in_flight",
                             "Idempotency key in flight")
OutcomeUnknown = _error("OutcomeUnknown", 409, "outcome_unknown", "Outcome unknown")
AlreadyCompleted = _error("AlreadyCompleted", 409, "already_completed", "Already completed")
NotReconcilable = _error("NotReconcilable", 409, "not_reconcilable", "Not reconcilable")
BodyTooLarge = _error("BodyTooLarge", 413, "body_too_large", "Body too large")
IdempotencyKeyReused = _error("IdempotencyKeyReused", 422, "idempotency_key_reused",
                              "Idempotency key reused")
MissingResource = _error("MissingResource", 428, "missing_resource", "Missing resource")
MissingFence = _error("MissingFence", 428, "missing_fence", "Missing fencing token")
MissingIdempotencyKey = _error("MissingIdempotencyKey", 428, "missing_idempotency_key",
                               "Missing idempotency key")
HeadersTooLarge = _error("HeadersTooLarge", 431, "headers_too_large", "Headers too large")
UpgradeNotSupported = _error("UpgradeNotSupported", 501, "upgrade_not_supported",
                             "Upgrade not supported")
UpstreamUnreachable = _error("UpstreamUnreachable", 502, "upstream_unreachable",
                             "Upstream unreachable")
UpstreamOutcomeUnknown = _error("UpstreamOutcomeUnknown", 502, "upstream_outcome_unknown",
                                "Upstream outcome unknown")
ResourceBusy = _error("ResourceBusy", 503, "resource_busy", "Resource busy")
StoreUnavailable = _error("StoreUnavailable", 503, "store_unavailable", "Store unavailable")
UpstreamTimeout = _error("UpstreamTimeout", 504, "upstream_timeout", "Upstream timeout")

BY_CODE: dict[str, type[GatewayError]] = {
    cls.code: cls for cls in GatewayError.__subclasses__()
}


def from_code(code: str, detail: str | None = None, **extra: Any) -> GatewayError:
    """The error for a reject code decided by the store or the pure admission rules."""
    return BY_CODE[code](detail, **extra)
