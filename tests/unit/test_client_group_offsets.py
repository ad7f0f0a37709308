"""Group lag is computed from the partition leaders' LIST_OFFSETS, not the coordinator's local replica
(break-it finding 5a)."""

from __future__ import annotations

from cursus.client.admin import PartitionOffsets, merge_group_offsets


def _status(*rows: tuple[str, int, int | None, int]) -> dict:
    return {"offsets": [{"topic": t, "partition": p, "committed_offset": c, "log_end_offset": end,
                         "lag": max(0, end - (c or 0)), "owner": "m-1" if p == 0 else None}
                        for t, p, c, end in rows]}


def test_leader_hwm_replaces_the_coordinators_stale_log_end():
    # the coordinator's replica is a follower 40 records behind (or holds no replica: log end 0)
    status = _status(("orders", 0, 10, 60), ("orders", 1, None, 0), ("audit", 0, 5, 5))
    bounds = {"orders": [PartitionOffsets(0, 0, 100, 100, 100), PartitionOffsets(1, 20, 70, 70, 70)],
              "audit": [PartitionOffsets(0, 0, 9, 9, 9)]}
    rows = {(r.topic, r.partition): r for r in merge_group_offsets(status, bounds)}
    assert (rows["orders", 0].log_end, rows["orders", 0].lag, rows["orders", 0].owner) == (100, 90, "m-1")
    assert (rows["orders", 1].log_end, rows["orders", 1].lag) == (70, 50)  # nothing committed: from log start
    assert (rows["audit", 0].log_end, rows["audit", 0].lag) == (9, 4)
    assert [(r.topic, r.partition) for r in merge_group_offsets(status, bounds)] == \
        [("audit", 0), ("orders", 0), ("orders", 1)]


def test_lag_is_never_negative_and_missing_bounds_keep_the_coordinators_figures():
    status = _status(("orders", 0, 80, 80), ("orders", 1, 3, 7))
    rows = merge_group_offsets(status, {"orders": [PartitionOffsets(0, 0, 50, 50, 50)]})
    assert (rows[0].log_end, rows[0].lag) == (50, 0)
    assert (rows[1].log_end, rows[1].lag) == (7, 4)
