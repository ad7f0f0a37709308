"""Python function calls on the broker's event-loop thread per single-record acks=1 PUBLISH (deterministic).

A CPU A/B on a loaded machine is noise; the number of Python calls the loop thread makes per request is
not. The broker runs under :mod:`cProfile`, switched on by SIGUSR1 and dumped by SIGUSR2 (main thread only:
the loop thread; the writer thread is not counted). After 200 warm-up publishes, two runs of
``CURSUS_BENCH_CALLS_SMALL`` (default 300) and ``CURSUS_BENCH_CALLS_LARGE`` (default 1,300) sequential
publishes are profiled; the difference of their call counts divided by the difference of their lengths is
the per-publish figure (startup and the toggling cancel out). Prints one JSON line: calls per publish, calls
per publish by source file (``~`` is C functions) and the top functions.

Run: ``python -m bench.bench_calls`` (``CURSUS_BENCH_TREE=/tmp/old`` measures the broker of another tree).
"""

from __future__ import annotations

import json
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_single import _RawPublisher
from cursus.client.connection import Connection

SMALL = int(os.environ.get("CURSUS_BENCH_CALLS_SMALL", "300"))
LARGE = int(os.environ.get("CURSUS_BENCH_CALLS_LARGE", "1300"))

_RUNNER = """
import cProfile, os, signal, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]  # PYTHONPATH picks the tree, not the cwd
from cursus.cli.broker import main
prof = cProfile.Profile()
out = sys.argv.pop(1)
def on(*_): prof.enable()
def off(*_):
    prof.disable(); prof.dump_stats(out); prof.clear()
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, off)
sys.argv[0] = "cursus-broker"
sys.exit(main())
"""


def _profile(broker: object, client: _RawPublisher, out: Path, n: int) -> tuple[int, dict[str, int]]:
    pid = broker.proc.pid  # type: ignore[attr-defined]
    out.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    client.publish()  # the signal handler runs on the loop thread at its next wake-up
    for _ in range(n):
        client.publish()
    os.kill(pid, signal.SIGUSR2)
    client.publish()
    deadline = time.monotonic() + 30
    while not out.exists() or out.stat().st_size == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("no profile written")
        time.sleep(0.05)
    time.sleep(0.2)
    stats = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    per: dict[str, int] = {}
    for (file, line, name), (_cc, nc, *_rest) in stats.items():
        per[f"{Path(file).name}:{line}:{name}"] = nc
    return sum(per.values()), per


def run() -> dict:
    from tests.brokerproc import BrokerProcess

    class _Profiled(BrokerProcess):
        def command(self) -> list[str]:
            cmd = super().command()
            return [cmd[0], "-c", _RUNNER, str(self.log_dir.parent / "prof.out"), *cmd[3:]]

    with tempfile.TemporaryDirectory() as tmp:
        tree = os.environ.get("CURSUS_BENCH_TREE")  # the broker's code (default: this process's)
        broker = _Profiled(Path(tmp) / "data", health=False, env={"PYTHONPATH": tree} if tree else None).start()
        try:
            with Connection("127.0.0.1", broker.port) as conn:
                conn.command("CREATE topic=single partitions=1")
            client = _RawPublisher(broker.port, "single")
            for _ in range(200):
                client.publish()
            out = Path(tmp) / "prof.out"
            small, small_per = _profile(broker, client, out, SMALL)
            large, large_per = _profile(broker, client, out, LARGE)
            client.close()
        finally:
            broker.stop()
    n = LARGE - SMALL
    top = sorted(((large_per.get(k, 0) - small_per.get(k, 0)) / n, k) for k in large_per)
    by_file: dict[str, float] = {}
    for per, key in top:
        file = key.split(":", 1)[0]
        by_file[file] = by_file.get(file, 0.0) + per
    return {"bench": "loop_thread_calls_per_publish", "calls_per_publish": round((large - small) / n, 1),
            "by_file": {f: round(v, 1) for f, v in sorted(by_file.items(), key=lambda kv: -kv[1]) if v >= 0.5},
            "top": [[k, round(v, 2)] for v, k in reversed(top[-120:])]}


if __name__ == "__main__":
    print(json.dumps(run(), indent=None))
    sys.stdout.flush()
