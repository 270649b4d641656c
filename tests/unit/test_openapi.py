"""The OpenAPI document describes exactly the /_gateway/v1 routes the app serves, and each
pattern it states is the check the gateway makes (what it admits, the gateway accepts)."""

import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.api import params
from gateway.api.openapi import (
    OWNER_PATTERN,
    RESOURCE_PATTERN,
    allowed_methods,
    document,
)
from gateway.api.receipts import (
    MAX_NOTE,
    MAX_SOURCE,
    NOTE_PATTERN,
    SOURCE_PATTERN,
    checked_resolution,
)
from gateway.config.policy import PolicySet, ResourceRule, Upstream
from gateway.config.settings import Settings
from gateway.core import errors, grammar
from gateway.server.app import create_app
from tests.harness import REPO_ROOT

METHOD_NOT_ALLOWED_ROUTE = "/_gateway/v1/{tail}"  # answers what the document leaves out


def served_operations() -> set[tuple[str, str]]:
    app = create_app(Settings(database_url="sqlite:///unused.db"), PolicySet([], []))
    served = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource else ""
        path = re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", path)
        v1 = path.startswith("/_gateway/v1/") and path != METHOD_NOT_ALLOWED_ROUTE
        if v1 and route.method != "HEAD":
            served.add((route.method.lower(), path))
    return served


def test_every_v1_route_is_described_and_nothing_else() -> None:
    described = {
        (method, path)
        for path, item in document()["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert described == served_operations()


def test_error_codes_are_the_spec_codes() -> None:
    codes = document()["components"]["schemas"]["Problem"]["properties"]["code"]["enum"]
    contract = (REPO_ROOT / "docs" / "contract.md").read_text()
    listed = contract.partition("**Codes.** `code` is one of: ")[2].partition(".\n")[0]
    assert codes == sorted(re.findall(r"`([a-z_]+)`", listed))
    assert len(codes) == 37 and "tool_not_allowed" in codes and "internal_error" not in codes


def test_an_open_gateway_asks_for_no_key_and_a_secured_one_for_a_bearer_key() -> None:
    secured, open_ = document(secured=True), document(secured=False)
    assert secured["security"] == [{"bearer": []}]
    assert secured["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "security" not in open_ and "securitySchemes" not in open_["components"]
    # never a header parameter standing in for the security scheme
    assert "Authorization" not in json.dumps(secured["paths"])


def test_ttl_is_bounded_by_the_smallest_maximum_of_the_gateway_issued_rules() -> None:
    def rule(match: str, issuer: str, max_ttl_s: float) -> ResourceRule:
        lease = {"issuer": issuer} | ({"max_ttl_s": max_ttl_s} if issuer == "gateway" else {})
        return ResourceRule(match=match, upstream="u", lease=lease)  # type: ignore[arg-type]

    upstream = Upstream(name="u", url="http://127.0.0.1:9", mount="/u")
    policies = PolicySet(
        [upstream],
        [rule("a/*", "gateway", 300), rule("b/*", "gateway", 120), rule("c", "external", 0)],
    )

    def ttl(described: dict, method: str) -> dict:
        lease_path = described["paths"]["/_gateway/v1/leases/{resource}"]
        body = lease_path[method]["requestBody"]["content"]["application/json"]["schema"]
        return body["properties"]["ttl_s"]  # type: ignore[no-any-return]

    bounded = {"type": "number", "exclusiveMinimum": 0, "maximum": 120}
    assert ttl(document(policies), "post") == ttl(document(policies), "put") == bounded
    assert "maximum" not in ttl(document(), "put")  # no policies: no bound to state


@pytest.mark.parametrize(
    ("path", "methods"),
    [
        ("/_gateway/v1/leases", ["GET", "HEAD"]),
        ("/_gateway/v1/leases/browser/account-42", ["DELETE", "GET", "HEAD", "POST", "PUT"]),
        ("/_gateway/v1/receipts/01JDQ3/resolve", ["POST"]),
        ("/_gateway/v1/receipts/01JDQ3/resolve/more", None),
        ("/_gateway/v1/nothing", None),
    ],
)
def test_allowed_methods_come_from_the_document(path: str, methods: list[str] | None) -> None:
    assert allowed_methods(path) == methods


# -- each pattern is the gateway's own check ---------------------------------------------------

_RESOURCE_ALPHABET = "ab.Z9_-:@/"


@given(st.text(alphabet=_RESOURCE_ALPHABET, min_size=0, max_size=12))
def test_resource_pattern_is_the_resource_grammar(value: str) -> None:
    assert (re.fullmatch(RESOURCE_PATTERN, value) is not None) == grammar.valid_resource(value)


@pytest.mark.parametrize(
    "value", ["a", "..a", ".a/b", "a/...", "a/..", ".", "/a", "a/", "a//b", "a/./b", "a b"]
)
def test_resource_pattern_on_the_edge_cases(value: str) -> None:
    assert (re.fullmatch(RESOURCE_PATTERN, value) is not None) == grammar.valid_resource(value)


@given(st.text(alphabet="aZ0._-:@/ %", max_size=130))
def test_owner_pattern_is_the_owner_grammar(value: str) -> None:
    assert (re.fullmatch(OWNER_PATTERN, value) is not None) == grammar.valid_owner(value)


@given(st.text(max_size=MAX_SOURCE + 2), st.one_of(st.none(), st.text(max_size=50)))
def test_source_and_note_patterns_are_what_resolve_accepts(source: str, note: str | None) -> None:
    admitted = (
        len(source) <= MAX_SOURCE
        and re.fullmatch(SOURCE_PATTERN, source) is not None
        and (note is None or (len(note) <= MAX_NOTE and re.fullmatch(NOTE_PATTERN, note)))
    )
    try:
        checked_resolution("applied", source, note)
    except errors.InvalidRequest:
        accepted = False
    else:
        accepted = True
    assert accepted == bool(admitted)


@pytest.mark.parametrize(
    ("source", "ok"),
    [("operator:alice", True), ("  ", False), ("", False), ("a\tb", False), ("zoë", True)],
)
def test_source_examples(source: str, ok: bool) -> None:
    assert (re.fullmatch(SOURCE_PATTERN, source) is not None) == ok


def test_an_unpaired_surrogate_is_refused_though_no_pattern_says_so() -> None:
    with pytest.raises(errors.InvalidRequest):
        checked_resolution("applied", "operator:\ud800", None)
    with pytest.raises(errors.InvalidRequest):
        checked_resolution("applied", "operator:a", "note \udfff")


@given(
    st.one_of(
        st.from_regex(r"[0-9A-Z]{26}", fullmatch=True),
        st.from_regex(r"[a-z]{1,5}(/[a-z]{1,5}){0,3}", fullmatch=True),
    )
)
def test_a_cursor_given_out_is_one_the_pattern_admits_and_decodes_back(position: str) -> None:
    cursor = params.encode_cursor(position)
    assert re.fullmatch(params.CURSOR_PATTERN, cursor)
    assert params.decode_cursor({"cursor": cursor}) == position


@pytest.mark.parametrize("cursor", ["", "nope", "garbage", "after:", "after:a b", "after:µ"])
def test_a_cursor_outside_the_pattern_is_refused(cursor: str) -> None:
    assert not re.fullmatch(params.CURSOR_PATTERN, cursor)
    with pytest.raises(errors.InvalidRequest):
        params.decode_cursor({"cursor": cursor})


@pytest.mark.parametrize(
    ("literal", "value"),
    [
        ("16270.0", 16270),
        ("1e3", 1000),
        ("-0.0", 0),
        ("0.5", 0.5),
        ("9007199254740993.0", 9007199254740993),  # exact: a float would round it
        ("1e400", math.inf),
    ],
)
def test_a_whole_json_number_written_with_a_fraction_is_an_integer(
    literal: str, value: float
) -> None:
    parsed = params._json_number(literal)
    assert parsed == value and type(parsed) is type(value)
