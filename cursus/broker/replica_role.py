"""The role state machine of a partition replica, as a table. Pure: no I/O, no asyncio.

States::

    OPENED    recovered from disk; no role yet (nothing may be appended, nothing is served)
    LEADER    appends client batches, stamped with its leader epoch; HWM = min durable end over the ISR
    FOLLOWER  refuses client appends; appends the leader's chunks as stored; learns the HWM from the leader
    FENCED    a write or fsync failed: terminal until the broker restarts (the log is reopened)
    DELETED   the topic was deleted: terminal

Events: ``BECOME_LEADER`` and ``BECOME_FOLLOWER`` come from metadata with a leader epoch; ``FENCE`` from the
storage writer; ``DELETE`` from metadata. A role change needs a leader epoch at least the current one
(:func:`check_epoch`); re-applying the current role at the current epoch is a no-op.
"""

from __future__ import annotations

from enum import Enum
from types import MappingProxyType


class Role(Enum):
    OPENED = "opened"
    LEADER = "leader"
    FOLLOWER = "follower"
    FENCED = "fenced"
    DELETED = "deleted"


class Event(Enum):
    BECOME_LEADER = "become_leader"
    BECOME_FOLLOWER = "become_follower"
    FENCE = "fence"
    DELETE = "delete"


#: (state, event) -> next state. A pair missing from the table is refused.
TRANSITIONS: MappingProxyType[tuple[Role, Event], Role] = MappingProxyType({
    (Role.OPENED, Event.BECOME_LEADER): Role.LEADER,
    (Role.OPENED, Event.BECOME_FOLLOWER): Role.FOLLOWER,
    (Role.OPENED, Event.FENCE): Role.FENCED,
    (Role.OPENED, Event.DELETE): Role.DELETED,
    (Role.LEADER, Event.BECOME_LEADER): Role.LEADER,        # a new epoch (ISR or election), or a retry
    (Role.LEADER, Event.BECOME_FOLLOWER): Role.FOLLOWER,
    (Role.LEADER, Event.FENCE): Role.FENCED,
    (Role.LEADER, Event.DELETE): Role.DELETED,
    (Role.FOLLOWER, Event.BECOME_LEADER): Role.LEADER,
    (Role.FOLLOWER, Event.BECOME_FOLLOWER): Role.FOLLOWER,  # a new leader, or a retry
    (Role.FOLLOWER, Event.FENCE): Role.FENCED,
    (Role.FOLLOWER, Event.DELETE): Role.DELETED,
    (Role.FENCED, Event.FENCE): Role.FENCED,
    (Role.FENCED, Event.DELETE): Role.DELETED,
    (Role.DELETED, Event.DELETE): Role.DELETED,
})


class TransitionRefused(Exception):
    """A role change the state machine does not allow (a programmer or metadata error).

    Attributes:
        state: the current state; event: the refused event; reason: why.
    """

    def __init__(self, state: Role, event: Event, reason: str) -> None:
        self.state = state
        self.event = event
        self.reason = reason
        super().__init__(f"{event.value} refused in state {state.value}: {reason}")


def next_role(state: Role, event: Event) -> Role:
    """The state after ``event``.

    Raises:
        TransitionRefused: ``(state, event)`` is not in :data:`TRANSITIONS`.
    """
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise TransitionRefused(state, event, "not an allowed transition") from None


def check_epoch(state: Role, event: Event, current_epoch: int, new_epoch: int) -> bool:
    """Whether a role change at ``new_epoch`` changes anything (``False``: an idempotent retry).

    Raises:
        TransitionRefused: the transition is not allowed, ``new_epoch`` is below ``current_epoch``, or the
            role changes without a new epoch (a leader epoch names one leader).
    """
    target = next_role(state, event)
    if new_epoch < current_epoch:
        raise TransitionRefused(state, event, f"leader epoch {new_epoch} is below the current {current_epoch}")
    if new_epoch == current_epoch and state is not Role.OPENED:
        if target is state:
            return False
        raise TransitionRefused(state, event, f"the role changes but the leader epoch stays {new_epoch}")
    return True
