"""Failure injection for crash tests (`GATEWAY_FAILPOINTS`): `crash` exits at once, like
kill -9 (no cleanup, no flush); `error` makes the store write at that point fail."""

from __future__ import annotations

import os
import sqlite3


class Failpoints:
    def __init__(self, actions: dict[str, str]) -> None:
        self._actions = actions

    def crash_at(self, name: str) -> None:
        if self._actions.get(name) == "crash":
            os._exit(137)

    def fails(self, name: str) -> bool:
        return self._actions.get(name) == "error"

    def in_commit(self) -> None:
        """Called by the store just before each COMMIT."""
        self.crash_at("in_commit")
        if self.fails("in_commit"):
            raise sqlite3.OperationalError("failpoint in_commit")
