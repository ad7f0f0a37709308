"""``partition_for_txn_record``: the TXN_PUBLISH partition=-1 rule (docs/transactions.md "Partition choice")."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cursus.partitioning import fnv1a_64, partition_for_txn_record


@given(st.text(max_size=40), st.text(min_size=1, max_size=40), st.integers(1, 2**64 - 1), st.integers(1, 1024))
def test_pure_and_in_range(producer_id: str, topic: str, seq: int, partitions: int) -> None:
    p = partition_for_txn_record(producer_id, topic, seq, partitions)
    assert 0 <= p < partitions
    assert p == partition_for_txn_record(producer_id, topic, seq, partitions)
    assert p == fnv1a_64(f"{producer_id}\0{topic}\0{seq}".encode()) % partitions


def test_distinct_seqnums_spread_over_the_partitions() -> None:
    counts = [0] * 4
    for seq in range(1, 4001):
        counts[partition_for_txn_record("17", "orders", seq, 4)] += 1
    assert min(counts) > 800  # about 1000 each
