"""TLS contexts built from PEM files (docs/contract.md §22): the one the gateway serves with,
and the one it reaches an HTTPS upstream with.

The files are read here and nowhere else. ssl's own errors name no file (`[SSL] PEM lib`), so
each file is checked on its own first and a `TlsFileError` says which one is missing,
unreadable, not PEM, or does not pair with its certificate; the gateway finds that at start
and `check-policies` finds it in a policy, never the first handshake.
"""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path
from typing import Literal

from gateway.config.policy import Tls

TlsField = Literal["ca_file", "cert_file", "key_file"]

_CERTIFICATE = "-----BEGIN CERTIFICATE-----"
_KEY_END = "PRIVATE KEY-----"  # BEGIN PRIVATE KEY, BEGIN RSA PRIVATE KEY, BEGIN EC PRIVATE KEY


class TlsFileError(Exception):
    """A PEM file the gateway cannot use; `field` says which of `Tls`'s fields names it."""

    def __init__(self, field: TlsField, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.field = field
        self.path = path
        self.problem = problem


class _UpstreamContext(ssl.SSLContext):
    """A client context that, given a `server_name`, names it in every handshake whatever
    address the connection was opened to: sent as SNI and checked against the certificate.

    Every client on asyncio (aiohttp's, or one on raw protocols) starts its TLS through
    `wrap_bio`, uvloop's too; so the name travels with the context and no caller has to
    pass it on.
    """

    server_name: str | None = None

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        name = self.server_name or server_hostname
        return super().wrap_bio(incoming, outgoing, server_side, name, session)


def ssl_context_for(tls: Tls) -> ssl.SSLContext:
    """The context an HTTPS upstream is reached with: its certificate verified, always,
    against `ca_file` (only it) or the system's store; a client certificate presented when
    `cert_file` is set; the name checked is `server_name`, or the URL's host."""
    context = _UpstreamContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, and checks the name
    context.server_name = tls.server_name
    if tls.ca_file:
        _load_ca(context, tls.ca_file)
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if tls.cert_file:
        _load_pair(context, tls.cert_file, tls.key_file)
    return context


def server_context(cert_file: str, key_file: str, client_ca: str | None) -> ssl.SSLContext:
    """The context the gateway serves HTTPS with; with `client_ca`, a client without a
    certificate that CA signed fails the handshake (the system's CAs are not trusted for
    it)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_pair(context, cert_file, key_file)
    if client_ca:
        _load_ca(context, client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def reload_pair(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """Load the pair now in `cert_file` and `key_file` into the live `context`: handshakes
    from now on present it, connections already open keep theirs (each took its own copy).

    The files are read once into a private copy, checked whole in a scratch context and
    only then loaded from that same copy: a bad pair, or files replaced halfway, raise
    `TlsFileError` and leave `context` as it was.
    """
    cert, key = _read(cert_file, "cert_file"), _read(key_file, "key_file")
    with tempfile.TemporaryDirectory(prefix="fence-gateway-tls-") as folder:
        copy_cert, copy_key = Path(folder, "cert.pem"), Path(folder, "key.pem")
        copy_cert.write_text(cert, encoding="latin-1")  # byte for byte, as `_read` read it
        copy_key.write_text(key, encoding="latin-1")
        try:
            _load_pair(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), str(copy_cert), str(copy_key))
        except TlsFileError as exc:  # named by the files the operator wrote, not the copy
            path = cert_file if exc.field == "cert_file" else key_file
            problem = exc.problem.replace(str(copy_cert), cert_file)
            raise TlsFileError(exc.field, path, problem) from None
        context.load_cert_chain(copy_cert, copy_key)


def _load_ca(context: ssl.SSLContext, ca_file: str) -> None:
    if _CERTIFICATE not in _read(ca_file, "ca_file"):
        raise TlsFileError("ca_file", ca_file, "holds no PEM certificate (BEGIN CERTIFICATE)")
    try:
        context.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise TlsFileError("ca_file", ca_file, f"not a usable CA certificate: {exc}") from None


def _load_pair(context: ssl.SSLContext, cert_file: str, key_file: str | None) -> None:
    """A certificate (chain) and its private key; the key may sit in the certificate's
    file."""
    cert = _read(cert_file, "cert_file")
    if _CERTIFICATE not in cert:
        raise TlsFileError("cert_file", cert_file, "holds no PEM certificate (BEGIN CERTIFICATE)")
    try:
        # parsed as X.509 on a scratch context: a broken certificate is named as such
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cert)
    except ssl.SSLError as exc:
        raise TlsFileError("cert_file", cert_file, f"not a valid certificate: {exc}") from None
    key_field: TlsField = "key_file" if key_file else "cert_file"
    key_path = key_file or cert_file
    key = cert if key_file is None else _read(key_file, "key_file")
    if _KEY_END not in key:
        raise TlsFileError(key_field, key_path, "holds no PEM private key (BEGIN PRIVATE KEY)")

    def encrypted() -> bytes:  # asked only for an encrypted key; never a prompt on a terminal
        raise TlsFileError(key_field, key_path, "the key is encrypted; give it unencrypted")

    try:
        context.load_cert_chain(cert_file, key_file, password=encrypted)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsFileError(
                key_field, key_path, f"this key does not match the certificate in {cert_file}"
            ) from None
        raise TlsFileError(key_field, key_path, f"not a usable private key: {exc}") from None


def _read(path: str, field: TlsField) -> str:
    try:
        return Path(path).read_text(encoding="latin-1")  # PEM is ASCII; any byte reads
    except OSError as exc:
        raise TlsFileError(field, path, f"cannot be read: {exc.strerror or exc}") from None
