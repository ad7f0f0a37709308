"""Broker processes under test: N ``cursus-broker`` nodes, each with its own data dir, port and log file.

A node binds port 0 on its first start and logs ``listening client=HOST:PORT ...`` then ``ready``; the
harness reads the port from the node's log file (polled with a deadline, never a fixed sleep) and restarts
the node on the same port, so clients reconnect to the same address. The approach mirrors
``tests/brokerproc.py`` but the harness does not import from ``tests/``.

Stage 1 runs standalone brokers: with ``--nodes N`` the nodes are independent and topics are spread over
them (:meth:`Cluster.node_for`). The cluster issues replace that routing with leader discovery; fault
targets are already drawn per node.

Node states: ``down`` (no process), ``up`` (running), ``paused`` (SIGSTOPped).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

_LISTENING = re.compile(r"listening client=(\S+):(\d+)")
#: How long a start may take before the harness gives up (a Python broker starts in well under a second).
START_TIMEOUT_S = 30.0
#: How long a clean shutdown (SIGTERM) may take before the node is killed.
STOP_TIMEOUT_S = 20.0
#: Restarting on the same port can race with the old socket; bind failures are retried this many times.
START_ATTEMPTS = 5


class NodeStartError(RuntimeError):
    """A node exited during startup or did not become ready in time; ``output`` is its log since then."""

    def __init__(self, message: str, output: str, returncode: int | None) -> None:
        super().__init__(message)
        self.output = output
        self.returncode = returncode


class Node:
    """One broker process.

    Args:
        index: node number (from 0).
        directory: the node's directory; data goes to ``directory/data``, output to ``directory/broker.log``.
        settings: broker configuration keys passed with ``--set key=value``.
        env: extra environment variables (``CURSUS_STORAGE_FAULTS`` for lose-unsynced).
    """

    def __init__(self, index: int, directory: Path, *, settings: dict[str, object] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.index = index
        self.directory = Path(directory)
        self.data_dir = self.directory / "data"
        self.log_path = self.directory / "broker.log"
        self.settings = dict(settings or {})
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.state = "down"
        self.starts = 0
        #: Address the broker binds and clients dial (cluster nodes: their own namespace's address).
        self.host = "127.0.0.1"
        #: Command prefix (cluster nodes: ``ip netns exec chaos-n<i>``).
        self.prefix: list[str] = []
        #: How long a start may take (cluster nodes wait for a Raft quorum: longer).
        self.start_timeout_s = START_TIMEOUT_S
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def name(self) -> str:
        """``node-<index>``."""
        return f"node-{self.index}"

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` clients connect to (port 0 before the first start)."""
        return self.host, self.port

    @property
    def pid(self) -> int | None:
        """The running process id, or None."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def command(self) -> list[str]:
        """The broker command line."""
        cmd = [*self.prefix, sys.executable, "-m", "cursus.cli.broker", "--host", self.host, "--port", str(self.port),
               "--health-port", "-1", "--metrics-port", "-1", "--log-dir", str(self.data_dir)]
        for key, value in self.settings.items():
            cmd += ["--set", f"{key}={value}"]
        return cmd

    def _spawn(self) -> int:
        """Start the process; return the log offset its output starts at."""
        self.starts += 1
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as out:
            out.write(f"--- chaos: start {self.starts} of {self.name} ---\n".encode())
            offset = out.tell()
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)
        return offset

    def start(self, timeout_s: float | None = None) -> None:
        """Start the node and wait until it logs ``ready``.

        Raises:
            NodeStartError: the process exited (for example, recovery refused a corrupt log) or was not ready
                in time; the node is left ``down``.
        """
        assert self.state == "down", f"{self.name} is {self.state}"
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        for attempt in range(START_ATTEMPTS):
            offset = self._spawn()
            try:
                self._wait_ready(offset, timeout_s)
                self.state = "up"
                return
            except NodeStartError as exc:
                self.state = "down"
                bind_race = "address already in use" in exc.output.lower()
                if not bind_race or attempt == START_ATTEMPTS - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))

    def _wait_ready(self, offset: int, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.output(offset)
            match = _LISTENING.search(text)
            if match and "ready" in text[match.end():]:
                self.port = int(match.group(2))
                return
            if self.proc.poll() is not None:
                raise NodeStartError(f"{self.name} exited with {self.proc.returncode} during startup",
                                     self.output(offset), self.proc.returncode)
            time.sleep(0.02)
        self._kill_process()
        raise NodeStartError(f"{self.name} not ready within {timeout_s}s", self.output(offset), None)

    def start_expecting_exit(self, timeout_s: float = START_TIMEOUT_S) -> tuple[int | None, str]:
        """Start the node and wait for it to exit by itself (corruption scenarios).

        Returns:
            ``(returncode, output)``; returncode is None when the node became ready instead (it is then
            stopped cleanly and left ``down``) or did not exit in time (it is then killed).
        """
        assert self.state == "down", f"{self.name} is {self.state}"
        offset = self._spawn()
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                return code, self.output(offset)
            text = self.output(offset)
            match = _LISTENING.search(text)
            if match and "ready" in text[match.end():]:
                self.port = int(match.group(2))
                self.state = "up"
                return None, text
            time.sleep(0.02)
        self._kill_process()
        return None, self.output(offset)

    def start_expecting_ready(self, timeout_s: float | None = None) -> tuple[int | None, str]:
        """Start the node; ``(None, "")`` when it became ready, ``(returncode, output)`` when it exited during
        startup (refused), ``(-1, output)`` when it was not ready in time (then it is killed, left down)."""
        try:
            self.start(timeout_s)
        except NodeStartError as exc:
            return (exc.returncode if exc.returncode is not None else -1), exc.output
        return None, ""

    def output(self, offset: int = 0) -> str:
        """The node's log from byte ``offset``."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the node's log."""
        return "\n".join(self.output().splitlines()[-lines:])

    def _kill_process(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def kill(self) -> None:
        """``kill -9`` (works on a paused node too): no flush, no clean-shutdown marker."""
        self._kill_process()
        self.state = "down"

    def pause(self) -> None:
        """``SIGSTOP`` the process."""
        assert self.state == "up" and self.proc is not None, f"{self.name} is {self.state}"
        self.proc.send_signal(signal.SIGSTOP)
        self.state = "paused"

    def resume(self) -> None:
        """``SIGCONT`` a paused process (no-op otherwise)."""
        if self.state == "paused" and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        if self.state == "paused":
            self.state = "up" if self.proc is not None and self.proc.poll() is None else "down"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Clean shutdown: ``SIGTERM`` and wait; killed if it takes longer than ``timeout_s``.

        Returns the exit code (None if it had to be killed or was not running).
        """
        self.resume()
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._kill_process()
        self.state = "down"
        return code

    def alive(self) -> bool:
        """True when the process is running (up or paused)."""
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    """N nodes under ``directory/node-<i>``.

    Args:
        directory: the run's output directory.
        nodes: how many nodes.
        settings: broker settings for every node.
        env: extra environment for every node.
    """

    def __init__(self, directory: Path, nodes: int, *, settings: dict[str, object] | None = None,
                 env: dict[str, str] | None = None) -> None:
        assert nodes >= 1, nodes
        self.nodes = [Node(i, Path(directory) / f"node-{i}", settings=settings, env=env) for i in range(nodes)]
        #: Start nodes in parallel (a Raft broker reports ready only once the cluster has a quorum).
        self.concurrent_start = False

    def __len__(self) -> int:
        return len(self.nodes)

    def start(self) -> None:
        """Start every node (raises :class:`NodeStartError` if one fails)."""
        if self.concurrent_start:
            self.start_nodes([n for n in self.nodes if n.state == "down"])
            return
        for node in self.nodes:
            node.start()

    def start_nodes(self, nodes: list[Node]) -> None:
        """Start ``nodes`` in parallel threads; raises the first :class:`NodeStartError`."""
        from concurrent.futures import ThreadPoolExecutor

        if not nodes:
            return
        with ThreadPoolExecutor(len(nodes)) as pool:
            futures = [pool.submit(node.start) for node in nodes]
        for future in futures:
            future.result()

    def node_for(self, index: int) -> Node:
        """The node hosting topic number ``index`` (standalone stage: topics spread round-robin)."""
        return self.nodes[index % len(self.nodes)]

    def heal(self) -> list[str]:
        """Resume paused nodes and start stopped ones; return what was done (errors included)."""
        actions = []
        if self.concurrent_start:
            for node in self.nodes:
                node.resume()
                if node.state == "up" and not node.alive():
                    node.state = "down"
                    actions.append(f"{node.name} had exited")
            down = [n for n in self.nodes if n.state == "down"]
            try:
                self.start_nodes(down)
                actions += [f"started {n.name}" for n in down]
            except NodeStartError as exc:
                actions.append(f"failed to start: {exc}")
            return actions
        for node in self.nodes:
            if node.state == "paused":
                node.resume()
                actions.append(f"resumed {node.name}")
            if node.state == "up" and not node.alive():
                node.state = "down"
                actions.append(f"{node.name} had exited")
            if node.state == "down":
                try:
                    node.start()
                    actions.append(f"started {node.name}")
                except NodeStartError as exc:
                    actions.append(f"{node.name} failed to start: {exc}")
        return actions

    def stop(self) -> None:
        """Stop every node cleanly."""
        for node in self.nodes:
            node.stop()

    def remove_data(self) -> None:
        """Delete every node's data dir (after a clean run; logs stay)."""
        for node in self.nodes:
            shutil.rmtree(node.data_dir, ignore_errors=True)
