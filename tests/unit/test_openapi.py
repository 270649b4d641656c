"""The OpenAPI document describes exactly the /_gateway/v1 routes the app serves."""

import re

from gateway.api.openapi import document
from gateway.config.policy import PolicySet
from gateway.config.settings import Settings
from gateway.server.app import create_app


def served_operations() -> set[tuple[str, str]]:
    app = create_app(Settings(database_url="sqlite:///unused.db"), PolicySet([], []))
    served = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource else ""
        if path.startswith("/_gateway/v1/") and route.method != "HEAD":
            served.add((route.method.lower(), re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", path)))
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
    assert len(codes) == 35 and "stale_fence" in codes and "internal_error" not in codes
