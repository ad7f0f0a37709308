"""Aggregate replay proof (spec "Aggregate replay proof"), sans-IO.

:func:`replay_proof` checks that the committed, retained entries of one aggregate hold exactly the
sequences (versions) 1..last, each with an event id and payload digest, and returns the proof JSON. A
failure carries one of the spec's codes and the same diagnostic proof document:

* ``aggregate_proof_retention_gap``: retention removed the first events (first retained sequence > 1);
* ``aggregate_proof_sequence_gap``: a sequence is missing, out of order, or the last sequence is not the
  ``expected_last_sequence`` the caller named;
* ``aggregate_proof_identity_conflict``: one sequence is stored with two identities (event id or digest),
  or an event has no identity;
* ``aggregate_proof_proof_unavailable``: the aggregate has no retained events (nothing to prove).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cursus.eventstore.index import StreamEntry


@dataclass(frozen=True, slots=True)
class ProofResult:
    """``code`` is None on success, else the failure code; ``proof`` is the proof (or diagnostic) JSON."""

    code: str | None
    proof: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.code is None


def replay_proof(topic: str, match_id: str, partition: int, entries: Sequence[StreamEntry], *,
                 log_start_offset: int, proof_hwm: int, expected_last_sequence: int | None = None) -> ProofResult:
    """The replay proof of ``entries`` (one aggregate's committed entries, offset order, all below
    ``proof_hwm``); entries below ``log_start_offset`` are no longer retained."""
    retained = [e for e in entries if e.offset >= log_start_offset and e.offset < proof_hwm]
    proof: dict[str, Any] = {
        "topic": topic, "match_id": match_id, "partition": partition, "proof_hwm": proof_hwm,
        "log_start_offset": log_start_offset, "event_count": len(retained),
    }
    if expected_last_sequence is not None:
        proof["expected_last_sequence"] = expected_last_sequence
    if retained:
        first, last = retained[0], retained[-1]
        proof.update({
            "first_sequence": first.version, "last_sequence": last.version,
            "first_offset": first.offset, "last_offset": last.offset,
            "first_event_id": first.event_id or "", "last_event_id": last.event_id or "",
        })
    if not retained:
        proof["reason"] = "no retained events" if not entries else "every event is below the log start"
        code = "aggregate_proof_retention_gap" if entries else "aggregate_proof_proof_unavailable"
        return ProofResult(code, proof)
    seen: dict[int, tuple[str | None, str | None]] = {}
    for e in retained:
        identity = (e.event_id, e.digest)
        if e.event_id is None or e.digest is None:
            proof.update(reason="event without identity", sequence=e.version, offset=e.offset)
            return ProofResult("aggregate_proof_identity_conflict", proof)
        if e.version in seen and seen[e.version] != identity:
            proof.update(reason="sequence stored with two identities", sequence=e.version, offset=e.offset)
            return ProofResult("aggregate_proof_identity_conflict", proof)
        seen[e.version] = identity
    if retained[0].version > 1:
        proof["reason"] = "retention removed the first sequences"
        return ProofResult("aggregate_proof_retention_gap", proof)
    expected = 1
    for e in retained:
        if e.version == expected - 1 and e.version in seen:
            continue  # an identical duplicate of the previous sequence
        if e.version != expected:
            proof.update(reason="sequence gap", expected_sequence=expected, sequence=e.version, offset=e.offset)
            return ProofResult("aggregate_proof_sequence_gap", proof)
        expected += 1
    if expected_last_sequence is not None and expected - 1 != expected_last_sequence:
        proof["reason"] = "last sequence differs from expected_last_sequence"
        return ProofResult("aggregate_proof_sequence_gap", proof)
    return ProofResult(None, proof)
