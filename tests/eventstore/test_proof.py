"""Aggregate replay proof (sans-IO): success and each failure code."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cursus.eventstore import StreamEntry, replay_proof


def entries(n: int, start_offset: int = 0) -> list[StreamEntry]:
    return [StreamEntry(v, start_offset + 2 * v, f"e{v}", f"d{v}") for v in range(1, n + 1)]


def proof(es: list[StreamEntry], log_start: int = 0, hwm: int = 10_000, expected: int | None = None):
    return replay_proof("t", "m", 0, es, log_start_offset=log_start, proof_hwm=hwm, expected_last_sequence=expected)


@given(st.integers(1, 50))
def test_complete_sequence_proves(n: int) -> None:
    result = proof(entries(n), expected=n)
    assert result.ok
    p = result.proof
    assert (p["first_sequence"], p["last_sequence"], p["event_count"]) == (1, n, n)
    assert p["first_event_id"] == "e1" and p["last_event_id"] == f"e{n}" and p["proof_hwm"] == 10_000
    assert p["first_offset"] == 2 and p["last_offset"] == 2 * n


def test_retention_gap() -> None:
    assert proof(entries(5), log_start=5).code == "aggregate_proof_retention_gap"
    assert proof(entries(5), log_start=100).code == "aggregate_proof_retention_gap"


@given(st.integers(3, 30), st.data())
def test_sequence_gap(n: int, data: st.DataObject) -> None:
    es = entries(n)
    missing = data.draw(st.integers(1, n - 2))  # not the first (that is a retention gap question), not last
    del es[missing]
    assert proof(es).code == "aggregate_proof_sequence_gap"
    assert proof(entries(n), expected=n + 1).code == "aggregate_proof_sequence_gap"


def test_identity_conflict() -> None:
    es = entries(3) + [StreamEntry(3, 100, "other", "d3")]
    assert proof(es).code == "aggregate_proof_identity_conflict"
    assert proof([StreamEntry(1, 0, None, None)]).code == "aggregate_proof_identity_conflict"
    same = entries(3) + [StreamEntry(3, 100, "e3", "d3")]
    assert proof(same).ok  # an identical duplicate is the same event


def test_unavailable_without_events_and_hwm_bounds() -> None:
    assert proof([]).code == "aggregate_proof_proof_unavailable"
    # entries at or above the proof HWM are not part of the proof
    assert proof(entries(4), hwm=7).proof["last_sequence"] == 3  # offsets 2, 4, 6 (8 is above)
