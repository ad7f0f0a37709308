"""The group-aware compaction planner of ``__consumer_offsets`` (pure, no I/O; issue 18).

The log cleaner (:mod:`cursus.storage.cleaner`, scheduled by :mod:`cursus.broker.cleaning`) cleans the
internal topic like any compacted topic, with :class:`OffsetsPlanner` deciding the survivors instead of the
per-key :class:`cursus.storage.compaction.KeyPlanner`. Per-key "latest record wins" is not enough here: a
group tombstone (key ``group_key``) also supersedes the group's offset snapshots and membership (other
keys), and so does a registration at a newer epoch. Record shapes and replay rules:
:mod:`cursus.coordinator.offsets`, docs/groups.md.

**Rules** (inside the cleanable range ``[log_start_offset, cleanable_end)`` the cleaner hands over: closed
segments below the HWM and the LSO; records above it are never planned and always survive):

* a record that is not the latest decodable record of its key in the range goes (per key, as Kafka);
* the latest registration of a group survives;
* the latest group tombstone survives until it is ``delete_retention_ms`` old (its chunk's append time),
  then it goes too, and with it the last trace of the group (a name registered again later starts at
  epoch 1, as a name never used: nothing of the old incarnation is left to conflict with it);
* the latest offset snapshot or membership of a key survives iff its group's latest group record in the
  range is a registration of the same epoch (no group record in the range: kept); it goes when that group record is a tombstone at or after its epoch, or a registration
  of a newer epoch (replay drops it as stale anyway, see :func:`cursus.coordinator.offsets.build_snapshot`);
* a record that does not decode is kept, and it supersedes nothing (replay refuses such a log; the cleaner
  never hides the evidence);
* records without a key, transaction markers and aborted records: as :mod:`cursus.storage.compaction`
  (the coordinator never writes transactional records to this topic: committed transactional offsets are
  materialized as ordinary offset snapshots after the commit, docs/transactions.md).

**Invariant** (property test ``tests/unit/test_offsets_compaction.py``): for a log the coordinator wrote,
replaying the survivors (plus everything at or above the cleanable end) yields exactly the registrations,
offsets, memberships and tombstones that replaying the whole log yields, except tombstones that expired in
the range. Per key the survivors are a suffix of the key's records, so replay's ordering checks see a subset
of the checks they saw before. Assumption (the coordinator's order, docs/groups.md): after a group's
tombstone at epoch E, the next record of that group is a registration at an epoch above E.
"""

from __future__ import annotations

from collections.abc import Sequence

from cursus.coordinator.offsets import (
    GroupRecord,
    RecordError,
    RegistrationRecord,
    TombstoneRecord,
    decode_payload,
)
from cursus.storage.compaction import RecordInfo, in_ranges
from cursus.wire.batch import decode_record

#: Kinds of latest record per key (small ints keep the map compact).
_REGISTRATION, _TOMBSTONE, _OTHER = 0, 1, 2


class OffsetsPlanner:
    """:class:`cursus.storage.compaction.Planner` of ``__consumer_offsets`` (see the module rules).

    Args:
        now_ms: wall clock of the pass (ms since the epoch), for the tombstone window.
        delete_retention_ms: how long a group tombstone survives (``log_cleaner_delete_retention_ms``).
        aborted: sorted disjoint offset ranges of aborted transactions (none are expected here).

    Memory: one small entry per live key and per group seen in the range. Thread-safety: one pass, one
    thread.
    """

    def __init__(self, *, now_ms: int, delete_retention_ms: int, aborted: Sequence[tuple[int, int]] = ()) -> None:
        self.now_ms = now_ms
        self.delete_retention_ms = delete_retention_ms
        self.aborted = aborted
        #: key -> (offset, kind, group, epoch) of its latest decodable record in the range.
        self._latest: dict[str, tuple[int, int, str, int]] = {}
        #: group -> (epoch, is_tombstone) of its latest registration or tombstone in the range.
        self._groups: dict[str, tuple[int, bool]] = {}
        #: Offsets of the records that did not decode (kept; rare: replay refuses such a log).
        self._undecodable: set[int] = set()

    # ------------------------------------------------------------------------------------ map phase

    def observe(self, info: RecordInfo, record: bytes | memoryview) -> None:
        """Map phase: account one stored CBV2 record (without its u32 length), in offset order."""
        if info.key is None or info.marker or (self.aborted and in_ranges(info.offset, self.aborted)):
            return
        try:
            rec = decode_payload(info.key, decode_record(record).payload)
        except (RecordError, ValueError):  # InvalidFrame is a ValueError too
            self._undecodable.add(info.offset)
            return
        self.observe_record(info, rec)

    def observe_record(self, info: RecordInfo, rec: GroupRecord) -> None:
        """Map phase for an already decoded record (``info.key == rec.key``)."""
        if isinstance(rec, RegistrationRecord):
            kind = _REGISTRATION
            self._groups[rec.group] = (rec.epoch, False)
        elif isinstance(rec, TombstoneRecord):
            kind = _TOMBSTONE
            self._groups[rec.group] = (rec.epoch, True)
        else:
            kind = _OTHER
        self._latest[rec.key] = (info.offset, kind, rec.group, rec.epoch)

    # ----------------------------------------------------------------------------------- copy phase

    def keeps(self, info: RecordInfo) -> bool:
        """Whether ``info`` (inside the cleanable range, after the map phase) survives the pass."""
        if info.marker:
            return True
        if self.aborted and in_ranges(info.offset, self.aborted):
            return False
        if info.key is None:
            return True
        latest = self._latest.get(info.key)
        if latest is None or info.offset in self._undecodable:
            return True  # undecodable, or unseen: keep the evidence
        offset, kind, group, epoch = latest
        if offset != info.offset:
            return False
        if kind == _REGISTRATION:
            return True
        if kind == _TOMBSTONE:
            return self.now_ms - info.time_ms < self.delete_retention_ms
        state = self._groups.get(group)
        if state is None:
            return True
        group_epoch, tombstone = state
        if tombstone:
            return epoch > group_epoch
        return epoch >= group_epoch

    @property
    def undecodable(self) -> int:
        """How many records of the range did not decode."""
        return len(self._undecodable)

    def survivors(self, infos: Sequence[RecordInfo]) -> list[int]:
        """Offsets of the survivors among ``infos`` (after the map phase), ascending."""
        return [info.offset for info in infos if self.keeps(info)]
