"""What token authentication costs: publish throughput on an authenticated connection versus an anonymous one.

Two brokers on this machine, identical but for ``enable_sasl`` (the anonymous one has it off, the other has
it on with 8 users). Logs live on /dev/shm when it exists, so fsync does not hide the per-request cost.

* ``auth_publish_single``: one connection, single-record CBV2 PUBLISH round trips (acks=1): the per-request
  cost of the permission check, where it is largest relative to the work. Records/s and broker CPU per
  publish; for the authenticated broker also with inline ``principal=``/``auth_token=`` on text PUBLISH (the
  public SDKs' style on some commands: two SHA-256 digests and a constant-time pass over the users each).
* ``auth_publish_batched``: one connection, 1,000-record batches (the common producer case).
* ``auth_connect``: connections per second, negotiation only versus negotiation plus AUTH (one digest
  pass per connection).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.support import proc_cpu_s
from cursus.client.connection import Connection
from cursus.wire import Batch, Command, CommandPayload, Record, Status, encode_batch, encode_crq2

SINGLE = int(os.environ.get("CURSUS_BENCH_AUTH_SINGLE", "3000"))
BATCHES = int(os.environ.get("CURSUS_BENCH_AUTH_BATCHES", "100"))
CONNECTS = int(os.environ.get("CURSUS_BENCH_AUTH_CONNECTS", "300"))
ROUNDS = int(os.environ.get("CURSUS_BENCH_AUTH_ROUNDS", "3"))
GUARD_CALLS = 20_000
PAYLOAD_BYTES = 100
USERS = ",".join(f"user{i}:bench-token-{i:04d}-xxxxxxxxxxxxxxxx:*" for i in range(8))
PRINCIPAL, TOKEN = "user7", "bench-token-0007-xxxxxxxxxxxxxxxx"  # the last user: a full pass over the list


def _connect(port: int, authenticated: bool) -> Connection:
    if authenticated:
        return Connection("127.0.0.1", port, timeout_s=30, principal=PRINCIPAL, token=TOKEN)
    return Connection("127.0.0.1", port, timeout_s=30)


def _publish_loop(port: int, pid: int, authenticated: bool, payload: bytes, count: int,
                  command: Command = Command.PUBLISH) -> tuple[float, float]:
    with _connect(port, authenticated) as conn:
        for _ in range(50):  # warm up
            assert conn.request(command, payload).status == Status.OK
        cpu0, t0 = proc_cpu_s(pid), time.perf_counter()
        for _ in range(count):
            frame = conn.request(command, payload)
            assert frame.status == Status.OK, frame.payload[:200]
        return time.perf_counter() - t0, proc_cpu_s(pid) - cpu0


def run() -> list[dict]:
    from tests.brokerproc import BrokerProcess

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    results: list[dict] = []
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        anonymous = BrokerProcess(Path(tmp) / "anon", health=False).start()
        secured = BrokerProcess(Path(tmp) / "sasl", health=False, settings={"enable_sasl": "true"},
                                env={"SASL_USERS": USERS}).start()
        try:
            for broker, authenticated in ((anonymous, False), (secured, True)):
                with _connect(broker.port, authenticated) as conn:
                    assert conn.command("CREATE topic=bench partitions=1").status == Status.OK
            single = encode_batch(Batch(topic="bench", partition=0, acks="1",
                                        records=[Record(topic="bench", partition=0, payload=b"x" * PAYLOAD_BYTES)]))
            batch = encode_batch(Batch(topic="bench", partition=0, acks="1", records=[
                Record(topic="bench", partition=0, payload=b"x" * PAYLOAD_BYTES) for _ in range(1000)]))
            text = {"topic": "bench", "partition": "0", "producerId": "p", "message": "x" * PAYLOAD_BYTES}
            inline = encode_crq2(CommandPayload((), {**text, "principal": PRINCIPAL, "auth_token": TOKEN}))
            plain_text = encode_crq2(CommandPayload((), text))
            cases = [
                ("auth_publish_single", "anonymous", anonymous, False, single, SINGLE, 1),
                ("auth_publish_single", "authenticated", secured, True, single, SINGLE, 1),
                ("auth_publish_single_text", "anonymous", anonymous, False, plain_text, SINGLE, 1),
                ("auth_publish_single_text", "authenticated", secured, True, plain_text, SINGLE, 1),
                ("auth_publish_single_text", "inline_credentials", secured, False, inline, SINGLE, 1),
                ("auth_publish_batched", "anonymous", anonymous, False, batch, BATCHES, 1000),
                ("auth_publish_batched", "authenticated", secured, True, batch, BATCHES, 1000),
            ]
            samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for _ in range(ROUNDS):  # interleaved rounds, median reported: the cores are shared
                for name, mode, broker, authenticated, payload, count, _per in cases:
                    assert broker.proc is not None
                    samples.setdefault((name, mode), []).append(
                        _publish_loop(broker.port, broker.proc.pid, authenticated, payload, count))
            for name, mode, _broker, _auth, _payload, count, per_request in cases:
                runs = sorted(samples[(name, mode)])
                elapsed, cpu = runs[len(runs) // 2]
                results.append({
                    "bench": name, "mode": mode, "requests": count, "rounds": ROUNDS,
                    "records_per_s": round(count * per_request / elapsed),
                    "broker_cpu_us_per_request": round(cpu / count * 1e6, 1),
                })
            for mode, broker, authenticated in (("anonymous", anonymous, False), ("authenticated", secured, True)):
                t0 = time.perf_counter()
                for _ in range(CONNECTS):
                    _connect(broker.port, authenticated).close()
                elapsed = time.perf_counter() - t0
                results.append({"bench": "auth_connect", "mode": mode, "connections": CONNECTS,
                                "connections_per_s": round(CONNECTS / elapsed),
                                "ms_per_connection": round(elapsed / CONNECTS * 1000, 3)})
        finally:
            anonymous.stop()
            secured.stop()
    results.extend(_guard_cost())
    return results


def _guard_cost() -> list[dict]:
    """The check before dispatch alone, in process (no I/O noise): microseconds per request."""
    import asyncio
    import types

    from cursus.broker.config import load_config
    from cursus.broker.handlers.access import authorize
    from cursus.broker.metrics import BrokerMetrics
    from cursus.broker.request import Request, SessionInfo
    from cursus.metadata.topics import TopicDefinition, TopicPolicy

    config = load_config(environ={"ENABLE_SASL": "true", "SASL_USERS": USERS})
    acl = TopicDefinition(name="bench", partitions=1, revision=1, replication_factor=1, lifecycle_epoch=0,
                          idempotent=False, event_sourcing=False,
                          policy=TopicPolicy(auth_policy="acl", read_acl=(PRINCIPAL,), write_acl=(PRINCIPAL,)))
    broker = types.SimpleNamespace(config=config, metrics=BrokerMetrics(),
                                   metadata=types.SimpleNamespace(get=lambda name: acl))
    session = SessionInfo(peer="bench")
    session.sign_in(PRINCIPAL, frozenset({"*"}))
    plain = Request(Command.PUBLISH, 1, {"topic": "bench", "message": "x"}, session=session)
    inline = Request(Command.CONSUME, 1, {"topic": "bench", "principal": PRINCIPAL, "auth_token": TOKEN},
                     session=SessionInfo(peer="bench"))
    out = []
    for label, req in (("authenticated_acl_topic", plain), ("inline_credentials", inline)):
        async def loop(req: Request = req) -> float:
            t0 = time.perf_counter()
            for _ in range(GUARD_CALLS):
                await authorize(broker, req)
            return time.perf_counter() - t0
        elapsed = min(asyncio.run(loop()) for _ in range(3))
        out.append({"bench": "auth_guard", "mode": label, "calls": GUARD_CALLS,
                    "us_per_request": round(elapsed / GUARD_CALLS * 1e6, 2)})
    return out
