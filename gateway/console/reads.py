"""What the pages read from the store, each read bounded: a console page never reads more
than `MOST_RECEIPTS` receipts, however busy the gateway, and says so when it stopped there."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.api.params import MAX_LIMIT
from gateway.core.leases import Lease
from gateway.store.base import Receipt, ReceiptPage, ReceiptQuery, Store

MOST_RECEIPTS = 20_000
QUEUE_PAGE = 50
LEASE_PAGE = 100


@dataclass(frozen=True, slots=True)
class Receipts:
    items: list[Receipt]
    complete: bool  # False: there were more than were read


async def receipts_since(
    store: Store, since: float, resource: str | None = None, most: int = MOST_RECEIPTS
) -> Receipts:
    """The receipts created from `since` on (of one resource, when given), oldest first."""
    items: list[Receipt] = []
    after: str | None = None
    while len(items) < most:
        size = min(MAX_LIMIT, most - len(items))
        page = await store.list_receipts(
            ReceiptQuery(resource=resource, since=since, after=after, limit=size)
        )
        items += page.items
        if len(page.items) < size:
            return Receipts(items, complete=True)
        after = page.end
    return Receipts(items, complete=False)


async def waiting(store: Store, after: str | None, limit: int = QUEUE_PAGE) -> ReceiptPage:
    """A page of the reconciliation queue: `outcome_unknown` receipts, oldest first, as
    `GET /_gateway/v1/reconciliation` lists them."""
    return await store.list_receipts(
        ReceiptQuery(status="outcome_unknown", after=after, limit=limit)
    )


async def count_waiting(store: Store, most: int = MOST_RECEIPTS) -> tuple[int, bool]:
    """How many receipts wait in the queue; False when there were more than `most`."""
    count, after = 0, None
    while count < most:
        size = min(MAX_LIMIT, most - count)
        page = await waiting(store, after, size)
        count += len(page.items)
        if len(page.items) < size:
            return count, True
        after = page.end
    return count, False


async def leases(
    store: Store, state: str | None, after: str | None, limit: int = LEASE_PAGE
) -> list[Lease]:
    return await store.list_leases(None, state, after, limit)
