"""MCP servers (docs/contract.md §16): every message is a POST to one endpoint, so the gateway
reads each one and fences the tool calls its rules name, one by one.

A fenced tool call takes the call path every fenced call takes (`gateway.proxy.checks`,
`forward.admit`, `forward.forward`), with three differences: its lease may travel in
`params._meta` instead of headers, its idempotency key and fingerprint come from the tool and
its canonical arguments, and its outcome comes from the JSON-RPC answer, which may be a
stream of server-sent events. Refusals are JSON-RPC errors (the server edge writes them,
`answers_in_jsonrpc`); a replay is the stored answer under the retrying request's id.

Everything else (`initialize`, `tools/list`, notifications, the 2025 revisions' GET streams
and DELETE) passes unfenced, with its stream left open as long as both sides keep it; so
does a tool call no rule fences, unless the upstream says `unmatched_tools: refuse` and no
`unfenced_tools` glob names the tool.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import errors, idempotency
from gateway.core import mcp as jsonrpc
from gateway.core.outcomes import Outcome
from gateway.core.sse import EventTooLarge, SseEvent, SseSplitter
from gateway.proxy import appkeys, checks, headers
from gateway.proxy.flow import Flow
from gateway.proxy.forward import admit, forward, take_turn
from gateway.proxy.relay import (
    Head,
    RelayedResponse,
    read_body,
    response_headers,
    send_unfenced,
    stream_back,
)
from gateway.store.base import Refused, Replayed
from gateway.wire.answer import Answer
from gateway.wire.errors import BrokenAnswer

# An MCP server answers a tool call with a 4xx only when it refused the message before running
# the tool (an unknown or expired session, headers that disagree with the body, invalid
# params); a tool that ran answers 200, `isError` or not. A retry after such an answer is a
# new attempt, never the refusal replayed (the SDK resends a call refused for stale headers).
_REFUSED_UNRUN = frozenset(range(400, 500))
_LEASE_HEADERS = (headers.RESOURCE_HEADER, headers.FENCE_HEADER)


def answers_in_jsonrpc(request: web.Request) -> bool:
    """Whether the gateway's own errors on this request are JSON-RPC errors: a POST to an MCP
    upstream, whose client reads JSON-RPC and not problem+json."""
    if request.method != "POST" or request.path.startswith("/_gateway/"):
        return False
    flow = request.get(appkeys.FLOW)
    if flow is not None:
        return flow.upstream is not None and flow.upstream.mcp
    found = request.app[appkeys.POLICIES].route(request.raw_path.partition("?")[0])
    return found is not None and found[0].mcp


async def handle(request: web.Request, flow: Flow, upstream: Upstream) -> web.StreamResponse:
    """Any request to an MCP upstream."""
    settings = request.app[appkeys.SETTINGS]
    body = await read_body(request, upstream.max_body_bytes, settings.body_timeout_s)
    if request.method != "POST":
        return await _unfenced(request, flow, upstream, body)
    if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
        # a server that inflates it would read a message the gateway could not: fail closed
        raise errors.InvalidRequest(
            "an encoded (compressed) body cannot be read to be fenced: send it as it is"
        )
    parsed = jsonrpc.parse_body(body)
    request[appkeys.JSONRPC_ID] = parsed.id
    message = jsonrpc.read_message(
        parsed,
        headers.single(request.headers, jsonrpc.METHOD_HEADER, errors.InvalidRequest),
        headers.single(request.headers, jsonrpc.NAME_HEADER, errors.InvalidRequest),
    )
    checks.identify_caller(request)  # after the body (docs/contract.md §16, "Order of checks")
    sent = message.stripped_body if message.stripped_body is not None else body
    if isinstance(message, jsonrpc.OtherMessage):
        return await _unfenced(request, flow, upstream, sent)
    if flow.trace is not None:  # traced: the span continues the call's _meta trace (§21)
        flow.trace.continue_from(message.meta)
    treatment = request.app[appkeys.POLICIES].tool_treatment(upstream, message.tool)
    if treatment == "refused":  # no rule governs it: no receipt (docs/contract.md §20)
        raise errors.ToolNotAllowed(
            f"upstream {upstream.name} fences no tool {message.tool!r} and does not list it "
            "in unfenced_tools (unmatched_tools: refuse)"
        )
    if treatment == "unfenced":
        return await _unfenced(request, flow, upstream, sent)
    return await _fenced(request, flow, upstream, message, sent)


# -- unfenced messages -----------------------------------------------------------------------


async def _unfenced(
    request: web.Request, flow: Flow, upstream: Upstream, body: bytes
) -> web.StreamResponse:
    """Passed on without admission or receipt, the fencing headers stripped. `timeout_s`
    bounds the wait for the answer's head only: a stream stays open until a side closes it."""
    answer, _ = await send_unfenced(request, flow, upstream, body)
    async with answer:
        flow.status = answer.status
        response = _relayed(answer, {headers.REQUEST_ID_HEADER: flow.request_id})
        try:
            await response.prepare(request)
        except ConnectionError:
            return response
        # From here on the answer goes at the tool's pace, as long as both sides keep it
        # open: GATEWAY_MAX_INFLIGHT no longer counts it (gateway.proxy.slot).
        slot = request.get(appkeys.SLOT)
        if slot is not None:
            slot.release(flow.upstream_s, asyncio.get_running_loop().time())
        await _relay_rest(request, response, answer, b"")
    return response


def _relayed(answer: Answer, extra: dict[str, str]) -> web.StreamResponse:
    """A response with the upstream's status and headers (hop-by-hop removed) and `extra`."""
    response = RelayedResponse(status=answer.status)
    for name, value in response_headers(answer):
        response.headers.add(name, value)
    for name, value in extra.items():
        response.headers[name] = value
    return response


async def _relay_rest(
    request: web.Request,
    response: web.StreamResponse,
    answer: Answer,
    first: bytes,
    deadline: float | None = None,
) -> None:
    """`first`, then the rest of the answer as it comes, until either side ends it (or
    `deadline`, loop time, passes: then the answer simply ends)."""
    try:
        if first:
            await response.write(first)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                while chunk := await answer.read():
                    await response.write(chunk)
        await response.write_eof()
        return
    except ConnectionError:
        pass  # the client left: an unfenced stream may close; a tool call's outcome is kept
    except BrokenAnswer:
        pass  # the tool's side broke: the client can only learn it from a cut connection
    if request.transport is not None:
        request.transport.abort()


# -- fenced tool calls -----------------------------------------------------------------------


async def _fenced(
    request: web.Request, flow: Flow, upstream: Upstream, call: jsonrpc.ToolCall, body: bytes
) -> web.StreamResponse:
    app = request.app
    flow.mcp = jsonrpc.McpRecord(call.tool, call.id)
    lease = _lease_of(request, call)
    try:
        rule = checks.rule_of(request, flow, upstream, lease, call.tool)
        flow.fence = headers.parse_fence(lease)
        flow.owner = headers.parse_owner(lease)
        client_key = headers.parse_idempotency_key(request.headers)
        if client_key is None and rule.idempotency.key == "require":
            raise errors.MissingIdempotencyKey("this resource requires an Idempotency-Key")
        checks.check_signature(request, rule, flow, lease)
    except errors.GatewayError as error:
        await checks.keep_rejection(request, flow, error, lease)
        raise
    resource = flow.resource or ""
    key = client_key or (
        idempotency.random_key()
        if rule.idempotency.key == "random"
        else jsonrpc.derived_key(resource, call)
    )
    admission = flow.admission(
        rule,
        key,
        jsonrpc.fingerprint(flow.request_target, call),
        rule.idempotency.retry_statuses | _REFUSED_UNRUN,
        app[appkeys.CLIENTS] is not None,
    )
    async with app[appkeys.LANES].join(resource) as place:
        try:
            await take_turn(rule, resource, place)
        except errors.GatewayError as error:
            await checks.keep_rejection(request, flow, error, lease)
            raise
        if request.transport is None or request.transport.is_closing():
            raise errors.InvalidRequest("the client went away before admission")
        result = await admit(app, admission, place)
        if isinstance(result, Refused):
            raise checks.error_for(result)
        told = flow.answer_headers(result.receipt_id)
        if isinstance(result, Replayed):
            return await _replay(request, flow, call, result, told)
        flow.admitted = result
        reader = _AnswerReader(request, call, rule, upstream, told)
        async with forward(app, flow, place, body, request, reader.read) as exchange:
            if not exchange.recorded:
                told["X-Receipt-Outcome"] = "unrecorded"
            if exchange.head is None:
                failed = exchange.error or errors.GatewayError()
                failed.headers.update(told)
                raise failed
            if reader.streaming is not None:
                return await reader.finish(exchange.head, exchange.answer, exchange.deadline)
            if reader.failure is not None:
                reader.failure.headers.update(told)
                raise reader.failure
            response, _ = await stream_back(
                request, exchange.head, exchange.answer, told, exchange.deadline
            )
        return response


def _lease_of(request: web.Request, call: jsonrpc.ToolCall) -> CIMultiDictProxy[str]:
    """The headers alone count when they carry a lease; else `params._meta`'s, if any."""
    if call.lease_entry is None or any(name in request.headers for name in _LEASE_HEADERS):
        return request.headers
    return CIMultiDictProxy(CIMultiDict(jsonrpc.lease_headers(call.lease_entry)))


async def _replay(
    request: web.Request,
    flow: Flow,
    call: jsonrpc.ToolCall,
    replayed: Replayed,
    told: dict[str, str],
) -> web.StreamResponse:
    """The stored answer, its JSON-RPC id the retrying request's."""
    flow.replayed = True
    body = jsonrpc.with_id(replayed.body, call.id) or replayed.body
    kept = [(k, v) for k, v in replayed.headers if k.lower() != "content-length"]
    head = Head(
        replayed.status,
        [*kept, ("Content-Length", str(len(body)))],
        body,
        complete=True,
        broken=False,
    )
    response, _ = await stream_back(
        request,
        head,
        None,
        {"Idempotent-Replayed": "true", **told},
        deadline=asyncio.get_running_loop().time() + request.app[appkeys.SETTINGS].body_timeout_s,
    )
    return response


# -- the answer of a fenced tool call --------------------------------------------------------


@dataclass(slots=True)
class _AnswerReader:
    """Reads a tool call's answer up to the JSON-RPC response that decides its outcome
    (`forward`'s `read_answer`).

    A JSON answer is read whole (within `max_body_bytes`) before anything goes back. An SSE
    answer is relayed event by event as it comes; the event that answers the call is held
    until its outcome is recorded, then `finish` passes it and the rest on. The stream is
    read on when the client leaves: MCP takes a closed stream for a cancellation, and an
    admitted call is not cancelled.
    """

    request: web.Request
    call: jsonrpc.ToolCall
    rule: ResourceRule
    upstream: Upstream
    told: dict[str, str]
    streaming: web.StreamResponse | None = None  # the client's SSE response, once started
    failure: errors.GatewayError | None = None  # a JSON answer that did not arrive whole
    client_gone: bool = False
    held: list[bytes] = field(default_factory=list)  # the answering event and what followed

    async def read(
        self, answer: Answer, deadline: float, forwarded_at: float
    ) -> tuple[Head, Outcome]:
        content_type = answer.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if 200 <= answer.status < 300 and content_type == "text/event-stream":
            return await self._read_events(answer, deadline, forwarded_at)
        return await self._read_json(answer, deadline, forwarded_at)

    async def _read_json(
        self, answer: Answer, deadline: float, forwarded_at: float
    ) -> tuple[Head, Outcome]:
        limit = max(self.upstream.max_body_bytes, self.rule.idempotency.replay_max_bytes)
        chunks, size = [], 0
        lost: errors.GatewayError | None = None
        try:
            while size <= limit and (chunk := await answer.read(limit + 1 - size, deadline)):
                chunks.append(chunk)
                size += len(chunk)
        except TimeoutError:
            lost = errors.UpstreamTimeout(
                f"upstream {self.upstream.name} did not answer within "
                f"{self.upstream.timeout_s}s; the tool call may have been applied"
            )
        except BrokenAnswer as exc:
            lost = errors.UpstreamOutcomeUnknown(
                f"upstream {self.upstream.name} broke its answer off ({type(exc).__name__}); "
                "the tool call may have been applied"
            )
        body = b"".join(chunks)
        kept = response_headers(answer)
        complete = lost is None and answer.at_eof()
        head = Head(answer.status, kept, body, complete=complete, broken=False)
        if lost is not None:
            self.failure = lost
            return head, Outcome("outcome_unknown", error=lost.code, forwarded_at=forwarded_at)
        # kept for replay only when whole and within replay_max_bytes (docs/contract.md §4)
        fits = complete and len(body) <= self.rule.idempotency.replay_max_bytes
        stored = (kept, body) if fits else None
        if not 200 <= answer.status < 300:  # the server refused it: docs/contract.md §3
            return head, Outcome(
                "failed", http_status=answer.status, forwarded_at=forwarded_at, response=stored
            )
        outcome = (
            jsonrpc.answer_outcome(jsonrpc.parse_json(body), self.call.id) if complete else None
        )
        if outcome is None:  # 2xx, but no readable answer to this call: it may have acted
            return head, Outcome(
                "outcome_unknown",
                http_status=answer.status,
                error="no_jsonrpc_answer",
                forwarded_at=forwarded_at,
            )
        return head, Outcome(
            outcome, http_status=answer.status, forwarded_at=forwarded_at, response=stored
        )

    async def _read_events(
        self, answer: Answer, deadline: float, forwarded_at: float
    ) -> tuple[Head, Outcome]:
        kept = response_headers(answer)
        self.streaming = response = _relayed(answer, self.told)
        try:
            await response.prepare(self.request)
        except ConnectionError:
            self.client_gone = True
        splitter = SseSplitter(max_event_bytes=self.upstream.max_body_bytes)
        error = "response_incomplete"
        # while the client is slow to read, the tool is not read either: that time is the
        # client's, not counted against the tool's timeout_s, up to the grace the contract
        # gives a call beyond it before it may be reconciled (docs/contract.md §7, §16)
        latest = deadline + self.request.app[appkeys.SETTINGS].reconcile_grace_s
        try:
            ended = False
            while not ended:
                chunk = await answer.read(deadline=deadline)
                ended = not chunk
                events = splitter.feed(chunk) if chunk else splitter.end()
                for index, event in enumerate(events):
                    outcome = self._outcome_of(event)
                    if outcome is not None:
                        self.held = [e.raw for e in events[index:]] + [splitter.rest()]
                        stored = self._stored(event)
                        head = Head(answer.status, kept, b"", complete=False, broken=False)
                        return head, Outcome(
                            outcome,
                            http_status=answer.status,
                            forwarded_at=forwarded_at,
                            response=stored,
                        )
                    held = await self._pass_on(event.raw, latest)
                    deadline = min(deadline + held, latest)
        except TimeoutError:
            error = "upstream_timeout"
        except BrokenAnswer:
            error = "response_incomplete"
        except EventTooLarge:
            error = "event_too_large"
        # the stream ended or broke before the call was answered: it may have acted
        head = Head(answer.status, kept, b"", complete=False, broken=True)
        return head, Outcome(
            "outcome_unknown", http_status=answer.status, error=error, forwarded_at=forwarded_at
        )

    def _outcome_of(self, event: SseEvent) -> jsonrpc.AnswerOutcome | None:
        if event.data is None or event.event not in (None, "message"):
            return None
        return jsonrpc.answer_outcome(jsonrpc.parse_json(event.data), self.call.id)

    def _stored(self, event: SseEvent) -> tuple[list[tuple[str, str]], bytes] | None:
        """The answering event's JSON-RPC response, kept for replay as a JSON answer."""
        body = (event.data or "").encode()
        if len(body) > self.rule.idempotency.replay_max_bytes:
            return None
        return [("Content-Type", "application/json")], body

    async def _pass_on(self, raw: bytes, deadline: float) -> float:
        """Relay an event that does not answer the call; how long the client held it up.
        A client still not reading at `deadline` is cut once the outcome is recorded, as
        one that left: the tool's stream is read on without it."""
        if self.client_gone or self.streaming is None:
            return 0.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout_at(deadline):
                await self.streaming.write(raw)
        except (ConnectionError, TimeoutError):
            self.client_gone = True  # read on: the outcome is still to be recorded
        return loop.time() - started

    async def finish(
        self, head: Head, answer: Answer | None, deadline: float
    ) -> web.StreamResponse:
        """After the outcome is recorded: the answering event, then what follows it until the
        server ends the stream, as it should once it has answered (by `timeout_s` from when
        the call was sent at the latest: a stream left open must not hold the resource's
        place)."""
        response = self.streaming
        if response is None:
            raise ValueError("finish follows an SSE answer only")
        if head.broken or answer is None or self.client_gone:
            if self.request.transport is not None:
                self.request.transport.abort()  # a cut stream is all the client can be told
            return response
        await _relay_rest(self.request, response, answer, b"".join(self.held), deadline)
        return response
