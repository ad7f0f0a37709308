"""Broker CPU per single-record acks=1 PUBLISH (send one, wait for its ack, repeat), A/B between two trees.

Each tree (a directory holding a ``cursus`` package: ``CURSUS_BENCH_TREES``, comma-separated, default this
tree only) runs its own broker process; rounds of ``CURSUS_BENCH_SINGLE_REQUESTS`` (default 2000) sequential
publishes are interleaved between the brokers (``CURSUS_BENCH_SINGLE_ROUNDS``, default 5), so a machine
loaded by other work slows every tree alike. Per round: the broker's CPU per publish (user + system, all
threads, from ``/proc/<pid>/stat``), its event-loop thread alone, and the round trip p50. Reported per tree:
medians and ranges over the rounds. The client is a raw socket with a pre-encoded frame (its own CPU does
not matter, but a lighter client leaves more of the 2 cores to the broker).

Run: ``python -m bench.bench_single`` (``CURSUS_BENCH_TREES=/tmp/old,/work/wt/x`` for an A/B, started from a
directory outside both trees: ``python -m`` puts the working directory first on every broker's ``sys.path``).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from bench.support import proc_cpu_s
from cursus.client.connection import Connection
from cursus.wire import HEADER_SIZE, Batch, Command, Kind, Record, encode_batch, encode_frame

REQUESTS = int(os.environ.get("CURSUS_BENCH_SINGLE_REQUESTS", "2000"))
ROUNDS = int(os.environ.get("CURSUS_BENCH_SINGLE_ROUNDS", "5"))
PAYLOAD_BYTES = 100
_LENGTHS = struct.Struct(">II")


def _user_sys_s(pid: int, tid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        data += chunk
    return data


class _RawPublisher:
    """A negotiated connection (via :class:`Connection`) used afterwards as a raw socket."""

    def __init__(self, port: int, topic: str) -> None:
        self.conn = Connection("127.0.0.1", port, timeout_s=30)
        self.conn.__enter__()
        self.sock: socket.socket = self.conn.sock
        record = Record(topic=topic, partition=0, payload=b"x" * PAYLOAD_BYTES)
        self.payload = encode_batch(Batch(topic=topic, partition=0, acks="1", records=[record]))
        self.request_id = 1 << 20

    def publish(self) -> None:
        self.request_id += 1
        self.sock.sendall(encode_frame(Kind.REQUEST, Command.PUBLISH, 0, self.request_id, self.payload))  # type: ignore[arg-type]
        header = _recv_exact(self.sock, HEADER_SIZE)
        assert header[9] == Command.PUBLISH and header[11] == 1, header  # status OK
        encoded, _ = _LENGTHS.unpack_from(header, 20)
        _recv_exact(self.sock, encoded)

    def close(self) -> None:
        self.conn.__exit__(None, None, None)


def run() -> list[dict]:
    from tests.brokerproc import BrokerProcess

    trees = [t for t in os.environ.get("CURSUS_BENCH_TREES", "").split(",") if t] or [
        str(Path(__file__).resolve().parent.parent)]
    if len(trees) > 1 and (Path.cwd() / "cursus").is_dir():
        # ``python -m`` puts the working directory first on sys.path: every broker would run its cursus.
        raise SystemExit("run an A/B from outside the trees (cd /tmp; PYTHONPATH=<tree> python -m bench.bench_single)")
    rows: dict[str, list[tuple[float, float, float, float]]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory() as tmp:
        brokers, clients = {}, {}
        try:
            for i, tree in enumerate(trees):
                env = {"PYTHONPATH": tree}
                broker = BrokerProcess(Path(tmp) / f"data{i}", health=False, env=env).start()
                brokers[tree] = broker
                with Connection("127.0.0.1", broker.port) as conn:
                    conn.command("CREATE topic=single partitions=1")
                clients[tree] = _RawPublisher(broker.port, "single")
                for _ in range(200):  # warm up
                    clients[tree].publish()
            for _ in range(ROUNDS):
                for tree in trees:
                    pid = brokers[tree].proc.pid  # type: ignore[union-attr]
                    client = clients[tree]
                    rtts = []
                    cpu0, loop0 = proc_cpu_s(pid), proc_cpu_s(pid, pid)
                    user0, _ = _user_sys_s(pid, pid)
                    for _ in range(REQUESTS):
                        t0 = time.perf_counter()
                        client.publish()
                        rtts.append(time.perf_counter() - t0)
                    cpu, loop = proc_cpu_s(pid) - cpu0, proc_cpu_s(pid, pid) - loop0
                    user = _user_sys_s(pid, pid)[0] - user0
                    rtts.sort()
                    rows[tree].append((cpu / REQUESTS * 1e6, loop / REQUESTS * 1e6, rtts[len(rtts) // 2] * 1e6,
                                       user / REQUESTS * 1e6))
        finally:
            for client in clients.values():
                client.close()
            for broker in brokers.values():
                broker.stop()
    results = []
    for tree, samples in rows.items():
        cpu, loop, p50, user = (sorted(column) for column in zip(*samples, strict=True))
        results.append({
            "bench": "broker_single_publish_acks1", "tree": tree, "rounds": len(samples), "requests": REQUESTS,
            "broker_cpu_us_median": round(statistics.median(cpu), 1),
            "broker_cpu_us_range": [round(cpu[0], 1), round(cpu[-1], 1)],
            "loop_thread_cpu_us_median": round(statistics.median(loop), 1),
            "loop_thread_cpu_us_range": [round(loop[0], 1), round(loop[-1], 1)],
            "loop_thread_user_cpu_us_median": round(statistics.median(user), 1),
            "rtt_p50_us_median": round(statistics.median(p50), 1),
        })
    return results


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row))
    sys.stdout.flush()
