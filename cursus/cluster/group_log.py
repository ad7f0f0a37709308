"""The cluster's group log: consumer-group records committed through the Raft metadata log.

:class:`RaftGroupLog` implements :class:`cursus.coordinator.ports.GroupLog` for a cluster broker (the
standalone broker keeps :class:`cursus.broker.group_log.OffsetsTopicLog` over ``__consumer_offsets``: the
coordinator is the same, only this seam differs). Each :meth:`~RaftGroupLog.append` becomes ONE
:class:`~cursus.metadata.commands.GroupRecords` command: the records of one group encoded with
:mod:`cursus.coordinator.offsets`' codec, stamped with the next revision per key and the wall-clock time,
and the group's next sequence number; the returned future resolves once the command is committed and applied
on this broker. The metadata FSM folds accepted records into
:attr:`MetadataState.groups <cursus.metadata.state.MetadataState.groups>` (rules and fencing:
:mod:`cursus.metadata.groups`), so they are in every Raft snapshot, and :meth:`~RaftGroupLog.replay` reads
them back from the applied state (no topic to scan).

**Every broker keeps every group.** :meth:`RaftGroupLog.observe` sees each applied command (on the event
loop, in commit order). An accepted ``GroupRecords`` that this broker did not submit and is not waiting for
(another broker owns the group, or one of our own commands whose outcome was reported unknown did commit) is
decoded and handed to ``on_adopt(group, Group | None, tombstone epoch | None)``: the coordinator makes it its
staged and durable state at once, so a broker that becomes a group's owner has its state without replay.

**Failures.** A refused command (``NOT_COORDINATOR``: this broker no longer owns the group in the state the
command was applied to; ``out_of_sequence``: an earlier command of the group was lost) fails its future and
every later one of that group (they carry later sequence numbers), as the seam requires; the next append
restarts from the applied state. ``NOT_COORDINATOR`` is answered with the current owner's ``host=`` and
``port=``. A commit timeout is ``request_timeout outcome=unknown``; if the command did commit, the adopt
path above brings its records in. Commands over the Raft cap are refused before anything is submitted.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from cursus.coordinator.groups import Group, GroupTable
from cursus.coordinator.offsets import (
    GroupRecord,
    LatestRecords,
    MembershipRecord,
    OffsetSnapshotRecord,
    RecordError,
    ReplayError,
    Snapshot,
    TombstoneRecord,
    build_snapshot,
    decode_payload,
    encode_payload,
    group_key,
    member_key,
    offset_key,
    restore_snapshot,
    utc_timestamp,
)
from cursus.metadata.apply import ApplyResult
from cursus.metadata.commands import Command, GroupRecords, encode
from cursus.metadata.groups import (
    MEMBERSHIP_SLOT,
    OFFSET_SLOT_PREFIX,
    REGISTRATION_SLOT,
    GroupEntry,
    StoredGroupRecord,
)
from cursus.metadata.state import MetadataState
from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.coordinator")

#: Largest encoded GroupRecords command submitted (the Raft entry cap is 64 KiB with framing).
MAX_GROUP_COMMAND_BYTES = 60 * 1024

#: ``on_adopt(group, state or None, tombstone epoch or None)``.
OnAdopt = Callable[[str, Group | None, int | None], None]
#: ``on_adopt_offsets(group, epoch, topic, {partition: offset}) -> handled``: the offset-only fast path.
OnAdoptOffsets = Callable[[str, int, str, Mapping[int, int]], bool]


def record_slot(rec: GroupRecord) -> str:
    """The :mod:`cursus.metadata.groups` slot of a coordinator record."""
    if isinstance(rec, OffsetSnapshotRecord):
        return OFFSET_SLOT_PREFIX + rec.topic
    if isinstance(rec, MembershipRecord):
        return MEMBERSHIP_SLOT
    return REGISTRATION_SLOT


def _record_key(name: str, stored: StoredGroupRecord) -> str:
    if stored.kind == "offset_snapshot":
        return offset_key(name, stored.topic)
    if stored.kind == "group_membership":
        return member_key(name)
    return group_key(name)


def entry_latest(name: str, entry: GroupEntry, latest: LatestRecords) -> int:
    """Decode ``entry``'s records strictly into ``latest``; returns how many. Raises ReplayError."""
    count = 0
    for slot, stored in entry.records.items():
        where = f"metadata group {name!r} {slot}"
        try:
            rec = decode_payload(_record_key(name, stored), stored.payload.encode("utf-8"))
        except RecordError as exc:
            raise ReplayError(f"{where}: {exc}") from None
        latest.put(rec, stored.payload.encode("utf-8"), where)
        count += 1
    return count


def group_from_entry(name: str, entry: GroupEntry, session_timeout_ms: int, now_ms: int
                     ) -> tuple[Group | None, int | None]:
    """The coordinator's view of one group's stored records: (group or None, tombstone epoch or None).
    Members get a session from ``now_ms``. Raises ReplayError (a record the strict codec refuses)."""
    latest = LatestRecords(0)
    entry_latest(name, entry, latest)
    table = GroupTable(session_timeout_ms)
    restore_snapshot(table, build_snapshot([latest]), now_ms)
    return table.groups.get(name), table.tombstones.get(name)


@dataclass(slots=True)
class _Staged:
    """What this broker appended for one group beyond the applied state (while commands are in flight)."""

    sequence: int
    revisions: dict[str, int]
    inflight: int = 0
    #: request id -> future of every command in flight on this staged view, in submission order.
    futures: dict[str, asyncio.Future[None]] = field(default_factory=dict)


class RaftGroupLog:
    """:class:`~cursus.coordinator.ports.GroupLog` over the metadata log (see the module docstring).

    Args:
        broker_id: this broker (the commands' ``origin``).
        submit: commits a metadata command and returns its result (``Metadata.submit``).
        state: the latest applied metadata state.
        address_of: a broker id's client address ``host:port`` ("" when unknown).
        wall_ms: wall clock (record timestamps).
        clock_ms: monotonic clock (sessions of adopted members).
        session_timeout_ms: ``consumer_session_timeout_ms``.
        max_command_bytes: refuse larger commands (``message_too_large``, nothing submitted).

    Thread-safety: event-loop thread only.
    """

    def __init__(self, broker_id: str, submit: Callable[[Command], Awaitable[ApplyResult]],
                 state: Callable[[], MetadataState], address_of: Callable[[str | None], str], *,
                 wall_ms: Callable[[], int], clock_ms: Callable[[], int], session_timeout_ms: int,
                 max_command_bytes: int = MAX_GROUP_COMMAND_BYTES) -> None:
        self.broker_id = broker_id
        self._submit = submit
        self._state = state
        self._address_of = address_of
        self._wall = wall_ms
        self._clock = clock_ms
        self._session_timeout_ms = session_timeout_ms
        self.max_command_bytes = max_command_bytes
        self._staged: dict[str, _Staged] = {}
        self._pending: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Set by the broker: the coordinator's :meth:`~cursus.coordinator.service.GroupCoordinator.adopt`
        #: and its offset-only fast path ``adopt_offsets`` (optional).
        self.on_adopt: OnAdopt | None = None
        self.on_adopt_offsets: OnAdoptOffsets | None = None
        #: Commands submitted / refused by the FSM (tests, logs).
        self.submitted = 0
        self.refused = 0

    # ------------------------------------------------------------------------------------------ replay

    async def replay(self) -> Snapshot:
        """Every group's records from the applied metadata state (registrations, tombstones, offsets,
        memberships). Raises ReplayError when a stored record fails the strict codec."""
        state = self._state()
        latest = LatestRecords(0)
        records = 0
        for name in sorted(state.groups):
            records += entry_latest(name, state.groups[name], latest)
        snap = build_snapshot([latest])
        snap.records = records
        return snap

    # ------------------------------------------------------------------------------------------ writes

    def append(self, group: str, records: Sequence[GroupRecord]) -> asyncio.Future[None]:
        """Submit ``records`` of ``group`` as one GroupRecords command; the future resolves once it is
        applied here (see the module docstring for its failures).

        Raises:
            BrokerError: ``message_too_large`` when the command would exceed :attr:`max_command_bytes`
                (nothing submitted).
        """
        staged = self._staged.get(group)
        if staged is None:
            entry = self._state().groups.get(group)
            staged = _Staged(entry.sequence if entry is not None else 0,
                             {slot: rec.revision for slot, rec in entry.records.items()} if entry else {})
        timestamp = utc_timestamp(self._wall())
        revisions = dict(staged.revisions)
        payloads = []
        for rec in records:
            assert rec.group == group
            slot = record_slot(rec)
            revisions[slot] = revisions.get(slot, 0) + 1
            rec = replace(rec, revision=revisions[slot], timestamp=timestamp)
            payloads.append(encode_payload(rec).decode("utf-8"))
            if isinstance(rec, TombstoneRecord):  # the fold drops the group's other keys
                revisions = {REGISTRATION_SLOT: revisions[REGISTRATION_SLOT]}
        command = GroupRecords(uuid.uuid4().hex, group, self.broker_id, staged.sequence + 1, tuple(payloads))
        # Embedding a payload in the command's JSON at most doubles it (escaped quotes and backslashes), so
        # the exact encoding is needed only near the cap.
        size = 2 * sum(len(p.encode("utf-8")) for p in payloads) + 512
        if size > self.max_command_bytes:
            size = len(encode(command))
        if size > self.max_command_bytes:
            raise BrokerError.of("message_too_large", group=group, reason="group_records_over_raft_cap",
                                 bytes=size, limit=self.max_command_bytes)
        staged.sequence += 1
        staged.revisions = revisions
        staged.inflight += 1
        self._staged[group] = staged
        self._pending.add(command.request_id)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        staged.futures[command.request_id] = fut
        task = asyncio.get_running_loop().create_task(self._commit(command, staged, fut))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.submitted += 1
        return fut

    async def _commit(self, command: GroupRecords, staged: _Staged, fut: asyncio.Future[None]) -> None:
        group = command.group
        try:
            await self._submit(command)
        except BrokerError as exc:
            self.refused += 1
            self._fail_from(staged, command.request_id, self._client_error(exc))
        except Exception as exc:  # never leave the coordinator waiting
            self._fail_from(staged, command.request_id, BrokerError.of(
                "coordinator_not_available", group=group, reason=f"group commit failed: {type(exc).__name__}"))
        else:
            if not fut.done():
                fut.set_result(None)
        finally:
            self._pending.discard(command.request_id)
            staged.futures.pop(command.request_id, None)
            staged.inflight -= 1
            if staged.inflight == 0 and self._staged.get(group) is staged:
                del self._staged[group]

    def _fail_from(self, staged: _Staged, request_id: str, error: BrokerError) -> None:
        """A command failed (refused, or its outcome is unknown): it and every later command of the group
        in flight fail now, as the seam requires, and the next append restarts from the applied state. A
        failed command that does commit after all is no longer pending, so :meth:`observe` adopts it."""
        group = next((g for g, s in self._staged.items() if s is staged), None)
        if group is not None:
            del self._staged[group]
        later = False
        for rid, fut in list(staged.futures.items()):
            later = later or rid == request_id
            if later:
                self._pending.discard(rid)
                if not fut.done():
                    fut.set_exception(error)

    def _client_error(self, exc: BrokerError) -> BrokerError:
        """``NOT_COORDINATOR`` from the FSM names no address: answer with the current owner's."""
        if exc.error.code != "NOT_COORDINATOR":
            return exc
        owner = exc.error.fields.get("owner")
        host, _, port = self._address_of(owner).rpartition(":")
        if not host:
            return BrokerError.of("coordinator_not_available", reason="the group has no coordinator right now")
        return BrokerError.of("NOT_COORDINATOR", host=host, port=port)

    async def close(self) -> None:
        """Wait for submitted commands to settle (their futures resolve or fail)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ------------------------------------------------------------------------------------------ adopt

    def observe(self, command: Command | None) -> None:
        """Metadata observer (event loop, commit order; the state is the one after ``command``): adopt the
        records of accepted GroupRecords this broker is not waiting for; after a snapshot restore
        (``command`` None) adopt every group from the restored state.

        A snapshot install jumps over commands this broker never saw applied, so a group with commands of
        ours in flight cannot tell which of them the snapshot holds: they fail now as
        ``request_timeout outcome=unknown`` (one that commits later is adopted like a foreign record), and
        the group is adopted from the restored state, so the coordinator's rollback lands on the committed
        state rather than on its copy from before the gap (chaos finding J)."""
        state = self._state()
        if command is None:
            for name in list(self._staged):
                staged = self._staged[name]
                first = next(iter(staged.futures), None)
                if first is not None:
                    self._fail_from(staged, first, BrokerError.of(
                        "request_timeout", outcome="unknown", group=name, reason="metadata_snapshot_installed"))
                else:
                    del self._staged[name]
            for name, entry in state.groups.items():
                self._adopt(name, entry)
            return
        if not isinstance(command, GroupRecords):
            return
        found = state.groups.get(command.group)
        if found is None or found.last_request != command.request_id:
            return  # refused
        if command.request_id in self._pending:
            return  # our own: its future publishes the coordinator's staged copy
        if not self._adopt_offsets(command.group, found, command):
            self._adopt(command.group, found)

    def _adopt_offsets(self, name: str, entry: GroupEntry, command: GroupRecords) -> bool:
        """Offset snapshots only (the common commit): hand over just the new offsets. False: adopt all."""
        if self.on_adopt_offsets is None:
            return False
        snapshots = []
        for payload in command.records:
            if '"type":"offset_snapshot"' not in payload:
                return False
            try:
                rec = decode_payload(None, payload.encode("utf-8"))
            except RecordError:
                return False
            if not isinstance(rec, OffsetSnapshotRecord) or rec.group != name:
                return False
            snapshots.append(rec)
        return all(self.on_adopt_offsets(name, rec.epoch, rec.topic, rec.offsets) for rec in snapshots)

    def _adopt(self, name: str, entry: GroupEntry) -> None:
        if self.on_adopt is None:
            return
        try:
            group, tombstone = group_from_entry(name, entry, self._session_timeout_ms, self._clock())
        except ReplayError as exc:
            log.error("group %s: committed records do not decode, not adopted: %s", name, exc)
            return
        self.on_adopt(name, group, tombstone)

    def stats(self) -> dict[str, int]:
        """Commands submitted and refused, groups with commands in flight."""
        return {"submitted": self.submitted, "refused": self.refused, "groups_in_flight": len(self._staged)}
