"""The pure metadata transition: ``apply(state, command) -> (state, result)``.

Deterministic and free of I/O, so a standalone broker and a Raft FSM that apply the same command bytes to
the same state reach the same state. Rules:

* a command whose ``request_id`` was applied recently returns the recorded result and changes nothing;
* ``expected_revision`` is a compare-and-set on the topic's revision (0: the topic must not exist);
  a mismatch raises ``version_conflict`` and changes nothing;
* the state revision grows by one per effective change, never otherwise;
* a topic's partition count never shrinks; new partitions are placed over the active brokers
  (:func:`cursus.metadata.state.place`), existing ones keep their assignment.

Validation failures raise :class:`~cursus.wire.errors.BrokerError` with the spec's typed code; the input
state is never modified.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from cursus.metadata.commands import (
    AlterTopicConfig,
    BrokerHeartbeat,
    ChangeIsr,
    Command,
    CommitHwm,
    CreateTopic,
    DeleteTopic,
    ElectLeader,
    FenceBroker,
    GroupRecords,
    PutTopic,
    RegisterBroker,
    TruncateTopic,
    TxnSync,
)
from cursus.metadata.groups import (
    GroupEntry,
    GroupRecordRefused,
    check_offsets_fence,
    fold_records,
    parse_record,
)
from cursus.metadata.lifecycle import require_lifecycle_protocol
from cursus.metadata.state import (
    APPLIED_REQUESTS_KEPT,
    BrokerInfo,
    MetadataState,
    PartitionAssignment,
    PartitionKey,
    TxnShardState,
    derive_txn_shards,
    place,
    transaction_shard,
)
from cursus.metadata.topics import TopicDefinition, apply_create, is_internal_topic
from cursus.transactions.state import PREPARE_COMMIT as TXN_PREPARE_COMMIT
from cursus.transactions.state import guard_admits as txn_guard_admits
from cursus.wire.errors import BrokerError


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What a command did.

    Attributes:
        topic: the topic's definition after the command (None for DELETE and broker commands).
        changed: False when the command was a no-op (restated values, an already-applied request id).
        added: (topic, partition) keys whose assignment the command created.
        removed: (topic, partition) keys whose assignment the command removed.
        moved: (topic, partition) keys whose leader, leader epoch or ISR the command changed.
        previous_leader: ELECT_LEADER: the leader before the command (None when it was leaderless).
        hwm_accepted: CommitHwm: the (topic, partition) keys whose committed HWM moved forward.
        hwm_rejected: CommitHwm: ``(topic, partition, reason)`` of every skipped entry; reason is one of
            :data:`HWM_REJECT_REASONS`.
    """

    topic: TopicDefinition | None = None
    changed: bool = False
    added: tuple[PartitionKey, ...] = ()
    removed: tuple[PartitionKey, ...] = ()
    moved: tuple[PartitionKey, ...] = ()
    previous_leader: str | None = None
    hwm_accepted: tuple[PartitionKey, ...] = ()
    hwm_rejected: tuple[tuple[str, int, str], ...] = ()


#: Why a CommitHwm entry was skipped (the facts B4 fencing codes where one applies):
#: ``partition_metadata_not_found`` (no such partition), ``NOT_PARTITION_LEADER`` (the submitter does not
#: lead it), ``STALE_LEADER_EPOCH`` (entry epoch below the assignment's), ``PARTITION_LEADER_FENCED`` (entry
#: epoch above it, or another lifecycle epoch), ``hwm_not_above_committed`` (nothing to move).
HWM_REJECT_REASONS = ("partition_metadata_not_found", "NOT_PARTITION_LEADER", "STALE_LEADER_EPOCH",
                      "PARTITION_LEADER_FENCED", "hwm_not_above_committed")


def apply(state: MetadataState, command: Command) -> tuple[MetadataState, ApplyResult]:
    """The state after ``command`` and what it did. Raises BrokerError (state unchanged)."""
    previous = state.applied.get(command.request_id)
    if isinstance(previous, ApplyResult):
        return state, dataclasses.replace(previous, changed=False)
    if isinstance(command, RegisterBroker):
        new, result = _register(state, command.broker)
    elif isinstance(command, BrokerHeartbeat):
        new, result = _heartbeat(state, command)
    elif isinstance(command, FenceBroker):
        new, result = _fence(state, command)
    elif isinstance(command, ElectLeader):
        new, result = _elect(state, command)
    elif isinstance(command, ChangeIsr):
        new, result = _change_isr(state, command)
    elif isinstance(command, CommitHwm):
        new, result = _commit_hwm(state, command)
        # Not recorded in ``applied``: a CommitHwm is idempotent by HWM monotonicity, and its frequency would
        # push the results of topic commands (whose retries need them) out of the bounded record.
        if not result.changed:
            return state, result
        return dataclasses.replace(new, revision=state.revision + 1), result
    elif isinstance(command, GroupRecords):
        new, result = _group_records(state, command)
        # Not recorded in ``applied`` either: retries are deduplicated by the Raft request id and fenced by
        # the group's sequence, and offset commits are far too frequent for the bounded record.
        return dataclasses.replace(new, revision=state.revision + 1), result
    elif isinstance(command, TxnSync):
        new, result = _txn_sync(state, command)
        # Not recorded in ``applied``: fenced by the shard epoch, and as frequent as transactions.
        return dataclasses.replace(new, revision=state.revision + 1), result
    elif isinstance(command, DeleteTopic):
        new, result = _delete(state, command)
    elif isinstance(command, TruncateTopic):
        new, result = _truncate(state, command)
    else:
        new, result = _put(state, command)
    if not result.changed:
        return state, result
    if new.coordinator_shards and (new.coordinator_shards != state.coordinator_shards
                                   or new.active_brokers() != state.active_brokers()):
        new = dataclasses.replace(new, txn_shards=derive_txn_shards(new))
    applied = dict(new.applied)
    applied[command.request_id] = result
    while len(applied) > APPLIED_REQUESTS_KEPT:
        del applied[next(iter(applied))]
    return dataclasses.replace(new, revision=state.revision + 1, applied=applied), result


def _check_revision(state: MetadataState, topic: str, expected: int | None) -> None:
    if expected is None:
        return
    current = state.topics.get(topic)
    actual = current.revision if current is not None else 0
    if actual != expected:
        raise BrokerError.of("version_conflict", topic=topic, expected_revision=expected, revision=actual)


def _register(state: MetadataState, info: BrokerInfo) -> tuple[MetadataState, ApplyResult]:
    previous = state.brokers.get(info.id)
    if previous == info:
        return state, ApplyResult()
    brokers = dict(state.brokers)
    brokers[info.id] = info
    new = dataclasses.replace(state, brokers=brokers)
    if (previous is not None and previous.incarnation and info.incarnation
            and previous.incarnation != info.incarnation and previous.status == "active"):
        # A restart the controller did not notice (back within the session timeout): every partition it
        # leads moves to a new leader epoch, so its (possibly truncated) log and its followers' logs are
        # told apart by epoch lineage instead of two histories sharing one epoch.
        moves = {key: dataclasses.replace(a, leader_epoch=a.leader_epoch + 1)
                 for key, a in state.assignments.items() if a.leader == info.id}
        if moves:
            new = dataclasses.replace(new, assignments={**state.assignments, **moves})
        return new, ApplyResult(changed=True, moved=tuple(sorted(moves)))
    if info.status == "active" and (previous is None or previous.status != "active"):
        # The last ISR member of a leaderless partition is back: its log holds the committed data.
        moves = {key: dataclasses.replace(a, leader=info.id, leader_epoch=a.leader_epoch + 1)
                 for key, a in state.assignments.items() if a.leader is None and a.isr == (info.id,)}
        if moves:
            new = dataclasses.replace(new, assignments={**state.assignments, **moves})
        return new, ApplyResult(changed=True, moved=tuple(sorted(moves)))
    return new, ApplyResult(changed=True)


def _heartbeat(state: MetadataState, command: BrokerHeartbeat) -> tuple[MetadataState, ApplyResult]:
    shards = command.coordinator_shards
    if shards < 1:
        raise BrokerError.of("cluster_join_failed", broker=command.broker.id, reason="coordinator shards must be >= 1")
    if state.coordinator_shards not in (0, shards):
        raise BrokerError.of("cluster_join_failed", broker=command.broker.id,
                             reason="transaction_coordinator_shards differs from the cluster's",
                             configured=shards, cluster=state.coordinator_shards)
    base = state if state.coordinator_shards else dataclasses.replace(state, coordinator_shards=shards)
    new, result = _register(base, dataclasses.replace(command.broker, status="active"))
    if base is not state and not result.changed:
        return base, ApplyResult(changed=True)
    return new, result


def _fence(state: MetadataState, command: FenceBroker) -> tuple[MetadataState, ApplyResult]:
    info = state.brokers.get(command.broker_id)
    if info is None:
        raise BrokerError.of("missing_broker", broker=command.broker_id, reason="not registered")
    if info.status == "inactive":
        return state, ApplyResult()
    brokers = {**state.brokers, info.id: dataclasses.replace(info, status="inactive")}
    moves: dict[PartitionKey, PartitionAssignment] = {}
    for key, a in state.assignments.items():
        if info.id not in a.isr:
            continue
        isr = tuple(b for b in a.isr if b != info.id)
        if not isr:  # leaderless, never an unclean election; the last member stays recorded
            moves[key] = dataclasses.replace(a, leader=None, leader_epoch=a.leader_epoch + (a.leader is not None))
        elif a.leader == info.id:
            moves[key] = dataclasses.replace(a, leader=isr[0], leader_epoch=a.leader_epoch + 1, isr=isr)
        else:
            moves[key] = dataclasses.replace(a, isr=isr)
    new = dataclasses.replace(state, brokers=brokers, assignments={**state.assignments, **moves})
    return new, ApplyResult(changed=True, moved=tuple(sorted(moves)))


def _partition(state: MetadataState, topic: str, partition: int) -> PartitionAssignment:
    assignment = state.assignments.get((topic, partition))
    if assignment is None:
        raise BrokerError.of("partition_not_found", topic=topic, partition=partition)
    return assignment


def _elect(state: MetadataState, command: ElectLeader) -> tuple[MetadataState, ApplyResult]:
    a = _partition(state, command.topic, command.partition)
    target = command.broker_id
    if a.leader == target:  # a retry against the already selected leader
        return state, ApplyResult(previous_leader=a.leader)
    info = state.brokers.get(target)
    reason = ("target is not a replica" if target not in a.replicas
              else "target is not in the ISR" if target not in a.isr
              else "target broker is not active" if info is None or info.status != "active"
              else None)
    if reason is None and command.expected_leader_epoch not in (None, a.leader_epoch):
        reason = "leader epoch changed"
    if reason is not None:
        raise BrokerError.of("leader_election_rejected", topic=command.topic, partition=command.partition,
                             broker=target, leader_epoch=a.leader_epoch,
                             expected_leader_epoch=command.expected_leader_epoch, reason=reason)
    key = (command.topic, command.partition)
    moved = dataclasses.replace(a, leader=target, leader_epoch=a.leader_epoch + 1)
    new = dataclasses.replace(state, assignments={**state.assignments, key: moved})
    return new, ApplyResult(changed=True, moved=(key,), previous_leader=a.leader)


def _change_isr(state: MetadataState, command: ChangeIsr) -> tuple[MetadataState, ApplyResult]:
    a = _partition(state, command.topic, command.partition)
    if command.leader_epoch != a.leader_epoch:
        raise BrokerError.of("STALE_LEADER_EPOCH", current=a.leader_epoch, requested=command.leader_epoch)
    wanted = set(command.isr)
    if a.leader is None or a.leader not in wanted or not wanted <= set(a.replicas):
        raise BrokerError.of("invalid_cluster_request", topic=command.topic, partition=command.partition,
                             reason="the ISR must hold the leader and only replicas")
    inactive = sorted(b for b in wanted - set(a.isr)
                      if (info := state.brokers.get(b)) is None or info.status != "active")
    if inactive:
        raise BrokerError.of("invalid_cluster_request", topic=command.topic, partition=command.partition,
                             broker=",".join(inactive), reason="an ISR expansion must add active brokers only")
    isr = tuple(b for b in a.replicas if b in wanted)
    if isr == a.isr:
        return state, ApplyResult()
    key = (command.topic, command.partition)
    new = dataclasses.replace(state, assignments={**state.assignments, key: dataclasses.replace(a, isr=isr)})
    return new, ApplyResult(changed=True, moved=(key,))


def _commit_hwm(state: MetadataState, command: CommitHwm) -> tuple[MetadataState, ApplyResult]:
    """Move committed HWMs forward, entry by entry (see :class:`CommitHwm`); the latest entry of a
    partition wins when one command names it twice. Raises BrokerError only outside a cluster."""
    if not state.cluster:
        raise BrokerError.of("invalid_cluster_request", reason="CommitHwm is a cluster command")
    moves: dict[PartitionKey, PartitionAssignment] = {}
    rejected: list[tuple[str, int, str]] = []
    for entry in command.entries:
        key = (entry.topic, entry.partition)
        a = moves.get(key) or state.assignments.get(key)
        reason = _hwm_reject_reason(a, command.broker_id, entry.leader_epoch, entry.lifecycle_epoch, entry.hwm)
        if reason is not None:
            rejected.append((entry.topic, entry.partition, reason))
            continue
        assert a is not None
        moves[key] = dataclasses.replace(a, committed_hwm=entry.hwm)
    result = ApplyResult(changed=bool(moves), hwm_accepted=tuple(sorted(moves)), hwm_rejected=tuple(rejected))
    if not moves:
        return state, result
    return dataclasses.replace(state, assignments={**state.assignments, **moves}), result


def _hwm_reject_reason(a: PartitionAssignment | None, broker_id: str, leader_epoch: int, lifecycle_epoch: int,
                       hwm: int) -> str | None:
    if a is None:
        return "partition_metadata_not_found"
    if a.leader != broker_id:
        return "NOT_PARTITION_LEADER"
    if leader_epoch < a.leader_epoch:
        return "STALE_LEADER_EPOCH"
    if leader_epoch > a.leader_epoch or lifecycle_epoch != a.lifecycle_epoch:
        return "PARTITION_LEADER_FENCED"
    if hwm <= a.committed_hwm:
        return "hwm_not_above_committed"
    return None


def _group_records(state: MetadataState, command: GroupRecords) -> tuple[MetadataState, ApplyResult]:
    """Fold one coordinator change into ``state.groups`` (rules: :mod:`cursus.metadata.groups`).

    Raises:
        BrokerError: ``invalid_cluster_request`` (standalone, a malformed record or a fold rule),
            ``NOT_COORDINATOR`` (``origin`` does not own the group here; ``owner=`` names who does),
            ``coordinator_not_available reason=out_of_sequence``; the state is unchanged.
    """
    if not state.cluster:
        raise BrokerError.of("invalid_cluster_request", reason="GroupRecords is a cluster command")
    group = command.group
    owner = state.group_coordinator(group)
    if owner != command.origin:
        raise BrokerError.of("NOT_COORDINATOR", group=group, origin=command.origin, owner=owner,
                             reason="origin_does_not_own_group")
    entry = state.groups.get(group)
    current = entry.sequence if entry is not None else 0
    if command.sequence != current + 1:
        raise BrokerError.of("coordinator_not_available", group=group, reason="out_of_sequence",
                             sequence=command.sequence, expected=current + 1)
    if not command.records:
        raise BrokerError.of("invalid_cluster_request", group=group, reason="no group records")
    try:
        parsed = [parse_record(group, payload) for payload in command.records]
        slots = fold_records(entry, group, parsed)
    except GroupRecordRefused as exc:
        raise BrokerError.of("invalid_cluster_request", reason=exc.reason, **exc.fields) from None
    except ValueError as exc:
        raise BrokerError.of("invalid_cluster_request", group=group, reason=str(exc)[:200]) from None
    new_entry = GroupEntry(command.sequence, command.request_id, command.origin, slots)
    new = dataclasses.replace(state, groups={**state.groups, group: new_entry})
    return new, ApplyResult(changed=True)


def _txn_sync(state: MetadataState, command: TxnSync) -> tuple[MetadataState, ApplyResult]:
    """Store one shard owner's coordinator transitions (rules: :class:`TxnSync`).

    Raises:
        BrokerError: ``invalid_cluster_request`` (standalone, a bad shard, an id of another shard, an
            epoch moving back), ``producer_fenced`` (``expect`` does not hold), ``NOT_COORDINATOR`` (``origin`` does not own the shard at that epoch;
            ``owner=`` names who does); the state is unchanged.
    """
    if not state.cluster:
        raise BrokerError.of("invalid_cluster_request", reason="TxnSync is a cluster command")
    shards = state.coordinator_shards
    if not 0 <= command.shard < shards:
        raise BrokerError.of("invalid_cluster_request", shard=command.shard, reason="no such coordinator shard")
    owner = state.txn_shards.get(command.shard)
    if owner is None or owner.owner != command.origin or owner.epoch != command.shard_epoch:
        raise BrokerError.of("NOT_COORDINATOR", shard=command.shard, origin=command.origin,
                             owner=owner.owner if owner is not None else None,
                             epoch=owner.epoch if owner is not None else 0, requested_epoch=command.shard_epoch,
                             reason="origin_does_not_own_shard")
    current = state.txn.get(command.shard) or TxnShardState()
    entries = dict(current.entries)
    for entry in command.entries:
        tid = entry.transactional_id
        if transaction_shard(tid, shards) != command.shard:
            raise BrokerError.of("invalid_cluster_request", shard=command.shard, reason="id_of_another_shard")
        previous = entries.get(tid)
        if command.expect is not None and not txn_guard_admits(previous, *command.expect):
            # guarded INIT_PRODUCER_ID: the caller is no longer the id's latest owner (in Raft order)
            raise BrokerError.of("producer_fenced", transactional_id=tid, producer=command.expect[0],
                                 got=command.expect[1], current=previous.epoch if previous is not None else 0,
                                 reason="the session was re-initialized by another instance")
        if previous is not None and (entry.epoch < previous.epoch or entry.producer_id != previous.producer_id):
            raise BrokerError.of("invalid_cluster_request", shard=command.shard,
                                 reason="producer_session_moves_back", epoch=entry.epoch, current=previous.epoch)
        if entry.state == TXN_PREPARE_COMMIT and entry.group is not None and entry.member is not None \
                and entry.generation is not None and (previous is None or previous.state != TXN_PREPARE_COMMIT):
            # the offsets' group fence in Raft order (the coordinator checked it on its possibly older view)
            try:
                check_offsets_fence(state.groups.get(entry.group), entry.group, entry.member, entry.generation,
                                    entry.offset_partitions)
            except GroupRecordRefused as exc:
                raise BrokerError.of(exc.code, transactional_id=tid, reason=exc.reason, **exc.fields) from None
        entries[tid] = entry
    shard_state = TxnShardState(entries, max(current.next_producer_id, command.next_producer_id),
                                command.request_id)
    touched = state.txn_touched | frozenset(command.touched) if command.touched else state.txn_touched
    new = dataclasses.replace(state, txn={**state.txn, command.shard: shard_state}, txn_touched=touched)
    return new, ApplyResult(changed=True)


def _delete(state: MetadataState, command: DeleteTopic) -> tuple[MetadataState, ApplyResult]:
    _check_revision(state, command.topic, command.expected_revision)
    if command.topic not in state.topics:
        raise BrokerError.of("topic_not_found", topic=command.topic)
    topics = {n: d for n, d in state.topics.items() if n != command.topic}
    removed = tuple(sorted(k for k in state.assignments if k[0] == command.topic))
    assignments = {k: a for k, a in state.assignments.items() if k[0] != command.topic}
    touched = frozenset(tp for tp in state.txn_touched if tp[0] != command.topic)
    incarnations = {n: i for n, i in state.incarnations.items() if n != command.topic}
    new = dataclasses.replace(state, topics=topics, assignments=assignments, txn_touched=touched,
                              incarnations=incarnations)
    return new, ApplyResult(topic=None, changed=True, removed=removed)


def _truncate(state: MetadataState, command: TruncateTopic) -> tuple[MetadataState, ApplyResult]:
    """TRUNCATE: same definition, revision + 1 and lifecycle epoch + 1; every partition keeps its replicas,
    leader and ISR, moves to the next leader epoch (a cluster's) and the new lifecycle epoch, with committed HWM 0 (the
    replicas reset their storage when they apply it). Every active broker of a cluster must implement the
    lifecycle protocol (``unsupported_topic_policy``)."""
    if is_internal_topic(command.topic):
        raise BrokerError.of("internal_topic_delete_forbidden", topic=command.topic, command="TRUNCATE")
    current = state.topics.get(command.topic)
    if current is None:
        raise BrokerError.of("topic_not_found", topic=command.topic)
    _check_revision(state, command.topic, command.expected_revision)
    require_lifecycle_protocol(state, "truncate")
    defn = dataclasses.replace(current, revision=current.revision + 1, lifecycle_epoch=current.lifecycle_epoch + 1)
    bump = 1 if state.cluster else 0  # standalone epochs stay 0 (facts B5), rebuilt so at every open
    moves = {key: dataclasses.replace(a, leader_epoch=a.leader_epoch + bump, committed_hwm=0,
                                      lifecycle_epoch=defn.lifecycle_epoch)
             for key, a in state.assignments.items() if key[0] == command.topic}
    new = dataclasses.replace(state, topics={**state.topics, command.topic: defn},
                              assignments={**state.assignments, **moves})
    return new, ApplyResult(topic=defn, changed=True, moved=tuple(sorted(moves)))


def _next_definition(state: MetadataState, command: CreateTopic | PutTopic | AlterTopicConfig,
                     current: TopicDefinition | None) -> TopicDefinition:
    if isinstance(command, CreateTopic):
        if state.cluster and current is None:
            wanted = command.spec.replication_factor or command.default_replication_factor
            if wanted > len(state.brokers):
                raise BrokerError.of("invalid_replication_factor", topic=command.topic, value=wanted,
                                     registered_brokers=len(state.brokers))
        return apply_create(current, command.spec,
                            default_partitions=command.default_partitions,
                            default_cleanup_policy=command.default_cleanup_policy,
                            max_replication_factor=len(state.active_brokers()),
                            default_replication_factor=command.default_replication_factor)
    if isinstance(command, PutTopic):
        defn = command.definition
        if current is not None and defn.partitions < current.partitions:
            raise BrokerError.of("invalid_partitions", reason="partition count can only increase",
                                 current=current.partitions, value=defn.partitions)
        if current is None or defn == current:
            return current or defn
        # a changed definition never moves the revision backwards
        return dataclasses.replace(defn, revision=max(defn.revision, current.revision + 1))
    if current is None:
        raise BrokerError.of("topic_not_found", topic=command.topic)
    override = command.min_in_sync_replicas
    if override is not None and not 1 <= override <= current.replication_factor:
        raise BrokerError.of("invalid_min_in_sync_replicas", value=override,
                             reason=f"must be between 1 and the replication factor {current.replication_factor}")
    if override == current.min_in_sync_replicas:
        return current
    return dataclasses.replace(current, min_in_sync_replicas=override, revision=current.revision + 1)


def _put(state: MetadataState, command: CreateTopic | PutTopic | AlterTopicConfig
         ) -> tuple[MetadataState, ApplyResult]:
    name = command.definition.name if isinstance(command, PutTopic) else command.topic
    _check_revision(state, name, command.expected_revision)
    current = state.topics.get(name)
    defn = _next_definition(state, command, current)
    if defn is current:
        return state, ApplyResult(topic=current)
    active = state.active_brokers()
    old_count = current.partitions if current is not None else 0
    added = tuple((name, p) for p in range(old_count, defn.partitions))
    if added and not active:
        raise BrokerError.of("cluster_metadata_unavailable", topic=name, reason="no active broker to place on")
    assignments: dict[PartitionKey, PartitionAssignment] = dict(state.assignments)
    leaders = Counter(a.replicas[0] for k, a in assignments.items() if k[0] == name and a.replicas)
    for key in added:
        assignments[key] = placed = place(defn, key[1], active, state.initial_leader_epoch, leaders)
        if placed.replicas:
            leaders[placed.replicas[0]] += 1
    topics = dict(state.topics)
    topics[name] = defn
    new = dataclasses.replace(state, topics=topics, assignments=assignments)
    if current is None and state.cluster:  # a new incarnation of the name: the revision of this state
        new = dataclasses.replace(new, incarnations={**state.incarnations, name: state.revision + 1})
    return new, ApplyResult(topic=defn, changed=True, added=added)
