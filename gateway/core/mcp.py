"""MCP tool calls (docs/contract.md §16) as plain decisions: which JSON-RPC message is a tool
call to fence, where its lease is, what its idempotency key and fingerprint are, what its
answer says about its outcome, and how a refusal or a replay is written in JSON-RPC.

An MCP server over Streamable HTTP takes every JSON-RPC message as a POST to one endpoint, so
the gateway reads the message to know what it is. It reads strictly: a body with a member
named twice, or nested too deep to read, is refused (another reader could see another
message in it); a body that is not JSON at all is passed on (the server answers its parse
error), unless an `Mcp-Method` header names a method it cannot agree with.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from gateway.core import errors
from gateway.core.canonical_json import NotCanonicalizable, canonical_json

TOOLS_CALL = "tools/call"
FENCE_ERROR_CODE = -31050
"""`error.code` of a refusal: an application code, outside what JSON-RPC and MCP reserve."""
LEASE_META_KEY = "fence-gateway/lease"
"""Where a tool call may carry its lease: `params._meta["fence-gateway/lease"]`."""
METHOD_HEADER = "Mcp-Method"
NAME_HEADER = "Mcp-Name"
# The params member each method's `Mcp-Name` header mirrors (revision 2026-07-28).
_NAME_BEARING = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
# The 2026-07-28 revision's header-value form for values that are not plain ASCII.
_BASE64_VALUE = re.compile(r"=\?base64\?(?P<payload>.*)\?=")
# The params of a tool call that, with its arguments, say which operation it is: a later
# round of a multi-round call (input responses, request state) is another operation.
_ROUND_PARAMS = ("inputResponses", "requestState")

JsonRpcId = str | int


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A `tools/call` request, read from its body."""

    id: JsonRpcId
    tool: str
    operation: bytes  # the canonical arguments (and a later round's inputs): what it does
    lease_entry: object | None  # params._meta[LEASE_META_KEY] as sent, None when absent
    meta: dict[str, Any] | None  # params._meta as sent (a trace context may be there, §21)
    stripped_body: bytes | None  # the body without the lease entry; None: it had none


@dataclass(frozen=True, slots=True)
class OtherMessage:
    """Anything else: passed on unfenced. `id` answers an error, when it had a usable one."""

    id: JsonRpcId | None
    stripped_body: bytes | None


Message = ToolCall | OtherMessage


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _Duplicate(name)
            seen.add(name)
    return document


@dataclass(frozen=True, slots=True)
class Body:
    """A POST's body, read: its JSON document and the request id an error answers with, when
    it has a usable one."""

    document: Any
    id: JsonRpcId | None


def parse_body(body: bytes) -> Body:
    """The JSON document of a POST; `400 invalid_request` for one another reader could read
    as another message (a member named twice, nesting too deep to read, what is not JSON
    Python reads)."""
    document: Any
    try:
        document = json.loads(body, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise errors.InvalidRequest(f"the JSON body names member {exc} twice") from None
    except RecursionError:
        raise errors.InvalidRequest("the JSON body is nested too deeply to read") from None
    except ValueError as exc:  # not JSON Python reads (a bad byte, a value after the first,
        # a number of more than 4,300 digits): a server with another reader may read it as a
        # tool call, which the gateway could not fence (docs/contract.md §16)
        raise errors.InvalidRequest(f"the body is not JSON the gateway can read: {exc}") from None
    request_id = document.get("id") if isinstance(document, dict) else None
    return Body(document, request_id if _is_id(request_id) else None)


def read_message(parsed: Body, method_header: str | None, name_header: str | None) -> Message:
    """What a POST to an MCP endpoint carries; `400 invalid_request` when it cannot be
    fenced as it must: headers that disagree with the body, a batch holding a tool call, a
    tool call that is no well-formed request."""
    document = parsed.document
    method = document.get("method") if isinstance(document, dict) else None
    if method_header is not None and method_header != method:
        raise errors.InvalidRequest(
            f"{METHOD_HEADER} {method_header!r} does not agree with the body's method"
        )
    if not isinstance(document, dict):
        _check_name_header(None, None, name_header)
    if isinstance(document, list):
        if any(isinstance(item, dict) and item.get("method") == TOOLS_CALL for item in document):
            raise errors.InvalidRequest(
                "a batch containing a tools/call is refused: send each tool call on its own"
            )
        return OtherMessage(None, None)
    if not isinstance(document, dict):
        return OtherMessage(None, None)
    params = document.get("params")
    _check_name_header(method, params, name_header)
    if method != TOOLS_CALL:
        return OtherMessage(parsed.id, _without_lease(document, params))
    return _tool_call(document, params)


def _tool_call(document: dict[str, Any], params: Any) -> ToolCall:
    request_id = document.get("id")
    if (
        document.get("jsonrpc") != "2.0"
        or not isinstance(request_id, str | int)
        or request_id is True
        or request_id is False
    ):
        raise errors.InvalidRequest(
            'a tools/call must be a JSON-RPC 2.0 request with an "id" (a string or an integer)'
        )
    if not isinstance(params, dict) or not isinstance(params.get("name"), str):
        raise errors.InvalidRequest('a tools/call needs "params" with the tool\'s "name"')
    arguments = params.get("arguments")
    if arguments is not None and not isinstance(arguments, dict):
        raise errors.InvalidRequest('a tools/call\'s "arguments" must be an object')
    meta = params.get("_meta")
    if meta is not None and not isinstance(meta, dict):
        raise errors.InvalidRequest('"params._meta" must be an object')
    try:
        operation = canonical_json(arguments or {})
        round_inputs = {name: params[name] for name in _ROUND_PARAMS if name in params}
        if round_inputs:
            operation += b"\n" + canonical_json(round_inputs)
    except (NotCanonicalizable, RecursionError):
        raise errors.InvalidRequest(
            "the tool's arguments hold a number JSON cannot carry (NaN, an infinity)"
        ) from None
    return ToolCall(
        id=request_id,
        tool=params["name"],
        operation=operation,
        lease_entry=meta.get(LEASE_META_KEY) if meta else None,
        meta=meta,
        stripped_body=_without_lease(document, params),
    )


def _is_id(value: object) -> bool:
    """A request id MCP allows: a string or an integer (never null, never a boolean)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _check_name_header(method: object, params: object, name_header: str | None) -> None:
    if name_header is None:
        return
    member = _NAME_BEARING.get(method) if isinstance(method, str) else None
    named = params.get(member) if member is not None and isinstance(params, dict) else None
    if named is None or decode_header_value(name_header) != named:
        raise errors.InvalidRequest(f"{NAME_HEADER} does not agree with the body")


def decode_header_value(value: str) -> str | None:
    """A header value as the 2026-07-28 revision writes it: verbatim, or `=?base64?…?=`
    around UTF-8 (None when that is malformed, so it never agrees by accident)."""
    found = _BASE64_VALUE.fullmatch(value)
    if found is None:
        return value
    payload = found.group("payload")
    try:
        decoded = base64.b64decode(payload, validate=True)
        if base64.b64encode(decoded).decode("ascii") != payload:
            return None
        return decoded.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None


def _without_lease(document: dict[str, Any], params: Any) -> bytes | None:
    """The body again without `params._meta[LEASE_META_KEY]`; None when it had none (the
    body then goes on byte for byte)."""
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(meta, dict) or LEASE_META_KEY not in meta:
        return None
    kept_meta = {name: value for name, value in meta.items() if name != LEASE_META_KEY}
    kept_params = {name: value for name, value in params.items() if name != "_meta"}
    if kept_meta:
        kept_params["_meta"] = kept_meta
    return _dumps({**document, "params": kept_params})


def _dumps(document: Any) -> bytes:
    try:  # ASCII with escapes: a lone surrogate the client escaped stays escaped
        return json.dumps(document, separators=(",", ":")).encode()
    except RecursionError:  # read, but too deep to write again: refused, not a 500
        raise errors.InvalidRequest("the JSON body is nested too deeply to pass on") from None


# -- the lease of a tool call --------------------------------------------------------------

_LEASE_FIELDS = {
    "resource": "X-Lease-Resource",
    "fence": "X-Fence-Token",
    "owner": "X-Lease-Owner",
    "signature": "X-Fence-Signature",
}


def lease_headers(entry: object) -> dict[str, str]:
    """The `_meta` lease as the headers it stands for, so that each field is checked as its
    header is, at that header's step. A field of the wrong JSON type becomes a value its
    check refuses (the fence must be a JSON integer: `"7"` is not one); null is absent."""
    if not isinstance(entry, dict):
        raise errors.InvalidRequest(f'params._meta["{LEASE_META_KEY}"] must be an object')
    unknown = sorted(set(entry) - set(_LEASE_FIELDS))
    if unknown:
        raise errors.InvalidRequest(
            f'params._meta["{LEASE_META_KEY}"] has unknown field {unknown[0]!r} '
            f"(known: {', '.join(_LEASE_FIELDS)})"
        )
    presented = {}
    for name, header in _LEASE_FIELDS.items():
        value = entry.get(name)
        if value is None:
            continue
        if name == "fence":
            is_integer = isinstance(value, int) and not isinstance(value, bool)
            presented[header] = str(value) if is_integer else json.dumps(value)
        else:
            presented[header] = value if isinstance(value, str) else json.dumps(value)
    return presented


# -- idempotency -----------------------------------------------------------------------------


def derived_key(resource: str, call: ToolCall) -> str:
    """`derive` for a tool call: resource, tool and canonical arguments."""
    material = f"{resource}\n{TOOLS_CALL}\n{call.tool}\n".encode() + call.operation
    return "gw-" + hashlib.sha256(material).hexdigest()[:32]


def fingerprint(request_target: str, call: ToolCall) -> str:
    """What makes two tool calls with one key the same call: endpoint, tool and canonical
    arguments (never the request id, `_meta`, or how the JSON was written)."""
    material = f"{TOOLS_CALL}\n{request_target}\n{call.tool}\n".encode() + call.operation
    return "sha256:" + hashlib.sha256(material).hexdigest()


# -- answers ---------------------------------------------------------------------------------

AnswerOutcome = Literal["succeeded", "failed"]


def answer_outcome(document: object, request_id: JsonRpcId) -> AnswerOutcome | None:
    """The outcome a JSON-RPC answer gives the call `request_id`: a `result` without
    `isError: true` succeeded, an `error` or an `isError` result failed; None when
    `document` does not answer it (a notification, a request of the server's, another id).
    A batch answers it when one of its members does."""
    if isinstance(document, list):
        for item in document:
            outcome = answer_outcome(item, request_id)
            if outcome is not None:
                return outcome
        return None
    if not isinstance(document, dict) or "method" in document:
        return None
    answered = document.get("id")
    if type(answered) is not type(request_id) or answered != request_id:
        return None
    if "error" in document:
        return "failed"
    if "result" not in document:
        return None
    result = document["result"]
    return "failed" if isinstance(result, dict) and result.get("isError") is True else "succeeded"


def parse_json(data: bytes | str) -> object | None:
    """A JSON document, or None when it is not one."""
    try:
        parsed: object = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return parsed


def with_id(stored: bytes, request_id: JsonRpcId) -> bytes | None:
    """A stored JSON-RPC response answering `request_id` instead; None when it is not one."""
    document = parse_json(stored)
    if not isinstance(document, dict) or "id" not in document:
        return None
    return _dumps({**document, "id": request_id})


def error_response(request_id: JsonRpcId | None, problem: dict[str, Any]) -> bytes:
    """A refusal in JSON-RPC: `error.message` the problem's title, `error.data` the problem."""
    return _dumps(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "error": {"code": FENCE_ERROR_CODE, "message": problem["title"], "data": problem},
        }
    )


# -- which calls are fenced ------------------------------------------------------------------

_TOOL_GLOB = re.compile(r"[\x21-\x7e]{1,128}")


def valid_tool_glob(pattern: str) -> bool:
    """1 to 128 visible ASCII characters; `*` stands for any run of characters."""
    return _TOOL_GLOB.fullmatch(pattern) is not None


def tool_matches(patterns: tuple[str, ...] | list[str], tool: str) -> bool:
    return any(_tool_regex(pattern).fullmatch(tool) is not None for pattern in patterns)


ToolTreatment = Literal["fenced", "unfenced", "refused"]


def treat_tool(
    tool: str,
    fenced: tuple[str, ...],
    unfenced: tuple[str, ...],
    unmatched: Literal["refuse", "pass"],
) -> ToolTreatment:
    """What a tool call of an MCP upstream gets (docs/contract.md §16, §20): fenced when a
    rule's `tools` glob names it (even if `unfenced_tools` names it too: the safe side wins),
    unfenced when an `unfenced_tools` glob does, and otherwise what `unmatched_tools` says, so
    that with `refuse` a tool newly added to the server fails closed."""
    if tool_matches(fenced, tool):
        return "fenced"
    if unmatched == "pass" or tool_matches(unfenced, tool):
        return "unfenced"
    return "refused"


@lru_cache(maxsize=1024)
def _tool_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")), re.DOTALL)


@dataclass(frozen=True, slots=True)
class McpRecord:
    """What a tool call's receipt says of it (`"mcp"`, docs/contract.md §7, §16)."""

    tool: str
    jsonrpc_id: JsonRpcId

    def to_json(self) -> dict[str, Any]:
        return {"tool": self.tool, "jsonrpc_id": self.jsonrpc_id}
