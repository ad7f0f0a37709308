"""The CONSUME reply header's sequence span (facts B3.1) from a records section: records of one length take
the last record's place from the stride, others are walked; both give the first and last record's
producer sequence (0 without a producer)."""

from __future__ import annotations

import pytest

from cursus.broker.handlers.fetch import _seq_span
from cursus.storage.chunk import uniform_stride
from cursus.wire import Batch, Record, encode_batch, scan_batch


def _section(sizes: list[int], *, producer: bool = True) -> tuple[bytes, int]:
    records = [Record("orders", 0, b"v" * size, **({"producer_id": "p", "seq_num": 10 + i, "producer_epoch": 3}
                                                   if producer else {}))
               for i, size in enumerate(sizes)]
    raw = encode_batch(Batch("orders", 0, "1", records))
    return raw[scan_batch(raw).records_offset:], len(records)


@pytest.mark.parametrize("sizes", [[100] * 500, [100, 101] * 40, [7], [0, 0], [5, 5, 5, 9], [9, 5, 5, 5]])
def test_seq_span_is_the_first_and_last_sequence(sizes: list[int]) -> None:
    section, count = _section(sizes)
    assert _seq_span(section, count) == (10, 10 + count - 1)
    assert bool(uniform_stride(section, count)) == (count > 1 and len(set(sizes)) == 1)


def test_seq_span_without_producer_and_empty() -> None:
    section, count = _section([100] * 50, producer=False)
    assert _seq_span(section, count) == (0, 0)
    assert _seq_span(b"", 0) == (0, 0)
