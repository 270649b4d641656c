"""`tls` in a policy (docs/contract.md §8, §22) is checked when the policy is read, by
`check-policies` and at start: the files are read and the client certificate paired with its
key, and a problem names the policy file, the line and the field, then the PEM file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from gateway.config.policy_files import PolicyError, load_policies
from tests.harness import REPO_ROOT, make_policy, write_policy
from tests.tls.certs import Authority


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path / "pki")


def written(tmp_path: Path, tls: dict[str, Any], url: str = "https://127.0.0.1:9/api") -> Path:
    return write_policy(tmp_path / "policies.yaml", make_policy(url, [{"match": "ext/*"}], tls=tls))


def line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_good_files_and_a_server_name_pass(tmp_path: Path, ca: Authority) -> None:
    client = ca.issue("client", client=True, ips=())
    tls = {
        "ca_file": str(ca.cert),
        "cert_file": str(client.cert),
        "key_file": str(client.key),
        "server_name": "tool.internal",
    }
    policies = load_policies(written(tmp_path, tls))
    assert policies.upstreams["tool"].tls.model_dump() == tls


def test_each_bad_file_is_named_with_its_field_and_line(tmp_path: Path, ca: Authority) -> None:
    client, other = ca.issue("client", client=True), ca.issue("other", client=True)
    missing, encrypted = tmp_path / "missing.pem", tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(client.key.read_bytes(), None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    good = {"ca_file": str(ca.cert), "cert_file": str(client.cert), "key_file": str(client.key)}
    cases = [
        ({**good, "ca_file": str(missing)}, "ca_file", "cannot be read: No such file or directory"),
        (
            {**good, "ca_file": str(client.key)},
            "ca_file",
            "holds no PEM certificate (BEGIN CERTIFICATE)",
        ),
        ({**good, "cert_file": str(tmp_path)}, "cert_file", "cannot be read: Is a directory"),
        (
            {**good, "key_file": str(client.cert)},
            "key_file",
            "holds no PEM private key (BEGIN PRIVATE KEY)",
        ),
        (
            {**good, "key_file": str(other.key)},
            "key_file",
            f"this key does not match the certificate in {client.cert}",
        ),
        # never a password prompt on the terminal of a server
        (
            {**good, "key_file": str(encrypted)},
            "key_file",
            "the key is encrypted; give it unencrypted",
        ),
    ]
    for tls, field, problem in cases:
        path = written(tmp_path, tls)
        with pytest.raises(PolicyError) as caught:
            load_policies(path)
        at = line_of(path, f"{field}:")
        assert str(caught.value) == (
            f"{path}:{at}: upstreams[0].tls.{field}: {tls[field]}: {problem}"
        ), tls


def test_what_the_schema_refuses(tmp_path: Path, ca: Authority) -> None:
    client = ca.issue("client", client=True)
    cases = [
        (
            {"key_file": str(client.key)},
            "https://127.0.0.1:9/api",
            "upstreams[0].tls: key_file without cert_file",
        ),
        (
            {"server_name": "tool internal"},
            "https://127.0.0.1:9/api",
            "upstreams[0].tls.server_name: 'tool internal': not a DNS name",
        ),
        (
            {"ca_file": str(ca.cert)},
            "http://127.0.0.1:9/api",
            "upstreams[0].tls: applies to https:// upstreams only, and url is http://",
        ),
        # no switch turns verification off
        ({"verify": False}, "https://127.0.0.1:9/api", "upstreams[0].tls.verify: unknown field"),
    ]
    for tls, url, message in cases:
        with pytest.raises(PolicyError) as caught:
            load_policies(written(tmp_path, tls, url))
        assert message in str(caught.value), str(caught.value)
    # a plain http upstream may spell out the empty defaults
    empty = {"ca_file": None, "cert_file": None, "key_file": None, "server_name": None}
    assert load_policies(written(tmp_path, empty, "http://127.0.0.1:9/api")).upstreams


def test_check_policies_exits_2_on_a_key_that_does_not_pair(tmp_path: Path, ca: Authority) -> None:
    client, other = ca.issue("client", client=True), ca.issue("other", client=True)
    path = written(tmp_path, {"cert_file": str(client.cert), "key_file": str(other.key)})
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check-policies", str(path)],
        capture_output=True,
        text=True,
        env={**clean, "PYTHONPATH": str(REPO_ROOT)},
        timeout=30,
    )
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.splitlines() == [
        f"fence-gateway: {path}:{line_of(path, 'key_file:')}: upstreams[0].tls.key_file: "
        f"{other.key}: this key does not match the certificate in {client.cert}"
    ]
