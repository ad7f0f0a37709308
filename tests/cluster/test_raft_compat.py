"""The compat layer's assumptions about pysyncobj hold for the pinned version, and only for it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cursus.cluster.raft import compat
from cursus.cluster.raft.errors import PysyncobjVersionError
from tests.cluster.raftsupport import RaftPki, free_ports, in_process_node, members_on, wait_for


def test_pinned_version_is_installed() -> None:
    compat.check_version()
    assert compat.PINNED_VERSION == "0.3.17"
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert '"pysyncobj==0.3.17"' in pyproject.read_text()


def test_other_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "VERSION", "0.3.18")
    with pytest.raises(PysyncobjVersionError, match="0.3.18 is installed.*0.3.17"):
        compat.check_version()


def test_every_class_internal_exists() -> None:
    assert compat.missing_internals() == []


def test_every_instance_internal_exists(pki: RaftPki, tmp_path: Path) -> None:
    # node-1 gets the highest address, so it dials the others and holds TcpConnection objects
    members = members_on(sorted(free_ports(3), key=lambda port: f"127.0.0.1:{port}", reverse=True))
    node = in_process_node(pki, "node-1", members, tmp_path / "n1")
    node.start()
    try:
        syncobj = node._syncobj
        assert syncobj is not None
        wait_for(lambda: syncobj._SyncObj__transport._connections, 5, "connection objects")
        assert compat.missing_internals(syncobj) == []
    finally:
        node.stop()


def test_occupied_raft_port_fails_start_with_oserror(pki: RaftPki, tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as occupied:
        address = f"127.0.0.1:{occupied.getsockname()[1]}"
        node = in_process_node(pki, "node-1", {"node-1": address}, tmp_path / "n1")
        with pytest.raises(OSError, match="cannot bind the Raft address"):
            node.start()
    assert not node.running
