"""Event sourcing (spec "Event Sourcing Commands", "Aggregate replay proof"): sans-IO core.

* :mod:`cursus.eventstore.index`: the per-partition stream index, a derived view of the partition's
  committed log (aggregate key -> ordered ``(version, offset)`` entries), with its checkpoint codec.
* :mod:`cursus.eventstore.snapshots`: the per-partition snapshot store (latest snapshot per key) and its
  append-only, checksummed file format (a torn final record is discarded).
* :mod:`cursus.eventstore.proof`: the aggregate replay proof over index entries.

Nothing here does I/O on its own; :mod:`cursus.broker.events` drives it from the broker.
"""

from cursus.eventstore.index import IndexCheckpointError, StreamEntry, StreamIndex
from cursus.eventstore.proof import ProofResult, replay_proof
from cursus.eventstore.snapshots import Snapshot, SnapshotStore, decode_snapshot_log, encode_snapshot_record

__all__ = [
    "IndexCheckpointError",
    "ProofResult",
    "Snapshot",
    "SnapshotStore",
    "StreamEntry",
    "StreamIndex",
    "decode_snapshot_log",
    "encode_snapshot_record",
    "replay_proof",
]
