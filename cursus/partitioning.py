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
