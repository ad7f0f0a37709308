"""Producer state after kill -9 with many segments: rebuilt from the last roll snapshot, dedup intact."""

from __future__ import annotations

import re

import pytest

from tests.integration.conftest import connect
from tests.integration.helpers import ack_of, create_topic, error_of, publish_batch

pytestmark = pytest.mark.timeout(120)


def test_kill9_with_many_segments_rebuilds_from_the_tail_and_still_dedups(broker_factory):
    broker = broker_factory(settings={"log_segment_bytes": 4096}).start()
    acks = {}
    with connect(broker) as conn:
        create_topic(conn, "idem", partitions=1)
        for n in range(1, 121):  # 120 batches of 3 records, two producers: dozens of 4 KiB segments
            producer = f"p{n % 2}"
            seq = 1 + 3 * ((n - 1) // 2)
            acks[(producer, seq)] = ack_of(publish_batch(
                conn, "idem", 0, [b"x" * 100] * 3, acks="all", producer=(producer, 1, seq), idempotent=True))
    segments = sorted((broker.log_dir / "topics" / "idem" / "0").glob("*.log"))
    assert len(segments) > 10
    broker.restart(kill=True)
    replay = re.findall(r"producer state from the snapshot at offset (\d+) plus (\d+) chunks", broker.output())
    assert replay, broker.output()[-2000:]
    snapshot_offset, chunks = (int(v) for v in replay[-1])
    assert snapshot_offset > 0 and chunks < 20  # the last segment only, not the 120 chunks of the log
    with connect(broker) as conn:
        # The last batch of each producer is a duplicate, answered with its first offsets...
        for producer, seq in (("p0", 178), ("p1", 178)):
            dup = ack_of(publish_batch(conn, "idem", 0, [b"x" * 100] * 3, acks="all",
                                       producer=(producer, 1, seq), idempotent=True))
            assert dup["last_offset"] == acks[(producer, seq)]["last_offset"]
        # ... and the sequence continues where it stopped.
        gap = error_of(publish_batch(conn, "idem", 0, [b"y"], acks="all", producer=("p0", 1, 190), idempotent=True))
        assert gap.code == "idempotency_gap"
        ok = ack_of(publish_batch(conn, "idem", 0, [b"y"], acks="all", producer=("p0", 1, 181), idempotent=True))
        assert ok["last_offset"] == 360
