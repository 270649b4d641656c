"""The store contract for trace ids (docs/contract.md §21), on every backend: an admitted
call's receipt, a session's, one admission refused and one rejected before admission keep
the `trace_id` they were written with; a receipt written without one says null."""

import dataclasses

from gateway.store.base import Admitted, Refused, Rejection
from tests.store.test_contract import call
from tests.store.test_contract_sessions import session

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class TestTraceIds:
    async def test_every_kind_of_receipt_keeps_its_trace_id(self, store) -> None:
        admitted = await store.admit(dataclasses.replace(call(5), trace_id=TRACE))
        assert isinstance(admitted, Admitted)
        stale = await store.admit(dataclasses.replace(call(4, key="k2"), trace_id=TRACE[::-1]))
        assert isinstance(stale, Refused) and stale.code == "stale_fence"
        opened = await store.admit(dataclasses.replace(session(6), trace_id="ab" * 16))
        assert isinstance(opened, Admitted)
        rejected = await store.reject(
            Rejection(
                "acct/1",
                7,
                None,
                None,
                "tool",
                "POST",
                "/x",
                "missing_fence",
                428,
                trace_id="0f" * 16,
            )
        )
        kept = [
            (await store.get_receipt(receipt_id)).to_json()["trace_id"]
            for receipt_id in (admitted.receipt_id, stale.receipt_id, opened.receipt_id, rejected)
        ]
        assert kept == [TRACE, TRACE[::-1], "ab" * 16, "0f" * 16]

    async def test_a_receipt_without_a_trace_says_null(self, store) -> None:
        admitted = await store.admit(call(5))
        assert isinstance(admitted, Admitted)
        assert (await store.get_receipt(admitted.receipt_id)).to_json()["trace_id"] is None
