"""Process settings, read from `GATEWAY_*` environment variables or `.env` (docs/contract.md §11).

Only this module and `cli` read the environment; everything else receives a `Settings`.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from functools import cached_property
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.core.floors import DEFAULT_GAP
from gateway.core.grammar import MAX_FENCE

FAILPOINT_NAMES = frozenset({"after_admit", "after_upstream", "in_commit"})
FAILPOINT_ACTIONS = frozenset({"crash", "error"})


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    database_url: str = "sqlite:///var/gateway.db"
    durability: Literal["strict", "relaxed"] = "strict"
    policies: str = "policies"
    clients: str | None = None
    trusted_proxies: str = ""
    sweep_interval_s: float = Field(1.0, gt=0)
    reconcile_grace_s: float = Field(10.0, ge=0)
    receipt_retention_s: float = Field(604800.0, gt=0)
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(30.0, gt=0)
    shutdown_grace_s: float = Field(10.0, ge=0)
    instance_id: str = Field(default_factory=default_instance_id, min_length=1, max_length=200)
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    allow_open: bool = False
    failpoints: str | None = None
    workers: int = Field(1, ge=1, le=64)
    # docs/contract.md §15: the address CDP discovery answers point at (http or https)
    public_url: str | None = None
    # docs/contract.md §18: how far above the backup's highest fence a restore sets the floor
    restore_fence_gap: int = Field(DEFAULT_GAP, ge=1, le=MAX_FENCE)
    # docs/contract.md §19: what a failover of the PostgreSQL primary may have lost
    replication: Literal["async", "sync"] = "async"
    sync_wait_s: float = Field(5.0, gt=0)
    database_connect_timeout_s: float = Field(5.0, gt=0)
    # proxied calls in progress at once: "auto" (an adaptive limit) or a fixed number
    max_inflight: int | Literal["auto"] = "auto"
    # docs/contract.md §22: HTTPS serving (PEM files), and the CA client certificates need
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # docs/contract.md §21: spans of proxied calls, with the otel extra; OTEL_* configure them
    otel: bool = False

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, value: str) -> str:
        for part in _split(value):
            try:
                ipaddress.ip_network(part, strict=False)
            except ValueError as exc:
                raise ValueError(f"{part!r} is not an address or CIDR") from exc
        return value

    @field_validator("failpoints")
    @classmethod
    def _check_failpoints(cls, value: str | None) -> str | None:
        if value:
            parse_failpoints(value)
        return value

    @field_validator("max_inflight", mode="before")
    @classmethod
    def _check_max_inflight(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            number = int(str(value).strip())
        except ValueError:
            raise ValueError(f"{value!r}: use auto or a whole number of calls") from None
        if number < 1:
            raise ValueError(f"{value!r}: the limit must be at least 1")
        return number

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("sqlite:///", "postgresql://", "postgres://")):
            raise ValueError(f"{value!r}: use sqlite:///PATH or postgresql://…")
        return value

    @model_validator(mode="after")
    def _check_replication(self) -> Settings:
        if self.replication == "sync" and not self.database_url.startswith("postgres"):
            raise ValueError("GATEWAY_REPLICATION=sync is for PostgreSQL (GATEWAY_DATABASE_URL)")
        if self.replication == "sync" and self.durability == "relaxed":
            raise ValueError(
                "GATEWAY_REPLICATION=sync needs durability strict (GATEWAY_DURABILITY): a "
                "relaxed commit waits for no standby"
            )
        return self

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parts = urlsplit(value)
        except ValueError as exc:
            raise ValueError(f"{value!r}: {exc}") from None
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.query
            or parts.fragment
            or "@" in parts.netloc
            or any(ord(ch) <= 0x20 or ord(ch) == 0x7F for ch in value)
        ):
            raise ValueError(
                f"{value!r}: an http(s) URL with a host and an optional path, "
                "no credentials, query or fragment"
            )
        return value.rstrip("/")

    @cached_property
    def trusted_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return tuple(ipaddress.ip_network(p, strict=False) for p in _split(self.trusted_proxies))

    @cached_property
    def failpoint_map(self) -> dict[str, str]:
        return parse_failpoints(self.failpoints) if self.failpoints else {}


def parse_failpoints(value: str) -> dict[str, str]:
    """`name=action,…` → {name: action}; unknown names or actions are configuration errors."""
    result = {}
    for item in _split(value):
        name, _, action = item.partition("=")
        if name not in FAILPOINT_NAMES or action not in FAILPOINT_ACTIONS:
            raise ValueError(
                f"{item!r}: expected one of {sorted(FAILPOINT_NAMES)} "
                f"= one of {sorted(FAILPOINT_ACTIONS)}"
            )
        result[name] = action
    return result


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]
