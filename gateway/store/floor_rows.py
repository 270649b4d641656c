"""Fence floors (docs/contract.md §18) from any backend's rows: the `fence_floor` row, the
`fence_raises` rules and a resource's `fences` row become `gateway.core.floors` values."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from gateway.core.floors import FenceRow, Floors, Raise

RESTORED_ERROR = "store_restored"
"""The `error` of a receipt a restore found `pending` and turned `outcome_unknown`."""


def floors_of(floor: int | None, epoch: int | None, raises: Iterable[Raise]) -> Floors:
    """`floor` and `epoch` None: a store without the row (it has never been migrated)."""
    return Floors(floor or 0, epoch or 0, tuple(raises))


def raises_of(rows: Iterable[Mapping[str, Any]]) -> list[Raise]:
    return [Raise(row["match"], row["at_least"], row["epoch"]) for row in rows]


def raises_of_json(text: str | None) -> list[Raise]:
    """The raises as PostgreSQL aggregates them into the admission's statement:
    `[[match, at_least, epoch], ...]`, or NULL for none."""
    if not text:
        return []
    return [Raise(str(m), int(a), int(e)) for m, a, e in json.loads(text)]


def fence_row_of(row: Mapping[str, Any] | None) -> FenceRow:
    """A resource's fences row; a resource never seen has none."""
    if row is None:
        return FenceRow()
    return FenceRow(row["issued"], row["accepted"], row["lifted"])
