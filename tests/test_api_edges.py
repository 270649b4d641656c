"""The control-plane API at its edges (docs/contract.md §5, §6, §7, §9, §10): a NUL in a
parameter is a bad request, not a store outage; `since` and `until` take RFC 3339 alone; a
method the API document does not give a path is 405; revoking an expired lease keeps its
`on_expiry` cleanup owed, whether the sweeper marked it yet or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.upkeep.sweeper import sweep_once
from tests.harness import AppFactory, InProcessGateway, RecordingUpstream, make_policy
from tests.pg import create_database, drop_database, url_of

CLEANUP = {"method": "DELETE", "path": "/sessions/{name}"}


def rules() -> list[dict[str, Any]]:
    gateway = {"issuer": "gateway"}
    return [
        {"match": "run/*", "lease": gateway | {"ttl_s": 1, "max_ttl_s": 5}},
        {
            "match": "browser/*",
            "lease": gateway | {"ttl_s": 1, "max_ttl_s": 5},
            "on_expiry": CLEANUP,
        },
        {"match": "ext/*", "lease": {"issuer": "external"}},
    ]


@pytest.fixture
async def gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    return await make_app(make_policy(upstream.url, rules()))


@pytest.fixture
async def pg_gw(
    make_app: AppFactory, upstream: RecordingUpstream
) -> AsyncIterator[tuple[InProcessGateway, str]]:
    """The real app on a fresh PostgreSQL database (tests/pg.py)."""
    name = create_database()
    gw = await make_app(make_policy(upstream.url, rules()), database_url=url_of(name))
    try:
        yield gw, url_of(name)
    finally:
        await gw.client.close()  # the app and its store first, then the database
        drop_database(name)


def is_problem(headers: Any) -> bool:
    return headers.get("Content-Type", "").split(";")[0] == "application/problem+json"


async def fenced_call(gw: InProcessGateway, resource: str, fence: int) -> int:
    status, _headers, _body = await gw.send(
        "POST",
        f"/tool/{resource}/{fence}",
        headers={"X-Lease-Resource": resource, "X-Fence-Token": str(fence)},
    )
    return status


# -- §5 "Never a 500", §7 "A bad filter ...: 400", §14 "same guarantees" -------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/_gateway/v1/receipts?resource=run/a%00", (200, 400)),
        ("/_gateway/v1/receipts?owner=%00", (200, 400)),
        ("/_gateway/v1/receipts?idempotency_key=k%00", (200, 400)),
        ("/_gateway/v1/leases?prefix=run/%00", (200, 400)),
        ("/_gateway/v1/receipts/%00", (404,)),
    ],
)
async def test_pg_a_nul_in_a_parameter_is_not_a_store_outage(
    pg_gw: tuple[InProcessGateway, str], path: str, expected: tuple[int, ...]
) -> None:
    """No key, name or id holds a NUL, and PostgreSQL text cannot: a NUL is refused (or found
    nowhere) before the store is asked, never a failed read answered `503 store_unavailable`
    as if the store were down."""
    gw, _url = pg_gw
    status, headers, body = await gw.send("GET", path)
    assert status in expected, (status, body)
    if status >= 400:
        assert is_problem(headers)


async def test_pg_resolving_a_receipt_id_with_a_nul_is_not_found(
    pg_gw: tuple[InProcessGateway, str],
) -> None:
    gw, _url = pg_gw
    status, _h, body = await gw.send(
        "POST",
        "/_gateway/v1/receipts/%00/resolve",
        json={"outcome": "applied", "source": "operator:alice"},
    )
    assert (status, body["code"]) == (404, "not_found"), body


# -- §7 "since is inclusive and until exclusive (RFC 3339). A bad filter ...: 400" --------------


@pytest.mark.parametrize(
    "value",
    [
        "20260829T050700Z",  # ISO 8601 basic format
        "2026-W35-1T05:07Z",  # ISO week date
        "2026-08-29 05:07Z",  # no seconds
        "2026-08-29T05:07:00,5Z",  # decimal comma
        "2026-08-29T05Z",  # hour only
    ],
)
async def test_since_and_until_refuse_what_is_not_rfc_3339(
    gw: InProcessGateway, value: str
) -> None:
    for name in ("since", "until"):
        status, headers, body = await gw.send("GET", "/_gateway/v1/receipts", params={name: value})
        assert (status, body.get("code")) == (400, "invalid_request"), (name, value, body)
        assert is_problem(headers)


# -- §10 "a method it does not give a path is 405 with Allow" -----------------------------------


async def test_put_on_fences_raise_is_not_a_method_of_that_path(gw: InProcessGateway) -> None:
    """The document gives the concrete path `/_gateway/v1/fences/raise` POST alone, and a
    concrete path is matched before a templated one (OpenAPI 3.1, "Paths"): `GET` and `PUT`
    there are `405` with `Allow: POST`, never a raise of a resource named `raise`."""
    status, headers, body = await gw.send("PUT", "/_gateway/v1/fences/raise", json={"at_least": 5})
    assert (status, body["code"], headers.get("Allow")) == (405, "method_not_allowed", "POST")


# -- §6 revoke, §9 on_expiry: an expired lease owes its cleanup, swept yet or not ---------------


async def test_revoking_an_expired_lease_keeps_its_cleanup_owed(
    make_app: AppFactory, upstream: RecordingUpstream
) -> None:
    """A lease that expired owes its `on_expiry` cleanup. Revoked after the sweeper marked it
    expired, the revoke only `free`s it; revoked before the sweeper's next pass, it is marked
    expired first, as the sweeper would, so its cleanup is still owed (not `released` as a
    live lease is)."""
    gw = await make_app(make_policy(upstream.url, rules()), sweep_interval_s=3600)
    status, _h, _lease = await gw.acquire("browser/acct-1", ttl_s=0.2)
    assert status == 201
    await asyncio.sleep(0.3)  # expired
    status, _h, _b = await gw.send(
        "DELETE", "/_gateway/v1/leases/browser/acct-1", params={"force": "true"}
    )
    assert status == 204
    await sweep_once(gw.app)
    owed = await gw.store.list_cleanups()
    sent = upstream.received(method="DELETE")
    assert owed or sent, "the expired lease's on_expiry cleanup is neither owed nor sent"
