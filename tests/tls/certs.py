"""Certificates the tests make themselves: a CA that issues server and client certificates
as PEM files, and what a handshake showed (the serial of the certificate served).

EC P-256 keys: made in a millisecond, so every test gets its own CA and nothing is shared
between tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its key, written as PEM files."""

    cert: Path
    key: Path
    serial: int


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class Authority:
    """A self-signed CA in `folder`; `cert` is its certificate's PEM file."""

    def __init__(self, folder: Path, name: str = "Test CA") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        self._certificate = certificate
        self.cert = folder / f"{name.replace(' ', '-').lower()}.pem"
        self.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        stem: str,
        *,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = ("127.0.0.1",),
        client: bool = False,
        expired: bool = False,
    ) -> Issued:
        """A leaf certificate for these names (a server's), or for TLS clients, written to
        `{stem}.pem` and `{stem}.key` in the CA's folder."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = (now - 10 * _DAY, now - _DAY) if expired else (now - _DAY, now + 10 * _DAY)
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        serial = x509.random_serial_number()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, stem)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        certificate = builder.sign(self._key, hashes.SHA256())
        cert, key_path = self.folder / f"{stem}.pem", self.folder / f"{stem}.key"
        cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_pem_key(key))
        return Issued(cert, key_path, serial)


def client_context(ca: Path | None, cert: Issued | None = None) -> ssl.SSLContext:
    """What a client verifies a server with (`ca`; None: the system's store) and presents."""
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        context.load_cert_chain(cert.cert, cert.key)
    return context


def server_context(cert: Issued, client_ca: Path | None = None) -> ssl.SSLContext:
    """A server's context; with `client_ca`, clients must present a certificate it signed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert.cert, cert.key)
    if client_ca is not None:
        context.load_verify_locations(cafile=str(client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


async def served_serial(port: int, context: ssl.SSLContext) -> int:
    """The serial number of the certificate a new TLS connection to 127.0.0.1:`port` is
    shown."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()
        await writer.wait_closed()
