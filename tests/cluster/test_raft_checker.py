"""Three Raft processes with mutual TLS, random kill -9 and restart, under a stream of commands.

Checked: every acknowledged command is in every node's applied state at the end (restarted nodes
included), no command is applied twice (retries after an unknown outcome reuse the request id), and no
node's applied log ever regresses or diverges: each observation is a prefix of the final log and, within
one process lifetime, extends the previous observation; no node ever truncates an applied entry.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from cursus.cluster.raft.kv import kv_command
from tests.cluster.raftsupport import IDS, DevNode, RaftPki, free_ports, members_on, wait_for

RUN_SECONDS = 12.0
WINDOW = 16  # commands in flight per round: exercises batching, pipelining and late acks
pytestmark = pytest.mark.slow


def _log_of(node: DevNode) -> list[str] | None:
    try:
        return list(node.request({"op": "state"}, timeout=5)["state"].get("log", []))
    except OSError:
        return None


def test_no_acknowledged_command_lost_under_kill9(pki: RaftPki, tmp_path: Path) -> None:
    rng = random.Random(1234)
    ports = free_ports(6)
    members = members_on(ports[:3])
    nodes = {node_id: DevNode(node_id, members, tmp_path / node_id, pki, port, tmp_path / f"{node_id}.log",
                              snapshot_entries=100)
             for node_id, port in zip(IDS, ports[3:], strict=True)}
    for node in nodes.values():
        node.start()
    acked: set[str] = set()
    maybe: set[str] = set()
    observations: list[tuple[str, int, list[str]]] = []  # (node, process start count, log)
    starts = dict.fromkeys(IDS, 1)
    killed: dict[str, float] = {}  # node -> restart time
    kills = 0
    next_kill = time.monotonic() + 2.0
    end = time.monotonic() + RUN_SECONDS
    sequence = 0
    try:
        wait_for(lambda: any(n.status()["is_leader"] for n in nodes.values()), 15, "a leader")
        while time.monotonic() < end:
            now = time.monotonic()
            for node_id, restart_at in list(killed.items()):
                if now >= restart_at:
                    nodes[node_id].start()
                    starts[node_id] += 1
                    del killed[node_id]
            if not killed and now >= next_kill:
                victim = rng.choice(IDS)
                nodes[victim].kill9()
                kills += 1
                killed[victim] = now + rng.uniform(0.5, 1.5)
                next_kill = now + rng.uniform(1.5, 3.0)
            pending = []
            for _ in range(WINDOW):
                sequence += 1
                pending.append((f"v{sequence}", rng.randbytes(16).hex()))
            for _attempt in range(4):
                if not pending:
                    break
                node = rng.choice([n for n in nodes.values() if n.alive])
                requests = [{"op": "submit", "command": kv_command("append", "log", value).decode(),
                             "rid": rid, "timeout": 2.0} for value, rid in pending]
                try:
                    replies = node.pipeline(requests, timeout=5)
                except OSError:
                    maybe.update(value for value, _rid in pending)
                    continue  # retry the same request ids elsewhere: applied at most once
                retry = []
                for (value, rid), reply in zip(pending, replies, strict=True):
                    if reply.get("ok"):
                        acked.add(value)
                    else:
                        if reply.get("error") == "unknown":
                            maybe.add(value)
                        retry.append((value, rid))  # "unavailable": definitely not applied yet
                pending = retry
                if pending:
                    time.sleep(0.05)
            if sequence % (4 * WINDOW) == 0:
                for node_id, node in nodes.items():
                    if node.alive and (log := _log_of(node)) is not None:
                        observations.append((node_id, starts[node_id], log))
        for node_id in list(killed):
            nodes[node_id].start()
            starts[node_id] += 1

        def converged() -> list[str] | None:
            logs = [_log_of(node) for node in nodes.values()]
            if any(log is None for log in logs) or any(log != logs[0] for log in logs):
                return None
            return logs[0] if acked <= set(logs[0]) else None

        final = wait_for(converged, 30, "all three nodes to apply every acknowledged command", 0.2)
    finally:
        for node in nodes.values():
            node.stop()

    print(f"checker: {kills} kills, {len(acked)} acknowledged, {len(maybe - acked)} unknown, "
          f"{len(final)} applied, {len(observations)} observations")
    assert kills >= 3 and len(acked) > 500, (kills, len(acked))
    missing = acked - set(final)
    assert not missing, f"{len(missing)} acknowledged commands missing"
    assert len(final) == len(set(final)), "a command was applied twice"
    assert set(final) <= acked | maybe
    regressions = [(node_id, len(log)) for node_id, _start, log in observations if final[:len(log)] != log]
    last: dict[tuple[str, int], int] = {}
    for node_id, start, log in observations:
        if len(log) < last.get((node_id, start), 0):
            regressions.append((node_id, len(log)))
        last[(node_id, start)] = len(log)
    assert not regressions, f"applied logs regressed or diverged: {regressions[:5]}"
    # pysyncobj logs CRITICAL when it truncates applied entries (its stock AppendEntries handling does
    # so under this load); our layer stops with CRITICAL on a safety violation. Neither may happen.
    critical = [line for node in nodes.values() for line in node.log_path.read_text().splitlines()
                if " CRITICAL " in line]
    assert not critical, critical[:3]
