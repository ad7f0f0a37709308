"""The standalone group log: the coordinator's records in the ``__consumer_offsets`` replicas.

:class:`OffsetsTopicLog` implements :class:`cursus.coordinator.ports.GroupLog` (record shapes, placement,
replay rules: :mod:`cursus.coordinator.offsets`, docs/groups.md). The broker's log cleaner compacts the
topic (:mod:`cursus.broker.cleaning` with :class:`cursus.coordinator.offsets_compaction.OffsetsPlanner`),
which keeps replay bounded; this class never rewrites or deletes records. :func:`open_offsets_log`
creates the internal topic at startup when it is missing and opens the log over its replicas. Standalone
only: a cluster keeps its groups in the metadata log (:mod:`cursus.cluster.group_log`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cursus.broker.replica import Replica
from cursus.coordinator.offsets import (
    OFFSETS_TOPIC,
    GroupRecord,
    LatestRecords,
    ReplayError,
    Snapshot,
    TombstoneRecord,
    build_snapshot,
    encode_payload,
    partition_for,
    replay_partition,
    utc_timestamp,
)
from cursus.coordinator.ports import PartitionOffsets
from cursus.metadata.topics import TopicDefinition, TopicPolicy
from cursus.wire import Record, decode_record, encode_record, iter_record_slices

if TYPE_CHECKING:
    from cursus.broker.core import Broker

log = logging.getLogger("cursus.coordinator")


class OffsetsTopicLog:
    """The ``__consumer_offsets`` partitions as the coordinator's :class:`~cursus.coordinator.ports.GroupLog`.

    Args:
        replicas: the internal topic's replicas, index = partition.
        run_blocking: runs a callable on the storage writer thread and awaits it.
        wall_ms: wall clock in ms (record timestamps; user-visible, so wall time).

    Thread-safety: event-loop thread only. :meth:`append` hands the chunk to the writer synchronously, so
    records reach the log in the order the coordinator staged them; a future resolves when the partition's
    HWM (standalone: fsynced) passes the chunk.
    """

    def __init__(self, replicas: list[Replica], run_blocking: Callable[[Callable[[], Any]], Awaitable[Any]],
                 *, wall_ms: Callable[[], int]) -> None:
        assert replicas, "the internal topic needs at least one partition"
        self.replicas = replicas
        self.run_blocking = run_blocking
        self.wall_ms = wall_ms
        self._latest = [LatestRecords(p) for p in range(len(replicas))]

    @property
    def partitions(self) -> int:
        """Partitions of the internal topic."""
        return len(self.replicas)

    def partition_of(self, group: str) -> int:
        """The partition holding ``group``'s records."""
        return partition_for(group, len(self.replicas))

    # ------------------------------------------------------------------------------------------ replay

    async def replay(self) -> Snapshot:
        """Read every retained record of every partition (up to its HWM) into the latest-record maps.

        Raises:
            ReplayError: see :mod:`cursus.coordinator.offsets`; the message is the broker's not-ready reason.
        """
        records = 0
        for p, replica in enumerate(self.replicas):
            records += replay_partition(self._latest[p], self._iter_records(replica), len(self.replicas))
        snap = build_snapshot(self._latest)
        snap.records = records
        return snap

    @staticmethod
    def _iter_records(replica: Replica) -> Iterator[tuple[int, str | None, bytes]]:
        """(offset, key, payload) of every durable record below the HWM."""
        plog = replica.log
        end = replica.hwm
        try:
            for base, count, body in plog.iter_chunks(plog.log_start_offset):
                if base >= end:
                    return
                for index, raw in enumerate(iter_record_slices(body, count)):
                    if base + index >= end:
                        return
                    record = decode_record(raw)
                    yield record.offset, record.key, record.payload
        except ReplayError:
            raise
        except Exception as exc:  # CorruptLogError, InvalidFrame, OSError: all mean "cannot trust this"
            raise ReplayError(f"{OFFSETS_TOPIC}/{replica.partition}: unreadable: {exc}") from None

    # ------------------------------------------------------------------------------------------ writes

    def append(self, group: str, records: Sequence[GroupRecord]) -> asyncio.Future[None]:
        """Append ``records`` (all of ``group``) now, as one chunk; the future resolves once they are fsynced.

        Each record gets the next revision of its key and the current timestamp. Superseded keys are
        forgotten: a tombstone drops the group's offset and membership keys.

        Raises:
            BrokerError: ``storage_unavailable`` when the partition is fenced (nothing is appended). The future
                fails with ``storage_unavailable`` when the write or fsync fails (outcome unknown).
        """
        p = self.partition_of(group)
        replica = self.replicas[p]
        replica.check_writable()
        latest = self._latest[p]
        stamp = self.wall_ms()
        timestamp = utc_timestamp(stamp)
        staged: list[tuple[GroupRecord, bytes]] = []
        revisions: dict[str, int] = {}
        for rec in records:
            assert rec.group == group
            previous = latest.records.get(rec.key)
            last = revisions.get(rec.key, previous[0].revision if previous is not None else 0)
            revisions[rec.key] = last + 1
            rec = replace(rec, revision=last + 1, timestamp=timestamp)
            staged.append((rec, encode_payload(rec)))
        base = replica.leo
        body = _chunk(p, base, [(rec.key, payload) for rec, payload in staged], stamp)
        replica.append(body, len(staged))
        for rec, payload in staged:
            if isinstance(rec, TombstoneRecord):
                for key, (old, _) in list(latest.records.items()):
                    if old.group == group and key != rec.key:
                        del latest.records[key]
            latest.records[rec.key] = (rec, payload)
        return replica.wait_hwm(base + len(staged))

    async def close(self) -> None:
        """Nothing to wait for: appends are handed to the writer synchronously."""

    def stats(self) -> dict[str, int]:
        """Live keys, summed over partitions."""
        return {"live_keys": sum(len(part.records) for part in self._latest)}


def _chunk(partition: int, base_offset: int, entries: list[tuple[str, bytes]], stamp_ms: int) -> bytes:
    """A records section of CBV2 records (key, JSON payload) with offsets from ``base_offset``."""
    parts = []
    for index, (key, payload) in enumerate(entries):
        encoded = encode_record(Record(topic=OFFSETS_TOPIC, partition=partition, payload=payload,
                                       offset=base_offset + index, timestamp=stamp_ms, key=key))
        parts.append(len(encoded).to_bytes(4, "big"))
        parts.append(encoded)
    return b"".join(parts)


# ---------------------------------------------------------------------------------------- broker glue


async def open_offsets_log(broker: Broker) -> OffsetsTopicLog:
    """Create ``__consumer_offsets`` (``offsets_topic_num_partitions``, compact policy, one replica) if the
    metadata lacks it, then open the log over its replicas (standalone startup; the coordinator's
    ``open_log``). A cluster never calls this: its groups live in the metadata log
    (:class:`cursus.cluster.group_log.RaftGroupLog`) and it has no ``__consumer_offsets`` topic."""
    defn = broker.metadata.get(OFFSETS_TOPIC)
    if defn is None:
        defn = TopicDefinition(OFFSETS_TOPIC, broker.config.offsets_topic_num_partitions, replication_factor=1,
                               policy=TopicPolicy(cleanup_policy="compact"))
        await broker.apply_definition(defn)
    replicas = [broker.replica(OFFSETS_TOPIC, p) for p in range(defn.partitions)]
    for replica in replicas:
        await replica.wait_writable()
    return OffsetsTopicLog(replicas, broker.run_blocking, wall_ms=broker.clock.wall_ms)


#: The LEO reported for a partition whose log end this broker cannot bound (no commit is refused for it).
UNKNOWN_LEO = 2**63 - 1


def partition_offsets(broker: Broker, topic: str, partition: int) -> PartitionOffsets | None:
    """The coordinator's view of a partition's offsets (commit validation against the log end, GROUP_STATUS
    lag), or None when this broker knows nothing about it.

    The local leader answers with its own offsets. In a cluster the coordinator of a group often does not
    lead the partition, and it does not ask the leader: HWM = the committed HWM of its applied metadata
    (GROUP_STATUS lag), LEO = :data:`UNKNOWN_LEO`. Only the leader knows its LEO (an ``acks=1`` write may
    be on no other broker yet), so a bound from the local follower or the committed HWM could refuse a
    valid commit; an offset past the log end is accepted there instead (CONSUME ignores a committed offset
    past the log end, docs/groups.md).
    """
    replica = broker.replicas.get((topic, partition))
    if replica is not None and replica.leader_id == broker.broker_id:
        return PartitionOffsets(replica.log_start_offset, replica.hwm, replica.leo)
    state = broker.metadata.state
    assignment = state.assignment(topic, partition) if state.cluster else None
    if assignment is None:
        return None
    hwm = assignment.committed_hwm
    start = min(replica.log_start_offset, hwm) if replica is not None else 0
    return PartitionOffsets(start, hwm, UNKNOWN_LEO)


def readiness_reporter(reasons: dict[str, str], check: str) -> Callable[[str | None], None]:
    """A :data:`~cursus.coordinator.ports.ReadinessReport` writing ``reasons[check]`` (``/ready``)."""

    def report(reason: str | None) -> None:
        if reason is None:
            reasons.pop(check, None)
        else:
            reasons[check] = reason

    return report
