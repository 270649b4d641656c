"""`fence-gateway fences raise GLOB --to N` (docs/contract.md §18): raise the fences of every
resource a glob covers on a running gateway, known now or first seen later. After a restore
it lets an external issuer's resources off hold at the issuer's current token; at any time it
fences out a token known to have leaked. It talks to the API (`POST /_gateway/v1/fences/raise`,
admin) like `leases` and `receipts` (`gateway.cli.remote`): `--url`, the key in `GATEWAY_KEY`.
"""

from __future__ import annotations

import argparse
import json
from typing import TypeVar

from gateway.cli.remote import Api, add_connection_options
from gateway.core.globs import valid_glob
from gateway.core.grammar import MAX_FENCE

_Parser = TypeVar("_Parser", bound=argparse.ArgumentParser)


def _glob(value: str) -> str:
    if not valid_glob(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a resource glob (* within a segment, ** across segments)"
        )
    return value


def _at_least(value: str) -> int:
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_FENCE:
        raise argparse.ArgumentTypeError(f"{value!r}: a whole number from 1 to {MAX_FENCE}")
    return int(value)


def add_commands(commands: argparse._SubParsersAction[_Parser]) -> None:
    fences = commands.add_parser("fences", help="raise fences on a running gateway (admin)")
    actions = fences.add_subparsers(dest="action", required=True, metavar="ACTION")
    raising = actions.add_parser(
        "raise",
        parents=add_connection_options(),
        help="raise every resource a glob covers, known now or first seen later, to at "
        "least N (never lowers)",
    )
    raising.add_argument("glob", type=_glob, help='a resource or a glob, e.g. "ext/**"')
    raising.add_argument("--to", required=True, type=_at_least, metavar="N")
    raising.set_defaults(handler=_raise)


def _raise(api: Api, args: argparse.Namespace) -> int:
    answer = api.request("POST", "/fences/raise", body={"match": args.glob, "at_least": args.to})
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    known = answer.get("known_resources") if isinstance(answer, dict) else None
    noun = "resource" if known == 1 else "resources"
    print(
        f"raised {args.glob} to at least {args.to}: {known} known {noun}, and every one "
        "first seen later"
    )
    return 0
