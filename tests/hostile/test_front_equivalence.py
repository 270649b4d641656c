"""The front answers as aiohttp's server does: one request, two servers, the same answer.

Every connection starts on the front (gateway.wire.front), which serves the proxied calls it
can frame by itself and leaves every other request to aiohttp's server (docs/contract.md §2,
§3 and §5 are written for one server, whichever parses the request). So each request of the
corpus below is sent twice, on a fresh connection each time:

* first thing on the connection: the front serves it, or leaves it to aiohttp if it is not
  its own;
* behind a `GET /_gateway/healthz` and its answer, on the same connection: aiohttp's server
  parses and answers the request under test. That healthz carries a head over the 8 KiB the
  front frames: a plain one would do while the front hands a connection over at its first
  request to `/_gateway/`, but not once it only lends aiohttp that one request and takes the
  connection back (as gateway.wire.front now does with the requests it can parse).

The two must agree on what the client sees (each answer's status line, its headers in their
order, its body; whether the connection is kept afterwards) and on what the tools receive
(method, target, headers in their order, body). Only what differs by call is left out: `Date`,
the request ids, receipt ids and derived idempotency keys the gateway makes, wherever they
appear (headers, problem+json bodies), and the token that makes each send's body or target
its own, so that neither send is a replay of the other (the replay case compares two replays
instead). Whether the connection is kept is asked, not waited for: after the answers, a `GET
/_gateway/healthz` with `Connection: close` is sent, and only a kept connection answers it.

The corpus holds the calls the front serves (plain and fenced calls, refusals of the call
path, HEAD, DELETE without a body, an empty body, a body over the limit, `Connection: close`,
percent-encoded targets, OPTIONS and TRACE, `X-Forwarded-For` from the client), the answers it
writes back its own way (a tool speaking raw HTTP: chunked, close-delimited, 204, 304, a body
cut short, no answer in time, no tool at all), and the requests it must leave to aiohttp to
answer as it always did (header values that are not UTF-8, ambiguous framing, obs-fold, bad
header names, an absolute-form target), alone and pipelined in one write. Both of aiohttp's
HTTP parsers are run. Where the front answers otherwise on purpose (`ON_PURPOSE`), the test
says why and pins what the front answers instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import json
import pprint
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from tests.harness import Behavior, GatewayProcess, RecordingUpstream, free_port, make_policy
from tests.hostile import wire
from tests.hostile.conftest import LoopThread, start_gateway
from tests.hostile.wire import Answer, Script, WireTool, request

pytestmark = pytest.mark.both_parsers

DEADLINE_S = 5.0  # no answer within this: the connection hung
MAX_BODY = 1024  # the upstream's max_body_bytes
RAW_TIMEOUT_S = 0.3  # the raw tool's timeout_s
HEALTHZ = b"GET /_gateway/healthz HTTP/1.1\r\nHost: x\r\n\r\n"
# The same, with a head over the 8 KiB the front ever frames (each line well inside aiohttp's
# 8,190 bytes): whatever the front does with a /_gateway/ call it can frame (it may lend the
# connection to aiohttp for that one request and take it back), this one it cannot, and the
# connection is aiohttp's from its first byte on
HAND_OVER = (
    b"GET /_gateway/healthz HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-Pad-%d: %s\r\n" % (n, b"p" * 4000) for n in range(3))
    + b"\r\n"
)
# Sent after the answers: answered only on a connection the gateway kept, which it then closes
PROBE = b"GET /_gateway/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
# What differs by call, by header name: its placeholder wherever the value appears
VOLATILE = {
    "x-request-id": "<request id>",
    "x-receipt-id": "<receipt id>",
    "idempotency-key": "<derived key>",
}
VOLATILE_FIELDS = {"request_id": "<request id>", "receipt_id": "<receipt id>"}
TOKEN = "<token>"

Headers = list[tuple[bytes, bytes]]


async def _until_close(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
    await writer.drain()
    writer.close()


async def _slow(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(RAW_TIMEOUT_S * 3)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlate")


async def _cut(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
    await writer.drain()
    await asyncio.sleep(0.05)  # the head and the first bytes are relayed before the end
    writer.close()


# What the raw tool (mounted at /raw) answers, by path: framings aiohttp's server would not
# write, which the gateway relays and the front writes back its own way.
RAW: dict[str, bytes | Script] = {
    "/api/chunked": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    "/api/head-length": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Content-Length: 14\r\n\r\n",  # to HEAD: no body
    "/api/head-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    "/api/until-close": _until_close,
    "/api/no-content": b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-From-Tool: 1\r\n\r\n",
    "/api/not-modified": b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\nContent-Length: 12\r\n\r\n',
    "/api/odd-status": b"HTTP/1.1 299 Fine\r\nContent-Length: 2\r\n\r\nok",
    "/api/redirect": b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n",
    "/api/headers": b"HTTP/1.1 200 OK\r\nset-cookie: a=1\r\nSet-Cookie: b=2\r\nX-Empty:\r\n"
    b"Server: tool/1\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\n"
    b"X-UTF8: \xc3\xa9\r\nContent-Length: 4\r\n\r\nbody",
    "/api/slow": _slow,
    "/api/cut": _cut,
    "/api/big": b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"0123456789" * 10_000,
}


@pytest.fixture(scope="module")
def raw_tool(loop_thread: LoopThread) -> Iterator[WireTool]:
    """A tool answering `RAW`'s bytes, serving from the loop thread."""
    tool = WireTool(RAW)
    loop_thread.run(tool.start())
    yield tool
    loop_thread.run(tool.close())


@pytest.fixture(scope="module")
def gateway(
    recording_upstream: RecordingUpstream,
    raw_tool: WireTool,
    http_parser: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    """A gateway in front of `recording_upstream` at `/tool`: `ok/**` fenced (external
    issuer, so any fence from the highest accepted up is taken), bodies up to `MAX_BODY`,
    127.0.0.1 a trusted proxy (a client's `X-Forwarded-For` is appended to, not replaced);
    and of `raw_tool` at `/raw`, unfenced."""
    recording_upstream.script(
        "/api/body",
        Behavior(body=b'{"made": true}', headers={"Content-Type": "application/json"}),
    )
    recording_upstream.script(
        "/api/made", Behavior(status=201, body=b"made", headers={"X-From-Tool": "1"})
    )
    policy = make_policy(
        recording_upstream.url, [{"match": "ok/**"}], max_body_bytes=MAX_BODY, timeout_s=5
    )
    policy["upstreams"] += [
        {"name": "raw", "url": raw_tool.url, "mount": "/raw", "timeout_s": RAW_TIMEOUT_S},
        {"name": "dead", "url": f"http://127.0.0.1:{free_port()}/api", "mount": "/dead"},
    ]
    policy["resources"].append({**policy["resources"][0], "upstream": "dead", "match": "dead/**"})
    gateway = start_gateway(
        tmp_path_factory.mktemp(f"front-{http_parser}"),
        policy,
        http_parser,
        {"GATEWAY_TRUSTED_PROXIES": "127.0.0.1/32"},
    )
    yield gateway
    gateway.kill9_sync()


# --------------------------------------------------------------------------------------------
# One connection, and what it came to
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Received:
    """One request as a tool received it."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclasses.dataclass
class Tools:
    """Both tools, and how to tell what each received since a mark."""

    upstream: RecordingUpstream
    raw: WireTool

    def mark(self) -> tuple[int, int]:
        return len(self.upstream.requests), len(self.raw.heads)

    def since(self, mark: tuple[int, int]) -> list[Received]:
        received = [
            Received(r.method, r.path_qs, list(r.headers.items()), r.body)
            for r in self.upstream.requests[mark[0] :]
        ]
        for head in self.raw.heads[mark[1] :]:
            line, *fields = head.decode("utf-8", "surrogateescape").split("\r\n")
            method, target, _ = line.split(" ", 2)
            pairs = [field.split(":", 1) for field in fields if field]
            received.append(Received(method, target, [(n, v.strip()) for n, v in pairs], b""))
        return received


@dataclasses.dataclass
class Conversation:
    """What one connection came to: the answers before the probe (with their status lines),
    whether the gateway kept the connection after them, whether it hung, and what the tools
    received meanwhile."""

    answers: list[tuple[str, Answer]]
    kept: bool
    hung: bool
    forwarded: list[Received]


def _read(
    sock: socket.socket, buffer: bytes, heads: Sequence[bool], want: int, deadline: float
) -> tuple[list[tuple[str, Answer]], bytes, bool, bool]:
    """Answers until `want` of them, the end of the connection, or `deadline`; (answers, the
    bytes left, closed, timed out). `heads[i]`: the i-th answer is to a HEAD."""
    answers: list[tuple[str, Answer]] = []
    closed = False
    while True:
        while True:
            to_head = len(answers) < len(heads) and heads[len(answers)]
            status_line = buffer[: buffer.find(b"\r\n")].decode("latin-1")
            try:
                answer, buffer = wire._parse(buffer, to_head, closed)
            except wire._Incomplete:
                break
            if answer.status >= 200:  # 1xx answers are interim
                answers.append((status_line, answer))
        if closed or len(answers) >= want:
            return answers, buffer, closed, False
        left = deadline - time.monotonic()
        if left <= 0:
            return answers, buffer, False, True
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset
            chunk = b""
        closed = not chunk
        buffer += chunk


def _healthz(answer: Answer) -> bool:
    return answer.status == 200 and answer.body == b'{"status": "ok"}'


def converse(
    port: int, payload: bytes, heads: Sequence[bool], tools: Tools, *, behind_healthz: bool
) -> Conversation:
    """Send `payload` on a new connection and read the `len(heads)` answers it should get,
    then probe whether the connection was kept. `behind_healthz`: first `HAND_OVER` and its
    answer (checked, left out), so aiohttp's server has the connection; sent before `payload`,
    not with it (aiohttp answers a read with a malformed request in it with that 400 alone,
    dropping the good requests before it)."""
    deadline = time.monotonic() + DEADLINE_S
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        buffer = b""
        if behind_healthz:
            sock.sendall(HAND_OVER)
            healthz, buffer, _, _ = _read(sock, buffer, (False,), 1, deadline)
            assert [_healthz(answer) for _, answer in healthz] == [True], healthz
        mark = tools.mark()
        with contextlib.suppress(OSError):  # the gateway may close before it read it all
            sock.sendall(payload)
        # at least one: a connection with no answer to give is read until it closes
        answers, buffer, closed, hung = _read(sock, buffer, heads, max(1, len(heads)), deadline)
        kept = False
        if not closed and not hung:
            with contextlib.suppress(OSError):
                sock.sendall(PROBE)
            more, _, _, hung = _read(sock, buffer, (), 1_000, deadline)
            if more and _healthz(more[-1][1]):
                kept = True
                more.pop()
            answers += more  # answers nobody asked for, if any
    return Conversation(answers, kept, hung, tools.since(mark))


# --------------------------------------------------------------------------------------------
# What is compared
# --------------------------------------------------------------------------------------------


def _volatile(conversation: Conversation, payload: bytes) -> dict[str, str]:
    """The values the gateway made for this call (not sent by the client), to placeholders."""
    found: dict[str, str] = {}
    pairs: list[tuple[str, str]] = []
    for _, answer in conversation.answers:
        pairs += answer.headers
        document = answer.problem or {}
        pairs += [(name, str(document[name])) for name in VOLATILE_FIELDS if name in document]
    for received in conversation.forwarded:
        pairs += received.headers
    for name, value in pairs:
        label = VOLATILE.get(name.lower()) or VOLATILE_FIELDS.get(name)
        if label is not None and value and value.encode("utf-8", "surrogateescape") not in payload:
            found[value] = label
    return found


def _scrubbed(text: str, token: str, volatile: dict[str, str]) -> str:
    for value, label in volatile.items():
        text = text.replace(value, label)
    return text.replace(token, TOKEN)


def _headers(
    pairs: Sequence[tuple[str, str]], token: str, volatile: dict[str, str]
) -> list[tuple[str, str]]:
    return [
        (name, _scrubbed(value, token, volatile)) for name, value in pairs if name.lower() != "date"
    ]


def view(conversation: Conversation, payload: bytes, token: str) -> dict[str, Any]:
    """What must be the same whichever server answered, the volatile values replaced."""
    volatile = _volatile(conversation, payload)

    def body(raw: bytes) -> str:
        return _scrubbed(raw.decode("utf-8", "surrogateescape"), token, volatile)

    return {
        "answers": [
            (line, _headers(a.headers, token, volatile), body(a.body))
            for line, a in conversation.answers
        ],
        "kept": conversation.kept,
        "hung": conversation.hung,
        "forwarded": [
            (
                r.method,
                _scrubbed(r.target, token, volatile),
                _headers(r.headers, token, volatile),
                body(r.body),
            )
            for r in conversation.forwarded
        ],
    }


def difference(front: dict[str, Any], aiohttp_: dict[str, Any]) -> str:
    """The two views line by line: what the front did (-), what aiohttp did (+)."""
    lines = difflib.unified_diff(
        pprint.pformat(front, width=100).splitlines(),
        pprint.pformat(aiohttp_, width=100).splitlines(),
        "front",
        "aiohttp",
        lineterm="",
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """Requests to send (made from a token of this send), the statuses aiohttp answers them
    with, and which of those answer a HEAD; `setup` is sent first on a connection of its own."""

    payload: Callable[[str], bytes]
    statuses: tuple[int, ...]
    heads: tuple[bool, ...] = ()
    setup: Callable[[str], bytes] | None = None

    def head_flags(self) -> tuple[bool, ...]:
        return self.heads or (False,) * len(self.statuses)


HOST: Headers = [(b"Host", b"gw.example")]
JSON: Headers = [(b"Content-Type", b"application/json")]
CLOSE: Headers = [(b"Connection", b"close")]


def fenced(resource: str = "ok/a", fence: int = 1) -> Headers:
    return [
        *HOST,
        (b"X-Lease-Resource", resource.encode()),
        (b"X-Fence-Token", str(fence).encode()),
    ]


def post(target: bytes, headers: Headers, body: bytes, *, method: bytes = b"POST") -> bytes:
    return request(method, target, [*headers, (b"Content-Length", b"%d" % len(body))], body)


def get(target: bytes, headers: Headers = HOST, *, method: bytes = b"GET") -> bytes:
    return request(method, target, headers)


def body_of(token: str) -> bytes:
    return json.dumps({"token": token, "steps": [1, 2, 3]}).encode()


def made(token: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    """A fenced POST the tool answers 201, its body this send's own."""
    return post(b"/tool/made", [*fenced(), *JSON, *headers], body_of(token))


# Proxied calls, answered by the tool.
CALLS: dict[str, Case] = {
    "GET, unfenced": Case(
        lambda t: get(
            f"/tool/plain/{t}?q=1&r=two".encode(),
            [*HOST, (b"Accept", b"*/*"), (b"X-Custom", b"kept"), (b"User-Agent", b"probe/1")],
        ),
        (200,),
    ),
    "GET, the tool answers with a body": Case(lambda t: get(b"/tool/body"), (200,)),
    "GET with fencing headers, unfenced": Case(
        lambda t: get(b"/tool/plain", [*fenced(), (b"X-Lease-Owner", b"run-1")]), (200,)
    ),
    "GET with a Content-Length body": Case(
        lambda t: post(b"/tool/plain", HOST, t.encode(), method=b"GET"), (200,)
    ),
    "GET, the mount itself, with a query": Case(lambda t: get(b"/tool?x=1"), (200,)),
    "POST, fenced, JSON": Case(made, (201,)),
    "POST, fenced, an owner and a client's request id": Case(
        lambda t: made(t, [(b"X-Lease-Owner", b"run-7"), (b"X-Request-Id", b"req-fixed-1")]),
        (201,),
    ),
    "POST, fenced, a client's Idempotency-Key": Case(
        lambda t: made(t, [(b"Idempotency-Key", f"key-{t}".encode())]), (201,)
    ),
    "POST, fenced, replayed": Case(made, (201,), setup=lambda t: made(t, CLOSE)),
    "POST, fenced, Expect: 100-continue": Case(
        lambda t: made(t, [(b"Expect", b"100-continue")]), (201,)
    ),
    "POST, fenced, chunked": Case(
        lambda t: request(
            b"POST",
            b"/tool/made",
            [*fenced(), (b"Transfer-Encoding", b"chunked")],
            b"%x\r\n%b\r\n0\r\n\r\n" % (len(body_of(t)), body_of(t)),
        ),
        (201,),
    ),
    "PUT, Content-Length with leading zeros": Case(
        lambda t: request(
            b"PUT", b"/tool/x", [*fenced(), (b"Content-Length", b"0012")], t.encode()
        ),
        (200,),
    ),
    "POST, empty body, Content-Length: 0": Case(
        lambda t: post(f"/tool/empty/{t}".encode(), fenced(), b""), (200,)
    ),
    "POST, a body of max_body_bytes": Case(
        lambda t: post(b"/tool/big", fenced(), t.encode().ljust(MAX_BODY, b"x")), (200,)
    ),
    "DELETE, no body": Case(
        lambda t: get(f"/tool/items/{t}".encode(), fenced(), method=b"DELETE"), (200,)
    ),
    "HEAD": Case(lambda t: get(b"/tool/h", method=b"HEAD"), (200,), heads=(True,)),
    "HEAD, the tool's answer has a length": Case(
        lambda t: get(b"/raw/head-length", method=b"HEAD"), (200,), heads=(True,)
    ),
    "HEAD with a Content-Length body": Case(
        lambda t: post(b"/tool/h", HOST, t.encode(), method=b"HEAD"), (200,), heads=(True,)
    ),
    "OPTIONS": Case(lambda t: get(b"/tool/x", method=b"OPTIONS"), (200,)),
    "OPTIONS with a Content-Length body": Case(
        lambda t: post(b"/tool/x", HOST, t.encode(), method=b"OPTIONS"), (200,)
    ),
    "HTTP/1.0": Case(lambda t: request(b"GET", b"/tool/x", HOST, version=b"HTTP/1.0"), (200,)),
    "X-Forwarded-For and the like from the client": Case(
        lambda t: get(
            b"/tool/x",
            [
                *HOST,
                (b"X-Forwarded-For", b"203.0.113.7, 10.0.0.1"),
                (b"X-Forwarded-Proto", b"https"),
                (b"X-Forwarded-Host", b"evil.example"),
                (b"Forwarded", b"for=203.0.113.7"),
            ],
        ),
        (200,),
    ),
    "GET, Connection names a header": Case(
        lambda t: get(
            b"/tool/x", [*HOST, (b"Connection", b"X-Drop, keep-alive"), (b"X-Drop", b"1")]
        ),
        (200,),
    ),
    "GET, Connection: upgrade without Upgrade": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"Connection", b"upgrade")]), (200,)
    ),
    "GET, an empty line before the request line": Case(lambda t: b"\r\n" + get(b"/tool/x"), (200,)),
    "GET, a Host with a space": Case(lambda t: get(b"/tool/x", [(b"Host", b"a b")]), (200,)),
    "GET, a header value in UTF-8": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"X-Custom", "é ü".encode())]), (200,)
    ),
    "GET, header values with surrounding whitespace": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"X-Custom", b" \t a b \t "), (b"X-Empty", b"")]),
        (200,),
    ),
    "GET, 120 headers": Case(
        lambda t: get(b"/tool/x", [*HOST, *[(b"X-N%d" % n, b"v") for n in range(120)]]),
        (200,),
    ),
    "GET, a header of 7,000 bytes": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"X-Long", b"v" * 7000)]), (200,)
    ),
}

# Targets: routing, dot segments, percent-encoding.
TARGETS: dict[str, Case] = {
    "GET, unknown mount": Case(lambda t: get(b"/nope/x"), (404,)),
    "GET, a mount's prefix that is no mount": Case(lambda t: get(b"/toolbox"), (404,)),
    "HEAD, unknown mount": Case(lambda t: get(b"/nope/x", method=b"HEAD"), (404,), heads=(True,)),
    "GET, dot segment": Case(lambda t: get(b"/tool/../x"), (400,)),
    "GET, percent-encoded dot segment": Case(lambda t: get(b"/tool/a/%2e%2E/x"), (400,)),
    "GET, a dot segment out of the mount into /_gateway/": Case(
        lambda t: get(b"/tool/../_gateway/healthz"), (400,)
    ),
    "GET, percent-encoded path": Case(
        lambda t: get(f"/tool/a%20b/%41%2Fc/{t}?x=%2F&y=%zz".encode()), (200,)
    ),
    "GET, percent-encoded mount": Case(lambda t: get(b"/t%6Fol/x"), (404,)),
    "GET, percent-encoded /_gateway/": Case(lambda t: get(b"/%5Fgateway/healthz"), (200,)),
    "GET, bad percent-encoding": Case(lambda t: get(b"/tool/%zz/%/%C3%28/%00"), (200,)),
    "GET, a fragment": Case(lambda t: get(b"/tool/x?q=1#frag"), (200,)),
    "GET, unusual characters in the target": Case(
        lambda t: get(b'/tool/a"b<c>d\\e^f`g{h|i}j'), (200,)
    ),
    "GET, absolute-form target": Case(lambda t: get(b"http://127.0.0.1/tool/x"), (400,)),
    "OPTIONS *": Case(lambda t: get(b"*", method=b"OPTIONS"), (404,)),
    "TRACE": Case(lambda t: get(b"/tool/x", method=b"TRACE"), (405,)),
    "GET, Upgrade: websocket": Case(
        lambda t: get(
            b"/tool/x",
            [
                *HOST,
                (b"Connection", b"Upgrade"),
                (b"Upgrade", b"websocket"),
                (b"Sec-WebSocket-Version", b"13"),
                (b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="),
            ],
        ),
        (501,),
    ),
}

# Refusals of a fenced call, before anything is forwarded.
REFUSALS: dict[str, Case] = {
    "POST, stale fence": Case(
        lambda t: post(b"/tool/made", [*fenced(f"ok/stale-{t}", 2), *JSON], body_of(t)),
        (409,),
        setup=lambda t: post(b"/tool/made", [*fenced(f"ok/stale-{t}", 5), *CLOSE], b"{}"),
    ),
    "POST, the key reused for another body": Case(
        lambda t: post(
            b"/tool/made", [*fenced(), (b"Idempotency-Key", f"k-{t}".encode())], b"second"
        ),
        (422,),
        setup=lambda t: post(
            b"/tool/made", [*fenced(), (b"Idempotency-Key", f"k-{t}".encode()), *CLOSE], b"first"
        ),
    ),
    "POST, missing fence": Case(
        lambda t: post(b"/tool/x", [*HOST, (b"X-Lease-Resource", b"ok/a")], body_of(t)), (428,)
    ),
    "POST, missing resource": Case(
        lambda t: post(b"/tool/x", [*HOST, (b"X-Fence-Token", b"1")], body_of(t)), (428,)
    ),
    "POST, invalid fence": Case(lambda t: post(b"/tool/x", fenced("ok/a", 0), body_of(t)), (400,)),
    "POST, resource not allowed": Case(
        lambda t: post(b"/tool/x", fenced("other/a"), body_of(t)), (403,)
    ),
    "POST, fence header twice": Case(
        lambda t: post(b"/tool/x", [*fenced(), (b"X-Fence-Token", b"1")], body_of(t)), (400,)
    ),
    "POST, dot segment, fenced": Case(lambda t: post(b"/tool/a/./x", fenced(), body_of(t)), (400,)),
    "POST, body over max_body_bytes": Case(
        lambda t: post(b"/tool/big", fenced(), t.encode() + b"x" * (2 * MAX_BODY)), (413,)
    ),
    "POST, the body slower than the body timeout": Case(
        lambda t: request(b"POST", b"/tool/made", [*fenced(), (b"Content-Length", b"100")]) + b"{}",
        (408,),
    ),
    "POST, an owner not UTF-8": Case(
        lambda t: post(b"/tool/x", [*fenced(), (b"X-Lease-Owner", b"\xfe")], body_of(t)), (400,)
    ),
}

# Connection: close, on calls with a body and without.
CLOSING: dict[str, Case] = {
    "GET, Connection: close": Case(lambda t: get(b"/tool/body", [*HOST, *CLOSE]), (200,)),
    "GET, Connection: keep-alive, close": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"Connection", b"keep-alive, close")]), (200,)
    ),
    "HEAD, Connection: close": Case(
        lambda t: get(b"/tool/h", [*HOST, *CLOSE], method=b"HEAD"), (200,), heads=(True,)
    ),
    "POST, fenced, Content-Length: 0, Connection: close": Case(
        lambda t: post(f"/tool/empty/{t}".encode(), [*fenced(), *CLOSE], b""), (200,)
    ),
    "POST, fenced, Connection: close": Case(lambda t: made(t, CLOSE), (201,)),
    "GET, refused, Connection: close": Case(lambda t: get(b"/tool/../x", [*HOST, *CLOSE]), (400,)),
    "POST, refused, Connection: close": Case(
        lambda t: post(b"/tool/x", [*HOST, (b"X-Fence-Token", b"1"), *CLOSE], b"{}"), (428,)
    ),
    "GET, unknown mount, Connection: close": Case(
        lambda t: get(b"/nope/x", [*HOST, *CLOSE]), (404,)
    ),
}

# Heads aiohttp's parser refuses (or would), which the front must leave to it.
MALFORMED: dict[str, Case] = {
    "GET, a header value not UTF-8": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"X-Custom", b"a\xffb")]), (400,)
    ),
    "POST, fenced, a header value not UTF-8": Case(
        lambda t: post(b"/tool/x", [*fenced(), (b"X-Custom", b"\xff")], body_of(t)), (400,)
    ),
    "GET, a header value with DEL": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"X-Custom", b"a\x7fb")]), (400,)
    ),
    "POST, two Content-Lengths": Case(
        lambda t: request(
            b"POST",
            b"/tool/x",
            [*fenced(), (b"Content-Length", b"2"), (b"Content-Length", b"2")],
            b"{}",
        ),
        (400,),
    ),
    "POST, Content-Length and Transfer-Encoding": Case(
        lambda t: request(
            b"POST",
            b"/tool/x",
            [*fenced(), (b"Content-Length", b"7"), (b"Transfer-Encoding", b"chunked")],
            b"0\r\n\r\n",
        ),
        (400,),
    ),
    "GET, obs-fold": Case(lambda t: get(b"/tool/x", [*HOST, (b"X-Fold", b"a\r\n b")]), (400,)),
    "GET, a space in a header name": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"X Bad", b"1")]), (400,)
    ),
    "GET, a space before the colon": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"X-Bad ", b"1")]), (400,)
    ),
    "GET, a control byte in a header name": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"X-B\x01d", b"1")]), (400,)
    ),
    "GET, bare LF line endings": Case(
        lambda t: request(b"GET", b"/tool/x", HOST, newline=b"\n"), (400,)
    ),
    "GET, no Host": Case(lambda t: get(b"/tool/x", []), (400,)),
    "GET, two Hosts": Case(lambda t: get(b"/tool/x", [*HOST, (b"Host", b"other.example")]), (400,)),
    "GET, two User-Agents": Case(
        lambda t: get(b"/tool/x", [*HOST, (b"User-Agent", b"a/1"), (b"User-Agent", b"b/2")]),
        (400,),
    ),
    "POST, fenced, two Content-Types": Case(
        lambda t: made(t, [(b"Content-Type", b"text/plain")]), (400,)
    ),
}

# Answers the front writes back its own way: framings from a tool that speaks raw HTTP.
ANSWERS: dict[str, Case] = {
    "tool: chunked answer": Case(lambda t: get(b"/raw/chunked"), (200,)),
    "tool: chunked answer to HEAD": Case(
        lambda t: get(b"/raw/head-chunked", method=b"HEAD"), (200,), heads=(True,)
    ),
    "tool: answer until the connection closes": Case(lambda t: get(b"/raw/until-close"), (200,)),
    "tool: 204 with Content-Length: 0": Case(lambda t: get(b"/raw/no-content"), (204,)),
    "tool: 304 with a Content-Length": Case(lambda t: get(b"/raw/not-modified"), (304,)),
    "tool: a status and reason of its own": Case(lambda t: get(b"/raw/odd-status"), (299,)),
    "tool: a redirect": Case(lambda t: get(b"/raw/redirect"), (302,)),
    "tool: headers repeated, empty, hop-by-hop, not ASCII": Case(
        lambda t: get(b"/raw/headers"), (200,)
    ),
    "tool: a body of 100,000 bytes": Case(lambda t: get(b"/raw/big"), (200,)),
    "tool: too slow": Case(lambda t: get(b"/raw/slow"), (504,)),
    "tool: the body cut short": Case(lambda t: get(b"/raw/cut"), ()),
    "tool: unreachable": Case(lambda t: get(b"/dead/x"), (502,)),
    "tool: unreachable, fenced": Case(
        lambda t: post(b"/dead/x", fenced("dead/a"), body_of(t)), (502,)
    ),
}

# Several requests in one write.
PIPELINED: dict[str, Case] = {
    "pipelined: a proxied call, then /_gateway/healthz": Case(
        lambda t: made(t) + HEALTHZ, (201, 200)
    ),
    "pipelined: /_gateway/healthz, then a proxied call": Case(
        lambda t: HEALTHZ + made(t), (200, 201)
    ),
    "pipelined: a /_gateway/ POST with a body, then a proxied call": Case(
        lambda t: (
            post(b"/_gateway/v1/leases/ok/p", [*HOST, *JSON], b'{"owner": "x"}')
            + get(b"/tool/body")
        ),
        (403, 200),
    ),
    "pipelined: unknown mount, then a proxied call": Case(
        lambda t: get(b"/nope/x") + made(t), (404, 201)
    ),
    "pipelined: two proxied calls": Case(lambda t: get(b"/tool/body") + made(t), (200, 201)),
    "pipelined: HEAD, then GET": Case(
        lambda t: get(b"/raw/head-length", method=b"HEAD") + get(b"/raw/chunked"),
        (200, 200),
        heads=(True, False),
    ),
    "pipelined: a refusal, then a proxied call": Case(
        lambda t: post(b"/tool/x", HOST, b"{}") + get(b"/tool/body"), (428, 200)
    ),
    "pipelined: after Connection: close": Case(
        lambda t: get(b"/tool/x", [*HOST, *CLOSE]) + get(b"/tool/hidden"), (400,)
    ),
    "pipelined: after Connection: close, with a body": Case(
        lambda t: made(t, CLOSE) + get(b"/tool/hidden"), (400,)
    ),
    "pipelined: a proxied call, then a malformed request": Case(
        lambda t: get(b"/tool/body") + get(b"/tool/x", [*HOST, (b"X Bad", b"1")]), (400,)
    ),
}

CASES: dict[str, Case] = {
    **CALLS,
    **TARGETS,
    **REFUSALS,
    **CLOSING,
    **MALFORMED,
    **ANSWERS,
    **PIPELINED,
}

# --------------------------------------------------------------------------------------------
# Where the front answers otherwise, on purpose: what it answers instead is pinned below
# --------------------------------------------------------------------------------------------

ON_PURPOSE: dict[str, tuple[str, tuple[int, ...], bool]] = {
    # name: (why, the front's statuses, whether it keeps the connection)
    "POST, the body slower than the body timeout": (
        "a 408 with the body still owed: the front says `Connection: close` and closes; "
        "aiohttp does not say it, reads what follows as the body's rest and closes later",
        (408,),
        False,
    ),
    "pipelined: a proxied call, then a malformed request": (
        "aiohttp refuses a whole read 400 when a request in it is malformed, dropping the "
        "good request before it; the front answers the good request, then lends the "
        "connection to aiohttp, which refuses the malformed one (RFC 9112 §9.6: each request "
        "is answered in turn)",
        (200, 400),
        False,
    ),
}


def send(
    gateway: GatewayProcess, tools: Tools, case: Case, *, behind_healthz: bool
) -> tuple[Conversation, bytes, str]:
    """One send of `case`, with a token of its own: first on its connection, or on one
    aiohttp's server already has."""
    assert gateway.port is not None
    token = f"t{uuid.uuid4().hex[:11]}"  # never all digits
    if case.setup is not None:
        result = wire.exchange(gateway.port, case.setup(token))
        assert [a.status for a in result.answers] in ([200], [201]), result
    payload = case.payload(token)
    conversation = converse(
        gateway.port, payload, case.head_flags(), tools, behind_healthz=behind_healthz
    )
    return conversation, payload, token


@pytest.mark.parametrize("name", [name for name in CASES if name not in ON_PURPOSE])
def test_the_front_answers_as_aiohttp_does(
    gateway: GatewayProcess,
    recording_upstream: RecordingUpstream,
    raw_tool: WireTool,
    name: str,
) -> None:
    case = CASES[name]
    tools = Tools(recording_upstream, raw_tool)
    on_front = send(gateway, tools, case, behind_healthz=False)
    on_aiohttp = send(gateway, tools, case, behind_healthz=True)
    front, aiohttp_ = view(*on_front), view(*on_aiohttp)
    assert front == aiohttp_, difference(front, aiohttp_)
    statuses = [answer.status for _, answer in on_aiohttp[0].answers]
    assert statuses == list(case.statuses), aiohttp_
    assert gateway.returncode is None, "the gateway died"


@pytest.mark.parametrize("name", sorted(ON_PURPOSE))
def test_where_the_front_answers_otherwise_on_purpose(
    gateway: GatewayProcess,
    recording_upstream: RecordingUpstream,
    raw_tool: WireTool,
    name: str,
) -> None:
    _why, statuses, kept = ON_PURPOSE[name]
    case = CASES[name]
    tools = Tools(recording_upstream, raw_tool)
    conversation, _, _ = send(gateway, tools, case, behind_healthz=False)
    assert [answer.status for _, answer in conversation.answers] == list(statuses)
    assert (conversation.kept, conversation.hung) == (kept, False)


def test_and_leave_no_trace(gateway: GatewayProcess) -> None:
    """After all of the above: no stack trace in the gateway's log, and it still serves."""
    assert "Traceback" not in gateway.stderr_text()
    assert gateway.returncode is None
