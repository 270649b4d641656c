"""Checkpoints and the run view in SQL, the same on every backend (docs/contract.md §17).

Each statement is written once with `placeholder(n)` for the backend's n-th parameter, so
SQLite (`?`) and PostgreSQL (`$n`) read and prune alike; rows turn into values here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gateway.core.checkpoints import RUN_VIEW_LIST_MAX, Checkpoint, Group, statuses_of
from gateway.store.ids import id_floor
from gateway.store.rows import RECEIPT_SELECT

Placeholder = Callable[[int], str]

CHECKPOINT_COLUMNS = (
    "resource",
    "seq",
    "fence",
    "owner",
    "client",
    "step",
    "state",
    "at",
    "mark",
)
CHECKPOINT_SELECT = ", ".join(CHECKPOINT_COLUMNS)

# Receipt ids begin with the millisecond they were made in, by the clock of the process that
# made them: on PostgreSQL the id of a rejection, and of a call admitted in one statement, is
# the replica's clock while its `created_at` is the database's. Receipts made after a
# checkpoint are looked for from this long before it, so the (resource, id) index bounds the
# scan and a replica's clock that is behind by less than this still counts its receipts.
ID_MARGIN_S = 60.0


def checkpoint_of(row: Mapping[str, Any]) -> Checkpoint:
    return Checkpoint(**{name: row[name] for name in CHECKPOINT_COLUMNS})


def latest_checkpoint(p: Placeholder) -> str:
    """The resource's newest checkpoint; parameters: resource."""
    return (
        f"SELECT {CHECKPOINT_SELECT} FROM checkpoints WHERE resource = {p(1)} "
        "ORDER BY seq DESC LIMIT 1"
    )


def insert_checkpoint(p: Placeholder) -> str:
    """The resource's new last checkpoint: it does not expire while it is the last.
    Parameters: resource, seq, fence, owner, client, step, state, at, mark, retention_s."""
    values = ", ".join(p(n) for n in range(1, 11))
    return f"INSERT INTO checkpoints ({CHECKPOINT_SELECT}, retention_s) VALUES ({values})"


def retire_checkpoint(p: Placeholder) -> str:
    """A checkpoint that is no longer the last starts to expire, counted from when it was
    written. Parameters: resource, seq."""
    return (
        "UPDATE checkpoints SET expires_at = at + retention_s "
        f"WHERE resource = {p(1)} AND seq = {p(2)}"
    )


def list_checkpoints(p: Placeholder, before: bool) -> str:
    """Newest first; parameters: resource, [before_seq,] limit."""
    bound = f"AND seq < {p(2)} " if before else ""
    return (
        f"SELECT {CHECKPOINT_SELECT} FROM checkpoints WHERE resource = {p(1)} {bound}"
        f"ORDER BY seq DESC LIMIT {p(3 if before else 2)}"
    )


def prune_checkpoints(p: Placeholder, now_sql: str) -> str:
    """Past retention (a last checkpoint has no `expires_at`); parameters: batch size."""
    return (
        "DELETE FROM checkpoints WHERE (resource, seq) IN (SELECT resource, seq FROM "
        f"checkpoints WHERE expires_at < {now_sql} LIMIT {p(1)})"
    )


def since(checkpoint: Checkpoint | None) -> tuple[str, str, float]:
    """(lowest receipt id to look at, the checkpoint's mark, its `at`): the parameters of the
    receipts made since `checkpoint`; every receipt of the resource when there is none.

    A receipt is made since the checkpoint when its id sorts after the checkpoint's mark (the
    store makes both from one sequence: exact within one process, even when the clock steps
    back, for ids made under the resource's lock) or it was created after the checkpoint by
    the store's clock (which orders the receipts of other replicas, whose ids made within the
    same millisecond sort by chance, and those of a PostgreSQL admission in one statement,
    whose id is made before it waits for the lock).
    Either way a receipt that may be later is shown: a call shown once too often is checked
    once more, one left out would be redone blindly."""
    if checkpoint is None:
        return "", "", float("-inf")
    return id_floor(checkpoint.at - ID_MARGIN_S), checkpoint.mark, checkpoint.at


_SINCE = "resource = {r} AND id >= {i} AND (id > {m} OR created_at > {t})"


def _where(p: Placeholder) -> str:
    return _SINCE.format(r=p(1), i=p(2), m=p(3), t=p(4))


def group_receipts(p: Placeholder, group: Group) -> str:
    """The newest receipts of `group` made since the checkpoint, newest first; parameters:
    resource and `since`'s."""
    statuses = ", ".join(f"'{status}'" for status in statuses_of(group))
    return (
        f"SELECT {RECEIPT_SELECT} FROM receipts WHERE {_where(p)} AND status IN ({statuses}) "
        f"ORDER BY id DESC LIMIT {RUN_VIEW_LIST_MAX}"
    )


def tallies(p: Placeholder) -> str:
    """The rejected receipts made since the checkpoint, and per upstream when the earliest
    `outcome_unknown` call among them left (`gateway.core.checkpoints.run_state`), in one
    read: rows of (status, upstream, n, left_at)."""
    return (
        "SELECT status, upstream, count(*) AS n, min(coalesce(forwarded_at, created_at)) "
        f"AS left_at FROM receipts WHERE {_where(p)} AND status IN ('rejected', "
        "'outcome_unknown') GROUP BY status, upstream"
    )


def rejected_and_unknown(rows: Iterable[Mapping[str, Any]]) -> tuple[int, dict[str, float]]:
    """`tallies`' rows: (how many rejected, per upstream when the earliest unknown left)."""
    rejected, unknown = 0, {}
    for row in rows:
        if row["status"] == "rejected":
            rejected += row["n"]
        else:
            unknown[row["upstream"]] = row["left_at"]
    return rejected, unknown
