"""Receipt lists on PostgreSQL, in an order in which a page's end never skips a receipt.

A receipt's id is made by its replica before the admission's transaction commits, and
transactions commit in any order: a list ordered by id could end a page past the id of a
receipt that becomes visible a moment later, and the next page would never show it
(docs/contract.md §7: a cursor never skips). So a list here is ordered by the id of the
transaction that admitted each receipt (`admitted_by`, schema 12), then by the receipt's id,
and shows a receipt only when every transaction of this database with a smaller id had ended
when the list was read (its horizon). A receipt that becomes visible later was admitted by a
transaction that had not ended then, whose id is at or above the horizon, so it sorts after
the end of every page read before it.

The price: the newest receipts are listed once the transactions of this database that were
open when they were admitted have ended. An admission's lasts milliseconds; a long transaction
of another client of the same database holds the list's tail back for as long as it lasts.
Transactions of other databases of the server count only while `pg_stat_activity` does not
show the gateway's role which database they are in (another role's, unless the gateway's may
read all statistics).
"""

from __future__ import annotations

import re

from gateway.store.base import ReceiptQuery
from gateway.store.rows import RECEIPT_SELECT, receipt_conditions, where

# The smallest id of a transaction still open in the statement's snapshot, not counting those
# `pg_stat_activity` places in another database; the snapshot's upper bound when there is none.
# `pg_current_snapshot()` is the statement's own snapshot, the one its rows are read in.
_HORIZON = (
    "horizon AS MATERIALIZED (SELECT coalesce(("
    "SELECT min(open) FROM pg_snapshot_xip(pg_current_snapshot()) AS open "
    "WHERE open::xid NOT IN (SELECT backend_xid FROM pg_stat_activity "
    "WHERE datname <> current_database() AND backend_xid IS NOT NULL)"
    "), pg_snapshot_xmax(pg_current_snapshot())) AS below)"
)

# A position is `<admitted_by>.<receipt id>`. Any other string the API's cursor pattern admits
# is still a harmless lower bound: read as a receipt id admitted before this order existed.
_POSITION = re.compile(r"(\d{1,20})\.(.*)", re.DOTALL)


def position(admitted_by: int, receipt_id: str) -> str:
    return f"{admitted_by}.{receipt_id}"


def after(value: str) -> tuple[int, str]:
    """The transaction id and the receipt id a position names."""
    match = _POSITION.fullmatch(value)
    if match is None or int(match[1]) >= 2**64:
        return 0, value
    return int(match[1]), match[2]


def receipt_list(query: ReceiptQuery) -> tuple[str, list[object]]:
    """The statement of one page and its parameters; each row has the receipt's columns and
    `admitted_by`."""
    conditions, params = receipt_conditions(query, lambda n: f"${n}")
    conditions.append("admitted_by < (SELECT below FROM horizon)")
    if query.after is not None:
        n = len(params)
        conditions.append(f"(admitted_by, id) > (${n + 1}::xid8, ${n + 2})")
        params.extend(after(query.after))
    sql = (
        f"WITH {_HORIZON} SELECT {RECEIPT_SELECT}, admitted_by "
        f"FROM receipts {where(conditions)} ORDER BY admitted_by, id LIMIT ${len(params) + 1}"
    )
    return sql, [*params, query.limit]
