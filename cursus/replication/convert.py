"""Protobuf <-> Python for the replication stream: typed errors, diverging epochs, concatenated chunks.

Pure functions, no I/O. The wire types are :mod:`cursus.internal.v1.replication_pb2`.

The proto's ``DivergingEpoch.end_offset`` is unsigned, so Kafka's undefined answer ``(-1, -1)`` (the leader
knows no epoch <= the follower's) travels as ``epoch = -1, end_offset = 0``; a leader never answers a
defined end offset with an undefined epoch, so ``epoch == -1`` decodes back to ``(-1, -1)`` (the follower
then truncates to its HWM, KIP-279).
"""

from __future__ import annotations

from cursus.internal.v1 import replication_pb2 as pb
from cursus.storage.chunk import decode_header
from cursus.storage.epochs import UNDEFINED, EpochEnd
from cursus.wire.errors import BrokerError, TypedError, classify


def error_to_pb(error: TypedError | BrokerError) -> pb.Error:
    """The wire form of a typed error (code, message, fields)."""
    typed = error.error if isinstance(error, BrokerError) else error
    return pb.Error(code=typed.code, message=typed.message, fields=dict(typed.fields))


def error_from_pb(error: pb.Error) -> TypedError | None:
    """The typed error a ``PartitionData.error`` carries, or None when its code is empty (success). The
    class and retryable flag come from this broker's registry (unknown codes classify as internal)."""
    if not error.code:
        return None
    error_class, retryable = classify(error.code)
    return TypedError(error.code, error_class, retryable, error.message, dict(error.fields))


def epoch_end_to_pb(answer: EpochEnd) -> pb.DivergingEpoch:
    """A leader's OffsetsForLeaderEpoch answer as ``DivergingEpoch`` (undefined: epoch -1, offset 0)."""
    if answer.epoch == UNDEFINED or answer.end_offset == UNDEFINED:
        return pb.DivergingEpoch(epoch=UNDEFINED, end_offset=0)
    return pb.DivergingEpoch(epoch=answer.epoch, end_offset=answer.end_offset)


def epoch_end_from_pb(diverging: pb.DivergingEpoch) -> EpochEnd:
    """The :class:`EpochEnd` a ``DivergingEpoch`` carries (epoch -1: ``(-1, -1)``)."""
    if diverging.epoch < 0:
        return EpochEnd(UNDEFINED, UNDEFINED)
    return EpochEnd(diverging.epoch, diverging.end_offset)


def split_chunks(data: bytes | bytearray | memoryview) -> list[bytes]:
    """Cut ``PartitionData.chunks`` (whole stored chunks, concatenated) into one ``bytes`` per chunk, by
    their CCK2 headers. Only the framing is checked here (the replica verifies CRC and records).

    Raises:
        ValueError: a header is invalid, or a chunk is cut short.
    """
    view = memoryview(data)
    chunks: list[bytes] = []
    position = 0
    while position < len(view):
        header = decode_header(view, position)
        if header is None:
            raise ValueError(f"no valid chunk header at byte {position}")
        end = position + header.size_bytes
        if end > len(view):
            raise ValueError(f"chunk at byte {position} is cut short: it needs {header.size_bytes} bytes, "
                             f"{len(view) - position} left")
        chunks.append(bytes(view[position:end]))
        position = end
    return chunks
