"""Moving bytes: the request body in, the upstream's headers out, the response back.

Both fenced and plain calls use these, so there is one way to read a body, one way to build
the headers the tool receives, and one way to stream an answer back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from dataclasses import dataclass
from itertools import chain

import aiohttp
from aiohttp import hdrs, web
from aiohttp.streams import StreamReader
from multidict import CIMultiDict

from gateway.config.policy import ResourceRule, Upstream
from gateway.core import errors
from gateway.core.outcomes import Outcome, outcome_of_answer
from gateway.proxy import appkeys
from gateway.proxy.flow import Flow
from gateway.proxy.headers import (
    FENCE_HEADER,
    GATEWAY_OWNED,
    RECEIPT_HEADER,
    REQUEST_ID_HEADER,
    RESOURCE_HEADER,
    strip,
)
from gateway.proxy.upstream import UpstreamFailure
from gateway.wire.answer import Answer
from gateway.wire.errors import BrokenAnswer
from gateway.wire.incoming import Incoming

# Client headers never passed on for an unfenced call: the gateway sets its own request id.
_UNFENCED_DROP = frozenset({REQUEST_ID_HEADER.lower()})


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole request body as received (de-chunked, never decompressed), within limits."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise errors.BodyTooLarge(f"the body of {declared} bytes is over the limit of {limit}")
    content = request.content
    try:
        if content.is_eof():  # all in already, as nearly every call's: nothing to wait for
            body = content.read_nowait()
        else:
            async with asyncio.timeout(timeout_s):
                body = await _read_arriving(content, limit)
    except TimeoutError:
        raise errors.RequestTimeout(f"the body did not arrive within {timeout_s}s") from None
    except (aiohttp.ClientPayloadError, web.HTTPException, ConnectionError) as exc:
        raise errors.InvalidRequest(f"the request body broke off: {exc}") from None
    if len(body) > limit:
        raise errors.BodyTooLarge(f"the body is over the limit of {limit} bytes")
    return body


async def _read_arriving(content: StreamReader, limit: int) -> bytes:
    """A body still arriving, read until its end or until it is over `limit` (the rest is
    not read into memory)."""
    chunks, size = [], 0
    async for chunk in content.iter_any():
        size += len(chunk)
        chunks.append(chunk)
        if size > limit:
            break
    return b"".join(chunks)


def framed_body(request: web.Request, body: bytes) -> bytes | None:
    """Send a body only when the client framed one: a bare GET stays without Content-Length."""
    framed = request.content_length is not None or "Transfer-Encoding" in request.headers
    return body if framed or body else None


async def send_unfenced(
    request: web.Request, flow: Flow, upstream: Upstream, body: bytes
) -> tuple[Answer, float]:
    """Send a call that takes no admission and leaves no receipt once, the fencing headers
    stripped: its answer with the head read, and the deadline (loop time) `timeout_s` gives
    it. The tool's time to that head is `flow.upstream_s`, not the gateway's."""
    app = request.app
    sent = upstream_headers(
        request,
        upstream,
        _UNFENCED_DROP,
        {REQUEST_ID_HEADER: flow.request_id},
        app[appkeys.SETTINGS].trusted_networks,
    )
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    deadline = sent_at + upstream.timeout_s
    try:
        answer = await app[appkeys.UPSTREAMS].send(
            upstream, request.method, flow.rest, sent, framed_body(request, body), deadline
        )
    except UpstreamFailure as failure:
        raise failure.error from None
    finally:
        flow.upstream_s = loop.time() - sent_at
    return answer, deadline


def admitted_headers(
    rule: ResourceRule,
    resource: str,
    fence: int,
    key: str | None,
    receipt_id: str,
    request_id: str,
) -> dict[str, str]:
    """What the gateway itself tells the tool about an admitted call (a session's upgrade
    has no key)."""
    sent = {} if key is None else {rule.idempotency.upstream_header: key}
    sent[RECEIPT_HEADER] = receipt_id
    sent[REQUEST_ID_HEADER] = request_id
    if rule.forward_fence_headers:
        sent[RESOURCE_HEADER] = resource
        sent[FENCE_HEADER] = str(fence)
    return sent


def upstream_headers(
    request: web.Request | None,
    upstream: Upstream,
    drop: frozenset[str],
    gateway_set: dict[str, str],
    trusted: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = (),
) -> CIMultiDict[str]:
    """The headers the tool receives (docs/contract.md §3, "Forwarded upstream"), in the
    contract's order.

    `request` is None for the calls the gateway makes itself (sweeper cleanups, probes):
    no client headers, no X-Forwarded-*.
    """
    headers = CIMultiDict[str](Host=upstream.authority)  # first, as RFC 9112 §3.2 asks
    if request is not None:
        headers.extend(strip(request.headers, GATEWAY_OWNED, drop))
    for name, value in (*gateway_set.items(), *upstream.inject_headers.items()):
        headers[name] = value  # replaces any value of that name from the client
    if request is None:
        return headers
    peer = request.remote or ""
    if is_trusted(peer, trusted):
        forwarded_for = [*request.headers.getall("X-Forwarded-For", []), peer]
        headers["X-Forwarded-For"] = ", ".join(forwarded_for)
        headers.setdefault("X-Forwarded-Proto", request.scheme)
    else:
        headers["X-Forwarded-For"] = peer
        headers["X-Forwarded-Proto"] = request.scheme
    return headers


def is_trusted(
    peer: str,
    trusted: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
) -> bool:
    if not trusted or not peer:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in network for network in trusted)


def response_headers(upstream: Answer) -> list[tuple[str, str]]:
    """The upstream's answer headers without the hop-by-hop ones."""
    return strip(upstream.headers)


@dataclass(slots=True)
class Head:
    """An upstream answer's status and first bytes, read before the outcome is recorded."""

    status: int
    headers: list[tuple[str, str]]
    prefix: bytes
    complete: bool  # the body ended within the prefix
    broken: bool  # the body broke while the prefix was read

    def outcome(self, forwarded_at: float) -> Outcome:
        """docs/contract.md §3's outcome of an answer; a complete one is kept for replay whole."""
        return Outcome(
            outcome_of_answer(self.status),
            http_status=self.status,
            forwarded_at=forwarded_at,
            response=(self.headers, self.prefix) if self.complete else None,
            error="response_incomplete" if self.broken else None,
        )


STREAMED = -1  # `read_head`'s keep_max for an answer kept for nothing: no byte waited for


async def read_head(response: Answer, keep_max: int, deadline: float) -> Head:
    """Read up to `keep_max` + 1 body bytes: an answer that fits is kept for replay whole.
    `STREAMED` (-1): none, for an answer that is only relayed, whose head need not wait for a
    byte of its body."""
    chunks, size, broken = [], 0, False
    try:
        while size <= keep_max:
            chunk = await response.read(keep_max + 1 - size, deadline)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except (TimeoutError, BrokenAnswer):
        broken = True
    complete = not broken and response.at_eof()
    return Head(response.status, response_headers(response), b"".join(chunks), complete, broken)


def _never_waits(request: web.Request, response: web.StreamResponse, body: bytes) -> bool:
    """Whether writing the whole of an answer cannot wait for the client: a write waits only
    when the connection's writing is paused, or this one pauses it (its buffer then holds
    more than the transport's high-water mark), or it is over aiohttp's write limit, past
    which its writer drains."""
    transport = request.transport
    if transport is None or request.protocol.writing_paused:
        return False
    try:
        room = transport.get_write_buffer_limits()[1] - transport.get_write_buffer_size()
    except NotImplementedError:  # a transport that does not say: any write may wait
        return False
    fields = response.headers
    head = sum(map(len, chain.from_iterable(fields.items()))) + 4 * len(fields)
    return head + len(body) + _STATUS_AND_ADDED <= min(room, _WRITE_LIMIT)


_WRITE_LIMIT = 64 * 1024  # aiohttp's StreamWriter drains once a write takes it above this
# room for the status line, the headers aiohttp adds (Date, Server, the framing) and the
# chunked framing of an answer of unknown length
_STATUS_AND_ADDED = 512


class RelayedResponse(web.StreamResponse):
    """A response carrying the upstream's headers as they were.

    aiohttp gives every non-empty body a `Content-Type: application/octet-stream` when none is
    set; an answer relayed from the tool must not gain a header the tool did not send. Its head
    goes out at `prepare`: a stream that is quiet for a while (an MCP GET stream, SSE) has its
    status at once.
    """

    async def _prepare_headers(self) -> None:
        typed = hdrs.CONTENT_TYPE in self.headers
        await super()._prepare_headers()
        if not typed:
            self.headers.popall(hdrs.CONTENT_TYPE, None)


class _WrittenWithBody(RelayedResponse):
    """`stream_back`'s: the head goes out with the first write of the body, which
    `stream_back` makes right after `prepare`, empty or not, with what of the body is in
    already. An answer that is all in is one system call and one wake-up of the client, where
    the head written at `prepare` made two."""

    _send_headers_immediately = False


async def stream_back(
    request: web.Request,
    head: Head,
    rest: Answer | None,
    extra: dict[str, str],
    deadline: float,
) -> tuple[web.StreamResponse, bool]:
    """Send the answer to the client by `deadline` (loop time); (response, body_broke).

    A body that breaks after its status went out can only be signalled by aborting the
    connection. A client that leaves, or reads too slowly to be done by the deadline, is cut
    off: the outcome is recorded already, and a stalled reader must not keep its resource's
    lane (and so a new owner) waiting.
    """
    response = (
        request.reply(head.status)  # a front connection's (gateway.wire.front)
        if isinstance(request, Incoming)
        else _WrittenWithBody(status=head.status)
    )
    answered = response.headers
    answered.extend(head.headers)
    answered.update(extra)  # each replaces any value of that name from the tool
    # with what else of the body is in already: an answer that is all in goes out whole in
    # one write, with the head
    first = head.prefix
    if rest is not None and not head.complete and not head.broken:
        first += rest.read_nowait()
    whole = not head.broken and (head.complete or (rest is not None and rest.at_eof()))
    # the deadline needs a timer only when a write may wait (most answers' never does)
    scope = (
        contextlib.nullcontext()
        if whole and _never_waits(request, response, first)
        else asyncio.timeout_at(deadline)
    )
    broken, reading = head.broken, False
    try:
        async with scope:
            await response.prepare(request)
            await response.write(first)
            while rest is not None and not head.complete and not broken:
                reading = True  # only the upstream's side counts as the body breaking
                try:
                    chunk = await rest.read()
                except BrokenAnswer:
                    broken = True
                    break
                reading = False
                if not chunk:
                    break
                await response.write(chunk)
            if not broken:
                await response.write_eof()
                return response, False
    except TimeoutError:
        broken = broken or reading
    except ConnectionError:
        pass  # the client left
    if request.transport is not None:
        request.transport.abort()
    return response, broken
