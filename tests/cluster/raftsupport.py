"""Test support for the Raft layer: a test PKI, free ports, in-process nodes, dev-node processes."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cursus.cluster.certs import generate_cluster_certs, issue_node_cert, new_authority, write_pem
from cursus.cluster.raft.kv import KeyValueFSM
from cursus.cluster.raft.node import RaftConfig, RaftNode
from cursus.cluster.tls import TLSFiles

IDS = ("node-1", "node-2", "node-3")
#: Fast timers for tests (seconds); generous enough for a loaded 2-core machine.
FAST = {"election_timeout_min": 0.4, "election_timeout_max": 0.8, "heartbeat_period": 0.05,
        "leader_fallback_timeout": 0.8, "reconnect_period": 0.1}


@dataclass(frozen=True)
class RaftPki:
    """``cursusctl certs``-style directory plus refusal fixtures: a foreign CA's cert and an
    identity-less cert."""

    directory: Path

    def files(self, node_id: str) -> TLSFiles:
        return TLSFiles(self.directory / f"{node_id}.crt", self.directory / f"{node_id}.key",
                        self.directory / "ca.crt")

    @property
    def foreign(self) -> TLSFiles:
        return TLSFiles(self.directory / "foreign.crt", self.directory / "foreign.key",
                        self.directory / "foreign-ca.crt")


def make_test_pki(directory: Path) -> RaftPki:
    generate_cluster_certs(directory, list(IDS), ["127.0.0.1", "localhost"], days=2)
    foreign = new_authority("foreign-ca", days=2)
    write_pem(foreign.cert, foreign.key, directory / "foreign-ca.crt", directory / "foreign-ca.key")
    cert, key = issue_node_cert(foreign, "node-2", ["127.0.0.1"], days=2)
    write_pem(cert, key, directory / "foreign.crt", directory / "foreign.key")
    return RaftPki(directory)


#: Ports handed to listeners that must keep their number across restarts (Raft, internal) come from below
#: the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default), so an outgoing
#: connection of any process cannot take one while its broker is down between a kill and a restart.
_FIXED_PORTS = range(20000, 32000)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free now, chosen at random below the ephemeral range."""
    rng = random.SystemRandom()
    chosen: list[int] = []
    while len(chosen) < count:
        port = rng.choice(_FIXED_PORTS)
        if port in chosen:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
    return chosen


def members_on(ports: Iterable[int], ids: Iterable[str] = IDS) -> dict[str, str]:
    return {node_id: f"127.0.0.1:{port}" for node_id, port in zip(ids, ports, strict=True)}


def in_process_node(pki: RaftPki, node_id: str, members: dict[str, str], data_dir: Path,
                    fsm: Any = None, **overrides: Any) -> RaftNode:
    config = RaftConfig(node_id=node_id, members=members, data_dir=data_dir, tls=pki.files(node_id),
                        **{**FAST, **overrides})
    return RaftNode(config, fsm if fsm is not None else KeyValueFSM())


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until truthy (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Read until EOF/reset/TLS alert; True when the peer closed within ``timeout``."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except (ssl.SSLError, ConnectionError):
        return True
    except TimeoutError:
        return False
    return False


class DevNode:
    """One ``python -m cursus.cluster.raft.devnode`` process with a JSON-lines control connection."""

    def __init__(self, node_id: str, members: dict[str, str], data_dir: Path, pki: RaftPki,
                 control_port: int, log_path: Path, snapshot_entries: int = 5000) -> None:
        self.node_id, self.members, self.data_dir, self.pki = node_id, members, data_dir, pki
        self.control_port, self.log_path = control_port, log_path
        self.snapshot_entries = snapshot_entries
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._next_id = 0

    def start(self) -> DevNode:
        members = ",".join(f"{k}={v}" for k, v in self.members.items())
        cmd = [sys.executable, "-m", "cursus.cluster.raft.devnode", "--id", self.node_id,
               "--members", members, "--data", str(self.data_dir), "--certs", str(self.pki.directory),
               "--control-port", str(self.control_port),
               "--election-min", str(FAST["election_timeout_min"]),
               "--election-max", str(FAST["election_timeout_max"]),
               "--heartbeat", str(FAST["heartbeat_period"]),
               "--snapshot-entries", str(self.snapshot_entries)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._connect, 20, f"{self.node_id} control port")
        return self

    def _connect(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"{self.node_id} exited with {self.proc.returncode}; see {self.log_path}")
        try:
            self._sock = socket.create_connection(("127.0.0.1", self.control_port), timeout=1)
        except OSError:
            return False
        self._buffer = b""
        return True

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.close()

    def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def request(self, request: dict, timeout: float = 10.0) -> dict:
        """One synchronous request; raises OSError when the node is down."""
        return self.pipeline([request], timeout)[0]

    def pipeline(self, requests: list[dict], timeout: float = 10.0) -> list[dict]:
        """Send all ``requests`` at once (the node runs them concurrently); responses in request order.

        Raises OSError when the node is down or closes the connection midway.
        """
        if self._sock is None:
            raise ConnectionError(f"{self.node_id} is not connected")
        ids = []
        lines = []
        for request in requests:
            self._next_id += 1
            ids.append(self._next_id)
            lines.append(json.dumps({**request, "id": self._next_id}).encode() + b"\n")
        self._sock.settimeout(timeout)
        self._sock.sendall(b"".join(lines))
        responses: dict[int, dict] = {}
        while len(responses) < len(ids):
            while b"\n" not in self._buffer:
                chunk = self._sock.recv(65536)
                if not chunk:
                    raise ConnectionError(f"{self.node_id} closed the control connection")
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\n", 1)
            response = dict(json.loads(line))
            responses[response["id"]] = response
        return [responses[request_id] for request_id in ids]

    def status(self) -> dict:
        return dict(self.request({"op": "status"})["status"])
