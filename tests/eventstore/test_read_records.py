"""READ_STREAM's record gather over a real partition log: any set of offsets, dense or sparse, comes back
as exactly those stored records, in order, within the byte budget."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from cursus.broker.eventstore import read_records
from cursus.storage import PartitionLog
from tests.unit.test_storage_support import append_records, records_section, small_config, split_section


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=12), st.data())
def test_read_records_returns_exactly_the_wanted_records(chunks: list[int], data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = PartitionLog.open(Path(tmp), small_config(), clean_shutdown=False)
        try:
            records = append_records(log, chunks)
            log.flush()
            total = len(records)
            offsets = sorted(data.draw(st.sets(st.integers(0, total - 1), min_size=1)))
            section, count = read_records(log, offsets, 1 << 30)
            assert count == len(offsets)
            assert split_section(section) == [records[o] for o in offsets]
            budget = data.draw(st.integers(1, 400))
            section, count = read_records(log, offsets, budget)
            got = split_section(section)
            assert 1 <= count == len(got) <= len(offsets)
            assert got == [records[o] for o in offsets[:count]]
            assert count == 1 or len(records_section(got)) <= budget
        finally:
            log.close()
