"""The flow: one request's way through the gateway, as one object.

A flow is made when a request is routed and filled in as the call path learns: the client,
the resource and fence it presented, the rule that governs it, what admission decided, the
receipt that records it, and the status the tool answered. Proxied calls and the sweeper's
cleanup calls travel the same steps as flows (`gateway.proxy.forward`); the server edge reads
the flow for the problem document, the metrics and the log line, so no step keeps facts of
its own on the side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.config.policy import ResourceRule, Upstream
from gateway.core.mcp import McpRecord
from gateway.core.receipts import Kind
from gateway.proxy import headers
from gateway.store.base import Admitted, Call, Rejection

if TYPE_CHECKING:
    from gateway.proxy.traces import CallTrace


@dataclass(slots=True, eq=False)
class Flow:
    request_id: str
    upstream: Upstream | None = None
    method: str = ""
    rest: str = ""  # after the mount, with the query: what the tool is sent
    request_target: str = ""  # path and query as received: part of the fingerprint
    client: str | None = None
    resource: str | None = None  # as presented, once readable
    fence: int | None = None  # as presented, once readable
    owner: str | None = None  # X-Lease-Owner as presented
    rule: ResourceRule | None = None
    call: Call | None = None  # what admission was asked
    admitted: Admitted | None = None  # what admission said, when it let the call in
    status: int | None = None  # what the tool answered
    upstream_s: float = 0.0  # how long the tool took to answer (to its head): not the gateway's
    replayed: bool = False  # answered from a stored answer
    kind: Kind = "call"  # "session": a WebSocket upgrade (docs/contract.md §15)
    session: dict[str, Any] = field(default_factory=dict)  # a session's end, for its log line
    mcp: McpRecord | None = None  # an MCP tool call's tool and JSON-RPC id (§16)
    outcome: str | None = None  # the receipt's status once the outcome is known
    # docs/contract.md §21: the call's span when tracing is on (None when off), and the trace
    # id the receipt and the log line carry once a sampled span started
    trace: CallTrace | None = None
    trace_id: str | None = None

    @property
    def receipt_id(self) -> str | None:
        return self.admitted.receipt_id if self.admitted is not None else None

    def rejection(self, code: str, http_status: int) -> Rejection | None:
        """The `rejected` receipt of a refusal before admission: kept only once resource and
        fence are readable (docs/contract.md §3, "Rejected receipts")."""
        if self.resource is None or self.fence is None or self.upstream is None:
            return None
        return Rejection(**self._asked(), code=code, http_status=http_status)

    def admission(
        self,
        rule: ResourceRule,
        key: str | None,
        fingerprint: str | None,
        retry_statuses: frozenset[int],
        clients_configured: bool,
    ) -> Call:
        """What admission is asked for this flow, once its resource and fence are read and
        `rule` governs it; kept as `call`. A session is never serial: it holds no turn."""
        self.call = Call(
            **self._asked(),
            issuer=rule.lease.issuer,
            idempotency_key=key,
            fingerprint=fingerprint,
            retry_statuses=retry_statuses,
            retention_s=rule.idempotency.retention_s,
            clients_configured=clients_configured,
            serial=self.kind == "call" and rule.concurrency == "serial",
        )
        return self.call

    def _asked(self) -> dict[str, Any]:
        """What a rejected receipt and an admission both record of the call asked for."""
        assert self.resource is not None and self.fence is not None and self.upstream is not None
        return {
            "resource": self.resource,
            "fence": self.fence,
            "owner": self.owner,
            "client": self.client,
            "upstream": self.upstream.name,
            "method": self.method,
            "path": self.rest,
            "kind": self.kind,
            "mcp": self.mcp,
            "trace_id": self.trace_id,
        }

    def answer_headers(self, receipt_id: str) -> dict[str, str]:
        """What the client is told about its admitted call, answered or replayed
        (docs/contract.md §3, "Answered to the client")."""
        assert self.call is not None and self.call.idempotency_key is not None
        return {
            headers.RECEIPT_HEADER: receipt_id,
            headers.REQUEST_ID_HEADER: self.request_id,
            headers.IDEMPOTENCY_HEADER: self.call.idempotency_key,
            headers.FENCE_HEADER: str(self.call.fence),
        }

    def log_fields(self) -> dict[str, object]:
        return {
            "upstream": self.upstream.name if self.upstream else None,
            "client": self.client,
            "resource": self.resource,
            "fence": self.fence,
            "receipt_id": self.receipt_id,
            "status": self.status,
            "kind": self.kind,
            "session_end": self.session,
            "trace_id": self.trace_id,
        }
