"""The pure parts of MCP tool calls (docs/contract.md §16): canonical JSON (RFC 8785), which
messages are tool calls and what disagrees, the `_meta` lease, keys, outcomes from answers,
SSE events cut from arbitrary chunks, and the policy checks of `mcp` and `tools`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.client import mcp_meta
from gateway.config.policy_files import PolicyError, load_policies
from gateway.core import errors
from gateway.core import mcp as m
from gateway.core.canonical_json import NotCanonicalizable, canonical_json
from gateway.core.sse import EventTooLarge, SseSplitter
from tests.harness import make_policy, write_policy


def test_canonical_json_is_rfc_8785() -> None:
    # the example of RFC 8785, section 3.2.2
    source = (
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001], '
        r'"string": "\u20ac$\u000F\u000aA' + "'" + r'\u0042\u0022\u005c\\\"\/", '
        '"literals": [null, true, false]}'
    )
    assert (
        canonical_json(json.loads(source))
        == (
            '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
            '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
        ).encode()
    )
    # members sorted by UTF-16 code units (RFC 8785 section 3.2.3)
    names = ["\u20ac", "\r", "\ufb33", "1", "\U0001f600", "\u0080", "\u00f6"]
    ordered = json.loads(canonical_json(dict.fromkeys(names, 0)))
    assert list(ordered) == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]
    for number, text in [
        (0.0, "0"),
        (-0.0, "0"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (1e-7, "1e-7"),
        (1e-6, "0.000001"),
        (1.0, "1"),
        (-1.5, "-1.5"),
    ]:
        assert canonical_json(number) == text.encode()
    assert canonical_json(2**60 + 1) == str(2**60 + 1).encode()  # never rounded to a double
    for bad in (float("nan"), float("inf")):
        with pytest.raises(NotCanonicalizable):
            canonical_json(bad)


def call_body(request_id: object = 1, **params: object) -> bytes:
    return json.dumps(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "tools/call",
            "params": {"name": "send", "arguments": {"a": 1}, **params},
        }
    ).encode()


def read(body: bytes, method: str | None = None, name: str | None = None) -> m.Message:
    return m.read_message(m.parse_body(body), method, name)


def test_which_messages_are_tool_calls_and_what_is_refused() -> None:
    call = read(call_body(), "tools/call", "send")
    assert isinstance(call, m.ToolCall) and (call.id, call.tool) == (1, "send")
    assert call.operation == b'{"a":1}' and call.stripped_body is None
    listing = b'{"jsonrpc":"2.0","id":"x","method":"tools/list"}'
    assert read(listing) == m.OtherMessage("x", None)
    assert read(b'[{"jsonrpc":"2.0","id":1,"method":"tools/list"}]') == m.OtherMessage(None, None)
    refused = [
        (call_body(), "tools/list", None),  # Mcp-Method disagrees
        (call_body(), None, "other"),  # Mcp-Name disagrees
        (call_body(), None, "=?base64?!!?="),  # a malformed encoded name never agrees
        (b"not json", "tools/call", None),
        (b"not json", None, None),  # not JSON: it might be a tool call to another reader
        (b"[" + call_body() + b"]", None, None),  # a batch holding a tool call
        (call_body(None), None, None),  # a tool call without an id
        (call_body(True), None, None),
        (call_body(arguments=[1]), None, None),
        (call_body(arguments={"x": float("inf")}), None, None),
        (b'{"id":1,"id":2,"method":"tools/list"}', None, None),  # a member named twice
        (b"[" * 100_000 + b"]" * 100_000, None, None),
    ]
    for body, method, name in refused:
        with pytest.raises(errors.InvalidRequest):
            read(body, method, name)
    encoded = "=?base64?c2VuZA==?="  # "send"
    assert isinstance(read(call_body(), "tools/call", encoded), m.ToolCall)


def test_the_meta_lease_is_read_field_by_field_and_removed() -> None:
    lease = {"resource": "mail/a", "fence": 7, "owner": "run-1"}
    meta = {m.LEASE_META_KEY: lease, "progressToken": 3}
    call = read(call_body(_meta=meta))
    assert isinstance(call, m.ToolCall) and call.lease_entry == lease
    forwarded = json.loads(call.stripped_body or b"")
    assert forwarded["params"]["_meta"] == {"progressToken": 3}
    alone = read(call_body(_meta={m.LEASE_META_KEY: lease}))
    assert "_meta" not in json.loads(alone.stripped_body or b"")["params"]
    assert m.lease_headers(lease) == {
        "X-Lease-Resource": "mail/a",
        "X-Fence-Token": "7",
        "X-Lease-Owner": "run-1",
    }
    # a fence that is not a JSON integer becomes a value its check refuses
    assert m.lease_headers({"resource": "r", "fence": "7"})["X-Fence-Token"] == '"7"'
    assert m.lease_headers({"resource": "r", "fence": True})["X-Fence-Token"] == "true"
    assert m.lease_headers({"fence": None}) == {}
    for bad in ([], {"resource": "r", "token": 1}):
        with pytest.raises(errors.InvalidRequest):
            m.lease_headers(bad)


def test_keys_and_fingerprints_follow_the_canonical_arguments() -> None:
    one = read(call_body(arguments={"a": 1, "b": [1.0, "x"]}))
    other = read(
        b'{"params":{"arguments":{"b":[1,"x"],"a":1},"name":"send"},"id":9,'
        b'"method":"tools/call","jsonrpc":"2.0"}'
    )
    assert isinstance(one, m.ToolCall) and isinstance(other, m.ToolCall)
    assert m.derived_key("mail/a", one) == m.derived_key("mail/a", other)
    assert m.fingerprint("/mcp", one) == m.fingerprint("/mcp", other)
    assert m.derived_key("mail/a", one) != m.derived_key("mail/b", one)
    later_round = read(call_body(arguments={"a": 1, "b": [1.0, "x"]}, requestState="s1"))
    assert isinstance(later_round, m.ToolCall)
    assert m.derived_key("mail/a", later_round) != m.derived_key("mail/a", one)


def test_the_outcome_comes_from_the_answer_to_the_calls_id() -> None:
    assert (
        m.answer_outcome({"jsonrpc": "2.0", "id": 1, "result": {"content": []}}, 1) == "succeeded"
    )
    assert m.answer_outcome({"id": 1, "result": {"isError": True}}, 1) == "failed"
    assert m.answer_outcome({"id": 1, "error": {"code": -32602}}, 1) == "failed"
    assert m.answer_outcome({"id": "1", "result": {}}, 1) is None  # another id
    assert m.answer_outcome({"id": True, "result": {}}, 1) is None
    assert m.answer_outcome({"method": "notifications/progress", "params": {}}, 1) is None
    assert m.answer_outcome([{"id": 2, "result": {}}, {"id": 1, "error": {}}], 1) == "failed"
    assert json.loads(m.with_id(b'{"jsonrpc":"2.0","id":1,"result":{}}', "r") or b"")["id"] == "r"
    assert m.with_id(b"[]", 1) is None
    problem = {"title": "Stale fencing token", "code": "stale_fence"}
    assert json.loads(m.error_response(4, problem)) == {
        "jsonrpc": "2.0",
        "id": 4,
        "error": {"code": -31050, "message": problem["title"], "data": problem},
    }


def test_sse_events_are_cut_whatever_the_chunks() -> None:
    stream = (
        b': ping\r\n\r\nevent: message\r\ndata: {"a":\r\ndata: 1}\r\n\r\n'
        b"data: x\n\ndata:y\r\rid: 3\ndata: z\n\n"
    )
    for size in (1, 2, 3, 7, len(stream)):
        splitter = SseSplitter(max_event_bytes=1000)
        events = []
        for start in range(0, len(stream), size):
            events.extend(splitter.feed(stream[start : start + size]))
        assert [(e.event, e.data) for e in events] == [
            (None, None),
            ("message", '{"a":\n1}'),
            (None, "x"),
            (None, "y"),
            (None, "z"),
        ]
        assert b"".join(e.raw for e in events) == stream and splitter.rest() == b""
    many = b"".join(b"data: %d\n\n" % n for n in range(20_000))  # one chunk, many events
    assert len(SseSplitter(max_event_bytes=100).feed(many)) == 20_000
    with pytest.raises(EventTooLarge):
        SseSplitter(max_event_bytes=10).feed(b"data: " + b"x" * 20)


def test_a_stream_s_end_and_its_byte_order_mark() -> None:
    # an event whose last line ends with a lone CR as the stream ends: nothing can follow it
    splitter = SseSplitter(max_event_bytes=100)
    assert splitter.feed(b"data: a\r\r") == []  # an LF may yet come
    assert [(e.data, e.raw) for e in splitter.end()] == [("a", b"data: a\r\r")]
    # one BOM before the stream's first line is not part of it; its bytes pass on unchanged
    (event,) = SseSplitter(max_event_bytes=100).feed(b"\xef\xbb\xbfdata: b\n\n")
    assert (event.data, event.raw) == ("b", b"\xef\xbb\xbfdata: b\n\n")


def test_check_policies_validates_mcp_and_tools(tmp_path: Path) -> None:
    def load(**rule: object) -> None:
        policy = make_policy("http://127.0.0.1:1", [{"match": "m/*", **rule}], mcp=True)
        load_policies(write_policy(tmp_path / "p.yaml", policy))

    load(tools=["send_*"])
    for rule, problem in [
        ({}, "tools"),
        ({"tools": []}, "at least one tool glob"),
        ({"tools": ["has space"]}, "not a tool glob"),
        ({"tools": ["x"], "fenced_methods": ["POST"]}, "fenced_methods"),
    ]:
        with pytest.raises(PolicyError, match=problem):
            load(**rule)
    plain = make_policy("http://127.0.0.1:1", [{"match": "m/*", "tools": ["x"]}])
    with pytest.raises(PolicyError, match="mcp: true only"):
        load_policies(write_policy(tmp_path / "q.yaml", plain))
    both = make_policy(
        "http://127.0.0.1:1", [{"match": "m/*", "tools": ["x"]}], mcp=True, websocket=True
    )
    with pytest.raises(PolicyError, match="websocket"):
        load_policies(write_policy(tmp_path / "r.yaml", both))


def test_a_tool_call_is_governed_by_the_rule_covering_resource_and_tool(tmp_path: Path) -> None:
    policy = make_policy(
        "http://127.0.0.1:1",
        [{"match": "mail/*", "tools": ["send_*"]}, {"match": "**", "tools": ["deploy"]}],
        mcp=True,
    )
    policies = load_policies(write_policy(tmp_path / "p.yaml", policy))
    upstream = policies.upstreams["tool"]
    assert policies.tool_treatment(upstream, "send_email") == "fenced"
    assert policies.tool_treatment(upstream, "deploy") == "fenced"
    assert policies.tool_treatment(upstream, "lookup") == "unfenced"
    assert policies.tool_rule("tool", "mail/a", "send_email") is policies.rules[0]
    assert policies.tool_rule("tool", "mail/a", "deploy") is policies.rules[1]
    assert policies.tool_rule("tool", "ops/a", "send_email") is None  # resource_not_allowed


def test_the_client_library_builds_the_meta_entry() -> None:
    assert mcp_meta("mail/a", 7, "run-1") == {
        m.LEASE_META_KEY: {"resource": "mail/a", "fence": 7, "owner": "run-1"}
    }
    assert mcp_meta("mail/a", 7) == {m.LEASE_META_KEY: {"resource": "mail/a", "fence": 7}}
    for fence in (0, True, "7", 2**63):
        with pytest.raises(ValueError):
            mcp_meta("mail/a", fence)  # type: ignore[arg-type]


def test_a_body_written_again_keeps_what_the_client_escaped() -> None:
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/list",
            "params": {"_meta": {m.LEASE_META_KEY: {}}, "x": "\ud800é"},
        }
    ).encode()
    message = read(body)
    assert json.loads(message.stripped_body or b"")["params"] == {"x": "\ud800é"}
