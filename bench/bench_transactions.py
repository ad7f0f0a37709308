"""Transactions: throughput and commit latency, read_committed versus read_uncommitted, journal replay.

1. ``txn_commit``: ``CURSUS_BENCH_TXNS`` (default 200) transactions of 10 TXN_PUBLISH records each over one
   connection against a standalone broker process (INIT_PRODUCER_ID, BEGIN_TXN, 10 x TXN_PUBLISH over two
   partitions, END_TXN commit): transactions/s and END_TXN latency p50/p99 (ms); ``txn_commit_concurrent``: the
   same over 4 connections with their own ids (journal group commit shares fsyncs).
2. ``txn_read``: a topic holding ``CURSUS_BENCH_READ_TXNS`` (default 300) transactions of 10 records, 10%
   aborted, and a plain topic with as many plain records: CONSUME throughput (records/s delivered, whole
   partition from offset 0, batch 8192) with read_committed and read_uncommitted on both. On the plain topic
   the two must be equal (no index, the old path).
   ``CURSUS_BENCH_PLAIN_ONLY=1`` runs only the plain-topic reads (``txn_read_plain_only``), e.g. with
   ``PYTHONPATH=<checkout without transactions>`` for a before/after of the plain read path.
3. ``txn_commit_cluster`` (three-node mode): the same transactions against a 3-node Raft cluster (mutual
   TLS, replication factor 3, output partitions led by different brokers): each transactional id's commands go
   to its coordinator (FIND_COORDINATOR), the state persists through TxnSync, records and markers on
   partitions led elsewhere travel over the internal listener; transactions/s and END_TXN p50/p99 (ms).
   ``CURSUS_BENCH_TXN_CLUSTER=0`` skips it, ``=only`` runs only it.
4. ``txn_journal_replay``: a journal holding 100,000 transactions (4 transitions each over 1,000 ids):
   replay time of the compacted file (what the broker keeps) and of the same history uncompacted.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from cursus.client.connection import Connection
from cursus.wire import TXN_CONTROL_MARKER_PAYLOAD, Status, decode_batch

TXNS = int(os.environ.get("CURSUS_BENCH_TXNS", "200"))
READ_TXNS = int(os.environ.get("CURSUS_BENCH_READ_TXNS", "300"))
#: Only the plain-topic reads (runs against a checkout without transactions, for a before/after).
PLAIN_ONLY = os.environ.get("CURSUS_BENCH_PLAIN_ONLY") == "1"
REPLAY_TXNS = int(os.environ.get("CURSUS_BENCH_REPLAY_TXNS", "100000"))
RECORDS_PER_TXN = 10


def _ok(frame) -> dict[str, str]:  # type: ignore[no-untyped-def]
    assert frame.status == Status.OK, frame.payload[:300]
    return dict(t.split("=", 1) for t in frame.payload.decode().split()[1:] if "=" in t)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _transaction(conn: Connection, tid: str, topic: str, partitions: int, *, commit: bool = True) -> float:
    init = _ok(conn.command(f"INIT_PRODUCER_ID transactional_id={tid}"))
    ids = f"transactional_id={tid} producerId={init['producerId']} epoch={init['epoch']}"
    _ok(conn.command(f"BEGIN_TXN {ids}"))
    for i in range(RECORDS_PER_TXN):
        _ok(conn.command(f"TXN_PUBLISH {ids} topic={topic} partition={i % partitions} seqNum={i + 1} "
                         f"message=record-{i:04d}-{'x' * 80}"))
    started = time.perf_counter()
    _ok(conn.command(f"END_TXN {ids} result={'commit' if commit else 'abort'}"))
    return time.perf_counter() - started


def _read_rate(conn: Connection, topic: str, isolation: str, rounds: int = 3) -> tuple[float, int]:
    best = 0.0
    delivered = 0
    for _ in range(rounds):
        offset, delivered = 0, 0
        started = time.perf_counter()
        while True:
            frame = conn.command(f"CONSUME topic={topic} partition=0 offset={offset} batch=8192 "
                                 f"isolation={isolation}")
            assert frame.status == Status.OK, frame.payload[:200]
            records = decode_batch(frame.payload).records if frame.payload else []
            if not records:
                break
            delivered += sum(1 for r in records if r.payload != TXN_CONTROL_MARKER_PAYLOAD)
            offset = records[-1].offset + 1
        elapsed = time.perf_counter() - started
        best = max(best, delivered / elapsed)
    return best, delivered


def _concurrent(port: int, producers: int = 4) -> dict[str, object]:
    """``producers`` connections, each its own transactional id, TXNS // producers transactions each."""
    import threading

    per = max(1, TXNS // producers)
    latencies: list[float] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        with Connection("127.0.0.1", port, timeout_s=60) as conn:
            mine = [_transaction(conn, f"conc-{n}", "bench-out", 2) for _ in range(per)]
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(producers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    ms = [s * 1000 for s in latencies]
    return {"bench": "txn_commit_concurrent", "producers": producers, "transactions": per * producers,
            "records_per_txn": RECORDS_PER_TXN, "txn_per_s": round(per * producers / elapsed, 1),
            "commit_p50_ms": round(_pct(ms, 0.5), 2), "commit_p99_ms": round(_pct(ms, 0.99), 2)}


def _plain_reads(conn: Connection) -> dict[str, object]:
    _ok(conn.command("CREATE topic=bench-plain partitions=1"))
    for i in range(READ_TXNS * RECORDS_PER_TXN):
        _ok(conn.command(f"PUBLISH topic=bench-plain producerId=plain acks=1 message=record-{i:04d}-{'x' * 80}"))
    row: dict[str, object] = {"bench": "txn_read_plain_only"}
    for isolation in ("read_committed", "read_uncommitted"):
        rate, count = _read_rate(conn, "bench-plain", isolation)
        row[f"plain_{isolation}_records_per_s"] = round(rate)
        row[f"plain_{isolation}_records"] = count
    return row


def _bench_broker() -> list[dict]:
    from tests.brokerproc import BrokerProcess

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", health=False).start(timeout_s=60)
        try:
            with Connection("127.0.0.1", broker.port, timeout_s=60) as conn:
                if PLAIN_ONLY:
                    return [_plain_reads(conn)]
                _ok(conn.command("CREATE topic=bench-out partitions=2"))
                commit_s = []
                started = time.perf_counter()
                for i in range(TXNS):
                    commit_s.append(_transaction(conn, f"bench-{i % 10}", "bench-out", 2))
                elapsed = time.perf_counter() - started
                ms = [s * 1000 for s in commit_s]
                results.append({"bench": "txn_commit", "transactions": TXNS, "records_per_txn": RECORDS_PER_TXN,
                                "txn_per_s": round(TXNS / elapsed, 1), "commit_p50_ms": round(_pct(ms, 0.5), 2),
                                "commit_p99_ms": round(_pct(ms, 0.99), 2)})
                results.append(_concurrent(broker.port))

                _ok(conn.command("CREATE topic=bench-txn partitions=1"))
                _ok(conn.command("CREATE topic=bench-plain partitions=1"))
                for i in range(READ_TXNS):
                    _transaction(conn, f"reader-{i % 10}", "bench-txn", 1, commit=i % 10 != 3)
                for i in range(READ_TXNS * RECORDS_PER_TXN):
                    _ok(conn.command(f"PUBLISH topic=bench-plain producerId=plain acks=1 "
                                     f"message=record-{i:04d}-{'x' * 80}"))
                row: dict[str, object] = {"bench": "txn_read", "transactions": READ_TXNS, "aborted_pct": 10}
                for topic, label in (("bench-txn", "txn"), ("bench-plain", "plain")):
                    for isolation in ("read_committed", "read_uncommitted"):
                        rate, count = _read_rate(conn, topic, isolation)
                        row[f"{label}_{isolation}_records_per_s"] = round(rate)
                        row[f"{label}_{isolation}_records"] = count
                results.append(row)
        finally:
            broker.stop()
    return results


def _write_history(directory: Path, txns: int, ids: int) -> None:
    """The journal records of ``txns`` transactions (begin, prepare, commit per transaction after its init),
    without fsync (a generator, not the broker's path)."""
    from cursus.transactions import state as st
    from cursus.transactions.journal import JOURNAL_NAME, VERSION, encode_frame

    frames = []
    epochs: dict[str, int] = {}
    for i in range(txns):
        tid = f"id-{i % ids}"
        epoch = epochs[tid] = epochs.get(tid, 0) + 1
        base = st.TxnEntry(tid, str(i % ids + 1), epoch, st.EMPTY, updated_ms=i)
        for state, partitions in ((st.EMPTY, ()), (st.OPEN, (("out", 0), ("out", 1))),
                                  (st.PREPARE_COMMIT, (("out", 0), ("out", 1))),
                                  (st.COMMITTED, (("out", 0), ("out", 1)))):
            entry = st.TxnEntry(tid, base.producer_id, epoch, state, partitions=partitions, messages=10,
                                updated_ms=i)
            frames.append(encode_frame({"version": VERSION, "kind": "entry", "next_producer_id": ids + 1,
                                        "entry": entry.to_json()}))
    (directory / JOURNAL_NAME).write_bytes(b"".join(frames))


def _bench_replay() -> list[dict]:
    from cursus.transactions.journal import JOURNAL_NAME, TxnJournal

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        _write_history(directory, REPLAY_TXNS, 1000)
        size_full = (directory / JOURNAL_NAME).stat().st_size
        started = time.perf_counter()
        journal = TxnJournal.open(directory)
        full_s = time.perf_counter() - started
        journal.compact()
        journal.close()
        size_compacted = (directory / JOURNAL_NAME).stat().st_size
        started = time.perf_counter()
        TxnJournal.open(directory).close()
        compacted_s = time.perf_counter() - started
    return [{"bench": "txn_journal_replay", "transactions": REPLAY_TXNS, "ids": 1000,
             "uncompacted_bytes": size_full, "uncompacted_replay_ms": round(full_s * 1000, 1),
             "compacted_bytes": size_compacted, "compacted_replay_ms": round(compacted_s * 1000, 1)}]


def _bench_cluster() -> list[dict]:
    from tests.cluster.clustersupport import Cluster
    from tests.cluster.raftsupport import make_test_pki

    with tempfile.TemporaryDirectory(prefix="bench-txn-cluster-") as tmp:
        root = Path(tmp)
        (root / "nodes").mkdir()
        cluster = Cluster(root / "nodes", make_test_pki(root / "pki"))
        conns: dict[int, Connection] = {}
        try:
            cluster.start()
            ports = [b.port for b in cluster.brokers]
            for port in ports:
                conns[port] = Connection("127.0.0.1", port, timeout_s=60)
            admin = conns[ports[0]]
            _ok(admin.command("CREATE topic=bench-out partitions=2 replication_factor=3"))
            deadline = time.monotonic() + 30
            while any(conns[p].command(f"LIST_OFFSETS topic=bench-out partition={q}").status != Status.OK
                      and time.monotonic() < deadline for p in ports[:1] for q in range(2)):
                time.sleep(0.1)
            owners: dict[str, Connection] = {}
            for i in range(10):
                found = _ok(admin.command(f"FIND_COORDINATOR transactional_id=bench-{i}"))
                owners[f"bench-{i}"] = conns[int(found["port"])]
            for i in range(10):  # warm-up: leaders ready, channels open
                _transaction(owners[f"bench-{i}"], f"bench-{i}", "bench-out", 2)
            commit_s = []
            started = time.perf_counter()
            for i in range(TXNS):
                tid = f"bench-{i % 10}"
                commit_s.append(_transaction(owners[tid], tid, "bench-out", 2))
            elapsed = time.perf_counter() - started
            ms = [x * 1000 for x in commit_s]
            return [{"bench": "txn_commit_cluster", "nodes": 3, "replication_factor": 3, "transactions": TXNS,
                     "records_per_txn": RECORDS_PER_TXN, "txn_per_s": round(TXNS / elapsed, 1),
                     "commit_p50_ms": round(_pct(ms, 0.5), 2), "commit_p99_ms": round(_pct(ms, 0.99), 2)}]
        finally:
            for conn in conns.values():
                conn.close()
            cluster.stop()


def run() -> list[dict]:
    mode = os.environ.get("CURSUS_BENCH_TXN_CLUSTER", "1")
    if mode == "only":
        return _bench_cluster()
    if PLAIN_ONLY:
        return _bench_broker()
    return _bench_broker() + (_bench_cluster() if mode != "0" else []) + _bench_replay()


if __name__ == "__main__":
    import json

    for result in run():
        print(json.dumps({"module": "bench_transactions", **result}), flush=True)
