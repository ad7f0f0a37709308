"""Startup recovery after kill -9 with many partitions, and ``/live`` latency while it runs.

Creates ``CURSUS_BENCH_STARTUP_PARTITIONS`` partitions (default 2,000, in topics of 500) with a few records
in some of them, kills the broker with SIGKILL (no clean-shutdown marker: every partition is recovered),
restarts it and probes ``GET /live`` every 10 ms from another thread until ``GET /ready`` is 200.

Reports the time from the restart to ready, and /live latency p50/p99/max (ms) over the recovery window.
Run ``python bench/bench_startup.py`` from another checkout (``PYTHONPATH=<checkout>``) for a before/after.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from cursus.client.connection import Connection
from cursus.wire import Batch, Command, Record, Status, encode_batch

PARTITIONS = int(os.environ.get("CURSUS_BENCH_STARTUP_PARTITIONS", "2000"))
PER_TOPIC = 500
#: Pause between two /live probes (a health checker polls; it does not flood).
PROBE_INTERVAL_S = 0.01


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run() -> list[dict]:
    from tests.brokerproc import BrokerProcess

    with tempfile.TemporaryDirectory() as tmp:
        health_port = _free_port()
        settings: dict[str, object] = {"health_check_port": health_port}
        if os.environ.get("CURSUS_BENCH_RECOVERY_THREADS"):
            settings["recovery_threads"] = os.environ["CURSUS_BENCH_RECOVERY_THREADS"]
        broker = BrokerProcess(Path(tmp) / "data", health=False, settings=settings)
        broker.start(timeout_s=120)
        try:
            created_at = time.monotonic()
            with Connection("127.0.0.1", broker.port, timeout_s=300) as conn:
                topics = []
                for i in range(0, PARTITIONS, PER_TOPIC):
                    name = f"bench{i // PER_TOPIC}"
                    frame = conn.command(f"CREATE topic={name} partitions={min(PER_TOPIC, PARTITIONS - i)}")
                    assert frame.status == Status.OK, frame.payload[:200]
                    topics.append(name)
                create_s = time.monotonic() - created_at
                for name in topics:
                    for p in range(0, 50):
                        records = [Record(topic=name, partition=p, payload=b"x" * 100) for _ in range(10)]
                        frame = conn.request(Command.PUBLISH, encode_batch(
                            Batch(topic=name, partition=p, acks="1", records=records)))
                        assert frame.status == Status.OK, frame.payload[:200]
            broker.kill()
            latencies: list[float] = []
            errors = 0
            ready = threading.Event()

            def probe() -> None:
                nonlocal errors
                while not ready.is_set():
                    started = time.monotonic()
                    try:
                        _status(health_port, "/live")
                    except OSError:
                        errors += 1
                        time.sleep(0.005)
                        continue
                    latencies.append(time.monotonic() - started)
                    time.sleep(PROBE_INTERVAL_S)

            restarted_at = time.monotonic()
            broker.start(expect_ready=False)
            prober = threading.Thread(target=probe, daemon=True)
            prober.start()
            while True:
                try:
                    if _status(health_port, "/ready") == 200:
                        break
                except OSError:
                    pass
                assert broker.proc is not None and broker.proc.poll() is None, broker.output()[-2000:]
                assert time.monotonic() - restarted_at < 600, "not ready in 600 s"
                time.sleep(0.01)
            to_ready = time.monotonic() - restarted_at
            ready.set()
            prober.join()
        finally:
            broker.stop()
    ms = [s * 1000 for s in latencies] or [0.0]
    return [{
        "bench": "startup_after_kill9", "partitions": PARTITIONS, "create_s": round(create_s, 2),
        "startup_to_ready_s": round(to_ready, 2), "live_samples": len(latencies), "live_connect_errors": errors,
        "live_p50_ms": round(_percentile(ms, 0.50), 1), "live_p99_ms": round(_percentile(ms, 0.99), 1),
        "live_max_ms": round(max(ms), 1), "cpus": os.cpu_count(),
    }]


if __name__ == "__main__":
    import json

    for result in run():
        print(json.dumps({"module": "bench_startup", **result}), flush=True)
