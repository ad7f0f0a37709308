"""The Raft transport's mutual TLS: every kind of unauthenticated or mis-identified peer is refused.

A real in-process node-1 listens; the test plays node-2 (whose address sorts above node-1's, so node-2
is the side that dials). Each refusal is checked on both ends: our socket is closed or the handshake
fails, and node-1 counts the rejection under the expected reason without ever connecting node-2.
"""

from __future__ import annotations

import pickle
import socket
import ssl
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from cursus.cluster.raft.node import RaftNode
from cursus.cluster.tls import TLSFiles
from tests.cluster.raftsupport import IDS, RaftPki, closed_by_peer, free_ports, in_process_node, wait_for


def _frame(message: object) -> bytes:
    data = zlib.compress(pickle.dumps(message, 2), 3)
    return struct.pack("i", len(data)) + data


@pytest.fixture(scope="module")
def target(pki: RaftPki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RaftNode, dict[str, str]]]:
    addresses = sorted(f"127.0.0.1:{port}" for port in free_ports(3))
    members = dict(zip(IDS, addresses, strict=True))
    node = in_process_node(pki, "node-1", members, Path(tmp_path_factory.mktemp("tls-node")),
                           handshake_timeout=1.0)
    node.start()
    yield node, members
    node.stop()


def _context(files: TLSFiles | None, *, max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the refusals under test are the server's
    if files is not None:
        context.load_cert_chain(str(files.cert), str(files.key))
    if max_version is not None:
        context.minimum_version = ssl.TLSVersion.TLSv1
        context.maximum_version = max_version
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
    return context


def _connect(node: RaftNode, members: dict[str, str]) -> socket.socket:
    host, port = members["node-1"].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _rejections(node: RaftNode, reason: str) -> int:
    return int(node.status().rejected_connections.get(reason, 0))


def _assert_refused(node: RaftNode, reason: str, before: int) -> None:
    wait_for(lambda: _rejections(node, reason) > before, 5, f"a {reason} rejection")
    assert "node-2" not in node.status().connected_peers


def _tls_session(pki_files: TLSFiles | None, node: RaftNode, members: dict[str, str]) -> ssl.SSLSocket:
    return _context(pki_files).wrap_socket(_connect(node, members))


def test_authenticated_peer_is_accepted(pki: RaftPki, target: tuple[RaftNode, dict[str, str]]) -> None:
    node, members = target
    with _tls_session(pki.files("node-2"), node, members) as sock:
        sock.sendall(_frame(members["node-2"]))
        wait_for(lambda: "node-2" in node.status().connected_peers, 5, "node-2 connected")
        sock.settimeout(5)
        assert sock.recv(4)  # node-1 starts talking Raft to its authenticated peer
    wait_for(lambda: "node-2" not in node.status().connected_peers, 5, "node-2 disconnected")


def test_plaintext_peer_is_refused(target: tuple[RaftNode, dict[str, str]]) -> None:
    node, members = target
    before = _rejections(node, "handshake_failed")
    with _connect(node, members) as sock:
        sock.sendall(_frame(members["node-2"]) + _frame({"type": "request_vote", "term": 99}))
        assert closed_by_peer(sock)
    _assert_refused(node, "handshake_failed", before)


def test_silent_peer_is_dropped(target: tuple[RaftNode, dict[str, str]]) -> None:
    node, members = target
    before = _rejections(node, "authentication_timeout")
    with _connect(node, members) as sock:
        assert closed_by_peer(sock, timeout=5)
    _assert_refused(node, "authentication_timeout", before)


def test_foreign_ca_certificate_is_refused(pki: RaftPki, target: tuple[RaftNode, dict[str, str]]) -> None:
    node, members = target
    before = _rejections(node, "handshake_failed")
    with _connect(node, members) as raw:
        try:
            sock = _context(pki.foreign).wrap_socket(raw)
            sock.sendall(_frame(members["node-2"]))
            assert closed_by_peer(sock)
        except (ssl.SSLError, ConnectionError):
            pass
    _assert_refused(node, "handshake_failed", before)


def test_missing_client_certificate_is_refused(target: tuple[RaftNode, dict[str, str]]) -> None:
    node, members = target
    before = _rejections(node, "handshake_failed")
    with _connect(node, members) as raw:
        try:  # TLS 1.3: the client finishes first and learns of the refusal on its next read
            sock = _context(None).wrap_socket(raw)
            sock.sendall(_frame(members["node-2"]))
            assert closed_by_peer(sock)
        except (ssl.SSLError, ConnectionError):
            pass
    _assert_refused(node, "handshake_failed", before)


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
def test_tls_below_1_2_is_refused(pki: RaftPki, target: tuple[RaftNode, dict[str, str]]) -> None:
    node, members = target
    before = _rejections(node, "handshake_failed")
    with _connect(node, members) as raw, pytest.raises(ssl.SSLError) as failure:
        _context(pki.files("node-2"), max_version=ssl.TLSVersion.TLSv1_1).wrap_socket(raw)
    _assert_refused(node, "handshake_failed", before)
    assert "PROTOCOL_VERSION" in str(failure.value).upper()  # node-1's alert, not a local refusal


def test_certificate_claiming_another_node_is_refused(pki: RaftPki,
                                                      target: tuple[RaftNode, dict[str, str]]) -> None:
    node, members = target
    before = _rejections(node, "identity_mismatch")
    with _tls_session(pki.files("node-3"), node, members) as sock:  # a valid cert, but node-3's
        sock.sendall(_frame(members["node-2"]))
        assert closed_by_peer(sock)
    _assert_refused(node, "identity_mismatch", before)


@pytest.fixture()
def dialer(pki: RaftPki, tmp_path: Path) -> Iterator[tuple[RaftNode, dict[str, str]]]:
    """node-1 with the highest address, so it dials node-2 and node-3."""
    addresses = sorted((f"127.0.0.1:{port}" for port in free_ports(3)), reverse=True)
    members = dict(zip(IDS, addresses, strict=True))
    node = in_process_node(pki, "node-1", members, tmp_path / "dialer", handshake_timeout=1.0,
                           reconnect_period=0.1)
    node.start()
    yield node, members
    node.stop()


def _serve_once(files: TLSFiles, address: str) -> tuple[socket.socket, ssl.SSLContext]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(files.cert), str(files.key))
    context.load_verify_locations(str(files.ca))
    context.verify_mode = ssl.CERT_REQUIRED
    host, port = address.rsplit(":", 1)
    listener = socket.create_server((host, int(port)))
    listener.settimeout(10)
    return listener, context


@pytest.mark.parametrize("cert_of", ["node-2", "node-3"])
def test_dialled_peer_must_present_its_own_identity(pki: RaftPki, dialer: tuple[RaftNode, dict[str, str]],
                                                    cert_of: str) -> None:
    """node-1 dials node-2's address; a server there with node-3's certificate is refused before
    node-1 sends anything, one with node-2's certificate receives node-1's address first."""
    node, members = dialer
    listener, context = _serve_once(pki.files(cert_of), members["node-2"])
    before = _rejections(node, "identity_mismatch")
    with listener:
        raw, _ = listener.accept()
        with context.wrap_socket(raw, server_side=True) as sock:
            sock.settimeout(5)
            if cert_of == "node-2":
                header = sock.recv(4)
                (length,) = struct.unpack("i", header)
                body = b""
                while len(body) < length:
                    body += sock.recv(length - len(body))
                assert pickle.loads(zlib.decompress(body)) == members["node-1"]
                wait_for(lambda: "node-2" in node.status().connected_peers, 5, "node-2 connected")
            else:
                assert closed_by_peer(sock)
                _assert_refused(node, "identity_mismatch", before)
