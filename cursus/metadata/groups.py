"""Consumer-group records in the cluster metadata: the compacted state and the pure ``GroupRecords`` rules.

In a cluster the group coordinator's durable log is the metadata log itself (issue 12): the coordinator
submits each change as one :class:`~cursus.metadata.commands.GroupRecords` command carrying the records of
:mod:`cursus.coordinator.offsets` (``group_registration``, ``group_tombstone``, ``offset_snapshot``,
``group_membership``) as their JSON payload text, and :func:`cursus.metadata.apply.apply` folds them into
:attr:`MetadataState.groups <cursus.metadata.state.MetadataState.groups>`, keeping exactly what the standalone
log's compaction keeps: the latest record per key (a group's registration or tombstone, its membership, one
offset snapshot per topic).

**Layering.** ``cursus.metadata`` never imports ``cursus.coordinator``: the records stay opaque-but-validated
payload text here. This module parses only the *envelope* the fold needs (``version``/``type`` pair and its
exact field set, ``group``, ``epoch``, ``revision``, the topic of an offset snapshot) and stores the payload
unchanged; the coordinator's strict codec (:func:`cursus.coordinator.offsets.decode_payload`) checks the
content (subscriptions, topic names, partitions) when it reads the records back. Keeping the codec in one
place (the coordinator) avoids moving its group model (``Selector``) under ``cursus.metadata``.

**Fold rules** (deterministic; any failure refuses the whole command, the state unchanged):

* the command's ``origin`` must own the group in the state it is applied to: the first broker of
  ``ring_replicas(active brokers, group, 1)`` (:func:`cursus.metadata.state.group_coordinator`, facts B7
  ``ring.Get(group)``), else
  ``NOT_COORDINATOR``. This fences a broker whose applied view of the membership is behind: two brokers may
  both *believe* they own a group for a moment, but only the one the log agrees with gets records in;
* ``sequence`` must be the group's current sequence + 1 (commands of one group apply in the order their
  owner staged them; a command staged on top of one that was lost is refused, never applied out of order),
  else ``coordinator_not_available reason=out_of_sequence``;
* per key, ``(epoch, revision)`` strictly grows; a registration after a tombstone needs a higher epoch;
  offsets and a membership need the group's registration at their epoch (earlier in the command or
  stored); a tombstone drops the group's offsets and membership; a registration at a new epoch drops
  offsets and memberships of other epochs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The (version, type) pairs of the coordinator's record codec and their exact field sets.
_COMMON = ("version", "type", "group", "epoch", "revision", "timestamp")
RECORD_SHAPES: dict[tuple[int, str], frozenset[str]] = {
    (1, "group_registration"): frozenset(_COMMON + ("topic", "partition_count")),
    (2, "group_registration"): frozenset(_COMMON + ("topic_partitions",)),
    (1, "group_tombstone"): frozenset(_COMMON),
    (1, "offset_snapshot"): frozenset(_COMMON + ("topic", "offsets")),
    (4, "group_membership"): frozenset(_COMMON + ("generation", "members")),
}
#: Slot names of a group's records (``offset/<topic>`` for offset snapshots).
REGISTRATION_SLOT = "registration"
MEMBERSHIP_SLOT = "membership"
OFFSET_SLOT_PREFIX = "offset/"
#: Longest group name the envelope accepts (the coordinator validates the real rules).
MAX_GROUP_NAME = 1024


class GroupRecordRefused(ValueError):
    """A ``GroupRecords`` command breaks a fold rule; ``code`` is the typed error code to answer with."""

    def __init__(self, code: str, reason: str, **fields: object) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.fields = fields


@dataclass(frozen=True, slots=True)
class StoredGroupRecord:
    """One record as the metadata keeps it: its envelope and the unchanged payload text.

    Attributes:
        kind: ``group_registration``, ``group_tombstone``, ``offset_snapshot`` or ``group_membership``.
        epoch: the group's lifecycle epoch the record belongs to (>= 0).
        revision: the key's write counter (>= 1 when written by a coordinator).
        topic: the topic of an offset snapshot ("" otherwise).
        payload: the compact JSON text (:func:`cursus.coordinator.offsets.encode_payload`, UTF-8 decoded).
    """

    kind: str
    epoch: int
    revision: int
    topic: str
    payload: str

    @property
    def slot(self) -> str:
        """The compaction key within its group."""
        if self.kind in ("group_registration", "group_tombstone"):
            return REGISTRATION_SLOT
        if self.kind == "group_membership":
            return MEMBERSHIP_SLOT
        return OFFSET_SLOT_PREFIX + self.topic


@dataclass(frozen=True, slots=True)
class GroupEntry:
    """The compacted records of one group in the metadata state.

    Attributes:
        sequence: accepted ``GroupRecords`` commands of this group (the next must carry sequence + 1).
        last_request: request id of the latest accepted command (lets its submitter recognise it).
        origin: broker id that submitted it.
        records: slot -> latest record (see :attr:`StoredGroupRecord.slot`); treat as read-only.
    """

    sequence: int = 0
    last_request: str = ""
    origin: str = ""
    records: Mapping[str, StoredGroupRecord] = field(default_factory=dict)

    def payloads(self) -> list[str]:
        """Every stored payload, registration first (the order readers fold them in)."""
        return [self.records[slot].payload for slot in sorted(self.records, key=_slot_order)]

    def revision_of(self, slot: str) -> int:
        """The stored revision of ``slot`` (0 when none)."""
        rec = self.records.get(slot)
        return rec.revision if rec is not None else 0


def _slot_order(slot: str) -> tuple[int, str]:
    return (0 if slot == REGISTRATION_SLOT else 1 if slot == MEMBERSHIP_SLOT else 2, slot)


def parse_record(group: str, payload: str) -> StoredGroupRecord:
    """Validate the envelope of one record payload of ``group``.

    Raises:
        ValueError: not a JSON object, unknown version/type, another field set, another group, bad
            epoch/revision/topic types.
    """
    try:
        doc = json.loads(payload)
    except ValueError as exc:
        raise ValueError(f"group record is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("group record is not a JSON object")
    version, kind = doc.get("version"), doc.get("type")
    if type(version) is not int or not isinstance(kind, str) or (version, kind) not in RECORD_SHAPES:
        raise ValueError(f"unknown group record version/type {version!r}/{kind!r}")
    if set(doc) != RECORD_SHAPES[(version, kind)]:
        raise ValueError(f"group record {kind} v{version} has fields {sorted(doc)}")
    if doc["group"] != group:
        raise ValueError(f"group record of {doc['group']!r} in a command of group {group!r}")
    epoch, revision = doc["epoch"], doc["revision"]
    if type(epoch) is not int or type(revision) is not int or epoch < 0 or revision < 0:
        raise ValueError("group record epoch and revision must be integers >= 0")
    topic = ""
    if kind == "offset_snapshot":
        topic = doc["topic"]
        if not isinstance(topic, str) or not topic:
            raise ValueError("offset snapshot topic must be a non-empty string")
    return StoredGroupRecord(kind, epoch, revision, topic, payload)


def fold_records(entry: GroupEntry | None, group: str, records: Iterable[StoredGroupRecord]) -> dict[str,
                                                                                                    StoredGroupRecord]:
    """The slots of ``group`` after ``records`` (in order), by the fold rules of this module.

    Raises:
        GroupRecordRefused: ``invalid_cluster_request`` when a record goes back, re-registers without a
            higher epoch, or has no registration at its epoch.
    """
    slots = dict(entry.records) if entry is not None else {}
    for rec in records:
        previous = slots.get(rec.slot)
        if previous is not None and (rec.epoch, rec.revision) <= (previous.epoch, previous.revision):
            raise GroupRecordRefused("invalid_cluster_request", "group_record_goes_back", group=group,
                                     slot=rec.slot, epoch=rec.epoch, revision=rec.revision)
        reg = slots.get(REGISTRATION_SLOT)
        if rec.kind == "group_registration":
            if reg is not None and reg.kind == "group_tombstone" and rec.epoch <= reg.epoch:
                raise GroupRecordRefused("invalid_cluster_request", "registration_not_above_tombstone",
                                         group=group, epoch=rec.epoch)
            slots = {s: r for s, r in slots.items() if s == REGISTRATION_SLOT or r.epoch == rec.epoch}
        elif rec.kind == "group_tombstone":
            slots = {}
        elif reg is None or reg.kind != "group_registration" or reg.epoch != rec.epoch:
            raise GroupRecordRefused("invalid_cluster_request", "group_record_without_registration",
                                     group=group, epoch=rec.epoch)
        slots[rec.slot] = rec
    return slots


def entry_to_row(name: str, entry: GroupEntry) -> list[Any]:
    """A JSON-able snapshot row: ``[group, sequence, last_request, origin, [payload, ...]]``."""
    return [name, entry.sequence, entry.last_request, entry.origin, entry.payloads()]


def entry_from_row(row: Any) -> tuple[str, GroupEntry]:
    """Inverse of :func:`entry_to_row` (re-validates every envelope). Raises ValueError."""
    if not isinstance(row, list) or len(row) != 5:
        raise ValueError("a group row is [group, sequence, last_request, origin, payloads]")
    name, sequence, last_request, origin, payloads = row
    if not isinstance(name, str) or not name or type(sequence) is not int or sequence < 0:
        raise ValueError("bad group row")
    if not isinstance(last_request, str) or not isinstance(origin, str) or not isinstance(payloads, list):
        raise ValueError("bad group row")
    records: dict[str, StoredGroupRecord] = {}
    for payload in payloads:
        if not isinstance(payload, str):
            raise ValueError("group payloads must be strings")
        rec = parse_record(name, payload)
        if rec.slot in records:
            raise ValueError(f"group {name!r} repeats slot {rec.slot}")
        records[rec.slot] = rec
    return name, GroupEntry(sequence, last_request, origin, records)


def check_offsets_fence(entry: GroupEntry | None, group: str, member: str, generation: int,
                        partitions: Iterable[tuple[str, int]]) -> None:
    """The group fence of a transaction's staged offsets against the group's applied records (cluster
    ``TxnSync`` entering ``prepare_commit``): the group is registered, ``member`` belongs to its current
    membership at ``generation`` and owns every partition.

    Raises:
        GroupRecordRefused: ``code`` ``group_not_found``, ``GEN_MISMATCH``, ``member_not_found`` or ``NOT_OWNER``.
    """
    registration = entry.records.get(REGISTRATION_SLOT) if entry is not None else None
    if registration is None or registration.kind != "group_registration":
        raise GroupRecordRefused("group_not_found", "group_not_registered", group=group)
    membership = entry.records.get(MEMBERSHIP_SLOT) if entry is not None else None
    doc: dict[str, Any] = {}
    if membership is not None and membership.epoch == registration.epoch:
        doc = json.loads(membership.payload)
    current = doc.get("generation")
    if current != generation:
        raise GroupRecordRefused("GEN_MISMATCH", "generation_changed", group=group, generation=generation,
                                 current=current if current is not None else 0)
    owned = {m.get("member_id"): {(a.get("topic"), a.get("partition")) for a in m.get("assignments") or []}
             for m in doc.get("members") or []}
    if member not in owned:
        raise GroupRecordRefused("member_not_found", "member_not_in_membership", group=group, member=member)
    for topic, partition in partitions:
        if (topic, partition) not in owned[member]:
            raise GroupRecordRefused("NOT_OWNER", "partition_not_assigned", group=group, member=member,
                                     topic=topic, partition=partition)
