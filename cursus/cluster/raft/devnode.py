"""A stand-alone Raft member running :class:`~.kv.KeyValueFSM`, controlled over a local socket.

For the checker test, the benchmark and manual experiments (not part of the broker)::

    python -m cursus.cluster.raft.devnode --id node-1 --members node-1=127.0.0.1:7001,... \\
        --data DIR --certs CERTDIR --control-port 7101 [--election-min 0.4 --election-max 1.0 ...]

``CERTDIR`` is ``cursusctl certs`` output (``ca.crt``, ``<id>.crt``, ``<id>.key``). The control port
(127.0.0.1 unless --control-host) speaks JSON lines; each request carries an ``id`` echoed in its response, and requests
on one connection run concurrently:

- ``{"op": "submit", "command": "<utf-8 command>", "rid": "<32 hex>"|null, "timeout": s}`` ->
  ``{"ok": true, "result": "..."}`` or ``{"error": "unknown"|"unavailable"|"too_large", "rid": hex}``
- ``{"op": "status"}`` -> ``{"status": {...RaftStatus fields...}}``
- ``{"op": "state"}`` -> ``{"state": {...}, "applied_index": n}`` (a consistent copy of the FSM data)
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from cursus.cluster.raft.errors import CommandTooLarge, RaftUnavailable, UnknownOutcome
from cursus.cluster.raft.kv import KeyValueFSM
from cursus.cluster.raft.node import RaftConfig, RaftNode
from cursus.cluster.tls import TLSFiles


class _LockedFSM(KeyValueFSM):
    """KeyValueFSM whose state the control thread can copy consistently."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def apply(self, command: bytes) -> bytes:
        with self.lock:
            return super().apply(command)

    def restore(self, data: bytes) -> None:
        with self.lock:
            super().restore(data)

    def copy_state(self) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.data)


async def _handle(node: RaftNode, fsm: _LockedFSM, request: dict) -> dict:
    op = request.get("op")
    if op == "status":
        return {"status": dataclasses.asdict(node.status())}
    if op == "state":
        applied = node.applied_index
        return {"state": fsm.copy_state(), "applied_index": applied}
    if op == "submit":
        rid = bytes.fromhex(request["rid"]) if request.get("rid") else None
        try:
            result = await node.submit(request["command"].encode(), float(request.get("timeout", 5.0)), rid)
            return {"ok": True, "result": result.decode()}
        except UnknownOutcome as exc:
            return {"error": "unknown", "rid": exc.request_id.hex()}
        except RaftUnavailable:
            return {"error": "unavailable"}
        except CommandTooLarge:
            return {"error": "too_large"}
    return {"error": "bad_request"}


async def _serve(node: RaftNode, fsm: _LockedFSM, host: str, port: int) -> None:
    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()

        async def one(request: dict) -> None:
            response = await _handle(node, fsm, request)
            response["id"] = request.get("id")
            async with lock:
                writer.write(json.dumps(response).encode() + b"\n")
                await writer.drain()

        tasks = set()
        try:
            while line := await reader.readline():
                task = asyncio.create_task(one(json.loads(line)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (ConnectionError, ValueError, asyncio.CancelledError):
            pass  # client gone, garbage, or the server is shutting down
        finally:
            for task in tasks:
                task.cancel()
            writer.close()

    server = await asyncio.start_server(client, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        while not stop.is_set() and node.fatal is None:
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cursus.cluster.raft.devnode")
    parser.add_argument("--id", required=True)
    parser.add_argument("--members", required=True, help="id=host:port,id=host:port,...")
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--certs", required=True, type=Path)
    parser.add_argument("--control-port", required=True, type=int)
    parser.add_argument("--election-min", type=float, default=0.4)
    parser.add_argument("--election-max", type=float, default=1.0)
    parser.add_argument("--heartbeat", type=float, default=0.1)
    parser.add_argument("--snapshot-entries", type=int, default=5000)
    parser.add_argument("--control-host", default="127.0.0.1", help="control listener address")
    parser.add_argument("--no-pre-vote", action="store_true", help="elect without a pre-vote round")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.id} %(levelname)s %(message)s")
    members = dict(item.split("=", 1) for item in args.members.split(","))
    config = RaftConfig(
        node_id=args.id, members=members, data_dir=args.data,
        tls=TLSFiles(args.certs / f"{args.id}.crt", args.certs / f"{args.id}.key", args.certs / "ca.crt"),
        election_timeout_min=args.election_min, election_timeout_max=args.election_max,
        heartbeat_period=args.heartbeat, leader_fallback_timeout=args.election_max,
        snapshot_min_entries=args.snapshot_entries, pre_vote=not args.no_pre_vote)
    fsm = _LockedFSM()
    node = RaftNode(config, fsm)
    node.start()
    try:
        asyncio.run(_serve(node, fsm, args.control_host, args.control_port))
    finally:
        node.stop()
    return 1 if node.fatal is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
