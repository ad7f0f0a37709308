"""Durable journal, snapshot format 9, the format marker, the command envelope and dedup table."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.cluster.raft.commands import (
    MAX_COMMAND_BYTES,
    DedupTable,
    decode_command,
    encode_command,
)
from cursus.cluster.raft.errors import (
    CommandTooLarge,
    RaftUnavailable,
    UnknownOutcome,
    UnsupportedRecoveryProtocol,
)
from cursus.cluster.raft.journal import JOURNAL_NAME, DurableJournal
from cursus.cluster.raft.kv import KeyValueFSM, kv_command
from cursus.cluster.raft.marker import MARKER_NAME, ensure_format_marker
from cursus.cluster.raft.node import SNAPSHOT_NAME
from cursus.cluster.raft.snapshot import (
    Snapshot,
    SnapshotCorrupt,
    decode_snapshot,
    encode_snapshot,
    read_snapshot,
    write_snapshot,
)
from tests.cluster.raftsupport import RaftPki, free_ports, in_process_node, wait_for

# -- journal ---------------------------------------------------------------------------------------


def test_journal_survives_reopen_only_after_sync(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    journal.add(b"\x01", 1, 0)
    journal.add(b"a", 2, 1)
    assert journal.needs_sync
    assert (tmp_path / JOURNAL_NAME).stat().st_size == 0  # nothing reaches the file before sync
    journal.sync()
    assert not journal.needs_sync
    journal.add(b"b", 3, 1)
    journal.sync()
    journal.deleteEntriesFrom(2)  # truncate entry 3
    journal.add(b"c", 3, 2)
    journal.sync()
    journal._destroy()
    reopened = DurableJournal(tmp_path)
    assert reopened[:] == [(b"\x01", 1, 0), (b"a", 2, 1), (b"c", 3, 2)]


def test_torn_tail_is_cut(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    for index in range(1, 4):
        journal.add(b"x" * 10, index, 1)
    journal.sync()
    journal._destroy()
    path = tmp_path / JOURNAL_NAME
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size - 3)  # power cut in the middle of the last record
    reopened = DurableJournal(tmp_path)
    assert [entry[1] for entry in reopened[:]] == [1, 2]
    reopened.add(b"y", 3, 1)
    reopened.sync()
    reopened._destroy()
    assert [entry[0] for entry in DurableJournal(tmp_path)[:]] == [b"x" * 10, b"x" * 10, b"y"]


def test_term_and_vote_are_stored_synchronously(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    journal.setCurrentTerm(7, "127.0.0.1:1")
    assert DurableJournal(tmp_path).getCurrentTerm() == 7
    assert DurableJournal(tmp_path).getVotedForNodeId() == "127.0.0.1:1"


def test_compaction_and_reconciliation_with_snapshot(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    for index in range(1, 11):
        journal.add(b"e%d" % index, index, 1)
    journal.deleteEntriesTo(3)  # unsynced entries are kept and become durable
    assert [entry[1] for entry in DurableJournal(tmp_path)[:]] == list(range(4, 11))
    # A crash between snapshot rename and compaction leaves a journal starting before the snapshot:
    assert journal.compact_to((b"e6", 6, 1), (b"e7", 7, 1))
    assert [entry[1] for entry in DurableJournal(tmp_path)[:]] == list(range(6, 11))
    assert not journal.compact_to((b"other", 8, 1), (b"e9", 9, 1))


# -- snapshot --------------------------------------------------------------------------------------

entries = st.tuples(st.binary(max_size=40), st.integers(0, 2**63), st.integers(0, 2**63))


@given(entries, entries, st.lists(st.text(min_size=1, max_size=20), max_size=5),
       st.binary(max_size=200), st.binary(max_size=500))
def test_snapshot_round_trip(last, prev, members, dedup, fsm) -> None:  # type: ignore[no-untyped-def]
    snapshot = Snapshot(last, prev, tuple(members), dedup, fsm)
    data = encode_snapshot(snapshot)
    assert data[8:12] == (9).to_bytes(4, "little")
    decoded = decode_snapshot(data)
    assert decoded == snapshot
    assert isinstance(decoded.last, tuple) and isinstance(decoded.last[0], bytes)  # pysyncobj's shape


def test_snapshot_other_version_and_corruption(tmp_path: Path) -> None:
    data = bytearray(encode_snapshot(Snapshot((b"a", 5, 1), (b"b", 4, 1), ("m",), b"", b"{}")))
    with pytest.raises(UnsupportedRecoveryProtocol, match="unsupported recovery protocol.*clean bootstrap"):
        decode_snapshot(bytes(data[:8] + (8).to_bytes(4, "little") + data[12:]))
    data[-1] ^= 0xFF
    with pytest.raises(SnapshotCorrupt):
        decode_snapshot(bytes(data))
    with pytest.raises(SnapshotCorrupt):
        decode_snapshot(bytes(data[:20]))
    path = tmp_path / "s"
    good = Snapshot((b"a", 5, 1), (b"b", 4, 1), (), b"", b"{}")
    write_snapshot(path, good)
    assert read_snapshot(path) == good


# -- marker ----------------------------------------------------------------------------------------


def test_marker_created_exclusively_on_empty_dir(tmp_path: Path) -> None:
    directory = tmp_path / "raft"
    ensure_format_marker(directory)
    assert (directory / MARKER_NAME).read_text().strip() == "9"
    (directory / "journal.log").write_bytes(b"")
    ensure_format_marker(directory)  # marked: accepted again


def test_unmarked_non_empty_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "journal.log").write_bytes(b"old")
    with pytest.raises(UnsupportedRecoveryProtocol, match="unsupported recovery protocol.*journal.log.*"
                                                          "clean bootstrap of the whole cluster"):
        ensure_format_marker(tmp_path)
    assert not (tmp_path / MARKER_NAME).exists()


def test_other_marker_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / MARKER_NAME).write_text("8\n")
    with pytest.raises(UnsupportedRecoveryProtocol, match="format '8'"):
        ensure_format_marker(tmp_path)


# -- envelope and dedup ----------------------------------------------------------------------------


def test_envelope_round_trip_and_cap() -> None:
    rid = os.urandom(16)
    assert decode_command(encode_command(rid, b"body")) == (rid, b"body")
    encode_command(rid, b"x" * MAX_COMMAND_BYTES)
    with pytest.raises(CommandTooLarge):
        encode_command(rid, b"x" * (MAX_COMMAND_BYTES + 1))


@given(st.lists(st.tuples(st.binary(min_size=16, max_size=16), st.binary(max_size=30)), max_size=30),
       st.integers(1, 10))
def test_dedup_table_round_trip_and_eviction(items, capacity) -> None:  # type: ignore[no-untyped-def]
    table = DedupTable(capacity)
    for rid, result in items:
        table.put(rid, result)
    copy = DedupTable(capacity)
    copy.restore(table.encode())
    assert copy.encode() == table.encode()
    assert len(copy) <= capacity


# -- through a running single-node cluster ---------------------------------------------------------


def _single(pki: RaftPki, data: Path, fsm: object = None, **overrides: object):  # type: ignore[no-untyped-def]
    members = {"node-1": f"127.0.0.1:{free_ports(1)[0]}"}
    return in_process_node(pki, "node-1", members, data, fsm, **overrides)


def test_snapshot_restart_and_dedup(pki: RaftPki, tmp_path: Path) -> None:
    data = tmp_path / "raft"
    node = _single(pki, data, snapshot_min_entries=20)
    node.start()
    wait_for(lambda: node.is_leader, 10, "leadership")
    rid = os.urandom(16)

    async def run() -> list[bytes]:
        results = [await node.submit(kv_command("append", "log", i), 5) for i in range(60)]
        results.append(await node.submit(kv_command("append", "log", "once"), 5, rid))
        results.append(await node.submit(kv_command("append", "log", "once"), 5, rid))  # a retry
        with pytest.raises(CommandTooLarge):
            await node.submit(b"x" * (MAX_COMMAND_BYTES + 1), 5)
        return results

    results = asyncio.run(run())
    assert results[-1] == results[-2] == b'{"length":61}'
    wait_for(lambda: (data / SNAPSHOT_NAME).exists(), 10, "a snapshot")
    node.stop()
    assert read_snapshot(data / SNAPSHOT_NAME).last[1] > 20

    fsm = KeyValueFSM()
    again = _single(pki, data, fsm)
    again.start()
    try:
        wait_for(lambda: again.is_leader, 10, "leadership")
        async def after() -> bytes:
            return await again.submit(kv_command("append", "log", "once"), 5, rid)  # still deduplicated
        assert asyncio.run(after()) == b'{"length":61}'
        assert fsm.data["log"] == [*range(60), "once"]
    finally:
        again.stop()


class _RefusingFSM(KeyValueFSM):
    def restore(self, data: bytes) -> None:
        raise UnsupportedRecoveryProtocol("partition t/0 has no committed-HWM provenance")


def test_fsm_refusal_of_a_snapshot_fails_startup(pki: RaftPki, tmp_path: Path) -> None:
    data = tmp_path / "raft"
    ensure_format_marker(data)
    write_snapshot(data / SNAPSHOT_NAME, Snapshot((b"\x01", 2, 1), (b"\x01", 1, 0), (), b"\0\0\0\0", b"{}"))
    node = _single(pki, data, _RefusingFSM())
    with pytest.raises(UnsupportedRecoveryProtocol, match="provenance.*clean bootstrap"):
        node.start()


def test_journal_sync_failure_stops_the_node(pki: RaftPki, tmp_path: Path) -> None:
    node = _single(pki, tmp_path / "raft")
    node.start()
    try:
        wait_for(lambda: node.is_leader, 10, "leadership")
        journal = node._syncobj._cursus_journal  # type: ignore[union-attr]

        def broken_sync() -> None:
            raise OSError(28, "ENOSPC")
        journal.sync = broken_sync

        async def run() -> None:
            with pytest.raises(UnknownOutcome):
                await node.submit(kv_command("set", "k", 1), 5)
            with pytest.raises(RaftUnavailable):
                await node.submit(kv_command("set", "k", 2), 5)
        asyncio.run(run())
        assert isinstance(node.fatal, OSError) and not node.running
    finally:
        node.stop()


def test_corrupt_snapshot_fails_startup(pki: RaftPki, tmp_path: Path) -> None:
    data = tmp_path / "raft"
    ensure_format_marker(data)
    write_snapshot(data / SNAPSHOT_NAME, Snapshot((b"\x01", 2, 1), (b"\x01", 1, 0), (), b"\0\0\0\0", b"{}"))
    with open(data / SNAPSHOT_NAME, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        handle.write(b"X")
    with pytest.raises(SnapshotCorrupt):
        _single(pki, data).start()
