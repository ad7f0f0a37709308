"""Helpers shared by the benchmarks: process CPU time from ``/proc`` and the raw PUBLISH worker."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import deque
from pathlib import Path

from cursus.client.connection import Connection
from cursus.wire import Batch, Command, Record, Status, encode_batch

RECORDS_PER_BATCH = 1000
PAYLOAD_BYTES = 100


def proc_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid``, or of its thread ``tid`` only (Linux ``/proc``)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def publisher(port: int, topic: str, partition: int, batches: int, out: mp.Queue, *, acks: str = "1",
              records_per_batch: int = RECORDS_PER_BATCH, payload_bytes: int = PAYLOAD_BYTES,
              in_flight: int = 1) -> None:
    """A worker process: ``batches`` PUBLISH requests of one ``records_per_batch``-record CBV2 batch of
    ``payload_bytes``-byte records to ``topic``/``partition`` on 127.0.0.1:``port``, up to ``in_flight`` of
    them written before their replies are read (pipelining, facts B1.4; 1: one at a time); puts its own CPU
    seconds on ``out``. Asserts every reply is OK."""
    records = [Record(topic=topic, partition=partition, payload=os.urandom(payload_bytes // 2).hex().encode())
               for _ in range(records_per_batch)]
    payload = encode_batch(Batch(topic=topic, partition=partition, acks=acks, records=records))
    start_cpu = time.process_time()
    with Connection("127.0.0.1", port, timeout_s=60) as conn:
        pending: deque[int] = deque()
        for _ in range(batches):
            if len(pending) >= in_flight:
                frame = conn.receive(pending.popleft(), Command.PUBLISH)
                assert frame.status == Status.OK, frame.payload[:200]
            pending.append(conn.send(Command.PUBLISH, payload))
        while pending:
            frame = conn.receive(pending.popleft(), Command.PUBLISH)
            assert frame.status == Status.OK, frame.payload[:200]
    out.put(time.process_time() - start_cpu)
