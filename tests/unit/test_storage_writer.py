"""GroupCommitWriter: shared fsyncs, ordering, calls, fencing on injected fsync failures."""

from __future__ import annotations

import errno
import queue
import threading
from pathlib import Path

import pytest

from cursus.storage import (
    Completion,
    GroupCommitWriter,
    LogConfig,
    PartitionLog,
    StorageFencedError,
    faults,
)
from cursus.storage.segment import Segment
from tests.unit.test_storage_support import read_all, record_for, records_section, small_config


class Collector:
    """A ``notify`` callback gathering completions, with a blocking wait for a number of them."""

    def __init__(self) -> None:
        self.rounds: queue.Queue[list[Completion]] = queue.Queue()
        self.completions: list[Completion] = []

    def __call__(self, completions: list[Completion]) -> None:
        assert threading.current_thread().name.startswith("cursus-writer")
        self.rounds.put(completions)

    def wait_for(self, count: int, timeout_s: float = 20.0) -> list[Completion]:
        while len(self.completions) < count:
            self.completions.extend(self.rounds.get(timeout=timeout_s))
        return self.completions


def chunk(log_offset: int, count: int, tag: str) -> bytes:
    return records_section([record_for(log_offset + i, tag) for i in range(count)])


def test_appends_from_two_threads_across_eight_logs_share_fsyncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 1 ms fsync delay makes batching independent of the machine's disk speed.
    monkeypatch.setattr(faults, "ACTIVE", faults.parse("fsync_delay_ms=1"))
    logs = [PartitionLog.open(tmp_path / str(n), small_config(segment_bytes=64 * 1024)) for n in range(8)]
    flush_calls = {id(log): 0 for log in logs}
    original_flush = PartitionLog.flush

    def counting_flush(self: PartitionLog) -> None:
        flush_calls[id(self)] += 1
        original_flush(self)

    monkeypatch.setattr(PartitionLog, "flush", counting_flush)
    collector = Collector()
    writer = GroupCommitWriter(collector)
    writer.start()
    locks = [threading.Lock() for _ in logs]
    next_offsets = [0] * len(logs)
    appends_per_thread = 1500

    def producer(seed: int) -> None:
        for n in range(appends_per_thread):
            number = (seed * 7 + n * 3) % len(logs)
            count = 1 + n % 4
            with locks[number]:  # offset assignment and submission in one step, as the loop thread does
                base = next_offsets[number]
                next_offsets[number] += count
                writer.submit_append(logs[number], base, count, chunk(base, count, f"log{number}"),
                                     (number, base + count))

    threads = [threading.Thread(target=producer, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    completions = collector.wait_for(2 * appends_per_thread)
    writer.close()
    assert all(c.error is None for c in completions)
    for c in completions:
        number, end_offset = c.token
        assert c.log is logs[number] and c.durable_end_offset >= end_offset
    total_flushes = sum(flush_calls.values())
    assert total_flushes == writer.flushes
    assert total_flushes <= 2 * appends_per_thread // 4, total_flushes  # fsyncs were shared
    for number, log in enumerate(logs):
        assert log.durable_end_offset == log.log_end_offset == next_offsets[number]
        assert read_all(log) == [record_for(o, f"log{number}") for o in range(next_offsets[number])]
        log.close()


def test_calls_run_in_order_with_appends_and_report_results(tmp_path: Path) -> None:
    log = PartitionLog.open(tmp_path / "p", LogConfig())
    collector = Collector()
    writer = GroupCommitWriter(collector)
    writer.submit_append(log, 0, 2, chunk(0, 2, "a"), "append-1")
    writer.submit_call(lambda: log.log_end_offset, "leo", log=log)
    writer.submit_call(lambda: 1 // 0, "boom")
    writer.submit_append(log, 2, 1, chunk(2, 1, "a"), "append-2")
    writer.submit_append(log, 99, 1, chunk(99, 1, "a"), "wrong-offset")
    writer.start()
    completions = {c.token: c for c in collector.wait_for(5)}
    assert completions["leo"].result == 2 and completions["leo"].durable_end_offset == 3
    assert isinstance(completions["boom"].error, ZeroDivisionError) and completions["boom"].log is None
    assert completions["append-2"].error is None and completions["append-2"].durable_end_offset == 3
    assert isinstance(completions["wrong-offset"].error, AssertionError)
    assert log.failed is None  # a programmer error does not fence the log
    writer.close()
    with pytest.raises(RuntimeError):
        writer.submit_call(lambda: None, "late")
    log.close()


def test_close_drains_the_queue_and_checkpoints(tmp_path: Path) -> None:
    log = PartitionLog.open(tmp_path / "p", LogConfig(recovery_point_interval_ms=3_600_000))
    collector = Collector()
    writer = GroupCommitWriter(collector)
    writer.start()
    writer.submit_append(log, 0, 1, chunk(0, 1, "a"), 1)  # first round checkpoints at once
    collector.wait_for(1)
    for offset in range(1, 50):
        writer.submit_append(log, offset, 1, chunk(offset, 1, "a"), offset)
    writer.close(timeout=20)
    assert len(collector.wait_for(50)) == 50
    assert log.durable_end_offset == 50
    assert '"recovery_point":50' in (tmp_path / "p" / "checkpoints.json").read_text()
    log.close()


def test_checkpoints_are_written_periodically_when_idle(tmp_path: Path) -> None:
    log = PartitionLog.open(tmp_path / "p", LogConfig(recovery_point_interval_ms=50))
    collector = Collector()
    writer = GroupCommitWriter(collector)
    writer.start()
    checkpoint = tmp_path / "p" / "checkpoints.json"
    for offset in range(3):
        writer.submit_append(log, offset, 1, chunk(offset, 1, "a"), offset)
        collector.wait_for(offset + 1)
    deadline = threading.Event()
    for _ in range(100):  # the writer wakes up by itself to persist the recovery point
        if '"recovery_point":3' in checkpoint.read_text():
            break
        deadline.wait(0.02)
    assert '"recovery_point":3' in checkpoint.read_text()
    writer.close()
    log.close()


def test_injected_fsync_failure_fences_only_that_log_and_is_never_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trigger = tmp_path / "fail-fsync"
    monkeypatch.setattr(faults, "ACTIVE", faults.parse(f"fsync_fail_file={trigger},fsync_fail_match=/bad/"))
    bad = PartitionLog.open(tmp_path / "bad", LogConfig())
    good = PartitionLog.open(tmp_path / "good", LogConfig())
    syncs: dict[str, int] = {"bad": 0, "good": 0}
    original_sync = Segment.sync

    def counting_sync(self: Segment) -> None:
        syncs[self.directory.name] += 1
        original_sync(self)

    monkeypatch.setattr(Segment, "sync", counting_sync)
    collector = Collector()
    writer = GroupCommitWriter(collector)
    writer.start()
    offsets = {"bad": 0, "good": 0}

    def submit(name: str, log: PartitionLog) -> None:
        base = offsets[name]
        offsets[name] += 2
        writer.submit_append(log, base, 2, chunk(base, 2, name), (name, base))

    submit("bad", bad)
    submit("good", good)
    assert all(c.error is None for c in collector.wait_for(2))
    trigger.touch()
    submit("bad", bad)
    submit("good", good)
    round_two = collector.wait_for(4)[2:]
    by_name = {c.token[0]: c for c in round_two}
    assert isinstance(by_name["bad"].error, StorageFencedError)
    assert isinstance(by_name["bad"].error.cause, OSError) and by_name["bad"].error.cause.errno == errno.EIO
    assert by_name["bad"].durable_end_offset == 2
    assert by_name["good"].error is None and by_name["good"].durable_end_offset == 4
    assert isinstance(bad.failed, OSError)
    bad_syncs = syncs["bad"]
    trigger.unlink()  # the disk "recovers"; the fenced log must stay fenced
    submit("bad", bad)
    submit("good", good)
    round_three = collector.wait_for(6)[4:]
    by_name = {c.token[0]: c for c in round_three}
    assert isinstance(by_name["bad"].error, StorageFencedError)
    assert by_name["good"].error is None and good.durable_end_offset == 6
    assert syncs["bad"] == bad_syncs  # no fsync retried on the fenced log
    assert bad.durable_end_offset == 2 and bad.log_end_offset == 4
    writer.close()
    bad.close()
    good.close()
    # the bytes of the failed round were dropped (like pages lost after a failed writeback)
    reopened = PartitionLog.open(tmp_path / "bad", LogConfig())
    assert reopened.log_end_offset in (2, 4) and read_all(reopened)[:2] == [record_for(0, "bad"),
                                                                            record_for(1, "bad")]
    reopened.close()


def test_write_error_fences_the_log_in_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = PartitionLog.open(tmp_path / "bad", LogConfig())
    good = PartitionLog.open(tmp_path / "good", LogConfig())
    original_write = Segment.write

    def failing_write(self: Segment, position: int, buffers: list, size_bytes: int) -> None:
        if self.directory.name == "bad":
            raise OSError(errno.ENOSPC, "No space left on device")
        original_write(self, position, buffers, size_bytes)

    monkeypatch.setattr(Segment, "write", failing_write)
    collector = Collector()
    writer = GroupCommitWriter(collector)
    writer.submit_append(bad, 0, 1, chunk(0, 1, "b"), "bad-0")
    writer.submit_append(good, 0, 1, chunk(0, 1, "g"), "good-0")
    writer.submit_append(bad, 1, 1, chunk(1, 1, "b"), "bad-1")
    writer.start()
    completions = {c.token: c for c in collector.wait_for(3)}
    assert isinstance(completions["bad-0"].error, StorageFencedError)
    assert isinstance(completions["bad-1"].error, StorageFencedError)
    assert completions["good-0"].error is None and completions["good-0"].durable_end_offset == 1
    assert isinstance(bad.failed, OSError) and bad.log_end_offset == 0
    writer.close()
    bad.close()
    good.close()


@pytest.mark.parametrize("method", ["flush", "append_chunks"])
def test_unexpected_exception_fences_the_log_and_fails_every_waiter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    # Regression: an unexpected exception in flush() was logged and swallowed, so the round's appends
    # completed without an error and without a durable end covering them: their waiters hung.
    log = PartitionLog.open(tmp_path / "p", small_config())
    healthy = PartitionLog.open(tmp_path / "q", small_config())
    original = getattr(PartitionLog, method)

    def broken(self: PartitionLog, *args: object) -> object:
        if self is log:
            raise RuntimeError(f"bug in {method}")
        return original(self, *args)

    monkeypatch.setattr(PartitionLog, method, broken)
    collector = Collector()
    writer = GroupCommitWriter(collector)
    writer.start()
    writer.submit_append(log, 0, 2, chunk(0, 2, "a"), "a1")
    writer.submit_append(healthy, 0, 1, chunk(0, 1, "b"), "b1")
    writer.submit_append(log, 2, 1, chunk(2, 1, "a"), "a2")
    done = {c.token: c for c in collector.wait_for(3)}
    for token in ("a1", "a2"):
        assert isinstance(done[token].error, StorageFencedError)
        assert isinstance(done[token].error.cause, RuntimeError)
        assert done[token].durable_end_offset == 0
    assert done["b1"].error is None and done["b1"].durable_end_offset == 1
    writer.submit_append(log, 3, 1, chunk(3, 1, "a"), "a3")  # a later round: still fenced, typed
    (later,) = collector.wait_for(4)[3:]
    assert isinstance(later.error, StorageFencedError) and log.failed is not None
    writer.close()
    log.close()
    healthy.close()
