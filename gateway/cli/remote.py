"""`leases list` and `receipts list|show|resolve`: an operator's view of a running gateway.

These commands only talk to the gateway's API (`/_gateway/v1`, docs/contract.md §6 and §7),
never to its database, so they work the same against any replica and any store.

Why the standard library's `urllib` and not aiohttp: a command makes one request (or a few,
following cursors), prints, and exits. A blocking client needs no event loop, starts faster,
and its failures map simply onto the two ways a command can end badly: the gateway answered
with an error (problem+json: `fence-gateway: <code>: <detail>`, exit 1) or it could not be
reached (one line, exit 1). Bad arguments are refused by the parser before any request (exit
2). Proxies from the environment are ignored on purpose: the key in `GATEWAY_KEY` goes to
`--url` and nowhere else.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from gateway.core.times import parse_rfc3339

DEFAULT_URL = "http://127.0.0.1:8080"
API = "/_gateway/v1"
EXIT_FAILED = 1
EXIT_CONFIG = 2
TIMEOUT_S = 30.0
MAX_LIMIT = 1000
RECEIPT_STATUSES = (
    "pending",
    "succeeded",
    "failed",
    "not_sent",
    "outcome_unknown",
    "rejected",
    "reconciled",
)
LEASE_STATES = ("held", "expired", "released")
OUTCOMES = ("applied", "not_applied", "compensated")
_CELL_MAX = 48  # a table cell longer than this is cut with "…"; `show` prints everything
_Parser = TypeVar("_Parser", bound=argparse.ArgumentParser)


# -- arguments ----------------------------------------------------------------------------------


def _url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError for a port that is no number in range
        (parts.hostname or "").encode("idna")  # an empty or overlong label: UnicodeError
    except (ValueError, UnicodeError):
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
    ):
        raise argparse.ArgumentTypeError(f"{value!r} is not a gateway URL like {DEFAULT_URL}")
    return value.rstrip("/")


def _limit(value: str) -> int:
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"{value!r}: a whole number from 1 to {MAX_LIMIT}")
    return int(value)


def _fence(value: str) -> int:
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        raise argparse.ArgumentTypeError(f"{value!r}: a non-negative whole number")
    return int(value)


def _moment(value: str) -> str:
    try:
        parse_rfc3339(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: an RFC 3339 time with a zone, e.g. 2026-08-29T05:07:00.000Z"
        ) from None
    return value


def _text(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def add_connection_options() -> list[Any]:
    """`--url` and `--json`, as `parents` of a command that talks to a running gateway."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        type=_url,
        default=DEFAULT_URL,
        help=f"the gateway (default {DEFAULT_URL}); the key is read from "
        "the GATEWAY_KEY environment variable",
    )
    common.add_argument("--json", action="store_true", help="print the API's JSON")
    # typeshed wants `parents` of the sub-parsers' own class; argparse takes any ArgumentParser
    # (it only copies the parent's arguments).
    return [common]


def add_commands(commands: argparse._SubParsersAction[_Parser]) -> None:
    """Register `leases` and `receipts` on the CLI's sub-command parser."""
    parents: list[_Parser] = add_connection_options()

    leases = commands.add_parser("leases", help="leases of a running gateway")
    lease_actions = leases.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = lease_actions.add_parser("list", parents=parents, help="list leases")
    listing.add_argument("--prefix", help="only resources starting with this")
    listing.add_argument("--state", choices=LEASE_STATES)
    _add_paging(listing, "leases")
    listing.set_defaults(handler=_leases_list)

    receipts = commands.add_parser("receipts", help="operation receipts of a running gateway")
    receipt_actions = receipts.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = receipt_actions.add_parser(
        "list", parents=parents, help="list receipts, oldest first"
    )
    listing.add_argument("--resource")
    listing.add_argument("--status", choices=RECEIPT_STATUSES)
    listing.add_argument("--owner")
    listing.add_argument("--idempotency-key")
    listing.add_argument("--fence-min", type=_fence)
    listing.add_argument("--fence-max", type=_fence)
    listing.add_argument("--since", type=_moment, help="RFC 3339, inclusive")
    listing.add_argument("--until", type=_moment, help="RFC 3339, exclusive")
    _add_paging(listing, "receipts")
    listing.set_defaults(handler=_receipts_list)

    show = receipt_actions.add_parser("show", parents=parents, help="one whole receipt")
    show.add_argument("id", type=_text)
    show.set_defaults(handler=_receipts_show)

    resolve = receipt_actions.add_parser(
        "resolve",
        parents=parents,
        help="reconcile an outcome_unknown receipt: say what became of its call",
    )
    resolve.add_argument("id", type=_text)
    resolve.add_argument("--outcome", required=True, choices=OUTCOMES)
    resolve.add_argument(
        "--source", required=True, type=_text, help="who decided, e.g. operator:alice"
    )
    resolve.add_argument("--note")
    resolve.set_defaults(handler=_receipts_resolve)


def _add_paging(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--limit", type=_limit, help=f"{what} per page (default 100, at most {MAX_LIMIT})"
    )
    parser.add_argument("--cursor", help="continue after a page (printed when there is more)")
    parser.add_argument("--all", action="store_true", help="follow every page")


def run(args: argparse.Namespace) -> int:
    key = os.environ.get("GATEWAY_KEY") or None
    if key is not None and not re.fullmatch(r"[\x21-\x7e]{1,255}", key):
        _error("GATEWAY_KEY: a key is 1 to 255 visible ASCII characters (no space or line end)")
        return EXIT_CONFIG
    api = Api(args.url, key)
    handler: Callable[[Api, argparse.Namespace], int] = args.handler  # set by add_commands
    try:
        return handler(api, args)
    except Problem as problem:
        _error(f"{problem.code}: {problem.detail}")
    except Unreachable as exc:
        _error(str(exc))
    except BrokenPipeError:  # `… | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return EXIT_FAILED


def _error(message: str) -> None:
    print(f"fence-gateway: {message}", file=sys.stderr)


# -- the API ------------------------------------------------------------------------------------


class Problem(Exception):
    """The gateway answered with an error (problem+json, or anything else that is not 2xx)."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class Unreachable(Exception):
    """No usable answer: refused, timed out, broken, or not what a gateway answers."""


class Api:
    def __init__(self, base_url: str, key: str | None) -> None:
        self.base_url = base_url
        self._headers = {"Accept": "application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        # No ProxyHandler from the environment: see the module docstring.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
    ) -> Any:
        params = {k: str(v) for k, v in (query or {}).items() if v is not None}
        url = self.base_url + API + path + (f"?{urlencode(params)}" if params else "")
        headers = dict(self._headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=TIMEOUT_S) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise _problem(exc) from None
        except urllib.error.URLError as exc:
            raise Unreachable(
                f"cannot reach the gateway at {self.base_url}: {_reason(exc.reason)}"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(
                f"cannot reach the gateway at {self.base_url}: {_reason(exc)}"
            ) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise Unreachable(
                f"{self.base_url} answered {method} {path} with something that "
                "is not JSON: is it a fence-gateway?"
            ) from None

    def record(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One receipt or lease: a JSON object with an `id` or a `resource`."""
        answer = self.request(method, path, body=body)
        if not isinstance(answer, dict) or not ("id" in answer or "resource" in answer):
            raise Unreachable(
                f"{self.base_url} answered {method} {path} with something that "
                "is not a record: is it a fence-gateway?"
            )
        return answer

    def pages(self, path: str, query: dict[str, Any], follow: bool) -> Iterator[dict[str, Any]]:
        """Pages of a list, following `next_cursor` when `follow`."""
        seen: set[str] = set()
        while True:
            page = self.request("GET", path, query)
            if not isinstance(page, dict) or not isinstance(page.get("items"), list):
                raise Unreachable(
                    f"{self.base_url} answered GET {path} with something that is "
                    "not a list page: is it a fence-gateway?"
                )
            yield page
            cursor = page.get("next_cursor")
            if not follow or not cursor or cursor in seen:
                return
            seen.add(cursor)
            query = {**query, "cursor": cursor}


def _problem(exc: urllib.error.HTTPError) -> Problem:
    try:
        raw = exc.read()
    except (OSError, http.client.HTTPException):
        raw = b""
    content_type = (exc.headers.get("Content-Type") or "").split(";")[0].strip()
    if content_type in ("application/problem+json", "application/json"):
        try:
            document = json.loads(raw)
            return Problem(
                exc.code,
                str(document["code"]),
                str(document.get("detail") or document.get("title") or ""),
            )
        except (ValueError, KeyError, TypeError):
            pass
    text = raw.decode("utf-8", "replace").strip().splitlines()
    return Problem(exc.code, f"http_{exc.code}", text[0][:200] if text else str(exc.reason))


def _reason(reason: object) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is it running? is --url right?)"
    if isinstance(reason, TimeoutError):
        return f"no answer within {TIMEOUT_S:g}s"
    return str(reason) or type(reason).__name__


# -- commands -----------------------------------------------------------------------------------


def _leases_list(api: Api, args: argparse.Namespace) -> int:
    query = {"prefix": args.prefix, "state": args.state, "limit": args.limit, "cursor": args.cursor}
    return _list(api, args, "/leases", query, "leases", _LEASE_COLUMNS)


def _receipts_list(api: Api, args: argparse.Namespace) -> int:
    query = {
        "resource": args.resource,
        "status": args.status,
        "owner": args.owner,
        "idempotency_key": args.idempotency_key,
        "fence_min": args.fence_min,
        "fence_max": args.fence_max,
        "since": args.since,
        "until": args.until,
        "limit": args.limit,
        "cursor": args.cursor,
    }
    return _list(api, args, "/receipts", query, "receipts", _RECEIPT_COLUMNS)


def _receipts_show(api: Api, args: argparse.Namespace) -> int:
    receipt = api.record("GET", f"/receipts/{quote(args.id, safe='')}")
    print(json.dumps(receipt, indent=2) if args.json else _record(receipt))
    return 0


def _receipts_resolve(api: Api, args: argparse.Namespace) -> int:
    body = {"outcome": args.outcome, "source": args.source}
    if args.note is not None:
        body["note"] = args.note
    receipt = api.record("POST", f"/receipts/{quote(args.id, safe='')}/resolve", body)
    if args.json:
        print(json.dumps(receipt, indent=2))
    else:
        print(f"reconciled {receipt['id']}: {args.outcome} (source {args.source})\n")
        print(_record(receipt))
    return 0


Column = tuple[str, Callable[[dict[str, Any]], Any]]


def _list(
    api: Api,
    args: argparse.Namespace,
    path: str,
    query: dict[str, Any],
    what: str,
    columns: Sequence[Column],
) -> int:
    items: list[dict[str, Any]] = []
    cursor = None
    for page in api.pages(path, query, args.all):
        items.extend(page["items"])
        cursor = page.get("next_cursor")
    if args.json:
        print(json.dumps({"items": items, "next_cursor": None if args.all else cursor}, indent=2))
        return 0
    if not items:
        print(f"no {what}")
    else:
        print(table(columns, items))
    if cursor and not args.all:
        print(f"(more {what}: add --all, or --cursor {cursor})", file=sys.stderr)
    return 0


def _tool_of(receipt: dict[str, Any]) -> str:
    """An MCP tool call's tool, after its path (docs/contract.md §16)."""
    mcp = receipt.get("mcp")
    return f" {mcp.get('tool')}" if isinstance(mcp, dict) else ""


def _receipt_status(r: dict[str, Any]) -> str:
    status = str(r.get("status") or "-")
    resolution = r.get("resolution")
    if status == "rejected" and r.get("reject_code"):
        status += f": {r['reject_code']}"
    elif status == "reconciled" and isinstance(resolution, dict):
        status += f": {resolution.get('outcome')}"
    error = r.get("error")
    extra: list[str] = [error] if error else []
    if r.get("late"):
        extra.append("late")
    return f"{status} ({', '.join(extra)})" if extra else status


_RECEIPT_COLUMNS: tuple[Column, ...] = (
    ("ID", lambda r: r.get("id")),
    ("CREATED", lambda r: r.get("created_at")),
    ("RESOURCE", lambda r: r.get("resource")),
    ("FENCE", lambda r: r.get("fence")),
    ("OWNER", lambda r: r.get("owner")),
    ("CALL", lambda r: f"{r.get('method')} {r.get('path')}{_tool_of(r)}"),
    ("ATTEMPT", lambda r: r.get("attempt")),
    ("HTTP", lambda r: r.get("http_status")),
    ("STATUS", _receipt_status),
)
_LEASE_COLUMNS: tuple[Column, ...] = (
    ("RESOURCE", lambda r: r.get("resource")),
    ("OWNER", lambda r: r.get("owner")),
    ("FENCE", lambda r: r.get("fence")),
    ("STATE", lambda r: r.get("state")),
    ("ACQUIRED", lambda r: r.get("acquired_at")),
    ("EXPIRES", lambda r: r.get("expires_at")),
)


def _cell(value: Any, cut: bool) -> str:
    text = "-" if value is None else str(value).replace("\n", " ")
    return text if not cut or len(text) <= _CELL_MAX else text[: _CELL_MAX - 1] + "…"


def table(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> str:
    """Aligned columns, numbers to the right. Long cells are cut, except in the last column,
    which has nothing to its right to push away (`show` prints everything whole)."""
    last = len(columns) - 1
    values = [[get(row) for _, get in columns] for row in rows]
    cells = [[_cell(v, i != last) for i, v in enumerate(line)] for line in values]
    numeric = [
        any(isinstance(line[i], int) for line in values)
        and all(isinstance(line[i], int) or line[i] is None for line in values)
        for i in range(len(columns))
    ]
    widths = [
        max(len(name), *(len(line[i]) for line in cells)) for i, (name, _) in enumerate(columns)
    ]

    def line(texts: Sequence[str]) -> str:
        parts = [
            t.rjust(w) if num else t.ljust(w)
            for t, w, num in zip(texts, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line([name for name, _ in columns]), *(line(c) for c in cells)])


def _record(record: dict[str, Any]) -> str:
    """Every field of a record, one per line; nested ones (resolution) as `name.field`."""
    flat: list[tuple[str, Any]] = []
    for name, value in record.items():
        if isinstance(value, dict):
            flat.extend((f"{name}.{k}", v) for k, v in value.items())
        else:
            flat.append((name, value))
    width = max(len(name) for name, _ in flat)

    def shown(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)

    return "\n".join(f"{name.ljust(width)}  {shown(value)}" for name, value in flat)
