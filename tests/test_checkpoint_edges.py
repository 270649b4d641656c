"""Checkpoints at their edges (docs/contract.md §17): a state is measured as the JSON its
owner sent, and an identical retry is one however its numbers are written: a retry with big
numbers is not a second checkpoint."""

from __future__ import annotations

import json
from typing import Any

from tests.harness import (
    AppFactory,
    InProcessGateway,
    RecordingUpstream,
    make_policy,
)


def _policy(upstream: RecordingUpstream) -> dict[str, Any]:
    return make_policy(
        upstream.url,
        [
            {"match": "g/*", "lease": {"issuer": "gateway", "ttl_s": 30}},
            {"match": "ext/**", "lease": {"issuer": "external"}},
        ],
    )


async def _checkpoint(gw: InProcessGateway, resource: str, fence: int, body: bytes):
    return await gw.send(
        "PUT",
        f"/_gateway/v1/checkpoints/{resource}",
        data=body,
        headers={"X-Fence-Token": str(fence), "Content-Type": "application/json"},
    )


class TestStateSize:
    async def test_state_is_measured_as_the_compact_json_sent(
        self, make_app: AppFactory, upstream: RecordingUpstream
    ) -> None:
        """§17: `state` is measured as compact JSON, at most 65536 bytes. A state of 10,000
        numbers written `1e30` is 50,001 bytes of compact JSON (60,001 as Python writes it,
        `1e+30`): it must be kept. The API's body parser turns each whole number written with
        an exponent into an int of 31 digits, so the gateway measures 320,001 bytes."""
        gw = await make_app(_policy(upstream))
        state = "[" + ",".join(["1e30"] * 10000) + "]"
        assert len(json.dumps(json.loads(state), separators=(",", ":"))) <= 65536
        body = ('{"step":"s","state":' + state + "}").encode()
        assert len(body) < 131072
        status, _h, answer = await _checkpoint(gw, "ext/a", 5, body)
        assert status == 201, answer


class TestIdenticalRetry:
    async def test_a_very_large_number_written_either_way_is_one_state(
        self, make_app: AppFactory, upstream: RecordingUpstream
    ) -> None:
        """§17: an identical retry (same fence, owner, step, `state` equal as JSON) answers
        200 and appends nothing. `1e31` and `10000000000000000000000000000000` are one JSON
        number, as `1e30` and `1000000000000000000000000000000` are (which the gateway does
        count as equal): a retry that writes it the other way must not append."""
        gw = await make_app(_policy(upstream))
        for exponent in (30, 31):
            resource = f"ext/n{exponent}"
            digits = "1" + "0" * exponent
            status, _h, first = await _checkpoint(
                gw, resource, 5, f'{{"step":"s","state":{{"n":{digits}}}}}'.encode()
            )
            assert (status, first["seq"]) == (201, 1)
            status, _h, retry = await _checkpoint(
                gw, resource, 5, f'{{"step":"s","state":{{"n":1e{exponent}}}}}'.encode()
            )
            assert (status, retry["seq"]) == (200, 1), (exponent, retry)
