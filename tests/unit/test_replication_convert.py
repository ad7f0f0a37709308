"""pb <-> Python helpers of the replication stream."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.internal.v1 import replication_pb2 as pb
from cursus.replication.convert import (
    epoch_end_from_pb,
    epoch_end_to_pb,
    error_from_pb,
    error_to_pb,
    split_chunks,
)
from cursus.storage.chunk import encode_header
from cursus.storage.epochs import UNDEFINED, EpochEnd
from cursus.wire.errors import BrokerError, ErrorClass


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**63 - 1))
def test_defined_epoch_ends_round_trip(epoch: int, end_offset: int) -> None:
    answer = EpochEnd(epoch, end_offset)
    wire = pb.DivergingEpoch.FromString(epoch_end_to_pb(answer).SerializeToString())
    assert epoch_end_from_pb(wire) == answer


def test_the_undefined_answer_survives_the_unsigned_end_offset() -> None:
    wire = epoch_end_to_pb(EpochEnd(UNDEFINED, UNDEFINED))
    assert (wire.epoch, wire.end_offset) == (-1, 0)
    assert epoch_end_from_pb(wire) == EpochEnd(UNDEFINED, UNDEFINED)


def test_typed_errors_round_trip_with_their_class() -> None:
    wire = error_to_pb(BrokerError.of("STALE_LEADER_EPOCH", current=3, requested=2))
    typed = error_from_pb(pb.Error.FromString(wire.SerializeToString()))
    assert typed is not None and typed.code == "STALE_LEADER_EPOCH" and typed.error_class is ErrorClass.FENCING
    assert dict(typed.fields) == {"current": "3", "requested": "2"}
    assert error_from_pb(pb.Error()) is None


def _chunk(base: int, body: bytes) -> bytes:
    return encode_header(base, 1, body, 0, 1) + body


def test_split_chunks_cuts_by_header_and_refuses_bad_framing() -> None:
    one, two = _chunk(0, b"\x00\x00\x00\x01a"), _chunk(1, b"\x00\x00\x00\x02bc")
    assert split_chunks(one + two) == [one, two]
    assert split_chunks(b"") == []
    with pytest.raises(ValueError, match="cut short"):
        split_chunks(one + two[:-1])
    with pytest.raises(ValueError, match="no valid chunk header"):
        split_chunks(one + b"\x00" * 40)
