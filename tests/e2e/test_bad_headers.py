"""Malformed calls are refused with the contract's status and code, and never reach the tool.

docs/contract.md §3 steps 2, 3, 3a and 3b (in that order), §2 (routing, methods, upgrades,
dot segments, body limits) and §5 (problem+json, never a 5xx for a bad request).
Requests go out as raw bytes so that nothing (duplicate headers, dot segments, non-ASCII
digits, empty values) is normalised away by a client library. The gateway runs as a
subprocess, once on aiohttp's C HTTP parser and once on its pure-Python one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import pytest

from tests.harness import (
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    build_raw,
    chunked,
    fetch_receipts,
    make_policy,
    pick,
    problem_summary,
    raw_request,
)

pytestmark = pytest.mark.both_parsers

MAX_BODY = 1024
RESOURCE = "ok/a"
Headers = Sequence[tuple[str, str]]


def valid(**override: str | None) -> list[tuple[str, str]]:
    """Valid fenced headers, with some replaced (a value of None leaves the header out)."""
    base = {"X-Lease-Resource": RESOURCE, "X-Fence-Token": "1", "Content-Type": "text/plain"}
    base.update(override)
    return [(k, v) for k, v in base.items() if v is not None]


async def send(
    gateway: GatewayProcess,
    method: str,
    target: str,
    headers: Headers,
    body: bytes = b"{}",
    *,
    raw_body: bytes | None = None,
) -> tuple[int | None, str | None]:
    """(status, problem code) of one raw request."""
    if raw_body is None:
        payload = build_raw(method, target, headers, body)
    else:
        payload = build_raw(method, target, headers, content_length=False) + raw_body
    assert gateway.port is not None
    response = await raw_request("127.0.0.1", gateway.port, payload)
    if response is None:
        return (None, "connection closed without an answer")
    return problem_summary(response.as_call())


async def run_cases(
    gateway: GatewayProcess, cases: Iterable[tuple[str, str, str, Headers, bytes]]
) -> dict[str, tuple[int | None, str | None]]:
    return {name: await send(gateway, m, t, h, b) for name, m, t, h, b in cases}


def assert_clean(gateway: GatewayProcess, upstream: RecordingUpstream, results: dict) -> None:
    """Nothing reached the tool, no unexpected 5xx, no stack trace in the gateway's log."""
    assert [(r.method, r.path_qs) for r in upstream.requests] == []
    server_errors = {
        k: v for k, v in results.items() if v[0] is None or (v[0] >= 500 and v[0] != 501)
    }
    assert server_errors == {}
    assert "Traceback" not in gateway.stderr_text()
    assert gateway.returncode is None, "the gateway died"


@pytest.fixture
async def gateway(upstream: RecordingUpstream, gateway_factory: GatewayFactory) -> GatewayProcess:
    return await gateway_factory(
        make_policy(upstream.url, [{"match": "ok/**"}], max_body_bytes=MAX_BODY)
    )


class TestResourceHeader:
    """Step 2: X-Lease-Resource present, well formed, and allowed by a rule of this upstream."""

    async def test_bad_resources(self, gateway, upstream, session) -> None:
        bad_forms = {
            "empty": "",
            "leading slash": "/ok/a",
            "trailing slash": "ok/a/",
            "empty segment": "ok//a",
            "dot segment": "ok/./a",
            "dot-dot segment": "ok/../a",
            "only dot": ".",
            "illegal char": "ok/a!b",
            "space inside": "ok/a b",
            "non-ascii": "ok/ä",
            "257 chars": "ok/" + "a" * 254,
        }
        cases = [("missing", "POST", "/tool/x", valid(**{"X-Lease-Resource": None}), b"{}")]
        cases += [
            (name, "POST", "/tool/x", valid(**{"X-Lease-Resource": value}), b"{}")
            for name, value in bad_forms.items()
        ]
        cases += [
            (
                "sent twice",
                "POST",
                "/tool/x",
                [("X-Lease-Resource", RESOURCE), *valid()],
                b"{}",
            ),
            (
                "no rule matches",
                "POST",
                "/tool/x",
                valid(**{"X-Lease-Resource": "other/a"}),
                b"{}",
            ),
            # Order of the checks: resource before fence.
            (
                "missing resource and bad fence",
                "POST",
                "/tool/x",
                valid(**{"X-Lease-Resource": None, "X-Fence-Token": "0"}),
                b"{}",
            ),
            (
                "bad resource and missing fence",
                "POST",
                "/tool/x",
                valid(**{"X-Lease-Resource": "ok//a", "X-Fence-Token": None}),
                b"{}",
            ),
            (
                "unmatched resource and bad fence",
                "POST",
                "/tool/x",
                valid(**{"X-Lease-Resource": "other/a", "X-Fence-Token": "x"}),
                b"{}",
            ),
        ]
        # Leaving the headers out never makes a call unfenced (every default fenced method).
        cases += [
            (f"{m} without headers", m, "/tool/x", [], b"{}")
            for m in ("POST", "PUT", "PATCH", "DELETE")
        ]
        results = await run_cases(gateway, cases)
        expected = {"missing": (428, "missing_resource")}
        expected |= {name: (400, "invalid_resource") for name in bad_forms}
        expected |= {
            "sent twice": (400, "invalid_resource"),
            "no rule matches": (403, "resource_not_allowed"),
            "missing resource and bad fence": (428, "missing_resource"),
            "bad resource and missing fence": (400, "invalid_resource"),
            "unmatched resource and bad fence": (403, "resource_not_allowed"),
        }
        expected |= {
            f"{m} without headers": (428, "missing_resource")
            for m in ("POST", "PUT", "PATCH", "DELETE")
        }
        assert results == expected
        assert_clean(gateway, upstream, results)

        # The boundary itself is fine: 256 characters are accepted and forwarded.
        longest = "ok/" + "a" * 253
        assert await send(gateway, "POST", "/tool/x", valid(**{"X-Lease-Resource": longest})) == (
            200,
            None,
        )
        assert [r.resource for r in upstream.requests] == [longest]


class TestFenceHeader:
    """Step 3: X-Fence-Token present and exactly `[1-9][0-9]*` up to 2**63 - 1."""

    async def test_bad_fences(self, gateway, upstream, session) -> None:
        bad_forms = {
            "zero": "0",
            "negative": "-1",
            "plus sign": "+1",
            "leading zero": "01",
            "underscore": "1_0",
            "arabic-indic digits": "١٢",
            "fullwidth digits": "１２",
            "2**63": "9223372036854775808",
            "decimal point": "1.0",
            "exponent": "1e3",
            "hex": "0x10",
            "inner space": "1 2",
            "empty": "",
        }
        cases = [("missing", "POST", "/tool/x", valid(**{"X-Fence-Token": None}), b"{}")]
        cases += [
            (name, "POST", "/tool/x", valid(**{"X-Fence-Token": value}), b"{}")
            for name, value in bad_forms.items()
        ]
        cases += [
            ("sent twice", "POST", "/tool/x", [("X-Fence-Token", "1"), *valid()], b"{}"),
            (
                "sent twice, different values",
                "POST",
                "/tool/x",
                [("X-Fence-Token", "2"), *valid()],
                b"{}",
            ),
            # Order of the checks: fence before the other headers.
            (
                "bad fence and bad idempotency key",
                "POST",
                "/tool/x",
                valid(**{"X-Fence-Token": "01", "Idempotency-Key": "gw-x"}),
                b"{}",
            ),
        ]
        results = await run_cases(gateway, cases)
        expected = {"missing": (428, "missing_fence")}
        expected |= {name: (400, "invalid_fence") for name in bad_forms}
        expected |= {
            "sent twice": (400, "invalid_fence"),
            "sent twice, different values": (400, "invalid_fence"),
            "bad fence and bad idempotency key": (400, "invalid_fence"),
        }
        assert results == expected
        assert_clean(gateway, upstream, results)

        # 2**63 - 1 is the largest valid token (on its own resource: it fences that one forever).
        top = "9223372036854775807"
        assert await send(
            gateway,
            "POST",
            "/tool/x",
            valid(**{"X-Lease-Resource": "ok/max", "X-Fence-Token": top}),
        ) == (200, None)
        assert [(r.resource, r.headers.get("X-Fence-Token")) for r in upstream.requests] == [
            ("ok/max", top)
        ]


class TestOtherHeaders:
    """Step 3a: X-Lease-Owner and Idempotency-Key, with rejected receipts left behind."""

    async def test_bad_owner_and_idempotency_key(self, gateway, upstream, session) -> None:
        owners = {
            "owner empty": "",
            "owner with space": "run 1",
            "owner illegal char": "run!1",
            "owner 129 chars": "r" * 129,
        }
        keys = {
            "key gw- prefix": "gw-0123456789abcdef",
            "key with space": "my key",
            "key empty": "",
            "key 256 chars": "k" * 256,
            "key non-ascii": "clé",
        }
        cases = [
            (name, "POST", f"/tool/{i}", valid(**{"X-Lease-Owner": v}), b"{}")
            for i, (name, v) in enumerate(owners.items())
        ]
        cases += [
            (name, "POST", f"/tool/k{i}", valid(**{"Idempotency-Key": v}), b"{}")
            for i, (name, v) in enumerate(keys.items())
        ]
        cases += [
            (
                "owner sent twice",
                "POST",
                "/tool/o2",
                [("X-Lease-Owner", "run-1"), *valid(**{"X-Lease-Owner": "run-1"})],
                b"{}",
            ),
            (
                "key sent twice",
                "POST",
                "/tool/k2",
                [("Idempotency-Key", "key-1"), *valid(**{"Idempotency-Key": "key-1"})],
                b"{}",
            ),
        ]
        results = await run_cases(gateway, cases)
        expected = {name: (400, "invalid_request") for name in owners}
        expected |= {name: (400, "invalid_idempotency_key") for name in keys}
        expected |= {
            "owner sent twice": (400, "invalid_request"),
            "key sent twice": (400, "invalid_idempotency_key"),
        }
        assert results == expected
        assert_clean(gateway, upstream, results)

        # Resource and fence were readable: each failure left a rejected receipt (§3).
        receipts = await fetch_receipts(session, gateway.url, resource=RESOURCE)
        fields = ("resource", "fence", "status", "reject_code", "attempt", "forwarded_at")
        assert sorted(
            (pick(r, fields) for r in receipts), key=lambda v: str(v["reject_code"])
        ) == sorted(
            (
                {
                    "resource": RESOURCE,
                    "fence": 1,
                    "status": "rejected",
                    "reject_code": code,
                    "attempt": None,
                    "forwarded_at": None,
                }
                for _, code in expected.values()
            ),
            key=lambda v: str(v["reject_code"]),
        )

        # The boundaries are fine: a 128-character owner and a 255-character key.
        ok = await send(
            gateway,
            "POST",
            "/tool/edge",
            valid(**{"X-Lease-Owner": "o" * 128, "Idempotency-Key": "~" + "k" * 254}),
        )
        assert ok == (200, None)
        assert [r.path for r in upstream.requests] == ["/api/edge"]


class TestRoutingAndMethods:
    """§2: routes, TRACE, upgrades and dot segments, fenced or not."""

    async def test_refused_routes_methods_and_paths(self, gateway, upstream, session) -> None:
        cases: list[tuple[str, str, str, Headers, bytes]] = [
            ("unknown mount", "POST", "/nope/x", valid(), b"{}"),
            ("unknown mount, GET", "GET", "/nope", [], b""),
            ("prefix is not a segment", "POST", "/toolbox/x", valid(), b"{}"),
            ("TRACE", "TRACE", "/tool/x", [], b""),
            (
                "websocket upgrade",
                "GET",
                "/tool/ws",
                [
                    ("Upgrade", "websocket"),
                    ("Connection", "Upgrade"),
                    ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
                    ("Sec-WebSocket-Version", "13"),
                ],
                b"",
            ),
            ("dot-dot segment", "POST", "/tool/a/../b", valid(), b"{}"),
            ("encoded dot-dot segment", "POST", "/tool/a/%2e%2e/b", valid(), b"{}"),
            ("encoded dot-dot, upper case", "POST", "/tool/a/%2E%2E/b", valid(), b"{}"),
            ("half-encoded dot-dot", "POST", "/tool/a/.%2e/b", valid(), b"{}"),
            ("dot segment", "POST", "/tool/./b", valid(), b"{}"),
            ("encoded dot segment", "POST", "/tool/a/%2e/b", valid(), b"{}"),
            ("dot-dot escaping the mount", "GET", "/tool/../admin", [], b""),
            ("absolute-form target", "POST", "http://127.0.0.1/tool/x", valid(), b"{}"),
        ]
        results = await run_cases(gateway, cases)
        assert results == {
            "unknown mount": (404, "no_route"),
            "unknown mount, GET": (404, "no_route"),
            "prefix is not a segment": (404, "no_route"),
            "TRACE": (405, "method_not_allowed"),
            "websocket upgrade": (501, "upgrade_not_supported"),
            "dot-dot segment": (400, "invalid_request"),
            "encoded dot-dot segment": (400, "invalid_request"),
            "encoded dot-dot, upper case": (400, "invalid_request"),
            "half-encoded dot-dot": (400, "invalid_request"),
            "dot segment": (400, "invalid_request"),
            "encoded dot segment": (400, "invalid_request"),
            "dot-dot escaping the mount": (400, "invalid_request"),
            "absolute-form target": (400, "invalid_request"),
        }
        assert_clean(gateway, upstream, results)


class TestBodyLimit:
    """§2 and §3 step 3b: a body over `max_body_bytes` is refused, with or without a length."""

    async def test_body_over_the_limit(self, gateway, upstream, session) -> None:
        too_big = b"x" * (MAX_BODY + 1)
        chunk_headers = [*valid(), ("Transfer-Encoding", "chunked")]
        results = {
            "with Content-Length": await send(gateway, "POST", "/tool/big", valid(), too_big),
            "chunked": await send(
                gateway,
                "POST",
                "/tool/big",
                chunk_headers,
                raw_body=chunked(*(b"x" * 100 for _ in range(11))),
            ),
            "chunked, one big chunk": await send(
                gateway, "PUT", "/tool/big", chunk_headers, raw_body=chunked(too_big * 4)
            ),
        }
        assert results == {
            "with Content-Length": (413, "body_too_large"),
            "chunked": (413, "body_too_large"),
            "chunked, one big chunk": (413, "body_too_large"),
        }
        assert_clean(gateway, upstream, results)

        # Exactly the limit is fine, chunked or not, and arrives byte for byte.
        exact = bytes(range(256)) * (MAX_BODY // 256)
        assert await send(gateway, "POST", "/tool/exact", valid(), exact) == (200, None)
        assert await send(
            gateway,
            "POST",
            "/tool/exact-chunked",
            [*valid(), ("Transfer-Encoding", "chunked")],
            raw_body=chunked(exact[:1000], exact[1000:]),
        ) == (200, None)
        assert [(r.path, r.body) for r in upstream.requests] == [
            ("/api/exact", exact),
            ("/api/exact-chunked", exact),
        ]


@pytest.fixture
async def gw(upstream: RecordingUpstream, gateway_factory: GatewayFactory) -> GatewayProcess:
    """`shared/*` unsigned and `signed/*` with an HMAC secret, on one upstream."""
    policy = make_policy(
        upstream.url,
        [
            {"match": "shared/*"},
            {"match": "signed/*", "lease": {"issuer": "external", "hmac_secret_env": "SECRET"}},
        ],
        timeout_s=1,
    )
    return await gateway_factory(policy, extra_env={"SECRET": "s"})


class TestConnectMethod:
    """§2: CONNECT in authority form is refused `405`, never tunnelled and never a 500."""

    async def test_connect_in_authority_form_is_405(self, gw):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == b"405"


class TestNonUtf8HeaderBytes:
    """§3 and §5: header bytes that are not UTF-8 are refused by the check that reads them
    (`400` for an owner, `403` for a signature), never a 500, and never forwarded."""

    @pytest.mark.parametrize(
        ("resource", "header", "status"),
        [
            (b"shared/g", b"X-Lease-Owner: \xff", b"400"),  # the owner check refuses it
            (b"signed/g", b"X-Fence-Signature: \xff", b"403"),  # the signature check does
        ],
    )
    async def test_non_utf8_header_bytes_are_no_500(self, gw, upstream, resource, header, status):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /tool/x HTTP/1.1\r\nHost: x\r\nX-Lease-Resource: "
            + resource
            + b"\r\nX-Fence-Token: 1\r\n"
            + header
            + b"\r\nContent-Length: 0\r\n\r\n"
        )
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == status
        assert upstream.received() == []
