"""What the tool receives and what the client gets back, through the real gateway process.

docs/contract.md §2 (routing: the path after the mount forwarded exactly, longest mount, Host from
the upstream URL, bodies byte for byte, redirects passed back, at most once) and §3
("Forwarded upstream", "Answered to the client", and the outcome table). Every check reads
what a real upstream server received and what a real client got, never the gateway's code.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.harness import (
    Behavior,
    GatewayFactory,
    GatewayProcess,
    RawResponse,
    Recorded,
    RecordingUpstream,
    build_raw,
    call,
    fenced_headers,
    fetch_receipts,
    free_port,
    make_policy,
    pick,
    problem,
    raw_request,
)
from tests.hostile.wire import WireTool

RESOURCE = "fwd/r1"


class RawBodyUpstream(RecordingUpstream):
    """A `RecordingUpstream` whose server keeps request bodies exactly as they arrived.

    aiohttp's server inflates a `Content-Encoding: gzip` request body by default, which
    would hide whether the gateway passed the compressed bytes on or inflated them itself.
    """

    async def start(self) -> RawBodyUpstream:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", r"/{tail:[\s\S]*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.2, auto_decompress=False
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    """This module's upstream: the recording server, with request bodies kept raw."""
    async with RawBodyUpstream() as server:
        yield server


@pytest.fixture
async def raw_session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that reads response bodies as sent (no gzip inflation)."""
    async with aiohttp.ClientSession(
        auto_decompress=False, timeout=aiohttp.ClientTimeout(total=20)
    ) as client:
        yield client


def rules(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"match": "fwd/**"}, *extra]


async def start(
    gateway_factory: GatewayFactory,
    upstream: RecordingUpstream,
    *,
    extra_rules: Iterable[dict[str, Any]] = (),
    extra_env: dict[str, str] | None = None,
    **upstream_options: Any,
) -> GatewayProcess:
    policy = make_policy(upstream.url, rules(*extra_rules), **upstream_options)
    return await gateway_factory(policy, extra_env=extra_env)


def seen(rec: Recorded, names: Iterable[str]) -> dict[str, list[str]]:
    """Every value the tool received for each named header (an empty list: absent)."""
    return {name: rec.headers.getall(name, []) for name in names}


def derived_key(resource: str, method: str, target: str, body: bytes) -> str:
    """docs/contract.md §4: `gw-` + hex(sha256(resource, method, target, body))[:32]."""
    digest = hashlib.sha256(f"{resource}\n{method}\n{target}\n".encode() + body)
    return "gw-" + digest.hexdigest()[:32]


def fingerprint(method: str, target: str, body: bytes) -> str:
    return "sha256:" + hashlib.sha256(f"{method}\n{target}\n".encode() + body).hexdigest()


async def get_receipt(
    session: aiohttp.ClientSession, gateway: GatewayProcess, receipt_id: str
) -> dict[str, Any]:
    async with session.get(f"{gateway.url}/_gateway/v1/receipts/{receipt_id}") as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def raw(gateway: GatewayProcess, payload: bytes) -> RawResponse:
    assert gateway.port is not None
    response = await raw_request("127.0.0.1", gateway.port, payload)
    assert response is not None, "the gateway closed the connection without an answer"
    return response


# --------------------------------------------------------------------------------------------
# Routing: the path after the mount, exactly
# --------------------------------------------------------------------------------------------


class TestPaths:
    async def test_rest_of_path_and_query_are_forwarded_exactly_under_the_base_path(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream)
        odd = "/a%2Fb/c%20d?x=1&y=%41"
        targets = [f"/tool{odd}", "/tool", "/tool?q=1", "/tool/"]
        for target in targets:
            response = await raw(gateway, build_raw("GET", target))
            assert response.status == 200, (target, response.body)
        fenced = await raw(
            gateway, build_raw("POST", f"/tool{odd}", fenced_headers(RESOURCE, 1).items(), b"{}")
        )
        assert fenced.status == 200, fenced.body

        assert [(r.method, r.path_qs) for r in upstream.requests] == [
            ("GET", f"/api{odd}"),
            ("GET", "/api"),
            ("GET", "/api?q=1"),
            ("GET", "/api/"),
            ("POST", f"/api{odd}"),
        ]
        receipt = await get_receipt(session, gateway, fenced.headers["X-Receipt-Id"])
        # docs/contract.md §7: `path` is what follows the mount, with the query, as received.
        assert pick(receipt, ("path", "status", "fingerprint")) == {
            "path": odd,
            "status": "succeeded",
            "fingerprint": fingerprint("POST", f"/tool{odd}", b"{}"),
        }

    async def test_an_encoded_line_end_in_a_path_is_forwarded_on_both_servers(
        self, upstream, gateway_factory, session
    ) -> None:
        """`%0A` and `%0D` are a path's bytes like any other: the call is routed by its
        target as received, whether the front serves it or aiohttp does (a chunked body);
        aiohttp's catch-all route matched no decoded line end, and answered 404."""
        gateway = await start(gateway_factory, upstream)
        odd = "/a%0Ab%0Dc"
        framed = await raw(gateway, build_raw("GET", f"/tool{odd}"))
        chunked = await call(
            session,
            "POST",
            f"{gateway.url}/tool{odd}",
            data=chunks_of(b"x" * 10, 5),
            headers=fenced_headers(RESOURCE, 1),
        )
        assert (framed.status, chunked.status) == (200, 200), (framed.body, chunked.body)
        assert [(r.method, r.path_qs) for r in upstream.requests] == [
            ("GET", f"/api{odd}"),
            ("POST", f"/api{odd}"),
        ]

    async def test_longest_mount_wins(self, gateway_factory, session) -> None:
        async with (
            RecordingUpstream(base_path="/api") as main,
            RecordingUpstream(base_path="/admin-base") as admin,
        ):
            policy = {
                "upstreams": [
                    {"name": "main", "url": main.url, "mount": "/tool", "timeout_s": 5},
                    {"name": "admin", "url": admin.url, "mount": "/tool/admin", "timeout_s": 5},
                ],
                "resources": [
                    {"match": "main/**", "upstream": "main", "lease": {"issuer": "external"}},
                    {"match": "admin/**", "upstream": "admin", "lease": {"issuer": "external"}},
                ],
            }
            gateway = await gateway_factory(policy)
            answers = {}
            for target in (
                "/tool/admin/users?all=1",
                "/tool/admin",
                "/tool/administrator",
                "/tool/x",
                "/toolbox",
            ):
                result = await call(session, "GET", f"{gateway.url}{target}")
                answers[target] = result.status
            fenced = await call(
                session,
                "POST",
                f"{gateway.url}/tool/admin/users",
                data=b"{}",
                headers=fenced_headers("admin/a", 1),
            )

            assert answers == {
                "/tool/admin/users?all=1": 200,
                "/tool/admin": 200,
                "/tool/administrator": 200,
                "/tool/x": 200,
                "/toolbox": 404,
            }
            assert fenced.status == 200, fenced.body
            assert [r.path_qs for r in admin.requests] == [
                "/admin-base/users?all=1",
                "/admin-base",
                "/admin-base/users",
            ]
            assert [r.path_qs for r in main.requests] == ["/api/administrator", "/api/x"]
            receipt = await get_receipt(session, gateway, fenced.headers["X-Receipt-Id"])
            assert pick(receipt, ("upstream", "path")) == {"upstream": "admin", "path": "/users"}


# --------------------------------------------------------------------------------------------
# Headers the tool receives
# --------------------------------------------------------------------------------------------

SPOOFED = {
    "Host": "evil.example",
    "X-Forwarded-Host": "evil.example",
    "Forwarded": "for=198.51.100.7;host=evil.example;proto=https",
    "X-Fence-Signature": "0" * 64,
    "X-Receipt-Id": "01FAKERECEIPT",
    "X-Custom": "kept",
}
FENCING = {"X-Fence-Token": "5", "X-Lease-Resource": RESOURCE, "X-Lease-Owner": "me"}


class TestRequestHeaders:
    async def test_host_is_the_upstreams_and_client_routing_headers_are_removed(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream)
        authority = f"127.0.0.1:{upstream.port}"
        plain = await call(
            session, "GET", f"{gateway.url}/tool/plain", headers={**SPOOFED, **FENCING}
        )
        fenced = await call(
            session,
            "POST",
            f"{gateway.url}/tool/fenced",
            data=b"{}",
            headers={**SPOOFED, **fenced_headers(RESOURCE, 5)},
        )
        assert (plain.status, fenced.status) == (200, 200), (plain.body, fenced.body)

        get, post = upstream.requests
        names = ("Host", "X-Forwarded-Host", "Forwarded", "X-Fence-Signature", "X-Custom")
        assert seen(get, (*names, "X-Receipt-Id", *FENCING)) == {
            "Host": [authority],
            "X-Forwarded-Host": [],
            "Forwarded": [],
            "X-Fence-Signature": [],
            "X-Custom": ["kept"],
            "X-Receipt-Id": [],
            "X-Fence-Token": [],
            "X-Lease-Resource": [],
            "X-Lease-Owner": [],
        }
        assert fenced.headers is not None
        assert seen(post, (*names, "X-Receipt-Id")) == {
            "Host": [authority],
            "X-Forwarded-Host": [],
            "Forwarded": [],
            "X-Fence-Signature": [],
            "X-Custom": ["kept"],
            # the gateway's own receipt id, never the client's
            "X-Receipt-Id": [fenced.headers["X-Receipt-Id"]],
        }
        assert fenced.headers["X-Receipt-Id"] != SPOOFED["X-Receipt-Id"]

    async def test_hop_by_hop_headers_are_removed_both_ways(
        self, upstream, gateway_factory
    ) -> None:
        upstream.default = Behavior(
            headers={
                "Content-Type": "application/json",
                "Keep-Alive": "timeout=99",
                "Proxy-Authenticate": "Basic realm=tool",
                "X-Tool": "t",
            }
        )
        gateway = await start(gateway_factory, upstream)
        hop = [
            ("Connection", "close, X-Secret"),
            ("X-Secret", "s"),
            ("Keep-Alive", "timeout=5"),
            ("TE", "trailers"),
            ("Trailer", "X-Checksum"),
            ("Proxy-Authorization", "Bearer proxy-secret"),
            ("Proxy-Connection", "keep-alive"),
            ("X-Kept", "yes"),
        ]
        answers = []
        for method, extra, body in (
            ("GET", [], b""),
            ("POST", list(fenced_headers(RESOURCE, 1).items()), b"{}"),
        ):
            head = f"{method} /tool/hop HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in [*hop, *extra])
            head += f"Content-Length: {len(body)}\r\n\r\n"
            answers.append(await raw(gateway, head.encode() + body))

        assert [a.status for a in answers] == [200, 200]
        for rec in upstream.requests:
            removed = (
                "X-Secret",
                "Keep-Alive",
                "TE",
                "Trailer",
                "Proxy-Authorization",
                "Proxy-Connection",
            )
            assert seen(rec, (*removed, "X-Kept")) == {
                **{name: [] for name in removed},
                "X-Kept": ["yes"],
            }, rec.method
            connection = ",".join(rec.headers.getall("Connection", [])).lower()
            assert "x-secret" not in connection, "the client's Connection was passed on"
        for answer in answers:
            got = {n: answer.headers.getall(n, []) for n in ("Keep-Alive", "Proxy-Authenticate")}
            assert got == {"Keep-Alive": [], "Proxy-Authenticate": []}
            assert answer.headers.getall("X-Tool") == ["t"]

    async def test_inject_headers_come_from_the_environment_and_replace_the_clients(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(
            gateway_factory,
            upstream,
            inject_headers={
                "Authorization": "Bearer ${FWD_TOOL_TOKEN}",
                "X-Api-Key": "k-${FWD_KEY}",
            },
            extra_env={"FWD_TOOL_TOKEN": "tool-secret-1", "FWD_KEY": "42"},
        )
        client_headers = {"Authorization": "Bearer client-token", "x-api-key": "client-key"}
        plain = await call(session, "GET", f"{gateway.url}/tool/i", headers=client_headers)
        fenced = await call(
            session,
            "POST",
            f"{gateway.url}/tool/i",
            data=b"{}",
            headers={**client_headers, **fenced_headers(RESOURCE, 1)},
        )
        assert (plain.status, fenced.status) == (200, 200)
        for rec in upstream.requests:
            assert seen(rec, ("Authorization", "X-Api-Key")) == {
                "Authorization": ["Bearer tool-secret-1"],
                "X-Api-Key": ["k-42"],
            }, rec.method

    async def test_x_forwarded_for_is_replaced_by_the_peer_when_it_is_not_trusted(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream)
        spoof = {"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"}
        await call(session, "GET", f"{gateway.url}/tool/x", headers=spoof)
        await call(
            session,
            "POST",
            f"{gateway.url}/tool/x",
            data=b"{}",
            headers={**spoof, **fenced_headers(RESOURCE, 1)},
        )
        assert [seen(r, ("X-Forwarded-For", "X-Forwarded-Proto")) for r in upstream.requests] == [
            {"X-Forwarded-For": ["127.0.0.1"], "X-Forwarded-Proto": ["http"]}
        ] * 2

    async def test_x_forwarded_for_is_appended_to_when_the_peer_is_trusted(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(
            gateway_factory, upstream, extra_env={"GATEWAY_TRUSTED_PROXIES": "127.0.0.1"}
        )
        await call(
            session, "GET", f"{gateway.url}/tool/x", headers={"X-Forwarded-For": "203.0.113.9"}
        )
        await call(
            session,
            "POST",
            f"{gateway.url}/tool/x",
            data=b"{}",
            headers={"X-Forwarded-For": "203.0.113.9", **fenced_headers(RESOURCE, 1)},
        )
        await call(session, "GET", f"{gateway.url}/tool/none")
        forwarded = [
            (
                ", ".join(r.headers.getall("X-Forwarded-For", [])),
                r.headers.getall("X-Forwarded-Proto", []),
            )
            for r in upstream.requests
        ]
        assert forwarded == [
            ("203.0.113.9, 127.0.0.1", ["http"]),
            ("203.0.113.9, 127.0.0.1", ["http"]),
            ("127.0.0.1", ["http"]),
        ]


class TestFencedCallHeaders:
    """docs/contract.md §3: what the gateway sets for the tool and for the client on an admitted
    call."""

    UPSTREAM_NAMES = (
        "Idempotency-Key",
        "X-Dedupe-Key",
        "X-Lease-Resource",
        "X-Fence-Token",
        "X-Receipt-Id",
        "X-Request-Id",
    )
    CLIENT_NAMES = ("X-Receipt-Id", "X-Request-Id", "Idempotency-Key", "X-Fence-Token")

    @pytest.fixture
    async def gateway(self, upstream, gateway_factory) -> GatewayProcess:
        return await start(
            gateway_factory,
            upstream,
            extra_rules=(
                {"match": "dedupe/**", "idempotency": {"upstream_header": "X-Dedupe-Key"}},
                {"match": "quiet/**", "forward_fence_headers": False},
            ),
        )

    def client_got(self, result) -> dict[str, str | None]:
        assert result.status == 200, result.body
        return {name: result.headers.get(name) for name in self.CLIENT_NAMES}

    async def test_derived_key_fence_headers_receipt_and_clients_request_id(
        self, gateway, upstream, session
    ) -> None:
        body = b'{"order": 1}'
        result = await call(
            session,
            "POST",
            f"{gateway.url}/tool/orders?n=1",
            data=body,
            headers=fenced_headers(RESOURCE, 3, **{"X-Request-Id": "req-abc-1"}),
        )
        key = derived_key(RESOURCE, "POST", "/tool/orders?n=1", body)
        (rec,) = upstream.requests
        receipt_id = rec.headers.get("X-Receipt-Id")
        assert receipt_id
        assert seen(rec, self.UPSTREAM_NAMES) == {
            "Idempotency-Key": [key],
            "X-Dedupe-Key": [],
            "X-Lease-Resource": [RESOURCE],
            "X-Fence-Token": ["3"],
            "X-Receipt-Id": [receipt_id],
            "X-Request-Id": ["req-abc-1"],
        }
        assert self.client_got(result) == {
            "X-Receipt-Id": receipt_id,
            "X-Request-Id": "req-abc-1",
            "Idempotency-Key": key,
            "X-Fence-Token": "3",
        }
        receipt = await get_receipt(session, gateway, receipt_id)
        assert pick(receipt, ("idempotency_key", "fence", "resource", "status")) == {
            "idempotency_key": key,
            "fence": 3,
            "resource": RESOURCE,
            "status": "succeeded",
        }

    async def test_clients_key_goes_in_the_rules_upstream_header(
        self, gateway, upstream, session
    ) -> None:
        result = await call(
            session,
            "POST",
            f"{gateway.url}/tool/send",
            data=b"{}",
            headers=fenced_headers("dedupe/chat-1", 9, **{"Idempotency-Key": "client-key-1"}),
        )
        (rec,) = upstream.requests
        got = self.client_got(result)
        request_id = got["X-Request-Id"]
        assert request_id  # the gateway made one, and told both sides the same
        assert seen(rec, self.UPSTREAM_NAMES) == {
            "Idempotency-Key": [],
            "X-Dedupe-Key": ["client-key-1"],
            "X-Lease-Resource": ["dedupe/chat-1"],
            "X-Fence-Token": ["9"],
            "X-Receipt-Id": [got["X-Receipt-Id"]],
            "X-Request-Id": [request_id],
        }
        assert got["Idempotency-Key"] == "client-key-1"
        assert got["X-Fence-Token"] == "9"

    async def test_forward_fence_headers_false_leaves_them_out_upstream_only(
        self, gateway, upstream, session
    ) -> None:
        body = b"{}"
        result = await call(
            session,
            "POST",
            f"{gateway.url}/tool/q",
            data=body,
            headers=fenced_headers("quiet/a", 4),
        )
        (rec,) = upstream.requests
        got = self.client_got(result)
        key = derived_key("quiet/a", "POST", "/tool/q", body)
        assert seen(rec, self.UPSTREAM_NAMES) == {
            "Idempotency-Key": [key],
            "X-Dedupe-Key": [],
            "X-Lease-Resource": [],
            "X-Fence-Token": [],
            "X-Receipt-Id": [got["X-Receipt-Id"]],
            "X-Request-Id": [got["X-Request-Id"]],
        }
        assert (got["Idempotency-Key"], got["X-Fence-Token"]) == (key, "4")


# --------------------------------------------------------------------------------------------
# Bodies, byte for byte
# --------------------------------------------------------------------------------------------


async def chunks_of(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start_at in range(0, len(data), size):
        yield data[start_at : start_at + size]
        await asyncio.sleep(0)


class TestBodies:
    async def test_gzip_request_body_arrives_compressed_and_identical(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream)
        compressed = gzip.compress(b'{"message": "hello"}' * 200, mtime=0)
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        plain = await call(
            session, "GET", f"{gateway.url}/tool/zip", data=compressed, headers=headers
        )
        fenced = await call(
            session,
            "POST",
            f"{gateway.url}/tool/zip",
            data=compressed,
            headers={**headers, **fenced_headers(RESOURCE, 1)},
        )
        assert (plain.status, fenced.status) == (200, 200)
        assert [(r.method, r.body) for r in upstream.requests] == [
            ("GET", compressed),
            ("POST", compressed),
        ]
        for rec in upstream.requests:
            assert seen(rec, ("Content-Encoding", "Content-Length")) == {
                "Content-Encoding": ["gzip"],
                "Content-Length": [str(len(compressed))],
            }
        receipt = await get_receipt(session, gateway, fenced.headers["X-Receipt-Id"])
        # docs/contract.md §4: the fingerprint is over the bytes received, not decompressed.
        assert receipt["fingerprint"] == fingerprint("POST", "/tool/zip", compressed)

    async def test_gzip_response_body_reaches_the_client_identical(
        self, upstream, gateway_factory, raw_session
    ) -> None:
        compressed = gzip.compress(os.urandom(1000).hex().encode(), mtime=0)
        upstream.default = Behavior(
            body=compressed,
            headers={"Content-Type": "text/plain", "Content-Encoding": "gzip"},
        )
        gateway = await start(gateway_factory, upstream)
        got = []
        for method, headers in (("GET", {}), ("POST", fenced_headers(RESOURCE, 1))):
            async with raw_session.request(
                method, f"{gateway.url}/tool/z", headers=headers, data=b"{}"
            ) as resp:
                got.append((resp.status, resp.headers.get("Content-Encoding"), await resp.read()))
        assert got == [(200, "gzip", compressed)] * 2

    async def test_chunked_request_body_arrives_de_chunked_and_identical(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream)
        body = bytes(range(256)) * 40
        results = [
            await call(
                session,
                method,
                f"{gateway.url}/tool/chunks",
                data=chunks_of(body, 1000),
                headers=headers,
            )
            for method, headers in (("GET", {}), ("POST", fenced_headers(RESOURCE, 1)))
        ]
        assert [r.status for r in results] == [200, 200]
        assert [(r.method, r.body) for r in upstream.requests] == [("GET", body), ("POST", body)]
        receipt = await get_receipt(session, gateway, results[1].headers["X-Receipt-Id"])
        assert receipt["fingerprint"] == fingerprint("POST", "/tool/chunks", body)

    async def test_binary_bodies_with_every_byte_value_pass_both_ways(
        self, upstream, gateway_factory, raw_session
    ) -> None:
        sent = bytes(range(256)) * 64
        answer = bytes(reversed(range(256))) * 300  # > replay_max_bytes: streamed, not kept
        small = bytes(range(256))
        upstream.script("/api/big", Behavior(body=answer, headers={"Content-Type": "x/bin"}))
        upstream.script("/api/small", Behavior(body=small, headers={"Content-Type": "x/bin"}))
        gateway = await start(gateway_factory, upstream)
        got = []
        for method, path, fence in (
            ("PUT", "/tool/big", 1),
            ("POST", "/tool/small", 2),
            ("GET", "/tool/big", None),
        ):
            headers = {} if fence is None else fenced_headers(RESOURCE, fence)
            async with raw_session.request(
                method, f"{gateway.url}{path}", data=sent, headers=headers
            ) as resp:
                got.append((resp.status, await resp.read()))
        assert got == [(200, answer), (200, small), (200, answer)]
        assert [(r.method, r.body) for r in upstream.requests] == [
            ("PUT", sent),
            ("POST", sent),
            ("GET", sent),
        ]


# --------------------------------------------------------------------------------------------
# Answers: redirects, size, HEAD, 204, failures
# --------------------------------------------------------------------------------------------


class TestAnswers:
    async def test_redirects_are_passed_back_not_followed(
        self, upstream, gateway_factory, session
    ) -> None:
        upstream.script(
            "/api/old",
            Behavior(status=302, body=b"moved", headers={"Location": "/tool/new"}),
        )
        gateway = await start(gateway_factory, upstream)
        plain = await call(session, "GET", f"{gateway.url}/tool/old")
        fenced = await call(
            session,
            "POST",
            f"{gateway.url}/tool/old",
            data=b"{}",
            headers=fenced_headers(RESOURCE, 1),
        )
        for result in (plain, fenced):
            assert (result.status, result.headers.get("Location"), result.body) == (
                302,
                "/tool/new",
                b"moved",
            )
        assert [(r.method, r.path) for r in upstream.requests] == [
            ("GET", "/api/old"),
            ("POST", "/api/old"),
        ]
        receipt = await get_receipt(session, gateway, fenced.headers["X-Receipt-Id"])
        assert pick(receipt, ("status", "http_status", "error")) == {
            "status": "failed",
            "http_status": 302,
            "error": None,
        }

    async def test_a_large_answer_is_streamed_back_complete(
        self, upstream, gateway_factory, raw_session
    ) -> None:
        big = os.urandom(5 * 1024 * 1024)
        upstream.default = Behavior(body=big, headers={"Content-Type": "application/x-blob"})
        gateway = await start(gateway_factory, upstream)
        got = []
        for method, headers in (("GET", {}), ("POST", fenced_headers(RESOURCE, 1))):
            async with raw_session.request(
                method, f"{gateway.url}/tool/blob", headers=headers, data=b"{}"
            ) as resp:
                body = await resp.read()
                got.append((resp.status, len(body), hashlib.sha256(body).hexdigest()))
                receipt_id = resp.headers.get("X-Receipt-Id")
        assert got == [(200, len(big), hashlib.sha256(big).hexdigest())] * 2
        receipt = await get_receipt(raw_session, gateway, receipt_id)
        assert pick(receipt, ("status", "http_status", "error")) == {
            "status": "succeeded",
            "http_status": 200,
            "error": None,
        }

    async def test_head_and_204(self, upstream, gateway_factory, session) -> None:
        upstream.script("/api/empty", Behavior(status=204, body=b"", headers={}))
        # No body in the scripted answer: the harness's server would write it even for HEAD
        # (a HEAD answer that keeps its Content-Length is in TestAnswerFraming).
        upstream.script("/api/doc", Behavior(body=b"", headers={"X-Doc": "1"}))
        gateway = await start(gateway_factory, upstream)
        head = await call(session, "HEAD", f"{gateway.url}/tool/doc")
        empty_get = await call(session, "GET", f"{gateway.url}/tool/empty")
        empty_delete = await call(
            session, "DELETE", f"{gateway.url}/tool/empty", headers=fenced_headers(RESOURCE, 1)
        )
        assert (head.status, head.body, head.headers.get("X-Doc")) == (200, b"", "1")
        assert (empty_get.status, empty_get.body) == (204, b"")
        assert (empty_delete.status, empty_delete.body) == (204, b"")
        assert [(r.method, r.path) for r in upstream.requests] == [
            ("HEAD", "/api/doc"),
            ("GET", "/api/empty"),
            ("DELETE", "/api/empty"),
        ]
        receipt = await get_receipt(session, gateway, empty_delete.headers["X-Receipt-Id"])
        assert pick(receipt, ("status", "http_status")) == {
            "status": "succeeded",
            "http_status": 204,
        }

    async def test_upstream_500_is_failed_and_its_answer_passed_on_unchanged(
        self, upstream, gateway_factory, session
    ) -> None:
        upstream.default = Behavior(
            status=500,
            body=b'{"error": "tool exploded"}',
            headers={"Content-Type": "application/json", "X-Tool-Error": "boom"},
        )
        gateway = await start(gateway_factory, upstream)
        result = await call(
            session,
            "POST",
            f"{gateway.url}/tool/x",
            data=b"{}",
            headers=fenced_headers(RESOURCE, 1),
        )
        assert result.headers is not None
        assert (
            result.status,
            result.body,
            result.headers.get("Content-Type"),
            result.headers.get("X-Tool-Error"),
        ) == (500, b'{"error": "tool exploded"}', "application/json", "boom")
        receipt = await get_receipt(session, gateway, result.headers["X-Receipt-Id"])
        assert pick(receipt, ("status", "http_status", "error", "reject_code")) == {
            "status": "failed",
            "http_status": 500,
            "error": None,
            "reject_code": None,
        }
        assert receipt["forwarded_at"] is not None and receipt["completed_at"] is not None
        assert len(upstream.requests) == 1


# Framings aiohttp's server will not produce on request: a HEAD answer with a Content-Length
# and no body, a chunked answer, `Connection` naming an answer header, an answer without
# Content-Type.
WIRE_ANSWERS = {
    "/api/doc": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nContent-Type: text/plain\r\n"
    b"X-Doc: 1\r\n\r\n",  # only HEAD asks for it: no body follows
    "/api/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Type: text/plain\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    "/api/private": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n"
    b"Connection: X-Private\r\nX-Private: p\r\nX-Public: q\r\n\r\nok",
    "/api/untyped": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Public: q\r\n\r\nok",
}


class TestAnswerFraming:
    """Answers whose framing matters, sent byte for byte by a scripted upstream."""

    async def fetch(self, gateway_factory, session, method: str, path: str, fence: int = 0):
        async with WireTool(WIRE_ANSWERS) as wire:
            gateway = await gateway_factory(make_policy(wire.url, rules()))
            headers = fenced_headers(RESOURCE, fence) if fence else {}
            result = await call(session, method, f"{gateway.url}/tool{path}", headers=headers)
            assert result.headers is not None, result.error
            return result, wire

    async def test_head_keeps_the_content_length_of_the_body_it_does_not_send(
        self, gateway_factory, session
    ) -> None:
        result, wire = await self.fetch(gateway_factory, session, "HEAD", "/doc")
        got = {n: result.headers.get(n) for n in ("Content-Length", "Content-Type", "X-Doc")}
        assert (result.status, result.body, got) == (
            200,
            b"",
            {"Content-Length": "10", "Content-Type": "text/plain", "X-Doc": "1"},
        )
        assert [h.split(b"\r\n")[0] for h in wire.heads] == [b"HEAD /api/doc HTTP/1.1"]

    @pytest.mark.parametrize("fence", [0, 1], ids=["plain", "fenced"])
    async def test_a_chunked_answer_arrives_whole(self, gateway_factory, session, fence) -> None:
        method = "POST" if fence else "GET"
        result, _ = await self.fetch(gateway_factory, session, method, "/chunked", fence)
        assert (result.status, result.body) == (200, b"hello world")

    @pytest.mark.parametrize("fence", [0, 1], ids=["plain", "fenced"])
    async def test_answer_headers_named_in_connection_are_removed(
        self, gateway_factory, session, fence
    ) -> None:
        method = "POST" if fence else "GET"
        result, _ = await self.fetch(gateway_factory, session, method, "/private", fence)
        got = {n: result.headers.getall(n, []) for n in ("X-Private", "X-Public")}
        assert (result.status, result.body, got) == (
            200,
            b"ok",
            {"X-Private": [], "X-Public": ["q"]},
        )

    @pytest.mark.parametrize("fence", [0, 1], ids=["plain", "fenced"])
    async def test_no_content_type_is_invented_for_an_untyped_answer(
        self, gateway_factory, session, fence
    ) -> None:
        method = "POST" if fence else "GET"
        result, _ = await self.fetch(gateway_factory, session, method, "/untyped", fence)
        assert (result.status, result.body, result.headers.getall("Content-Type", [])) == (
            200,
            b"ok",
            [],
        )


class TestUpstreamFailures:
    async def test_unreachable_upstream_is_502_and_not_sent(self, gateway_factory, session) -> None:
        closed = f"http://127.0.0.1:{free_port()}/api"
        gateway = await gateway_factory(make_policy(closed, rules(), connect_timeout_s=1))
        fenced = await call(
            session,
            "POST",
            f"{gateway.url}/tool/x",
            data=b"{}",
            headers=fenced_headers(RESOURCE, 1),
        )
        plain = await call(session, "GET", f"{gateway.url}/tool/x")
        assert pick(problem(fenced), ("status", "code")) == {
            "status": 502,
            "code": "upstream_unreachable",
        }
        assert pick(problem(plain), ("status", "code")) == {
            "status": 502,
            "code": "upstream_unreachable",
        }
        receipt = await get_receipt(session, gateway, fenced.headers["X-Receipt-Id"])
        assert pick(receipt, ("status", "forwarded_at", "resource", "fence", "path")) == {
            "status": "not_sent",
            "forwarded_at": None,
            "resource": RESOURCE,
            "fence": 1,
            "path": "/x",
        }

    async def test_upstream_slower_than_timeout_is_504_and_outcome_unknown(
        self, upstream, gateway_factory, session
    ) -> None:
        upstream.default = Behavior(delay=1.5)
        gateway = await start(gateway_factory, upstream, timeout_s=0.4)
        result = await call(
            session,
            "POST",
            f"{gateway.url}/tool/slow",
            data=b"{}",
            headers=fenced_headers(RESOURCE, 1),
        )
        assert pick(problem(result), ("status", "code")) == {
            "status": 504,
            "code": "upstream_timeout",
        }
        assert len(upstream.requests) == 1
        receipt = await get_receipt(session, gateway, result.headers["X-Receipt-Id"])
        assert receipt["status"] == "outcome_unknown"
        assert receipt["forwarded_at"] is not None

    @pytest.mark.parametrize(
        ("size", "sent_before_break"),
        [(1000, 10), (200_000, 150_000)],
        ids=["breaks-within-replay-prefix", "breaks-after-replay-prefix"],
    )
    async def test_a_body_broken_after_the_status_aborts_the_client_connection(
        self, upstream, gateway_factory, session, size, sent_before_break
    ) -> None:
        upstream.default = Behavior(
            body=b"x" * size,
            action="partial",
            partial_bytes=sent_before_break,
            headers={"Content-Type": "application/octet-stream"},
        )
        gateway = await start(gateway_factory, upstream)
        url = f"{gateway.url}/tool/partial"
        headers = fenced_headers(RESOURCE, 1)
        async with session.post(url, data=b"{}", headers=headers) as resp:
            status, receipt_id = resp.status, resp.headers["X-Receipt-Id"]
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        assert status == 200

        async def settled() -> dict[str, Any]:
            return await get_receipt(session, gateway, receipt_id)

        receipt = await settled()
        for _ in range(50):  # the mark after the stream broke is written just after the abort
            if receipt["error"] is not None:
                break
            await asyncio.sleep(0.05)
            receipt = await settled()
        assert pick(receipt, ("status", "http_status", "error")) == {
            "status": "succeeded",
            "http_status": 200,
            "error": "response_incomplete",
        }
        # Nothing kept for replay: the same call again is not answered from a broken copy.
        again = await call(session, "POST", url, data=b"{}", headers=headers)
        assert pick(problem(again), ("status", "code", "receipt_id")) == {
            "status": 409,
            "code": "already_completed",
            "receipt_id": receipt_id,
        }
        assert len(upstream.requests) == 1


# --------------------------------------------------------------------------------------------
# Request body limits
# --------------------------------------------------------------------------------------------


@pytest.mark.both_parsers
class TestBodyLimits:
    async def test_over_the_limit_with_and_without_content_length_is_413(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(gateway_factory, upstream, max_body_bytes=1024)
        too_big = b"y" * 2000
        sized = await call(
            session,
            "POST",
            f"{gateway.url}/tool/sized",
            data=too_big,
            headers=fenced_headers(RESOURCE, 1),
        )
        streamed = await call(
            session,
            "POST",
            f"{gateway.url}/tool/chunked",
            data=chunks_of(too_big, 500),
            headers=fenced_headers(RESOURCE, 2),
        )
        fits = await call(
            session,
            "POST",
            f"{gateway.url}/tool/fits",
            data=b"z" * 1024,
            headers=fenced_headers(RESOURCE, 3),
        )
        for result in (sized, streamed):
            assert pick(problem(result), ("status", "code", "resource")) == {
                "status": 413,
                "code": "body_too_large",
                "resource": RESOURCE,
            }
        assert fits.status == 200
        assert [r.path for r in upstream.requests] == ["/api/fits"]
        receipts = [
            await get_receipt(session, gateway, r.headers["X-Receipt-Id"])
            for r in (sized, streamed)
        ]
        fields = ("status", "reject_code", "http_status", "fence", "path", "forwarded_at")
        assert [pick(r, fields) for r in receipts] == [
            {
                "status": "rejected",
                "reject_code": "body_too_large",
                "http_status": 413,
                "fence": fence,
                "path": path,
                "forwarded_at": None,
            }
            for fence, path in ((1, "/sized"), (2, "/chunked"))
        ]

    async def test_a_body_slower_than_the_body_timeout_is_408(
        self, upstream, gateway_factory, session
    ) -> None:
        gateway = await start(
            gateway_factory, upstream, extra_env={"GATEWAY_BODY_TIMEOUT_S": "0.4"}
        )
        head = build_raw(
            "POST",
            "/tool/slow-body",
            [*fenced_headers(RESOURCE, 1).items(), ("Content-Length", "100")],
            content_length=False,
        )
        assert gateway.port is not None
        response = await raw_request("127.0.0.1", gateway.port, head + b"0123456789", timeout=5)
        assert response is not None, "closed without an answer"
        assert pick(problem(response.as_call()), ("status", "code")) == {
            "status": 408,
            "code": "request_timeout",
        }
        assert upstream.requests == []
        # docs/contract.md §3: a failure at step 3b, resource and fence readable, leaves a
        # rejected receipt.
        receipts = await fetch_receipts(session, gateway.url, resource=RESOURCE)
        fields = ("status", "reject_code", "http_status", "fence", "path", "forwarded_at")
        assert [pick(r, fields) for r in receipts] == [
            {
                "status": "rejected",
                "reject_code": "request_timeout",
                "http_status": 408,
                "fence": 1,
                "path": "/slow-body",
                "forwarded_at": None,
            }
        ]
