"""Throwaway TLS files for tests: a CA, a server certificate for 127.0.0.1 / localhost and a
client certificate, all signed by the CA (PEM). Made with the ``cryptography`` package when
installed, else the ``openssl`` command; :func:`make_tls_files` skips the test when neither
is there."""

from __future__ import annotations

import datetime
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the PEM files (``other_ca`` signed nothing here: a wrong trust root)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def make_tls_files(folder: Path) -> TlsFiles:
    """Write the files into ``folder``; skips the calling test when no tool can."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        return _with_openssl(folder)
    return _with_cryptography(folder)


def _with_cryptography(folder: Path) -> TlsFiles:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def key_pem(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def ca(cn: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        return key, cert

    def leaf(cn: str, ca_key, ca_cert, server: bool):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return key, builder.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = ca("pagedserve test CA")
    _, other_cert = ca("some other CA")
    s_key, s_cert = leaf("localhost", ca_key, ca_cert, server=True)
    c_key, c_cert = leaf("pagedserve test client", ca_key, ca_cert, server=False)
    pem = serialization.Encoding.PEM
    files = {
        "ca.pem": ca_cert.public_bytes(pem),
        "other_ca.pem": other_cert.public_bytes(pem),
        "server.pem": s_cert.public_bytes(pem),
        "server.key": key_pem(s_key),
        "client.pem": c_cert.public_bytes(pem),
        "client.key": key_pem(c_key),
    }
    for fname, data in files.items():
        (folder / fname).write_bytes(data)
    return _paths(folder)


def _with_openssl(folder: Path) -> TlsFiles:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    for ca_name in ("ca", "other_ca"):
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{ca_name}.key", "-out", f"{ca_name}.pem", "-days", "1",
            "-subj", f"/CN={ca_name}")  # fmt: skip
    (folder / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    )
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for leaf in ("server", "client"):
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr", "-subj", f"/CN={leaf}")  # fmt: skip
        run("x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{leaf}.pem", "-days", "1", "-extfile", f"{leaf}.ext")  # fmt: skip
    return _paths(folder)


def _paths(folder: Path) -> TlsFiles:
    return TlsFiles(
        ca=str(folder / "ca.pem"),
        server_cert=str(folder / "server.pem"),
        server_key=str(folder / "server.key"),
        client_cert=str(folder / "client.pem"),
        client_key=str(folder / "client.key"),
        other_ca=str(folder / "other_ca.pem"),
    )
