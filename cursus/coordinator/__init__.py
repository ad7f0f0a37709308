"""Consumer-group coordination: membership, generations, assignment and committed offsets.

Three layers (see ``docs/groups.md``):

* :mod:`cursus.coordinator.groups`: the group state machine as plain data. No I/O, no clock, no event loop:
  every operation takes ``now_ms`` and returns what changed, so it is unit- and property-tested directly.
* :mod:`cursus.coordinator.offsets`: the durable records (registrations, tombstones, offset snapshots,
  memberships) in the internal ``__consumer_offsets`` topic, their strict codec, replay and compaction.
* :mod:`cursus.coordinator.service`: :class:`~cursus.coordinator.service.GroupCoordinator`, which ties the two
  to a :class:`~cursus.broker.core.Broker`: persist before acknowledging, the session-expiry timer, topic
  lifecycle hooks.
"""
