"""Development PKI for the internal cluster transport: one CA and one certificate per node.

Every node certificate is usable as a TLS server and client certificate (mutual TLS between nodes), its
SubjectAlternativeName lists the node's host names / IP addresses and exactly one ``raft://<node-id>``
URI: the identity :func:`cursus.cluster.tls.peer_identity` extracts and the Raft transport checks against
the node id a peer announces. Keys are ECDSA P-256, written with mode 0600.

Files written by :func:`generate_cluster_certs` into ``out``: ``ca.crt``, ``ca.key``, and per node
``<node-id>.crt`` / ``<node-id>.key``. The CA key is needed only to issue more certificates; keep it off
the nodes outside development.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cursus.cluster.tls import IDENTITY_SCHEME

DEFAULT_VALIDITY_DAYS = 825


@dataclass(frozen=True)
class Authority:
    """A CA able to issue node certificates: its certificate and private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class NodeFiles:
    """Paths of one node's PEM certificate and key."""

    node_id: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterCerts:
    """What :func:`generate_cluster_certs` wrote: the CA certificate and key, and each node's files."""

    ca_cert: Path
    ca_key: Path
    nodes: tuple[NodeFiles, ...]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def new_authority(name: str = "cursus-cluster-ca", days: int = DEFAULT_VALIDITY_DAYS) -> Authority:
    """A fresh self-signed CA (ECDSA P-256, SHA-256, valid ``days`` days)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue_node_cert(authority: Authority, node_id: str, hosts: Sequence[str],
                    days: int = DEFAULT_VALIDITY_DAYS, *,
                    identity: str | None = None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Issue a server+client certificate for ``node_id`` with SAN ``hosts`` and ``raft://<identity>``.

    ``identity`` defaults to ``node_id``; pass ``""`` to omit the URI (tests of refusals only).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    names = [_host_name(host) for host in hosts]
    uri = node_id if identity is None else identity
    if uri:
        names.append(x509.UniformResourceIdentifier(f"{IDENTITY_SCHEME}{uri}"))
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(node_id))
        .issuer_name(authority.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(authority.key, hashes.SHA256()), key


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def write_pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert_path: Path,
              key_path: Path) -> None:
    """Write ``cert`` (0644) and unencrypted PKCS#8 ``key`` (0600) as PEM files."""
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))


def node_ids(count: int) -> list[str]:
    """The default node ids of an ``count``-node development cluster: ``node-1`` ... ``node-<count>``."""
    if count < 1:
        raise ValueError("a cluster needs at least one node")
    return [f"node-{index}" for index in range(1, count + 1)]


def generate_cluster_certs(out: Path, ids: Sequence[str], hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                           days: int = DEFAULT_VALIDITY_DAYS) -> ClusterCerts:
    """Create ``out`` (if needed) and write a new CA plus one certificate per id in ``ids``.

    Raises:
        ValueError: no ids, a duplicate id, or an id that is not a plain name.
        FileExistsError: ``out`` already holds a ``ca.crt`` (regenerating would orphan its nodes).
        OSError: writing a file failed.
    """
    if not ids or len(set(ids)) != len(ids):
        raise ValueError("node ids must be given and distinct")
    for node_id in ids:
        if not node_id or "/" in node_id or node_id.startswith("."):
            raise ValueError(f"invalid node id {node_id!r}")
    out.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = out / "ca.crt", out / "ca.key"
    if ca_cert.exists():
        raise FileExistsError(f"{ca_cert} exists; remove {out} to generate a new CA")
    authority = new_authority()
    write_pem(authority.cert, authority.key, ca_cert, ca_key)
    nodes = []
    for node_id in ids:
        cert, key = issue_node_cert(authority, node_id, hosts, days)
        files = NodeFiles(node_id, out / f"{node_id}.crt", out / f"{node_id}.key")
        write_pem(cert, key, files.cert, files.key)
        nodes.append(files)
    return ClusterCerts(ca_cert, ca_key, tuple(nodes))
