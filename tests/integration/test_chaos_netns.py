"""The cluster harness's private network really drops traffic by address pair, in both directions or one,
leaves client traffic from the harness namespace alone, and heals. Runs a small script inside its own
``unshare -n -m`` namespaces (never the host's network). Needs root, ``unshare``, ``ip`` and ``nft``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "ip", "nft")),
                                reason="needs root, unshare, ip and nft")

SCRIPT = r'''
import socket, subprocess, sys, time
from chaos.netns import Network, node_address

net = Network(2)
net.setup()
server = subprocess.Popen([*net.exec_prefix(1), sys.executable, "-c",
    "import socket,time\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('{node_address(1)}', 7777)); s.listen(50)\nprint('up', flush=True)\n"
    "while True:\n c,_=s.accept(); c.close()\n"], stdout=subprocess.PIPE, text=True)
assert server.stdout.readline().strip() == "up"

def from_node0():
    code = (f"import socket\ntry:\n socket.create_connection(('{node_address(1)}', 7777), timeout=1.0).close(); print('ok')\n"
            "except OSError as e: print('dropped')")
    return subprocess.run([*net.exec_prefix(0), sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()

def from_harness():
    try:
        socket.create_connection((node_address(1), 7777), timeout=1.0).close()
        return "ok"
    except OSError:
        return "dropped"

results = [from_node0()]
net.set_cuts({(0, 1)})
results += [from_node0(), from_harness()]
net.set_cuts({(1, 0)})           # one way: node 1 -> node 0 only; the SYN gets through, the SYN-ACK does not
results.append(from_node0())
net.heal()
results.append(from_node0())
server.kill()
print(",".join(results))
'''


def test_partitions_drop_by_address_pair_and_heal() -> None:
    env = {**os.environ, "CURSUS_CHAOS_NETNS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(["unshare", "-n", "-m", "--propagation", "private", sys.executable, "-c", SCRIPT],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok,dropped,ok,dropped,ok", proc.stdout
