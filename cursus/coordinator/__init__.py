"""Consumer-group coordination: membership, generations, assignment and committed offsets.

Five modules (see ``docs/groups.md``); none imports :mod:`cursus.broker`:

* :mod:`cursus.coordinator.groups`: the group state machine as plain data. No I/O, no clock, no event loop:
  every operation takes ``now_ms`` and returns what changed, so it is unit- and property-tested directly, and
  it is what a replicated state machine applies.
* :mod:`cursus.coordinator.offsets`: the durable records (registrations, tombstones, offset snapshots,
  memberships), their strict codec and the latest-record bookkeeping of replay.
* :mod:`cursus.coordinator.offsets_compaction`: the group-aware log-cleaner planner of ``__consumer_offsets``
  (pure: which records a cleaner pass keeps so that replay gives the same state).
* :mod:`cursus.coordinator.ports`: what the coordinator needs from its host: a
  :class:`~cursus.coordinator.ports.GroupLog` (append, await durability, replay), topic definitions, partition
  offsets, readiness reporting, a timer and clocks. The standalone log is :mod:`cursus.broker.group_log`.
* :mod:`cursus.coordinator.service`: :class:`~cursus.coordinator.service.GroupCoordinator`: staged state
  validated and appended in log order, durable copies for readers, the session-expiry timer, topic lifecycle
  hooks.
"""
