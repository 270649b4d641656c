"""`fence-gateway leases list` and `receipts list|show|resolve` against a running gateway
(docs/contract.md §12).

The command runs as a real subprocess (`python -m gateway`), the gateway as another, and the
tool is the recording upstream; where the test needs to see what the command sent (its key),
`--url` points at the recording server itself, a real HTTP server that answers like the API.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from dataclasses import dataclass

import aiohttp
import pytest

from tests.harness import (
    REPO_ROOT,
    Behavior,
    GatewayFactory,
    GatewayProcess,
    RecordingUpstream,
    call,
    fenced_headers,
    fetch_receipts,
    free_port,
    make_policy,
)

TIMEOUT_S = 0.5


@dataclass
class Run:
    code: int
    out: str
    err: str


async def cli(*argv: str, env: dict[str, str] | None = None) -> Run:
    """`python -m gateway ARGV` as an operator would run it; no GATEWAY_* from the test run."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    base["PYTHONPATH"] = str(REPO_ROOT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        *argv,
        env={**base, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return Run(proc.returncode, out.decode(), err.decode())


def rows(table: str) -> list[dict[str, str]]:
    """Parse an aligned table by the header's column starts; also checks the alignment."""
    lines = table.rstrip("\n").split("\n")
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    parsed = []
    for line in lines[1:]:
        cells = []
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(line)
            # Right-aligned numbers end where their column ends; text starts where it starts.
            cells.append(line[start:end].strip())
            assert start == 0 or line[start - 1] == " ", f"misaligned: {line!r}"
        parsed.append(dict(zip(names, cells, strict=True)))
    return parsed


@pytest.fixture
async def gateway(upstream: RecordingUpstream, gateway_factory: GatewayFactory) -> GatewayProcess:
    policy = make_policy(
        upstream.url,
        [
            {"match": "ext/*"},
            {"match": "lease/*", "lease": {"issuer": "gateway", "ttl_s": 30}},
        ],
        timeout_s=TIMEOUT_S,
    )
    return await gateway_factory(policy, extra_env={"GATEWAY_RECONCILE_GRACE_S": "0"})


async def post(
    session: aiohttp.ClientSession, gateway: GatewayProcess, resource: str, fence: int, key: str
) -> str:
    headers = fenced_headers(resource, fence, **{"Idempotency-Key": key})
    result = await call(session, "POST", f"{gateway.url}/tool/ops", data=b"{}", headers=headers)
    return result.headers["X-Receipt-Id"]


@pytest.fixture
async def receipts(gateway: GatewayProcess, upstream: RecordingUpstream, session) -> dict[str, str]:
    """Three receipts on ext/a: succeeded (fence 2), rejected stale (fence 1), lost (fence 2)."""
    upstream.script(
        "/api/ops",
        lambda rec: Behavior(
            action="close" if rec.headers["Idempotency-Key"] == "k-lost" else "answer"
        ),
    )
    return {
        "ok": await post(session, gateway, "ext/a", 2, "k-ok"),
        "stale": await post(session, gateway, "ext/a", 1, "k-stale"),
        "lost": await post(session, gateway, "ext/a", 2, "k-lost"),
    }


class TestReceiptsList:
    """A readable table, the API's filters, paging, and the API's JSON for scripts."""

    async def test_table_shows_every_receipt_aligned(
        self, gateway: GatewayProcess, receipts: dict[str, str]
    ) -> None:
        run = await cli("receipts", "list", "--url", gateway.url)

        assert (run.code, run.err) == (0, "")
        table = rows(run.out)
        assert [
            {k: r[k] for k in ("ID", "RESOURCE", "FENCE", "CALL", "ATTEMPT", "HTTP", "STATUS")}
            for r in table
        ] == [
            {
                "ID": receipts["ok"],
                "RESOURCE": "ext/a",
                "FENCE": "2",
                "CALL": "POST /ops",
                "ATTEMPT": "1",
                "HTTP": "200",
                "STATUS": "succeeded",
            },
            {
                "ID": receipts["stale"],
                "RESOURCE": "ext/a",
                "FENCE": "1",
                "CALL": "POST /ops",
                "ATTEMPT": "-",
                "HTTP": "409",
                "STATUS": "rejected: stale_fence",
            },
            {
                "ID": receipts["lost"],
                "RESOURCE": "ext/a",
                "FENCE": "2",
                "CALL": "POST /ops",
                "ATTEMPT": "1",
                "HTTP": "-",
                "STATUS": "outcome_unknown (upstream_outcome_unknown)",
            },
        ]

    async def test_filters_and_json(
        self, gateway: GatewayProcess, receipts: dict[str, str], session
    ) -> None:
        url = ("--url", gateway.url)
        runs = await asyncio.gather(
            cli("receipts", "list", *url, "--status", "outcome_unknown", "--json"),
            cli("receipts", "list", *url, "--fence-min", "2", "--fence-max", "2", "--json"),
            cli("receipts", "list", *url, "--idempotency-key", "k-ok", "--json"),
            cli("receipts", "list", *url, "--resource", "ext/other"),
            cli("receipts", "list", *url, "--since", "2999-01-01T00:00:00Z"),
            cli("receipts", "list", *url, "--until", "2999-01-01T00:00:00.000Z", "--json"),
        )
        api_items = await fetch_receipts(session, gateway.url)

        assert [r.code for r in runs] == [0] * 6, [r.err for r in runs]
        ids = [[i["id"] for i in json.loads(r.out)["items"]] for r in (runs[0], runs[1], runs[2])]
        assert ids == [
            [receipts["lost"]],
            [receipts["ok"], receipts["lost"]],
            [receipts["ok"]],
        ]
        assert [runs[3].out, runs[4].out] == ["no receipts\n"] * 2
        assert json.loads(runs[5].out) == {"items": api_items, "next_cursor": None}

    async def test_paging_one_page_or_all(
        self, gateway: GatewayProcess, receipts: dict[str, str]
    ) -> None:
        url = ("--url", gateway.url)
        one_page, every_page, as_json = await asyncio.gather(
            cli("receipts", "list", *url, "--limit", "2"),
            cli("receipts", "list", *url, "--limit", "1", "--all"),
            cli("receipts", "list", *url, "--limit", "2", "--json"),
        )
        cursor = json.loads(as_json.out)["next_cursor"]
        rest = await cli("receipts", "list", *url, "--limit", "2", "--cursor", cursor)

        assert [r["ID"] for r in rows(one_page.out)] == [receipts["ok"], receipts["stale"]]
        assert "--all" in one_page.err and cursor in one_page.err
        assert [r["ID"] for r in rows(rest.out)] == [receipts["lost"]]
        assert (every_page.err, [r["ID"] for r in rows(every_page.out)]) == (
            "",
            list(receipts.values()),
        )


class TestReceiptsShowAndResolve:
    async def test_show_prints_the_whole_receipt(
        self, gateway: GatewayProcess, receipts: dict[str, str], session
    ) -> None:
        text, as_json = await asyncio.gather(
            cli("receipts", "show", receipts["ok"], "--url", gateway.url),
            cli("receipts", "show", receipts["ok"], "--url", gateway.url, "--json"),
        )
        async with session.get(f"{gateway.url}/_gateway/v1/receipts/{receipts['ok']}") as r:
            receipt = await r.json()

        assert json.loads(as_json.out) == receipt
        lines = dict(
            line.split(None, 1) if " " in line else (line, "") for line in text.out.splitlines()
        )
        shown = {
            name: (
                "-"
                if value is None
                else str(value).lower()
                if isinstance(value, bool)
                else str(value)
            )
            for name, value in receipt.items()
        }
        assert lines == shown
        assert lines["fingerprint"].startswith("sha256:")  # long values are not cut in show

    async def test_resolve_after_grace_and_refusals(
        self, gateway: GatewayProcess, receipts: dict[str, str], upstream: RecordingUpstream
    ) -> None:
        lost = receipts["lost"]
        url = ("--url", gateway.url)
        await asyncio.sleep(TIMEOUT_S + 0.1)  # past forwarded_at + timeout_s + grace (0)
        resolved = await cli(
            "receipts",
            "resolve",
            lost,
            *url,
            "--outcome",
            "not_applied",
            "--source",
            "operator:alice",
            "--note",
            "checked the ledger",
        )
        again = await cli(
            "receipts", "resolve", lost, *url, "--outcome", "applied", "--source", "operator:bob"
        )
        done = await cli(
            "receipts",
            "resolve",
            receipts["ok"],
            *url,
            "--outcome",
            "applied",
            "--source",
            "operator:bob",
            "--json",
        )
        missing = await cli("receipts", "show", "no-such-receipt", *url)

        assert resolved.code == 0, resolved.err
        first, _, record = resolved.out.partition("\n\n")
        assert first == f"reconciled {lost}: not_applied (source operator:alice)"
        assert re.search(r"^status +reconciled$", record, re.MULTILINE)
        assert re.search(r"^resolution\.note +checked the ledger$", record, re.MULTILINE)
        for run, code in (
            (again, "not_reconcilable"),
            (done, "not_reconcilable"),
            (missing, "not_found"),
        ):
            assert (run.code, run.out) == (1, "")
            assert run.err.startswith(f"fence-gateway: {code}: ")
            assert run.err.count("\n") == 1

    async def test_resolve_before_grace_is_refused(
        self, upstream: RecordingUpstream, gateway_factory: GatewayFactory, session
    ) -> None:
        upstream.default = Behavior(action="close")
        gateway = await gateway_factory(make_policy(upstream.url, [{"match": "ext/*"}]))
        lost = await post(session, gateway, "ext/a", 1, "k-1")
        run = await cli(
            "receipts",
            "resolve",
            lost,
            "--url",
            gateway.url,
            "--outcome",
            "applied",
            "--source",
            "operator:alice",
        )
        assert (run.code, run.out) == (1, "")
        assert re.fullmatch(r"fence-gateway: not_reconcilable: .*reconcilable from .*\n", run.err)


class TestLeasesList:
    async def test_leases_table_filters_and_json(self, gateway: GatewayProcess, session) -> None:
        for resource, owner in (("lease/a", "run-1"), ("lease/b", "run-2")):
            async with session.post(
                f"{gateway.url}/_gateway/v1/leases/{resource}", json={"owner": owner, "ttl_s": 30}
            ) as resp:
                assert resp.status == 201, await resp.text()
        async with session.delete(
            f"{gateway.url}/_gateway/v1/leases/lease/b", params={"force": "true"}
        ) as resp:
            assert resp.status == 204

        url = ("--url", gateway.url)
        table, held, as_json, none = await asyncio.gather(
            cli("leases", "list", *url),
            cli("leases", "list", *url, "--state", "held"),
            cli("leases", "list", *url, "--prefix", "lease/b", "--json"),
            cli("leases", "list", *url, "--prefix", "nothing/"),
        )

        assert [
            {k: r[k] for k in ("RESOURCE", "OWNER", "FENCE", "STATE")} for r in rows(table.out)
        ] == [
            {"RESOURCE": "lease/a", "OWNER": "run-1", "FENCE": "1", "STATE": "held"},
            {"RESOURCE": "lease/b", "OWNER": "run-2", "FENCE": "1", "STATE": "released"},
        ]
        assert [r["RESOURCE"] for r in rows(held.out)] == ["lease/a"]
        items = json.loads(as_json.out)["items"]
        assert [(i["resource"], i["state"]) for i in items] == [("lease/b", "released")]
        assert none.out == "no leases\n"


class TestFailures:
    """One line on stderr: exit 1 for the gateway's errors, 2 for bad arguments."""

    async def test_connection_refused(self) -> None:
        run = await cli("receipts", "list", "--url", f"http://127.0.0.1:{free_port()}")
        assert (run.code, run.out) == (1, "")
        assert re.fullmatch(r"fence-gateway: cannot reach the gateway at .*refused.*\n", run.err)

    @pytest.mark.parametrize(
        "argv",
        [
            ["receipts", "list", "--limit", "0"],
            ["receipts", "list", "--limit", "1001"],
            ["receipts", "list", "--status", "done"],
            ["receipts", "list", "--since", "yesterday"],
            ["receipts", "list", "--until", "2026-01-01T00:00:00"],  # no zone
            ["receipts", "list", "--fence-min", "-1"],
            ["receipts", "list", "--url", "ftp://127.0.0.1:1"],
            ["receipts", "resolve", "X", "--outcome", "maybe", "--source", "operator:a"],
            ["receipts", "resolve", "X", "--outcome", "applied"],
            ["receipts", "resolve", "X", "--outcome", "applied", "--source", " "],
            ["receipts", "show"],
            ["receipts"],
            ["leases", "list", "--state", "lost"],
        ],
    )
    async def test_bad_arguments_exit_2(self, argv: list[str]) -> None:
        run = await cli(*argv)  # refused by the parser: no request is made
        assert (run.code, run.out) == (2, "")
        assert run.err.startswith("fence-gateway: ") and run.err.count("\n") == 1, run.err

    async def test_key_is_sent_as_bearer_and_env_proxies_are_ignored(
        self, upstream: RecordingUpstream
    ) -> None:
        upstream.script(
            "/_gateway/v1/receipts",
            Behavior(body=b'{"items": [], "next_cursor": null}'),
        )
        dead_proxy = f"http://127.0.0.1:{free_port()}"
        run = await cli(
            "receipts",
            "list",
            "--url",
            f"http://127.0.0.1:{upstream.port}",
            env={"GATEWAY_KEY": "s3cret", "HTTP_PROXY": dead_proxy, "http_proxy": dead_proxy},
        )
        assert (run.code, run.out, run.err) == (0, "no receipts\n", "")
        [sent] = upstream.requests
        assert (sent.path_qs, sent.headers["Authorization"]) == (
            "/_gateway/v1/receipts",
            "Bearer s3cret",
        )

    async def test_an_answer_that_is_not_the_api(self, upstream: RecordingUpstream) -> None:
        upstream.script(
            "/_gateway/v1/receipts/x", Behavior(status=500, body=b"it broke\n", headers={})
        )
        upstream.script("/_gateway/v1/receipts", Behavior(body=b"[1, 2]"))
        base = f"http://127.0.0.1:{upstream.port}"
        failed, odd = await asyncio.gather(
            cli("receipts", "show", "x", "--url", base),
            cli("receipts", "list", "--url", base),
        )
        assert (failed.code, failed.err) == (1, "fence-gateway: http_500: it broke\n")
        assert (odd.code, odd.out) == (1, "")
        assert "is it a fence-gateway?" in odd.err
