"""Throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1/localhost, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _issue(subject: str, issuer_key, issuer_name, *, ca: bool, san: list | None = None):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name or _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def make_pki(directory: Path, name: str = "test") -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _issue(f"{name}-ca", None, None, ca=True)
    ca_path, _ = _write(directory / f"{name}-ca", ca_key, ca_cert)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    s_key, s_cert = _issue("cursus-broker", ca_key, ca_cert.subject, ca=False, san=san)
    s_cert_path, s_key_path = _write(directory / f"{name}-server", s_key, s_cert)
    c_key, c_cert = _issue("cursus-client", ca_key, ca_cert.subject, ca=False)
    c_cert_path, c_key_path = _write(directory / f"{name}-client", c_key, c_cert)
    return Pki(ca_path, s_cert_path, s_key_path, c_cert_path, c_key_path)
