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
from dataclasses import dataclass

from cursus.metadata.commands import (
    AlterTopicConfig,
    Command,
    CreateTopic,
    DeleteTopic,
    PutTopic,
    RegisterBroker,
)
from cursus.metadata.state import (
    APPLIED_REQUESTS_KEPT,
    MetadataState,
    PartitionAssignment,
    PartitionKey,
    place,
)
from cursus.metadata.topics import TopicDefinition, apply_create
from cursus.wire.errors import BrokerError


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What a command did.

    Attributes:
        topic: the topic's definition after the command (None for DELETE and broker commands).
        changed: False when the command was a no-op (restated values, an already-applied request id).
        added: (topic, partition) keys whose assignment the command created.
        removed: (topic, partition) keys whose assignment the command removed.
    """

    topic: TopicDefinition | None = None
    changed: bool = False
    added: tuple[PartitionKey, ...] = ()
    removed: tuple[PartitionKey, ...] = ()


def apply(state: MetadataState, command: Command) -> tuple[MetadataState, ApplyResult]:
    """The state after ``command`` and what it did. Raises BrokerError (state unchanged)."""
    previous = state.applied.get(command.request_id)
    if isinstance(previous, ApplyResult):
        return state, dataclasses.replace(previous, changed=False)
    if isinstance(command, RegisterBroker):
        new, result = _register(state, command)
    elif isinstance(command, DeleteTopic):
        new, result = _delete(state, command)
    else:
        new, result = _put(state, command)
    if not result.changed:
        return state, result
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


def _register(state: MetadataState, command: RegisterBroker) -> tuple[MetadataState, ApplyResult]:
    info = command.broker
    if state.brokers.get(info.id) == info:
        return state, ApplyResult()
    brokers = dict(state.brokers)
    brokers[info.id] = info
    return dataclasses.replace(state, brokers=brokers), ApplyResult(changed=True)


def _delete(state: MetadataState, command: DeleteTopic) -> tuple[MetadataState, ApplyResult]:
    _check_revision(state, command.topic, command.expected_revision)
    if command.topic not in state.topics:
        raise BrokerError.of("topic_not_found", topic=command.topic)
    topics = {n: d for n, d in state.topics.items() if n != command.topic}
    removed = tuple(sorted(k for k in state.assignments if k[0] == command.topic))
    assignments = {k: a for k, a in state.assignments.items() if k[0] != command.topic}
    new = dataclasses.replace(state, topics=topics, assignments=assignments)
    return new, ApplyResult(topic=None, changed=True, removed=removed)


def _next_definition(state: MetadataState, command: CreateTopic | PutTopic | AlterTopicConfig,
                     current: TopicDefinition | None) -> TopicDefinition:
    if isinstance(command, CreateTopic):
        return apply_create(current, command.spec,
                            default_partitions=command.default_partitions,
                            default_cleanup_policy=command.default_cleanup_policy,
                            max_replication_factor=len(state.active_brokers()))
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
    for key in added:
        assignments[key] = place(defn, key[1], active, state.initial_leader_epoch)
    topics = dict(state.topics)
    topics[name] = defn
    new = dataclasses.replace(state, topics=topics, assignments=assignments)
    return new, ApplyResult(topic=defn, changed=True, added=added)
