"""Key-to-partition routing shared by the broker and the SDK (facts decision 12, spec section 8).

``hash_key`` topics route keyed records by FNV-1a 64-bit of the key's UTF-8 bytes modulo the partition
count; unkeyed records (and every record of a ``round_robin`` topic) go round-robin.
"""

from __future__ import annotations

FNV64_OFFSET_BASIS = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_MASK64 = 0xFFFFFFFFFFFFFFFF


def fnv1a_64(data: bytes) -> int:
    """FNV-1a 64-bit hash of ``data`` (unsigned)."""
    h = FNV64_OFFSET_BASIS
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & _MASK64
    return h


def partition_for_key(key: str | bytes, partitions: int) -> int:
    """The partition a keyed record goes to on a ``hash_key`` topic with ``partitions`` partitions."""
    assert partitions > 0
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return fnv1a_64(raw) % partitions


def partition_for_txn_record(producer_id: str, topic: str, seq_num: int, partitions: int) -> int:
    """The partition of a transactional record the broker places itself (TXN_PUBLISH partition=-1 with no key
    on a ``hash_key`` topic, or any record of a ``round_robin`` topic): FNV-1a 64 of
    ``<producer_id> NUL <topic> NUL <seq_num decimal>`` (UTF-8) modulo ``partitions``.

    A pure function of the record's identity, so every coordinator (after a failover) and every retry of the
    same (producer id, topic, seqNum) picks the same partition, where the seqNum deduplicates it
    (docs/transactions.md "Partition choice"). Spreads distinct seqNums over the partitions like round-robin.
    """
    assert partitions > 0
    return fnv1a_64(f"{producer_id}\0{topic}\0{seq_num}".encode()) % partitions
