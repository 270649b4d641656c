"""MkDocs hook: the reference pages that the code itself holds, generated at every build so
they can never fall behind it.

- `reference/http-api.md` (and `reference/openapi.json` beside it): the OpenAPI document the
  gateway serves at `GET /_gateway/v1/openapi.json`, from the same function that serves it
  (`gateway.api.openapi.document`), as one page.
- `reference/cli.md`: every subcommand's `--help`, from the parser `fence-gateway` runs.

Nothing here reaches the network; it needs the project installed (`make docs` runs it in .venv).
"""

from __future__ import annotations

import argparse
import io
import json
import os
from contextlib import redirect_stdout
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

METHODS = ("get", "put", "post", "delete", "patch")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    from gateway.api.openapi import document

    described = document(secured=True)
    generated = {
        "reference/http-api.md": http_api_page(described),
        "reference/openapi.json": json.dumps(described, indent=2) + "\n",
        "reference/cli.md": cli_page(),
    }
    for uri, content in generated.items():
        files.append(File.generated(config, uri, content=content))
    return files


# -- the HTTP API ---------------------------------------------------------------------------------


def http_api_page(described: dict[str, Any]) -> str:
    out = [
        "# HTTP API",
        "",
        "The gateway's own API, under `/_gateway/v1`, as the OpenAPI "
        f"{described['openapi']} document it serves at `GET /_gateway/v1/openapi.json` "
        "describes it ([download it](openapi.json)). Every error is `application/problem+json`"
        " with a `code` from the [error codes](errors.md). With a clients file every call "
        "carries `Authorization: Bearer <key>`; running open, the document the gateway serves "
        "lists no security. `ttl_s` is bounded by the policies' smallest `max_ttl_s`.",
        "",
        "Proxied calls (any path under an upstream's mount) are not part of this document: "
        "they are the tool's own API, with the fencing headers of the "
        "[contract](../contract.md).",
        "",
    ]
    for path, item in described["paths"].items():
        for method in METHODS:
            if method in item:
                out += _operation(method.upper(), path, item[method])
    out += ["## Schemas", ""]
    for name, schema in described["components"]["schemas"].items():
        out += [f"### {name} {{#schema-{name.lower()}}}", "", "```json"]
        out += [json.dumps(schema, indent=2, ensure_ascii=False), "```", ""]
    return "\n".join(out)


def _operation(method: str, path: str, operation: dict[str, Any]) -> list[str]:
    out = [f"## {method} `{path}`", "", operation.get("summary", ""), ""]
    parameters = operation.get("parameters", [])
    if parameters:
        out += ["| parameter | in | required | schema | description |", "|---|---|---|---|---|"]
        for parameter in parameters:
            out.append(
                f"| `{parameter['name']}` | {parameter['in']} | "
                f"{'yes' if parameter.get('required') else 'no'} | "
                f"{_schema_cell(parameter.get('schema', {}))} | "
                f"{_cell(parameter.get('description', ''))} |"
            )
        out.append("")
    body = operation.get("requestBody")
    if body:
        required = "required" if body.get("required") else "optional"
        for media, content in body["content"].items():
            out += [f"Request body ({required}, `{media}`):", "", "```json"]
            out += [json.dumps(content["schema"], indent=2, ensure_ascii=False), "```", ""]
    out += ["| status | answer | body |", "|---|---|---|"]
    for status, answer in operation["responses"].items():
        media = ", ".join(
            f"`{kind}` {_schema_cell(content.get('schema', {}))}"
            for kind, content in answer.get("content", {}).items()
        )
        out.append(f"| {status} | {_cell(answer['description'])} | {media} |")
    return [*out, ""]


def _schema_cell(schema: dict[str, Any]) -> str:
    """A schema in one table cell: a link for a reference, the JSON otherwise."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#schema-{name.lower()})"
    if schema.get("type") == "array" and "$ref" in schema.get("items", {}):
        return f"array of {_schema_cell(schema['items'])}"
    return _cell(f"`{json.dumps(schema, ensure_ascii=False)}`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- the command line -----------------------------------------------------------------------------


def cli_page() -> str:
    from gateway.cli.main import build_parser

    # argparse wraps help to the terminal's width: one width, whoever builds the site
    os.environ["COLUMNS"] = "100"
    out = [
        "# Command line",
        "",
        "`fence-gateway` is installed with the package (`.venv/bin/fence-gateway` after "
        "`make`; `python -m gateway` runs the same). Every subcommand's `--help`, as this "
        "version prints it. The `leases`, `receipts` and `fences` commands talk to a running "
        "gateway: the key is read from `GATEWAY_KEY`; an error from the gateway prints "
        "`fence-gateway: <code>: <detail>` and exits 1. A bad setting or policy exits 2.",
        "",
    ]
    for words, parser in _commands(build_parser(), ["fence-gateway"]):
        out += [f"## `{' '.join(words)}`", "", "```text", _help(parser).rstrip(), "```", ""]
    return "\n".join(out)


def _commands(
    parser: argparse.ArgumentParser, words: list[str]
) -> list[tuple[list[str], argparse.ArgumentParser]]:
    found = [(words, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, [*words, name])
    return found


def _help(parser: argparse.ArgumentParser) -> str:
    printed = io.StringIO()
    with redirect_stdout(printed):
        parser.print_help()
    return printed.getvalue()
