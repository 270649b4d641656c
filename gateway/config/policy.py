"""The policy schema (docs/contract.md §8), validated once at start into frozen typed values.

Request code sees only these models: a bad value is found by `check-policies` or at start,
never on the first request.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Literal
from urllib.parse import quote, urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.core.globs import glob_matches, valid_glob
from gateway.core.grammar import HTTP_TOKEN
from gateway.core.mcp import ToolTreatment, tool_matches, treat_tool, valid_tool_glob

HttpMethod = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_HEADER_NAME = re.compile(HTTP_TOKEN)
# RFC 3986 path characters and %XX escapes
_PATH_CHARS = r"A-Za-z0-9\-._~!$&'()*+,;=:@/"
_URL_PATH = re.compile(rf"(?:[{_PATH_CHARS}]|%[0-9A-Fa-f]{{2}})*")
# Headers an upstream's inject_headers may not set: message framing, Host, and what the
# gateway sets to tell the tool about a fenced call.
_NOT_INJECTABLE = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "x-lease-resource",
        "x-fence-token",
        "x-receipt-id",
        "x-request-id",
        "idempotency-key",
        "x-forwarded-for",
        "x-forwarded-proto",
    }
)
# The path of an on_expiry or probe call, placeholders taken out: RFC 3986 path and query
# characters and %XX escapes, since it goes on the request line as it is.
_TEMPLATE_PATH = re.compile(rf"/(?:[{_PATH_CHARS}?]|%[0-9A-Fa-f]{{2}})*")
# RFC 3986 pchar without pct-encoded: what a path segment may hold literally.
_MOUNT = re.compile(r"(?:/[A-Za-z0-9._~!$&'()*+,;=:@-]+)+")
# A DNS name the certificate of an HTTPS upstream is checked for, and sent as SNI.
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"(?=.{{1,253}}$){_DNS_LABEL}(?:\.{_DNS_LABEL})*")
# host[:port]: a reg-name of unreserved characters or a bracketed IPv6 literal.
_AUTHORITY = re.compile(r"(?P<host>[A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>.*))?")


class _Model(BaseModel):
    # .inf passes gt=0 but no duration or size is infinite (rfc3339(inf) overflows)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Tls(_Model):
    """How an HTTPS upstream is reached (docs/contract.md §22): its certificate is always
    verified, against `ca_file` when set (else the system's store), for `server_name` when
    set (else the URL's host, which is then also the SNI); `cert_file` and `key_file` are a
    client certificate presented to it. The files are read by `gateway.config.tls`."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    @field_validator("server_name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _DNS_NAME.fullmatch(value):
            raise ValueError("not a DNS name (letters, digits, '-' and '.', e.g. tool.internal)")
        return value

    @model_validator(mode="after")
    def _key_needs_cert(self) -> Tls:
        if self.key_file and not self.cert_file:
            raise ValueError("key_file without cert_file: the key belongs to a certificate")
        return self

    @property
    def configured(self) -> bool:
        return any((self.ca_file, self.cert_file, self.key_file, self.server_name))


class Upstream(_Model):
    name: str = Field(pattern=r"^[a-z0-9-]+$")
    url: str
    mount: str
    timeout_s: float = Field(30, gt=0)
    connect_timeout_s: float = Field(5, gt=0)
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=0)
    max_connections: int = Field(100, gt=0)
    inject_headers: dict[str, str] = Field(default_factory=dict)
    tls: Tls = Field(default_factory=Tls)
    # Sessions (docs/contract.md §15): WebSocket upgrades, and CDP discovery rewriting.
    websocket: bool = False
    cdp: bool = False
    max_message_bytes: int = Field(64 * 1024 * 1024, gt=0)
    session_idle_timeout_s: float = Field(300, gt=0)
    # An MCP server (docs/contract.md §16): fenced per tool call, by its rules' `tools`;
    # a tool call no rule fences is refused or passed by `unmatched_tools`, unless one of the
    # `unfenced_tools` globs names it (docs/contract.md §20).
    mcp: bool = False
    unmatched_tools: Literal["refuse", "pass"] = "pass"
    unfenced_tools: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _cdp_implies_websocket(self) -> Upstream:
        # after validation: `cdp: "true"` or `cdp: 1` is a cdp upstream too
        if self.cdp and not self.websocket:
            if "websocket" in self.model_fields_set:
                raise ValueError("cdp: true implies websocket: true; leave websocket out")
            object.__setattr__(self, "websocket", True)  # frozen: set once, while validated
        if self.mcp and self.websocket:
            raise ValueError(
                "mcp: true speaks Streamable HTTP (POST, GET, DELETE): websocket and cdp "
                "do not apply to it"
            )
        return self

    @field_validator("unmatched_tools", "unfenced_tools")
    @classmethod
    def _mcp_only(cls, value: object, info: ValidationInfo) -> object:
        # runs only when the field is written (defaults are not validated); `mcp` comes first
        if info.data.get("mcp") is not True:
            raise ValueError(f"{info.field_name} applies to upstreams with mcp: true only")
        return value

    @field_validator("unfenced_tools")
    @classmethod
    def _tool_globs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            if not valid_tool_glob(pattern):
                raise ValueError(
                    f"{pattern!r} is not a tool glob: 1 to 128 visible ASCII characters, "
                    "* for any run of them"
                )
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if any(ord(ch) <= 0x20 or ord(ch) == 0x7F for ch in value):
            # urlsplit silently drops tabs and newlines; the URL is refused instead
            raise ValueError("no spaces or control characters in an upstream URL")
        try:
            parts = urlsplit(value)
        except ValueError as exc:  # a bracketed host that is no IPv6 address
            raise ValueError(str(exc)) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s) URL with a host")
        if "@" in parts.netloc:
            # The authority becomes the Host header: credentials there would reach the tool's
            # logs and every proxy on the way. Credentials belong in inject_headers.
            raise ValueError(
                "no user:password@ in an upstream URL; put credentials in "
                "inject_headers (e.g. Authorization)"
            )
        authority = _AUTHORITY.fullmatch(parts.netloc)
        if authority is None:
            raise ValueError(
                "the host must be a name, an IPv4 address or a [bracketed] "
                "IPv6 address, with an optional :port"
            )
        port = authority.group("port")
        if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"port {port!r} is not a number from 1 to 65535")
        host = authority.group("host")
        if not host.startswith("["):
            try:
                host.encode("idna")
            except UnicodeError:
                raise ValueError(
                    f"host {host!r}: an empty label, or one longer than 63 characters"
                ) from None
        if parts.query or parts.fragment:
            raise ValueError("no query or fragment in an upstream URL")
        if not _URL_PATH.fullmatch(parts.path):
            # The base path goes on every request line as it is: a space or a control
            # character there would make every forwarded request malformed.
            raise ValueError("the path may hold only RFC 3986 path characters and %XX escapes")
        return value.rstrip("/")

    @field_validator("mount")
    @classmethod
    def _mount(cls, value: str) -> str:
        if value == "/":
            raise ValueError(
                "a mount of '/' would swallow /_gateway/, which belongs to the gateway itself"
            )
        if not _MOUNT.fullmatch(value):
            # Matched byte for byte against the raw request path, so anything that could be
            # percent-encoded, a query or a fragment would make it match never or by surprise.
            raise ValueError(
                "a mount is '/a' or '/a/b': segments of letters, digits and "
                "-._~!$&'()*+,;=:@ only (no percent-encoding, no empty segment, "
                "no trailing '/')"
            )
        if any(seg in (".", "..") for seg in value.split("/")):
            raise ValueError("no '.' or '..' segment in a mount")
        if value == "/_gateway" or value.startswith("/_gateway/"):
            raise ValueError("/_gateway/ belongs to the gateway itself")
        return value

    @field_validator("inject_headers")
    @classmethod
    def _header_names(cls, value: dict[str, str]) -> dict[str, str]:
        seen: set[str] = set()
        for name in value:
            if name.lower() in seen:
                # header names are case-insensitive: the last would silently replace the first
                raise ValueError(f"{name!r}: the same header is named twice (in another case)")
            seen.add(name.lower())
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a header name")
            if name.lower() in _NOT_INJECTABLE:
                raise ValueError(
                    f"{name!r} is set by the gateway itself (framing, Host or "
                    "the fencing headers): it cannot be injected"
                )
        return value

    @cached_property
    def authority(self) -> str:
        """`host[:port]` as written in `url`: the Host header the tool receives, on every
        call. Worked out once: the model is frozen."""
        return urlsplit(self.url).netloc.rpartition("@")[2]  # `_url` refuses userinfo anyway


class Lease(_Model):
    issuer: Literal["gateway", "external"] = "gateway"
    ttl_s: float = Field(30, gt=0)
    max_ttl_s: float = Field(300, gt=0)
    lock_delay_s: float = Field(0, ge=0)
    hmac_secret_env: str | None = None

    @model_validator(mode="after")
    def _ttl(self) -> Lease:
        if self.ttl_s > self.max_ttl_s:
            raise ValueError(f"ttl_s {self.ttl_s} is above max_ttl_s {self.max_ttl_s}")
        if self.hmac_secret_env and self.issuer != "external":
            raise ValueError("hmac_secret_env applies to issuer: external only")
        return self


class Idempotency(_Model):
    key: Literal["derive", "random", "require"] = "derive"
    upstream_header: str = Field("Idempotency-Key", pattern=_HEADER_NAME.pattern)
    retention_s: float = Field(86400, gt=0)
    replay_max_bytes: int = Field(65536, ge=0)
    retry_statuses: frozenset[int] = frozenset({408, 425, 429, 503})

    @field_validator("retry_statuses")
    @classmethod
    def _statuses(cls, value: frozenset[int]) -> frozenset[int]:
        for status in sorted(value):
            if not 100 <= status <= 599:
                raise ValueError(f"{status} is not an HTTP status (100 to 599)")
            if 200 <= status <= 299:
                raise ValueError(
                    f"{status} is a success: a 2xx answer is `succeeded`, replayed "
                    "and never retried"
                )
        return value


PLACEHOLDERS = frozenset({"resource", "name", "idempotency_key", "receipt_id", "fence"})
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


class CallTemplate(_Model):
    """A call the gateway makes itself (`on_expiry`, `probe`), with the placeholders of
    docs/contract.md §8."""

    method: HttpMethod
    path: str = Field(pattern=r"^/")

    @field_validator("path")
    @classmethod
    def _placeholders(cls, value: str) -> str:
        unknown = set(re.findall(r"\{([^}]*)\}", value)) - PLACEHOLDERS
        if unknown:
            raise ValueError(
                f"unknown placeholder {{{sorted(unknown)[0]}}}; "
                f"known: {', '.join(sorted(PLACEHOLDERS))}"
            )
        if not _TEMPLATE_PATH.fullmatch(re.sub(r"\{[a-z_]+\}", "", value)):
            # it goes on the request line as it is: a space would make the call malformed
            raise ValueError(
                "the path may hold only RFC 3986 path and query characters, %XX escapes and "
                "placeholders"
            )
        return value

    def render(
        self, resource: str, fence: int, idempotency_key: str, receipt_id: str | None = None
    ) -> str:
        """The path with docs/contract.md §8's placeholders filled in.

        `{resource}` and `{idempotency_key}` are percent-encoded whole (a resource has '/',
        a client's key may hold '/', '?', '#' or '%'). `{receipt_id}` stays literal while
        `receipt_id` is None: a receipt is made by admission, after its path is fixed.
        """
        values = {
            "resource": quote(resource, safe=""),
            "name": quote(resource.rsplit("/", 1)[-1], safe=""),
            "idempotency_key": quote(idempotency_key, safe=""),
            "fence": str(fence),
        }
        if receipt_id is not None:
            values["receipt_id"] = receipt_id
        return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), self.path)


class ResourceRule(_Model):
    match: str
    upstream: str
    fenced_methods: frozenset[HttpMethod] = frozenset({"POST", "PUT", "PATCH", "DELETE"})
    concurrency: Literal["serial", "parallel"] = "parallel"
    queue_timeout_s: float = Field(30, gt=0)
    forward_fence_headers: bool = True
    lease: Lease = Field(default_factory=Lease)
    idempotency: Idempotency = Field(default_factory=Idempotency)
    on_expiry: CallTemplate | None = None
    probe: CallTemplate | None = None
    # MCP upstreams only (docs/contract.md §16): the tool calls this rule fences, as globs
    # (`*` any run of characters).
    tools: tuple[str, ...] | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError(
                "at least one tool glob: a rule fencing no tool leaves every call unfenced"
            )
        for pattern in value:
            if not valid_tool_glob(pattern):
                raise ValueError(
                    f"{pattern!r} is not a tool glob: 1 to 128 visible ASCII characters, "
                    "* for any run of them"
                )
        return value

    @field_validator("fenced_methods")
    @classmethod
    def _fences_something(cls, value: frozenset[str]) -> frozenset[str]:
        if not value:
            raise ValueError(
                "at least one method: a rule fencing none leaves every call "
                "unfenced (to mean that, leave the upstream without a rule)"
            )
        return value

    @field_validator("match")
    @classmethod
    def _match(cls, value: str) -> str:
        if not valid_glob(value):
            raise ValueError("not a resource glob")
        return value

    def covers(self, resource: str) -> bool:
        return glob_matches(self.match, resource)

    def fences_tool(self, tool: str) -> bool:
        return self.tools is not None and tool_matches(self.tools, tool)


class PolicyFile(_Model):
    upstreams: list[Upstream] = Field(default_factory=list)
    resources: list[ResourceRule] = Field(default_factory=list)


class PolicySet:
    """All policy files merged: upstreams by name, mounts longest first, rules in file order."""

    def __init__(
        self,
        upstreams: list[Upstream],
        rules: list[ResourceRule],
        hmac_secrets: dict[str, bytes] | None = None,
    ) -> None:
        self.upstreams = {u.name: u for u in upstreams}
        self.hmac_secrets = hmac_secrets or {}  # env name -> secret, read once at start
        self.rules = rules
        self._by_mount = sorted(upstreams, key=lambda u: len(u.mount), reverse=True)
        self.rules_of = {name: [r for r in rules if r.upstream == name] for name in self.upstreams}
        self.fenced_methods = {
            name: frozenset().union(*(r.fenced_methods for r in rules)) if rules else frozenset()
            for name, rules in self.rules_of.items()
        }
        self.tool_globs = {  # the `tools` globs of all the rules of each (MCP) upstream
            name: tuple(glob for rule in rules for glob in rule.tools or ())
            for name, rules in self.rules_of.items()
        }

    def route(self, path: str) -> tuple[Upstream, str] | None:
        """The upstream whose mount is the longest prefix of `path`, and the rest of it."""
        for upstream in self._by_mount:
            mount = upstream.mount
            if path == mount or (path.startswith(mount) and path[len(mount)] in "/?"):
                return upstream, path[len(mount) :]
        return None

    def rule_for(self, upstream: str, resource: str) -> ResourceRule | None:
        for rule in self.rules_of.get(upstream, ()):
            if rule.covers(resource):
                return rule
        return None

    def tool_treatment(self, upstream: Upstream, tool: str) -> ToolTreatment:
        """Whether a tool call of an MCP upstream is fenced, passed unfenced or refused."""
        return treat_tool(
            tool, self.tool_globs[upstream.name], upstream.unfenced_tools, upstream.unmatched_tools
        )

    def tool_rule(self, upstream: str, resource: str, tool: str) -> ResourceRule | None:
        """The first rule of an MCP upstream that covers both the resource and the tool."""
        for rule in self.rules_of.get(upstream, ()):
            if rule.covers(resource) and rule.fences_tool(tool):
                return rule
        return None

    def lease_rule(self, resource: str) -> ResourceRule | None:
        """The first rule, across all files, that covers `resource` with a gateway issuer."""
        for rule in self.rules:
            if rule.lease.issuer == "gateway" and rule.covers(resource):
                return rule
        return None
