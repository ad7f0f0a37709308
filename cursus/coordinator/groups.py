"""The consumer-group state machine (spec "Consumer Group Coordination" and section 6; facts B5, decision 9).

Pure data: no sockets, no event loop, no clock, no persistence. Every operation takes the time as ``now_ms``
(a monotonic clock in milliseconds; the service converts to wall time only for display) and either raises
:class:`~cursus.wire.errors.BrokerError` (the typed error the command answers) without changing anything, or
applies the whole change and returns what changed. The same inputs always give the same state (member-id
suffixes come from the injected ``rng``), so this is what a replicated state machine applies. The coordinator
service runs it as the *staged* state (the end of the group log) and publishes a copy to readers once the
records of a change are durable (:mod:`cursus.coordinator.service`).

Model:

* A **group** has a *selector* (one topic, a list of topics, or a glob pattern), its concrete *expansion*
  (topic -> partition count, for the topics that exist), a durable lifecycle *epoch* (a new one each time a
  deleted group name is registered again), an in-memory *generation*, *members* and *committed offsets*.
* The **generation** bumps on every rebalance, and a rebalance happens exactly when the member set or the
  expansion changes: a new member joins, a member leaves or its session expires, partitions are added or
  topics appear or disappear, plus once more when a rejoin frees partitions a caught-up member waits for
  (below). A member that joins again with its full id while it is still a member does not change the member
  set, so it gets the current generation and its assignment back; this is what lets a group converge after
  a rebalance instead of fencing itself forever.
* **Target assignment** is round-robin and deterministic: the expansion's topic-partitions sorted by (topic,
  partition), dealt in turn to the members sorted by member id. The same members and expansion always give
  the same target.
* **Ownership is exclusive (the join barrier).** A member's *assignment* is what it was last told (in its
  latest JOIN reply) and may be reading; it changes only when that member joins. A join gives the member
  its target minus every partition another live member still holds, so a partition moves to a new owner
  only after its previous owner has rejoined (and so given it up), left or expired. When a rejoin gives up
  partitions that a member already in the current generation is waiting for, the generation bumps again so
  that member rejoins and takes them (Kafka's cooperative protocol, in two rounds). No partition is ever in
  two live members' assignments. Members that have not rejoined since a rebalance keep their assignment and
  their *member generation*: commits are fenced by it (a member may commit what it holds until it rejoins,
  which is how its processed work is committed before the partition moves).
* **Sessions** are data: each member has a deadline (last heartbeat + session timeout). :meth:`GroupTable.expire`
  removes members whose deadline passed and :meth:`GroupTable.next_deadline_ms` tells the caller when to
  call it next (one timer for the whole table, armed by the service).
* **Commits** are fenced (member, the member's generation, ownership) and monotonic per partition: a lower offset is
  ``offset_regression``, the same offset is accepted without change.
* **Join retries.** A member that joined with a client id and has not been heard from under its full id since
  (no SYNC_GROUP, HEARTBEAT, commit or rejoin with that id) is *unconfirmed*: its client may never have seen
  the reply. A JOIN_GROUP with the same client id from the same client host without ``generation=``, while
  the connection the first join came on is closed (its client gave up on it), is taken as a retry of that
  join and answers the same member, instead of adding a ghost member. Two consumers that share a client id
  and run at once keep two connections open, so they stay two members.
"""

from __future__ import annotations

import fnmatch
import heapq
import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from cursus.metadata.topics import is_internal_topic, validate_topic_name
from cursus.wire.errors import BrokerError

#: Spec section 6: "Server session timeout: configurable (default ~30s)".
DEFAULT_SESSION_TIMEOUT_MS = 30_000
#: A member id the broker handed out: the client's id, a dash and four digits (facts B5 JOIN_GROUP).
FULL_MEMBER_ID = re.compile(r".+-[0-9]{4}")
#: Group names and member ids appear in ``OK`` text replies and comma lists: no whitespace, commas,
#: brackets or quotes.
_NAME = re.compile(r"[A-Za-z0-9._=:@+/-]{1,249}")
_PATTERN = re.compile(r"[A-Za-z0-9._=*?\[\]!-]{1,249}")

TopicPartition = tuple[str, int]


# ---------------------------------------------------------------------------------------------- validation


def _host(origin: str) -> str:
    """The host part of a ``host:port`` connection origin."""
    return origin.rsplit(":", 1)[0]


def validate_group_name(name: str | None, *, command: str) -> str:
    """Check a group name: 1-249 of ``A-Z a-z 0-9 . _ = : @ + / -``.

    Raises:
        BrokerError: ``missing_group`` when absent or empty, ``invalid_payload`` (field=group) otherwise.
    """
    if name is None or name == "":
        raise BrokerError.of("missing_group", command=command)
    if not _NAME.fullmatch(name):
        raise BrokerError.of("invalid_payload", command=command, field="group",
                             reason="group names are 1-249 of A-Z a-z 0-9 . _ = : @ + / -")
    return name


def validate_member_id(member: str | None, *, command: str) -> str:
    """Check a member id (same alphabet as group names, at most 244 characters so a suffix fits).

    Raises:
        BrokerError: ``missing_member`` when absent or empty, ``invalid_payload`` (field=member) otherwise.
    """
    if member is None or member == "":
        raise BrokerError.of("missing_member", command=command)
    if not _NAME.fullmatch(member) or len(member) > 244:
        raise BrokerError.of("invalid_payload", command=command, field="member",
                             reason="member ids are 1-244 of A-Z a-z 0-9 . _ = : @ + / -")
    return member


# ---------------------------------------------------------------------------------------------- selectors


@dataclass(frozen=True, slots=True)
class Selector:
    """What a group subscribes to (spec REGISTER_GROUP): exactly one of a topic, topics, or a glob pattern.

    Attributes:
        kind: ``"topic"``, ``"topics"`` or ``"pattern"``.
        topics: the topic names (one for ``topic``, one or more for ``topics``); empty for a pattern.
        pattern: an :mod:`fnmatch` glob (``*``, ``?``, ``[...]``) for ``pattern``; else empty. A pattern never
            matches broker-internal topics (names starting with ``__``).
    """

    kind: str
    topics: tuple[str, ...] = ()
    pattern: str = ""

    @classmethod
    def single(cls, topic: str) -> Selector:
        """A one-topic selector."""
        return cls("topic", (topic,))

    @classmethod
    def parse(cls, *, topic: str | None, topics: str | None, pattern: str | None, command: str) -> Selector:
        """Build a selector from REGISTER_GROUP fields; exactly one must be given.

        ``topics`` is a comma list (duplicates removed, order kept).

        Raises:
            BrokerError: ``invalid_subscription`` (none or several selectors, bad pattern, empty list),
                ``invalid_topic_name`` for a bad topic name.
        """
        given = [name for name, value in (("topic", topic), ("topics", topics), ("pattern", pattern))
                 if value not in (None, "")]
        if len(given) != 1:
            raise BrokerError.of("invalid_subscription", command=command,
                                 reason="exactly one of topic, topics or pattern is required")
        if topic:
            return cls.single(validate_topic_name(topic, command=command))
        if topics:
            names: list[str] = []
            for raw in topics.split(","):
                name = validate_topic_name(raw.strip(), command=command)
                if name not in names:
                    names.append(name)
            return cls("topics", tuple(names))
        assert pattern is not None
        if not _PATTERN.fullmatch(pattern):
            raise BrokerError.of("invalid_subscription", command=command, field="pattern",
                                 reason="patterns are 1-249 of topic-name characters and * ? [ ] !")
        return cls("pattern", (), pattern)

    @property
    def multi_topic(self) -> bool:
        """True for ``topics`` and ``pattern`` selectors (replies use ``topic_assignments=``)."""
        return self.kind != "topic"

    def matches(self, topic: str) -> bool:
        """Whether ``topic`` belongs to this subscription."""
        if self.kind == "pattern":
            return not is_internal_topic(topic) and fnmatch.fnmatchcase(topic, self.pattern)
        return topic in self.topics

    def describe(self) -> str:
        """``topic=T``, ``topics=a,b`` or ``pattern=P`` (for replies and messages)."""
        if self.kind == "pattern":
            return f"pattern={self.pattern}"
        return f"{self.kind}={','.join(self.topics)}"


def expansion_for(selector: Selector, partition_counts: Mapping[str, int]) -> dict[str, int]:
    """The concrete expansion of ``selector`` over existing topics ``{topic: partitions}``, sorted by topic."""
    return {t: partition_counts[t] for t in sorted(partition_counts) if selector.matches(t)}


# ---------------------------------------------------------------------------------------------- assignment


def assign_round_robin(member_ids: Iterable[str],
                       topic_partitions: Iterable[TopicPartition]) -> dict[str, tuple[TopicPartition, ...]]:
    """Deal topic-partitions (sorted) to members (sorted by id) in turn.

    Deterministic: the same inputs always give the same result; every topic-partition goes to exactly one
    member; member loads differ by at most one. No members: an empty mapping.
    """
    members = sorted(set(member_ids))
    if not members:
        return {}
    dealt: dict[str, list[TopicPartition]] = {m: [] for m in members}
    for index, tp in enumerate(sorted(set(topic_partitions))):
        dealt[members[index % len(members)]].append(tp)
    return {m: tuple(tps) for m, tps in dealt.items()}


# ---------------------------------------------------------------------------------------------- state


@dataclass(slots=True)
class Member:
    """One live group member.

    Attributes:
        member_id: the full id (client id + ``-NNNN``).
        joined_ms, last_heartbeat_ms: monotonic ms of the join and of the latest heartbeat (or join).
        deadline_ms: the session expires when ``now_ms >= deadline_ms`` (monotonic ms).
        assignment: topic-partitions this member holds (what its latest join answered), sorted; never
            shared with another live member.
        generation: the generation of that join (< the group's generation until it rejoins).
        unconfirmed_client: the client id it joined with, until it is first heard from under its full id
            (None afterwards, and for restored or resumed members); see "Join retries".
        origin: the connection the join came on (the client's ``host:port``), for recognising a retry of it.
    """

    member_id: str
    joined_ms: int
    last_heartbeat_ms: int
    deadline_ms: int
    assignment: tuple[TopicPartition, ...] = ()
    unconfirmed_client: str | None = None
    origin: str | None = None
    generation: int = 0


@dataclass(slots=True)
class Group:
    """One registered consumer group (see the module docstring for the model).

    Attributes:
        name: the group name.
        selector: the subscription.
        partitions: the expansion ``{topic: partition count}`` (sorted by topic).
        epoch: durable lifecycle epoch (>= 1).
        generation: current generation (0 until the first rebalance).
        members: live members by id (insertion order = join order).
        owners: ``(topic, partition) -> member id`` holding it (the union of the members' assignments).
        offsets: committed next offsets ``(topic, partition) -> offset``.
        last_rebalance_ms: monotonic ms of the latest rebalance (0: never).
        last_commit_ms: monotonic ms of the latest successful commit per topic.
    """

    name: str
    selector: Selector
    partitions: dict[str, int]
    epoch: int
    generation: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    owners: dict[TopicPartition, str] = field(default_factory=dict)
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    last_rebalance_ms: int = 0
    last_commit_ms: dict[str, int] = field(default_factory=dict)

    @property
    def state(self) -> str:
        """``Stable`` with members, ``Empty`` without (GROUP_STATUS ``state``)."""
        return "Stable" if self.members else "Empty"

    @property
    def partition_count(self) -> int:
        """Topic-partitions in the expansion."""
        return sum(self.partitions.values())

    def topic_partitions(self) -> list[TopicPartition]:
        """Every topic-partition of the expansion, sorted."""
        return [(t, p) for t in sorted(self.partitions) for p in range(self.partitions[t])]

    def subscribes(self, topic: str) -> bool:
        """Whether ``topic`` is part of the subscription (in the expansion or named by the selector)."""
        return topic in self.partitions or self.selector.matches(topic)

    def committed(self, topic: str, partition: int) -> int | None:
        """The committed next offset, or None when nothing was committed."""
        return self.offsets.get((topic, partition))

    def topic_offsets(self, topic: str) -> dict[int, int]:
        """Committed offsets of one topic ``{partition: offset}``, sorted by partition."""
        return {p: o for (t, p), o in sorted(self.offsets.items()) if t == topic}

    def partitions_of(self, member_id: str, topic: str) -> list[int]:
        """The partitions of ``topic`` that ``member_id`` holds, sorted."""
        member = self.members.get(member_id)
        if member is None:
            return []
        return [p for t, p in member.assignment if t == topic]

    def copy(self) -> Group:
        """An independent copy (members too): what readers see while the original keeps changing."""
        members = {m: Member(x.member_id, x.joined_ms, x.last_heartbeat_ms, x.deadline_ms, x.assignment,
                             x.unconfirmed_client, x.origin, x.generation) for m, x in self.members.items()}
        return Group(self.name, self.selector, dict(self.partitions), self.epoch, self.generation, members,
                     dict(self.owners), dict(self.offsets), self.last_rebalance_ms, dict(self.last_commit_ms))

    def targets(self) -> dict[str, tuple[TopicPartition, ...]]:
        """The target assignment (round-robin over the current members and expansion)."""
        return assign_round_robin(self.members, self.topic_partitions())

    def _rebuild_owners(self) -> None:
        self.owners = {tp: member_id for member_id, member in self.members.items() for tp in member.assignment}

    def rebalance(self, now_ms: int) -> None:
        """Start a new generation: every member must rejoin to learn its assignment in it. Members keep what
        they hold (minus partitions that no longer exist) until they do; a departed member's partitions are
        free for the next joiner whose target has them."""
        self.generation += 1
        self.last_rebalance_ms = now_ms
        valid = set(self.topic_partitions())
        for member in self.members.values():
            member.assignment = tuple(tp for tp in member.assignment if tp in valid)
        self._rebuild_owners()

    def catch_up(self, member_id: str, now_ms: int) -> bool:
        """A join of ``member_id``: its assignment becomes its target minus what other live members hold, in
        the current generation. If it gives up partitions that a member already in the current generation
        is waiting for, the generation bumps first (that member learns it on its next heartbeat). Returns
        whether anything changed (the caller persists the membership)."""
        member = self.members[member_id]
        targets = self.targets()
        target_owner = {tp: owner for owner, tps in targets.items() for tp in tps}
        assignment = tuple(tp for tp in targets.get(member_id, ())
                           if self.owners.get(tp, member_id) == member_id)
        released = set(member.assignment) - set(assignment)
        waiting = any(self.members[target_owner[tp]].generation == self.generation
                      for tp in released if target_owner.get(tp, member_id) != member_id)
        if waiting:
            self.generation += 1
            self.last_rebalance_ms = now_ms
        changed = waiting or assignment != member.assignment or member.generation != self.generation
        member.assignment, member.generation = assignment, self.generation
        self._rebuild_owners()
        return changed


@dataclass(frozen=True, slots=True)
class JoinResult:
    """What :meth:`GroupTable.join` did.

    Attributes:
        group: the group (after the join).
        member_id: the member's full id.
        rebalanced: the membership changed: a new generation started or this member's assignment changed
            (the caller persists the membership).
        resumed: the request carried ``generation=`` and a full id that is kept (facts B5 ``resumed=true``).
    """

    group: Group
    member_id: str
    rebalanced: bool
    resumed: bool


class GroupTable:
    """All consumer groups of one coordinator, plus the deadlines of every member's session.

    Args:
        session_timeout_ms: how long a member lives without a heartbeat (``consumer_session_timeout_ms``).
        rng: source of member-id suffixes (default: the system's secure random source).
    """

    def __init__(self, session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
                 rng: random.Random | None = None) -> None:
        if session_timeout_ms <= 0:
            raise ValueError("session_timeout_ms must be positive")
        self.session_timeout_ms = session_timeout_ms
        self.groups: dict[str, Group] = {}
        #: The last epoch of each deleted group name (a new registration takes a higher one).
        self.tombstones: dict[str, int] = {}
        self._rng = rng or random.SystemRandom()
        # Lazy heap of (deadline_ms, seq, group, member): stale entries are skipped when popped.
        self._deadlines: list[tuple[int, int, str, str]] = []
        self._seq = 0

    # ------------------------------------------------------------------------------------------ lookups

    def get(self, name: str) -> Group:
        """The group ``name``. Raises BrokerError ``group_not_found``."""
        group = self.groups.get(name)
        if group is None:
            raise BrokerError.of("group_not_found", group=name)
        return group

    @staticmethod
    def member(group: Group, member_id: str) -> Member:
        """A live member of ``group``. Raises BrokerError ``member_not_found``."""
        member = group.members.get(member_id)
        if member is None:
            raise BrokerError.of("member_not_found", member=member_id, group=group.name)
        return member

    @staticmethod
    def check_generation(group: Group, member_id: str, generation: int | None) -> None:
        """Raise ``GEN_MISMATCH current= requested= group= member=`` unless ``generation`` is current (None
        passes: HEARTBEAT and LEAVE_GROUP take it as optional, decision 9)."""
        if generation is not None and generation != group.generation:
            raise BrokerError.of("GEN_MISMATCH", current=group.generation, requested=generation,
                                 group=group.name, member=member_id)

    @staticmethod
    def check_topic(group: Group, topic: str) -> None:
        """Raise ``topic_not_assigned_to_group`` unless the group subscribes to ``topic``."""
        if not group.subscribes(topic):
            raise BrokerError.of("topic_not_assigned_to_group", group=group.name, topic=topic,
                                 actual=",".join(group.partitions) or group.selector.describe())

    def active_groups_for(self, topic: str) -> list[Group]:
        """Groups subscribed to ``topic`` that have at least one member (they block topic deletion)."""
        return [g for g in self.groups.values() if g.members and topic in g.partitions]

    # ------------------------------------------------------------------------------------ registration

    def next_epoch(self, name: str) -> int:
        """The epoch a new registration of ``name`` takes: one past its tombstone, else 1."""
        return self.tombstones.get(name, 0) + 1

    def register(self, name: str, selector: Selector, partitions: Mapping[str, int], now_ms: int) -> tuple[Group, bool]:
        """Create ``name`` or change its subscription; returns (group, changed).

        An unchanged selector and expansion is a no-op. A changed expansion of a group with members starts a
        new generation.
        """
        expansion = dict(sorted(partitions.items()))
        group = self.groups.get(name)
        if group is None:
            group = Group(name, selector, expansion, self.next_epoch(name))
            self.groups[name] = group
            self.tombstones.pop(name, None)
            return group, True
        if group.selector == selector and group.partitions == expansion:
            return group, False
        group.selector = selector
        self.set_expansion(group, expansion, now_ms)
        return group, True

    def set_expansion(self, group: Group, partitions: Mapping[str, int], now_ms: int) -> bool:
        """Replace the expansion; rebalance if it changed and the group has members. Returns whether it
        changed. Committed offsets of topics that left the expansion are dropped."""
        expansion = dict(sorted(partitions.items()))
        if expansion == group.partitions:
            return False
        group.partitions = expansion
        group.offsets = {tp: o for tp, o in group.offsets.items() if tp[0] in expansion}
        if group.members:
            group.rebalance(now_ms)
        else:
            group.owners = {}
        return True

    def tombstone(self, name: str) -> int:
        """Delete group ``name`` (it must have no members); returns its last epoch. Raises ``group_not_found``."""
        group = self.get(name)
        assert not group.members, "tombstoning a group with members"
        del self.groups[name]
        self.tombstones[name] = group.epoch
        return group.epoch

    # ------------------------------------------------------------------------------------ membership

    def _new_member_id(self, group: Group, client_id: str) -> str:
        for _ in range(100):
            candidate = f"{client_id}-{self._rng.randrange(10_000):04d}"
            if candidate not in group.members:
                return candidate
        raise BrokerError.of("coordinator_not_available", group=group.name,
                             reason="could not allocate a unique member id")

    def _touch(self, group: Group, member: Member, now_ms: int, *, confirm: bool = True) -> None:
        if confirm:
            member.unconfirmed_client = None
        member.last_heartbeat_ms = now_ms
        member.deadline_ms = now_ms + self.session_timeout_ms
        self._seq += 1
        heapq.heappush(self._deadlines, (member.deadline_ms, self._seq, group.name, member.member_id))

    def join(self, name: str, requested_id: str, now_ms: int, *, topic: str | None = None,
             generation: int | None = None, origin: str | None = None,
             origin_open: Callable[[str], bool] | None = None) -> JoinResult:
        """JOIN_GROUP: add or refresh a member and return its generation and assignment.

        * ``requested_id`` is a current member's full id: the member is refreshed and catches up with the
          current generation (:meth:`Group.catch_up`; a new generation only when it releases partitions a
          caught-up member waits for).
        * no ``generation``, and an unconfirmed member joined with client id ``requested_id`` from the same
          client host as ``origin`` (not None) on a connection that ``origin_open`` says is closed (None:
          treat every earlier connection as closed): a retry of that join; the same member, refreshed,
          caught up.
        * ``generation`` is given and ``requested_id`` looks like a full id (``<client>-NNNN``): the id is kept
          (a member resuming after its session expired or the broker restarted); rebalance.
        * otherwise: a new member ``<requested_id>-NNNN`` (random, unique in the group); rebalance.

        A new member's assignment leaves out partitions other members still hold (the join barrier).

        Raises:
            BrokerError: ``group_not_found``; ``topic_not_assigned_to_group`` when ``topic`` is given and not
                subscribed.
        """
        group = self.get(name)
        if topic is not None:
            self.check_topic(group, topic)
        existing = group.members.get(requested_id)
        if existing is not None:
            self._touch(group, existing, now_ms)
            changed = group.catch_up(requested_id, now_ms)
            return JoinResult(group, requested_id, rebalanced=changed, resumed=generation is not None)
        if generation is None and origin is not None:
            for candidate in group.members.values():
                if (candidate.unconfirmed_client == requested_id and candidate.origin is not None
                        and _host(candidate.origin) == _host(origin)
                        and not (origin_open is not None and origin_open(candidate.origin))):
                    self._touch(group, candidate, now_ms, confirm=False)
                    changed = group.catch_up(candidate.member_id, now_ms)
                    return JoinResult(group, candidate.member_id, rebalanced=changed, resumed=False)
        resumed = generation is not None and FULL_MEMBER_ID.fullmatch(requested_id) is not None
        member_id = requested_id if resumed else self._new_member_id(group, requested_id)
        member = Member(member_id, now_ms, now_ms, now_ms + self.session_timeout_ms,
                        unconfirmed_client=None if resumed else requested_id, origin=origin)
        group.members[member_id] = member
        self._touch(group, member, now_ms, confirm=False)
        group.rebalance(now_ms)
        group.catch_up(member_id, now_ms)
        return JoinResult(group, member_id, rebalanced=True, resumed=resumed)

    def sync(self, name: str, member_id: str, generation: int, now_ms: int) -> Member:
        """SYNC_GROUP: the member (its assignment: what it holds) for ``generation`` (which must be current);
        refreshes the session. Raises ``group_not_found``, ``member_not_found``, ``GEN_MISMATCH``."""
        group = self.get(name)
        member = self.member(group, member_id)
        self.check_generation(group, member_id, generation)
        self._touch(group, member, now_ms)
        return member

    def heartbeat(self, name: str, member_id: str, generation: int | None, now_ms: int) -> Group:
        """HEARTBEAT: extend the member's session. Raises ``group_not_found``, ``member_not_found``,
        ``GEN_MISMATCH`` (when ``generation`` is given and stale: the member must rejoin)."""
        group = self.get(name)
        member = self.member(group, member_id)
        self.check_generation(group, member_id, generation)
        self._touch(group, member, now_ms)
        return group

    def touch(self, name: str, member_id: str, now_ms: int) -> None:
        """Extend ``member_id``'s session and mark it confirmed, if it is a member (else nothing)."""
        group = self.groups.get(name)
        member = group.members.get(member_id) if group is not None else None
        if group is not None and member is not None:
            self._touch(group, member, now_ms)

    def confirm(self, name: str, member_id: str) -> None:
        """The member was heard from under its full id (a commit): a later join is not a retry."""
        group = self.groups.get(name)
        member = group.members.get(member_id) if group is not None else None
        if member is not None:
            member.unconfirmed_client = None

    def restore(self, name: str, group: Group | None, tombstone_epoch: int | None) -> None:
        """Put back ``name``'s state as given (a durable copy after a failed append): the group (None: not
        registered) and its tombstone epoch. Members still present keep their current session."""
        current = self.groups.get(name)
        if group is None:
            self.groups.pop(name, None)
        else:
            for member_id, member in group.members.items():
                live = current.members.get(member_id) if current is not None else None
                if live is not None:
                    member.last_heartbeat_ms, member.deadline_ms = live.last_heartbeat_ms, live.deadline_ms
                    member.unconfirmed_client, member.origin = live.unconfirmed_client, live.origin
            self.groups[name] = group
        if tombstone_epoch is None:
            self.tombstones.pop(name, None)
        else:
            self.tombstones[name] = tombstone_epoch

    def leave(self, name: str, member_id: str, generation: int | None, now_ms: int) -> Group:
        """LEAVE_GROUP: remove the member and rebalance the rest. Raises ``group_not_found``,
        ``member_not_found``, ``GEN_MISMATCH`` (stale ``generation`` when given)."""
        group = self.get(name)
        self.member(group, member_id)
        self.check_generation(group, member_id, generation)
        del group.members[member_id]
        group.rebalance(now_ms)
        return group

    def next_deadline_ms(self) -> int | None:
        """The earliest live session deadline, or None when no group has members."""
        heap = self._deadlines
        while heap:
            deadline, _, name, member_id = heap[0]
            group = self.groups.get(name)
            member = group.members.get(member_id) if group is not None else None
            if member is not None and member.deadline_ms == deadline:
                return deadline
            heapq.heappop(heap)
        return None

    def expire(self, now_ms: int, owns: Callable[[str], bool] | None = None) -> list[tuple[Group, list[str]]]:
        """Remove every member whose session deadline is at or before ``now_ms``; each affected group starts
        a new generation. Returns ``[(group, expired member ids)]``.

        ``owns(group name)`` (default: every group) says which groups this table times: sessions of other
        groups are left to their owner (their deadlines are dropped; :meth:`refresh_sessions` restarts them
        when the group becomes this table's)."""
        expired: dict[str, list[str]] = {}
        heap = self._deadlines
        while heap and heap[0][0] <= now_ms:
            deadline, _, name, member_id = heapq.heappop(heap)
            group = self.groups.get(name)
            member = group.members.get(member_id) if group is not None else None
            if group is None or member is None or member.deadline_ms != deadline:
                continue  # stale entry: the member heartbeated, left, or the group is gone
            if owns is not None and not owns(name):
                continue  # another broker coordinates this group and times its sessions
            del group.members[member_id]
            expired.setdefault(name, []).append(member_id)
        result = []
        for name, member_ids in expired.items():
            group = self.groups[name]
            group.rebalance(now_ms)
            result.append((group, member_ids))
        return result

    def refresh_sessions(self, name: str, now_ms: int, *, only_untracked: bool = False) -> None:
        """Give ``name``'s members a fresh session from ``now_ms`` (this table starts timing the group, e.g.
        its coordination moved here). ``only_untracked``: only members without a pending deadline here
        (members adopted from another broker's records); the others keep theirs."""
        group = self.groups.get(name)
        if group is None:
            return
        tracked = {(n, m, d) for d, _, n, m in self._deadlines} if only_untracked else set()
        for member in group.members.values():
            if (name, member.member_id, member.deadline_ms) not in tracked:
                self._touch(group, member, now_ms, confirm=False)

    def restore_membership(self, group: Group, generation: int, members: Mapping[str, tuple[TopicPartition, ...]],
                           now_ms: int) -> None:
        """Reinstate a persisted generation (broker restart): members get a fresh session from ``now_ms``.

        Assignments are taken as persisted (what each member held), restricted to the current expansion;
        every member is taken to be in ``generation``; owners are rebuilt.
        """
        group.generation = generation
        group.members = {}
        group.owners = {}
        valid = set(group.topic_partitions())
        for member_id, assignment in members.items():
            kept = tuple(tp for tp in assignment if tp in valid and tp not in group.owners)
            member = Member(member_id, now_ms, now_ms, now_ms + self.session_timeout_ms, kept,
                            generation=generation)
            group.members[member_id] = member
            for tp in kept:
                group.owners[tp] = member_id
            self._touch(group, member, now_ms)

    # ------------------------------------------------------------------------------------------ offsets

    def check_commit(self, name: str, topic: str, member_id: str, generation: int,
                     offsets: Mapping[int, int]) -> tuple[Group, dict[int, int]]:
        """Validate a COMMIT_OFFSET / BATCH_COMMIT without applying it; returns (group, changed offsets).

        Checks, in order: group exists (``group_not_found``), topic subscribed (``topic_not_assigned_to_group``),
        partitions exist (``partition_not_found``), member alive (``member_not_found``), ``generation`` is the
        member's generation (``GEN_MISMATCH``: the generation of its latest join, which lags the group's
        until it rejoins; its held partitions stay its own until then), every partition held by the member
        (``NOT_OWNER``), no offset below the committed one (``offset_regression``). ``changed`` omits
        partitions whose offset equals the committed one.
        """
        group = self.get(name)
        self.check_topic(group, topic)
        count = group.partitions.get(topic, 0)
        for partition in offsets:
            if not 0 <= partition < count:
                raise BrokerError.of("partition_not_found", topic=topic, partition=partition, group=name)
        member = self.member(group, member_id)
        if generation != member.generation:
            raise BrokerError.of("GEN_MISMATCH", current=group.generation, requested=generation,
                                 group=group.name, member=member_id)
        for partition in sorted(offsets):
            if group.owners.get((topic, partition)) != member_id:
                raise BrokerError.of("NOT_OWNER", partition=partition, member=member_id, group=name,
                                     generation=group.generation, topic=topic)
        changed: dict[int, int] = {}
        for partition, offset in sorted(offsets.items()):
            current = group.offsets.get((topic, partition))
            if current is not None and offset < current:
                raise BrokerError.of("offset_regression", group=name, topic=topic, partition=partition,
                                     committed=current, requested=offset,
                                     reason="commit_below_committed_offset")
            if current != offset:
                changed[partition] = offset
        return group, changed

    @staticmethod
    def apply_commit(group: Group, topic: str, changed: Mapping[int, int], now_ms: int) -> None:
        """Store offsets validated by :meth:`check_commit`."""
        for partition, offset in changed.items():
            group.offsets[(topic, partition)] = offset
        group.last_commit_ms[topic] = now_ms
