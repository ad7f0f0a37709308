"""``make cluster``: three brokers on 127.0.0.1 as one Raft metadata cluster, in the foreground.

``python -m cursus.cluster.devcluster [--data ./data/cluster] [--nodes 3]``: node ``N`` (``node-1``...)
serves clients on ``9000+N-1``, health on ``9080+N-1``, metrics on ``9100+N-1`` and Raft on
``9200+N`` (mutual TLS; ``--port-offset`` shifts them all), with data under ``<data>/node-N``. Certificates (``cursusctl certs``) are written
to ``<data>/certs`` on the first run. Ctrl-C (or SIGTERM) stops every broker cleanly and waits for them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from cursus.cluster.certs import generate_cluster_certs, node_ids


def broker_command(data: Path, index: int, count: int, offset: int = 0) -> list[str]:
    """The ``cursus-broker`` command line of node ``index`` (1-based) of a ``count``-node dev cluster; every
    port is shifted by ``offset``. The internal token is not on it: pass ``INTERNAL_AUTH_TOKEN`` in the
    environment."""
    certs = data / "certs"
    node = f"node-{index}"
    members = ",".join(f"node-{i}@127.0.0.1:{9200 + offset + i}" for i in range(1, count + 1))
    settings = {
        "enabled_distribution": "true", "broker_id": node, "raft_port": 9200 + offset + index,
        "internal_broker_port": 9300 + offset + index,
        "static_cluster_members": members, "bootstrap_cluster": "true",
        "internal_use_tls": "true", "internal_tls_cert_path": certs / f"{node}.crt",
        "internal_tls_key_path": certs / f"{node}.key", "internal_tls_ca_path": certs / "ca.crt",
    }
    cmd = [sys.executable, "-m", "cursus.cli.broker", "--host", "127.0.0.1", "--port", str(8999 + offset + index),
           "--health-port", str(9079 + offset + index), "--metrics-port", str(9099 + offset + index),
           "--log-dir", str(data / node)]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cursus.cluster.devcluster")
    parser.add_argument("--data", type=Path, default=Path("data/cluster"))
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--port-offset", type=int, default=0, help="shift every port (e.g. 1000: 10000-10002)")
    args = parser.parse_args(argv)
    certs = args.data / "certs"
    if not (certs / "ca.crt").exists():
        generate_cluster_certs(certs, node_ids(args.nodes), ["127.0.0.1", "localhost"])
        print(f"devcluster: certificates written to {certs}", flush=True)
    token_file = certs / "internal-token"
    if not token_file.exists():
        import secrets

        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
    token = token_file.read_text().strip()
    offset = args.port_offset
    # Own sessions: a terminal's Ctrl-C reaches only this process, which stops each broker exactly once.
    # The token travels in the environment (INTERNAL_AUTH_TOKEN), never on a command line ``ps`` shows.
    env = {**os.environ, "INTERNAL_AUTH_TOKEN": token}
    procs = [subprocess.Popen(broker_command(args.data, i, args.nodes, offset), start_new_session=True,
                              env=env)
             for i in range(1, args.nodes + 1)]
    print(f"devcluster: {args.nodes} brokers on 127.0.0.1:{9000 + offset}-{8999 + offset + args.nodes}; "
          "Ctrl-C stops them; a broker that exits (kill -9 for a failover test) is reported and the others "
          "keep running", flush=True)
    reported: set[int] = set()
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while not stopping and any(p.poll() is None for p in procs):
        for index, p in enumerate(procs, 1):
            if p.poll() is not None and index not in reported:
                reported.add(index)
                print(f"devcluster: node-{index} exited with {p.returncode}; restart it with: "
                      f"{' '.join(broker_command(args.data, index, args.nodes, offset))} "
                      f"(INTERNAL_AUTH_TOKEN from {token_file})", flush=True)
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = [p.wait() for p in procs]
    print(f"devcluster: stopped (exit codes {codes})", flush=True)
    return 0 if all(code == 0 for code in codes) or stopping else 1


if __name__ == "__main__":
    raise SystemExit(main())
