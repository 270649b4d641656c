"""Every error the gateway answers with, one class per docs/contract.md §5 code.

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
    ├── ToolNotAllowed                403 tool_not_allowed
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
    ├── Overloaded                    503 overloaded
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

    def __init__(
        self,
        detail: str | None = None,
        *,
        retry_after: int | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.retry_after = retry_after
        self.headers = headers or {}  # e.g. X-Receipt-Id of the call this error answers
        self.extra = extra

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__doc__ is None:
            cls.__doc__ = f"{cls.status} {cls.code}: {cls.title}."


class InvalidRequest(GatewayError):
    status, code, title = 400, "invalid_request", "Invalid request"


class InvalidResource(GatewayError):
    status, code, title = 400, "invalid_resource", "Invalid resource"


class InvalidFence(GatewayError):
    status, code, title = 400, "invalid_fence", "Invalid fencing token"


class InvalidIdempotencyKey(GatewayError):
    status, code, title = 400, "invalid_idempotency_key", "Invalid idempotency key"


class Unauthenticated(GatewayError):
    status, code, title = 401, "unauthenticated", "Unauthenticated"


class Forbidden(GatewayError):
    status, code, title = 403, "forbidden", "Forbidden"


class ResourceNotAllowed(GatewayError):
    status, code, title = 403, "resource_not_allowed", "Resource not allowed"


class FenceNotIssued(GatewayError):
    status, code, title = 403, "fence_not_issued", "Fence was never issued"


class NotLeaseHolder(GatewayError):
    status, code, title = 403, "not_lease_holder", "Not the lease holder"


class BadFenceSignature(GatewayError):
    status, code, title = 403, "bad_fence_signature", "Bad fence signature"


class ToolNotAllowed(GatewayError):
    status, code, title = 403, "tool_not_allowed", "Tool not allowed"


class NotFound(GatewayError):
    status, code, title = 404, "not_found", "Not found"


class NoRoute(GatewayError):
    status, code, title = 404, "no_route", "No route"


class MethodNotAllowed(GatewayError):
    status, code, title = 405, "method_not_allowed", "Method not allowed"


class RequestTimeout(GatewayError):
    status, code, title = 408, "request_timeout", "Request timeout"


class StaleFence(GatewayError):
    status, code, title = 409, "stale_fence", "Stale fencing token"


class LeaseExpired(GatewayError):
    status, code, title = 409, "lease_expired", "Lease expired"


class OwnerMismatch(GatewayError):
    status, code, title = 409, "owner_mismatch", "Owner mismatch"


class LeaseHeld(GatewayError):
    status, code, title = 409, "lease_held", "Lease held"


class LeaseLost(GatewayError):
    status, code, title = 409, "lease_lost", "Lease lost"


class IdempotencyInFlight(GatewayError):
    status, code, title = 409, "idempotency_in_flight", "Idempotency key in flight"


class OutcomeUnknown(GatewayError):
    status, code, title = 409, "outcome_unknown", "Outcome unknown"


class AlreadyCompleted(GatewayError):
    status, code, title = 409, "already_completed", "Already completed"


class NotReconcilable(GatewayError):
    status, code, title = 409, "not_reconcilable", "Not reconcilable"


class BodyTooLarge(GatewayError):
    status, code, title = 413, "body_too_large", "Body too large"


class IdempotencyKeyReused(GatewayError):
    status, code, title = 422, "idempotency_key_reused", "Idempotency key reused"


class MissingResource(GatewayError):
    status, code, title = 428, "missing_resource", "Missing resource"


class MissingFence(GatewayError):
    status, code, title = 428, "missing_fence", "Missing fencing token"


class MissingIdempotencyKey(GatewayError):
    status, code, title = 428, "missing_idempotency_key", "Missing idempotency key"


class HeadersTooLarge(GatewayError):
    status, code, title = 431, "headers_too_large", "Headers too large"


class UpgradeNotSupported(GatewayError):
    status, code, title = 501, "upgrade_not_supported", "Upgrade not supported"


class UpstreamUnreachable(GatewayError):
    status, code, title = 502, "upstream_unreachable", "Upstream unreachable"


class UpstreamOutcomeUnknown(GatewayError):
    status, code, title = 502, "upstream_outcome_unknown", "Upstream outcome unknown"


class ResourceBusy(GatewayError):
    status, code, title = 503, "resource_busy", "Resource busy"


class StoreUnavailable(GatewayError):
    status, code, title = 503, "store_unavailable", "Store unavailable"


class Overloaded(GatewayError):
    status, code, title = 503, "overloaded", "Overloaded"


class UpstreamTimeout(GatewayError):
    status, code, title = 504, "upstream_timeout", "Upstream timeout"


BY_CODE: dict[str, type[GatewayError]] = {cls.code: cls for cls in GatewayError.__subclasses__()}


def from_code(code: str, detail: str | None = None, **extra: Any) -> GatewayError:
    """The error for a reject code decided by the store or the pure admission rules."""
    return BY_CODE[code](detail, **extra)
