"""The floor under a single-record acks=1 publish on this machine: what the bare mechanics cost in Python.

A minimal uvloop server does only what such a publish must: read a 32-byte header and its payload, hand the
payload to a writer thread (``threading.Condition``), which ``write``s and ``fdatasync``s it and wakes the
loop (``call_soon_threadsafe``); the loop then writes a 100-byte reply. A client process sends one request
at a time. Reported, with and without the fsync: the server's CPU per request (user + system, per thread)
and the client's round-trip p50/p99 (µs), to compare with ``broker_publish_latency_acks1`` of
``bench_broker`` (the broker's own figure).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import struct
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import uvloop

REQUESTS = int(os.environ.get("CURSUS_BENCH_FLOOR_REQUESTS", "3000"))
_LENGTH = struct.Struct(">I")


def _thread_cpu_s() -> dict[str, tuple[float, float]]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out[tid] = (int(fields[11]) / ticks, int(fields[12]) / ticks)
    return out


class _Writer:
    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, fsync: bool) -> None:
        self._loop, self._fd, self._fsync = loop, fd, fsync
        self._queue: deque[tuple[bytes, asyncio.Future[None]]] = deque()
        self._condition = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, data: bytes, done: asyncio.Future[None]) -> None:
        with self._condition:
            self._queue.append((data, done))
            self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._queue:
                    self._condition.wait()
                items = list(self._queue)
                self._queue.clear()
            for data, _ in items:
                os.write(self._fd, data)
            if self._fsync:
                os.fdatasync(self._fd)
            self._loop.call_soon_threadsafe(_resolve, items)


def _resolve(items: list[tuple[bytes, asyncio.Future[None]]]) -> None:
    for _, done in items:
        done.set_result(None)


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: _Writer) -> None:
    loop = asyncio.get_running_loop()
    try:
        while True:
            header = await reader.readexactly(32)
            data = await reader.readexactly(_LENGTH.unpack_from(header)[0])
            done = loop.create_future()
            log.submit(data, done)
            await done
            writer.write(header[:4] + b"x" * 96)
    except asyncio.IncompleteReadError:
        writer.close()


def _client(port: int, out: mp.Queue) -> None:
    samples = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        message = _LENGTH.pack(200) + b"h" * 28 + b"p" * 200
        for _ in range(REQUESTS):
            started = time.perf_counter()
            sock.sendall(message)
            received = 0
            while received < 100:
                received += len(sock.recv(100 - received))
            samples.append(time.perf_counter() - started)
    samples.sort()
    out.put((samples[len(samples) // 2], samples[int(len(samples) * 0.99)]))


async def _measure(directory: str, fsync: bool) -> dict:
    loop = asyncio.get_running_loop()
    fd = os.open(os.path.join(directory, f"log-{int(fsync)}"), os.O_CREAT | os.O_WRONLY | os.O_APPEND)
    log = _Writer(loop, fd, fsync)
    server = await asyncio.start_server(lambda r, w: _serve(r, w, log), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    before = _thread_cpu_s()
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    client = ctx.Process(target=_client, args=(port, out))
    client.start()
    p50, p99 = await loop.run_in_executor(None, out.get)
    await loop.run_in_executor(None, client.join)
    after = _thread_cpu_s()
    server.close()
    os.close(fd)
    user = sum(after[t][0] - before.get(t, (0.0, 0.0))[0] for t in after)
    system = sum(after[t][1] - before.get(t, (0.0, 0.0))[1] for t in after)
    return {"bench": f"floor_publish_{'fsync' if fsync else 'no_fsync'}", "requests": REQUESTS,
            "server_cpu_us_per_request": round((user + system) / REQUESTS * 1e6, 1),
            "user_us": round(user / REQUESTS * 1e6, 1), "system_us": round(system / REQUESTS * 1e6, 1),
            "p50_us": round(p50 * 1e6, 1), "p99_us": round(p99 * 1e6, 1)}


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return [uvloop.run(_measure(tmp, fsync)) for fsync in (True, False)]
