"""Policy files → a validated, merged `PolicySet`, or a `PolicyError` naming file, line and
field. Checks that span files (unique names and mounts, known upstreams) live here."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from gateway.config.policy import PolicyFile, PolicySet, ResourceRule, Upstream
from gateway.config.tls import TlsFileError, ssl_context_for
from gateway.config.yaml_file import ConfigFileError, YamlFile

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


PolicyError = ConfigFileError  # a policy file is unusable: `file:line: field: problem`


def policy_files(path: str | Path) -> list[Path]:
    root = Path(path)
    if root.is_dir():
        files = sorted(root.glob("*.yaml"))
        if not files:
            raise PolicyError(f"{root}: no *.yaml policy file in this folder")
        return files
    if root.is_file():
        return [root]
    raise PolicyError(f"{root}: no such policy file or folder")


def load_policies(
    path: str | Path, environ: dict[str, str] | None = None, warnings: list[str] | None = None
) -> PolicySet:
    """Load, validate and merge every policy file under `path`.

    `environ` resolves `${NAME}` in `inject_headers`; `warnings` collects advice that does
    not stop the gateway (an external issuer without a signature secret, an upstream that no
    rule fences, an MCP upstream that passes the tools no rule names).
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    upstreams: list[Upstream] = []
    rules: list[ResourceRule] = []
    seen: dict[tuple[str, str], str] = {}  # (kind, value) -> file:line of first use
    places: list[str] = []  # each rule's file:line, in the order of `rules`
    for file in policy_files(path):
        source = YamlFile(file)
        parsed = source.validate(PolicyFile)
        for index, upstream in enumerate(parsed.upstreams):
            where = source.where("upstreams", index)
            for kind, value in (("name", upstream.name), ("mount", upstream.mount)):
                if (kind, value) in seen:
                    raise PolicyError(
                        f"{where}: upstreams[{index}].{kind}: {value!r} is "
                        f"already used at {seen[kind, value]}"
                    )
                seen[kind, value] = where
            _tls_checks(upstream, source, index)
            upstreams.append(_expand(upstream, env, where, index))
        rules.extend(parsed.resources)
        for index, rule in enumerate(parsed.resources):
            where = source.where("resources", index)
            places.append(f"{where}: resources[{index}]")
            _rule_checks(rule, (where, index), env, warnings)
    names = {u.name for u in upstreams}
    for rule, place in zip(rules, places, strict=True):
        if rule.upstream not in names:
            raise PolicyError(
                f"{place}.upstream: rule {rule.match!r} names upstream {rule.upstream!r},"
                f" which no policy file declares (known: {sorted(names)})"
            )
    mcp_checks(upstreams, rules, places)
    if warnings is not None:
        # Allowed (a read-only tool needs no fencing), but it fails open: say so at start.
        # (An MCP upstream refusing unmatched tools fails closed, rules or not.)
        ruled = {rule.upstream for rule in rules}
        warnings.extend(
            f"{seen['name', u.name]}: upstream {u.name} has no resource rule: every call to it "
            "is forwarded unfenced, without a receipt"
            for u in upstreams
            if u.name not in ruled and u.unmatched_tools == "pass"
        )
        # An upgrade is always fenced (docs/contract.md §15): with no rule, none is admitted.
        warnings.extend(
            f"{seen['name', u.name]}: upstream {u.name} accepts WebSocket upgrades but has no "
            "resource rule: every upgrade is refused (resource_not_allowed)"
            for u in upstreams
            if u.websocket and u.name not in ruled
        )
        # Allowed too, but a tool newly added to the server is then forwarded unfenced.
        warnings.extend(
            f"{seen['name', u.name]}: upstream {u.name} is an MCP server left on "
            "unmatched_tools: pass: a tool call no rule's tools name (a tool newly added to "
            "the server too) is forwarded unfenced; say unmatched_tools: refuse and list the "
            "read-only tools in unfenced_tools"
            for u in upstreams
            if u.mcp and u.unmatched_tools == "pass"
        )
    secrets = {
        r.lease.hmac_secret_env: env[r.lease.hmac_secret_env].encode()
        for r in rules
        if r.lease.hmac_secret_env
    }
    return PolicySet(upstreams, rules, secrets)


def mcp_checks(upstreams: list[Upstream], rules: list[ResourceRule], places: list[str]) -> None:
    """An MCP upstream's rules say which tools they fence (docs/contract.md §16), and only
    its rules do: a rule of an MCP upstream fences tool calls, never methods."""
    mcp = {u.name for u in upstreams if u.mcp}
    for rule, place in zip(rules, places, strict=True):
        if rule.upstream in mcp:
            if rule.tools is None:
                raise PolicyError(
                    f"{place}.tools: upstream {rule.upstream} is an MCP server (mcp: true): "
                    'its rules name the tool calls they fence, e.g. tools: ["send_*"]'
                )
            if "fenced_methods" in rule.model_fields_set:
                raise PolicyError(
                    f"{place}.fenced_methods: upstream {rule.upstream} is an MCP server: its "
                    "rules fence tool calls (tools), not methods"
                )
        elif rule.tools is not None:
            raise PolicyError(
                f"{place}.tools: upstream {rule.upstream} is not an MCP server: tools applies "
                "to upstreams with mcp: true only"
            )


def _rule_checks(
    rule: ResourceRule, where: tuple[str, int], env: Mapping[str, str], warnings: list[str] | None
) -> None:
    place, index = where
    secret_env = rule.lease.hmac_secret_env
    if rule.lease.issuer == "external" and not secret_env and warnings is not None:
        warnings.append(
            f"{place}: resources[{index}]: issuer external without hmac_secret_env: any client "
            "allowed on it can push the fence to the maximum and lock the resource forever"
        )
    if secret_env and not env.get(secret_env):
        raise PolicyError(
            f"{place}: resources[{index}].lease.hmac_secret_env: "
            f"environment variable {secret_env} is not set"
        )


def _tls_checks(upstream: Upstream, source: YamlFile, index: int) -> None:
    """An upstream's `tls` files are read, and its pair matched, as the gateway will
    (docs/contract.md §22); `tls` on a plain http upstream would be ignored, so it is refused."""
    if not upstream.url.startswith("https:"):
        if upstream.tls.configured:
            raise source.error(
                ("upstreams", index, "tls"),
                f"applies to https:// upstreams only, and url is {upstream.url}",
            )
        return
    try:
        ssl_context_for(upstream.tls)
    except TlsFileError as exc:
        raise source.error(("upstreams", index, "tls", exc.field), str(exc)) from None


def _expand(upstream: Upstream, env: Mapping[str, str], where: str, index: int) -> Upstream:
    def resolve(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise PolicyError(
                f"{where}: upstreams[{index}].inject_headers: "
                f"environment variable {name} is not set"
            )
        return env[name]

    headers = {k: _ENV_REF.sub(resolve, v) for k, v in upstream.inject_headers.items()}
    for name, value in headers.items():
        if any(ch in value for ch in "\r\n\0"):
            raise PolicyError(
                f"{where}: upstreams[{index}].inject_headers.{name}: value contains CR, LF or NUL"
            )
    return upstream.model_copy(update={"inject_headers": headers})
