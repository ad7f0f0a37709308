"""TLS contexts for the internal (node-to-node) listener and peer identity extraction.

Both directions use TLS 1.2 or newer and require a certificate issued by the internal CA: the server side
refuses clients without one (mutual TLS). Host names are not checked (nodes share hosts in development);
instead the caller compares :func:`peer_identity` (the certificate's ``raft://<node-id>`` URI) with the
node id the peer claims to be. The Raft transport and, later, the gRPC replication listener use these.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

IDENTITY_SCHEME = "raft://"


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths of this node's certificate and key and of the internal CA bundle."""

    cert: Path
    key: Path
    ca: Path


def _base(purpose: int, files: TLSFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(str(files.cert), str(files.key))
    context.load_verify_locations(cafile=str(files.ca))
    return context


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """A server context: TLS >= 1.2, presents ``files.cert``, requires a client certificate from the CA.

    Raises:
        OSError, ssl.SSLError: a file is missing or not a valid PEM certificate/key.
    """
    return _base(ssl.PROTOCOL_TLS_SERVER, files)


def client_context(files: TLSFiles) -> ssl.SSLContext:
    """A client context: TLS >= 1.2, presents ``files.cert``, verifies the server against the CA.

    Host names are not checked; verify the peer with :func:`peer_identity` instead.
    """
    context = _base(ssl.PROTOCOL_TLS_CLIENT, files)
    context.check_hostname = False
    return context


def identity_of(cert: dict | None) -> str | None:
    """The node id of a decoded peer certificate (``SSLSocket.getpeercert()``), or None.

    Exactly one ``raft://<node-id>`` URI SAN is accepted; none, several or an empty id give None.
    """
    if not cert:
        return None
    uris = [value for kind, value in cert.get("subjectAltName", ())
            if kind == "URI" and value.startswith(IDENTITY_SCHEME)]
    if len(uris) != 1:
        return None
    node_id = uris[0][len(IDENTITY_SCHEME):]
    return node_id or None


def peer_identity(sock: ssl.SSLSocket | ssl.SSLObject) -> str | None:
    """The node id in the verified certificate of ``sock``'s peer (after the handshake), or None."""
    return identity_of(sock.getpeercert())
