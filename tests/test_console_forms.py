"""The console's forms and pages at their edges (docs/console.md): a bad form changes
nothing, a form sends the browser back only to a console page, a value that is not Unicode
text is a 400, a NUL in a receipt id is no such receipt, an unknown page is 404 whatever the
method."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.console.guard import SESSIONS
from gateway.console.sessions import COOKIE
from tests.harness import AppFactory, InProcessGateway, RecordingUpstream
from tests.pg import create_database, drop_database, url_of
from tests.test_console import (
    CLIENTS,
    CONSOLE,
    KEYS,
    api,
    csrf_of,
    get,
    lost_call,
    policy,
    post,
    sign_in,
)


@pytest.fixture
async def gw(make_app: AppFactory, upstream: RecordingUpstream) -> InProcessGateway:
    """The gateway with a clients file, as tests/test_console.py's."""
    return await make_app(policy(upstream.url), clients=CLIENTS, reconcile_grace_s=0)


async def session_csrf(gw: InProcessGateway) -> str:
    """This browser's session's form token (a page without forms shows none)."""
    await get(gw, CONSOLE)
    token = gw.client.session.cookie_jar.filter_cookies(gw.client.make_url(CONSOLE))[COOKIE]
    session = gw.app[SESSIONS].find(token.value)
    assert session is not None
    return session.csrf


# -- a bad form is refused before anything changes -------------------------------------------


async def test_a_resolve_form_with_a_bad_back_field_is_400_and_resolves_nothing(
    gw: InProcessGateway, upstream: RecordingUpstream
) -> None:
    """`back` is read before anything is changed: a bad one is `400` and the receipt stays
    as it was."""
    receipt_id = await lost_call(gw, upstream, "k-back")
    await sign_in(gw, "reconciler")
    _, _, queue = await get(gw, f"{CONSOLE}/queue")
    form = [
        ("csrf", csrf_of(queue)),
        ("outcome", "applied"),
        ("source", "operator:alice"),
        ("back", f"{CONSOLE}/queue"),
        ("back", f"{CONSOLE}/leases"),
    ]
    status, _, _ = await post(gw, f"{CONSOLE}/receipts/{receipt_id}/resolve", form)
    assert status == 400
    _, receipt = await api(gw, "GET", f"/receipts/{receipt_id}")
    assert receipt["status"] == "outcome_unknown", receipt["resolution"]


async def test_a_revoke_form_with_a_bad_back_field_is_400_and_revokes_nothing(
    gw: InProcessGateway,
) -> None:
    async with gw.client.post(
        "/_gateway/v1/leases/deploy/web",
        json={"owner": "run-1"},
        headers={"Authorization": f"Bearer {KEYS['agent']}"},
    ) as r:
        assert r.status == 201
    await sign_in(gw, "admin")
    _, _, leases = await get(gw, f"{CONSOLE}/leases")
    form = [
        ("csrf", csrf_of(leases)),
        ("resource", "deploy/web"),
        ("back", f"{CONSOLE}/leases"),
        ("back", f"{CONSOLE}/queue"),
    ]
    status, _, _ = await post(gw, f"{CONSOLE}/leases/revoke", form)
    assert status == 400
    assert (await api(gw, "GET", "/leases/deploy/web"))[1]["state"] == "held"


# -- after a form, back to a console page only -----------------------------------------------


@pytest.mark.parametrize(
    "back",
    [
        f"{CONSOLE}/../../tool/x",
        f"{CONSOLE}/%2e%2e/%2E%2E/tool/x",
        f"{CONSOLE}/queue/../../v1/leases",
        f"{CONSOLE}/.%2e/metrics",
    ],
)
async def test_a_form_cannot_send_the_browser_out_of_the_console_with_dot_segments(
    gw: InProcessGateway, back: str
) -> None:
    """A browser resolves `..` (and `%2e%2e`) in a Location: such a `back` goes to the
    default page, inside the console."""
    await sign_in(gw, "admin")
    _, _, html = await get(gw, f"{CONSOLE}/leases")
    form = {"csrf": csrf_of(html), "resource": "deploy/x", "back": back}
    status, headers, _ = await post(gw, f"{CONSOLE}/leases/revoke", form)
    assert (status, headers["Location"]) == (303, f"{CONSOLE}/leases")


# -- no bad input gets a 500 -----------------------------------------------------------------


@pytest.mark.parametrize("field", ["csrf", "key"])
async def test_a_form_value_that_is_no_unicode_text_is_400_not_500(
    gw: InProcessGateway, field: str
) -> None:
    """A charset that decodes to a lone surrogate (unicode_escape) gives no text for the
    CSRF check or the key's hash to read: `400`, never a 500."""
    _, _, form = await get(gw, f"{CONSOLE}/signin")
    values = {"csrf": csrf_of(form), "key": KEYS["reconciler"], field: "\\ud800"}
    body = "&".join(f"{name}={value}" for name, value in values.items()).encode()
    async with gw.client.post(
        f"{CONSOLE}/signin",
        data=body,
        headers={"Content-Type": "application/x-www-form-urlencoded; charset=unicode_escape"},
        allow_redirects=False,
    ) as r:
        assert (r.status, r.content_type) == (400, "text/html"), await r.text()


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
async def test_an_unknown_page_is_404_whatever_the_method(
    gw: InProcessGateway, method: str
) -> None:
    """docs/console.md: an unknown page is 404 whatever the method, never a 405 with
    `Allow: GET, HEAD, POST` as if the page existed."""
    await sign_in(gw, "admin")
    async with gw.client.request(method, f"{CONSOLE}/no/such/page") as r:
        assert (r.status, r.content_type) == (404, "text/html")


@pytest.fixture
async def pg_open_gw(
    make_app: AppFactory, upstream: RecordingUpstream
) -> AsyncIterator[InProcessGateway]:
    """The open gateway on a fresh PostgreSQL database (tests/pg.py)."""
    name = create_database()
    gw = await make_app(policy(upstream.url), database_url=url_of(name), reconcile_grace_s=0)
    try:
        yield gw
    finally:
        await gw.client.close()
        drop_database(name)


@pytest.mark.parametrize("action", ["resolve", "probe"])
async def test_pg_a_nul_in_a_receipt_id_is_a_message_not_a_store_outage(
    pg_open_gw: InProcessGateway, action: str
) -> None:
    """The API refuses a NUL in a receipt id as no such receipt, and so does the console,
    which never passes it to PostgreSQL (that cannot hold one: 503 Store unavailable)."""
    gw = pg_open_gw
    form = {"csrf": await session_csrf(gw), "outcome": "applied", "source": "operator:local"}
    status, headers, page = await post(gw, f"{CONSOLE}/receipts/a%00b/{action}", form)
    assert (status, headers.get("Location")) == (303, f"{CONSOLE}/queue"), page[-600:]
    assert "Not found: no receipt" in (await get(gw, f"{CONSOLE}/queue"))[2]
