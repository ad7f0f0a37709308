"""The controller: broker liveness from heartbeats, acting only by committing metadata commands.

Every cluster broker commits a :class:`~cursus.metadata.commands.BrokerHeartbeat` every
``broker_heartbeat_interval_ms``. The broker that currently believes it leads Raft also watches the
heartbeats it sees applied; a broker without one for ``broker_session_timeout_ms`` is fenced by committing
:class:`~cursus.metadata.commands.FenceBroker` (inactive, out of every ISR, leaders moved within the ISR by
the pure ``apply``). Believing it leads only decides *who proposes*: a deposed leader's proposal simply
fails to commit, and the fencing itself (epochs, ISR) is the applied command, identical on every node.
A new leader gives every active broker a full timeout of grace, so a failover never fences a live broker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping

from cursus.metadata.apply import ApplyResult
from cursus.metadata.commands import BrokerHeartbeat, Command, FenceBroker
from cursus.metadata.state import BrokerInfo, MetadataState

log = logging.getLogger("cursus.controller")


def overdue(last_seen: Mapping[str, float], active: Iterable[str], now: float, timeout: float) -> list[str]:
    """Active brokers whose last applied heartbeat is older than ``timeout`` seconds (sorted).

    A broker never seen counts as seen at the controller's takeover (the caller seeds ``last_seen``).
    """
    return sorted(b for b in active if now - last_seen.get(b, now) > timeout)


def lease_valid(sent: float | None, now: float, timeout: float, interval: float) -> bool:
    """The read lease: True while this broker's latest applied own heartbeat was *submitted* (``sent``,
    monotonic seconds) less than ``timeout - interval`` seconds before ``now``. The controller fences only
    ``timeout`` after it applied a heartbeat (applied after it was sent), so until then no other broker can
    have been made leader of this broker's partitions. ``None`` (no own heartbeat applied yet): invalid."""
    return sent is not None and now - sent < timeout - interval


class Controller:
    """Heartbeats for ``local`` and, on the Raft leader, fencing of silent brokers.

    Args:
        submit: commits one command (the metadata backend's ``submit``).
        state: the latest applied metadata state.
        is_raft_leader: whether this node believes it leads Raft (proposer choice only).
        local: this broker's registration.
        coordinator_shards: this broker's ``transaction_coordinator_shards``.
        interval: seconds between heartbeats and liveness checks.
        timeout: seconds without a heartbeat before a broker is fenced.
    """

    def __init__(self, submit: Callable[[Command], Awaitable[ApplyResult]], state: Callable[[], MetadataState],
                 is_raft_leader: Callable[[], bool], local: BrokerInfo, coordinator_shards: int,
                 interval: float, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._submit, self._state, self._is_leader = submit, state, is_raft_leader
        self.local, self.coordinator_shards = local, coordinator_shards
        self.interval, self.timeout, self._clock = interval, timeout, clock
        self.last_seen: dict[str, float] = {}
        self._leading = False
        self._task: asyncio.Task[None] | None = None
        #: Own heartbeats submitted and not yet applied here: request id -> monotonic submit time.
        self._sent: dict[str, float] = {}
        #: Submit time of the latest own heartbeat applied here (the read lease's start), or None.
        self.own_heartbeat_sent: float | None = None

    def heartbeat_command(self) -> BrokerHeartbeat:
        command = BrokerHeartbeat(uuid.uuid4().hex, self.local, self.coordinator_shards)
        self._sent[command.request_id] = self._clock()
        while len(self._sent) > 64:  # never applied (lost proposals): drop the oldest
            del self._sent[next(iter(self._sent))]
        return command

    def observe(self, command: Command | None) -> None:
        """Applied-command observer (event loop): remember when each broker's heartbeat was applied."""
        if isinstance(command, BrokerHeartbeat):
            self.last_seen[command.broker.id] = self._clock()
            if command.broker.id == self.local.id:
                sent = self._sent.pop(command.request_id, None)
                if sent is not None and (self.own_heartbeat_sent is None or sent > self.own_heartbeat_sent):
                    self.own_heartbeat_sent = sent

    def lease_valid(self) -> bool:
        """May this broker's leader replicas serve reads (:func:`lease_valid`)? O(1), event loop."""
        return lease_valid(self.own_heartbeat_sent, self._clock(), self.timeout, self.interval)

    async def tick(self) -> list[str]:
        """One round: heartbeat, then (leader only) fence overdue brokers. Returns the brokers fenced."""
        try:
            await self._submit(self.heartbeat_command())
        except Exception as exc:  # no leader yet, commit timeout: the next round tries again
            log.debug("heartbeat not committed: %s", exc)
        if not self._is_leader():
            self._leading = False
            return []
        now = self._clock()
        active = self._state().active_brokers()
        if not self._leading:
            self._leading = True
            self.last_seen = {b: now for b in active}
        fenced = []
        for broker_id in overdue(self.last_seen, active, now, self.timeout):
            try:
                await self._submit(FenceBroker(uuid.uuid4().hex, broker_id))
                fenced.append(broker_id)
                log.warning("broker %s missed its heartbeats: fenced", broker_id)
            except Exception as exc:
                log.warning("fencing broker %s not committed: %s", broker_id, exc)
        return fenced

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            started = self._clock()
            await self.tick()
            await asyncio.sleep(max(0.0, self.interval - (self._clock() - started)))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
