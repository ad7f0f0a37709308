"""The leader-epoch history of a partition log (KIP-101/279), as pure functions on lists.

The history is ``[(epoch, start_offset), ...]``: epochs strictly increase and start offsets never
decrease; ``start_offset`` is the offset of the first chunk appended in that epoch. It is what Kafka keeps
in ``leader-epoch-checkpoint``; here it lives in ``checkpoints.json`` (see :mod:`cursus.storage.checkpoint`)
and every chunk header carries its epoch too, so recovery can rebuild the history from the chunks.

``UNDEFINED`` (-1) is Kafka's ``UNDEFINED_EPOCH`` / ``UNDEFINED_EPOCH_OFFSET``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

#: Kafka's UNDEFINED_EPOCH and UNDEFINED_EPOCH_OFFSET.
UNDEFINED = -1

Epochs = Sequence[tuple[int, int]]


class EpochEnd(NamedTuple):
    """An OffsetsForLeaderEpoch answer: the largest known epoch <= the requested one, and its end offset
    (the start offset of the next epoch, or the LEO). ``(UNDEFINED, UNDEFINED)`` when unknown."""

    epoch: int
    end_offset: int


def end_offset_for_epoch(epochs: Epochs, requested: int, log_end_offset: int) -> EpochEnd:
    """Kafka's ``LeaderEpochFileCache.endOffsetFor``.

    * ``requested`` is the latest epoch: ``(requested, log_end_offset)``;
    * ``requested`` is above every known epoch (or undefined, or the history is empty): undefined;
    * ``requested`` is below every known epoch: ``(requested, start of the first epoch)``;
    * otherwise: ``(largest epoch <= requested, start of the first epoch > requested)``.
    """
    if requested == UNDEFINED or not epochs:
        return EpochEnd(UNDEFINED, UNDEFINED)
    if epochs[-1][0] == requested:
        return EpochEnd(requested, log_end_offset)
    higher = next(((epoch, start) for epoch, start in epochs if epoch > requested), None)
    if higher is None:
        return EpochEnd(UNDEFINED, UNDEFINED)
    floor = [epoch for epoch, _ in epochs if epoch <= requested]
    return EpochEnd(floor[-1] if floor else requested, higher[1])


def truncate_from_end(epochs: Epochs, end_offset: int) -> list[tuple[int, int]]:
    """The history after the log is cut at ``end_offset``: epochs starting at or after it are dropped."""
    return [(epoch, start) for epoch, start in epochs if start < end_offset]


def truncate_from_start(epochs: Epochs, start_offset: int) -> list[tuple[int, int]]:
    """The history after the log start moves up to ``start_offset`` (retention): epochs that start below
    it are dropped, except the latest of them, which now starts at ``start_offset``."""
    below = [(epoch, start) for epoch, start in epochs if start < start_offset]
    kept = [(epoch, start) for epoch, start in epochs if start >= start_offset]
    if below and (not kept or kept[0][1] > start_offset):
        kept.insert(0, (below[-1][0], start_offset))
    return kept


def rebuild(checkpointed: Epochs, observed_from: int | None, observed: Epochs,
            end_offset: int) -> list[tuple[int, int]]:
    """The history after recovery, from the checkpoint and the epochs read in chunk headers.

    Args:
        checkpointed: the history in ``checkpoints.json`` (it covers every chunk below its recovery point).
        observed_from: the offset from which chunk headers were validated (``None``: none were).
        observed: ``(epoch, base_offset)`` of the first validated chunk and of each chunk whose epoch
            differs from the one before it.
        end_offset: the end of valid data.

    The chunks are the truth at and above ``observed_from``: a checkpoint that is behind (a new epoch's
    first chunk was written, its checkpoint was not) is completed from them. A checkpointed epoch that
    starts exactly at ``end_offset`` (begun by a reset, no chunk yet) is kept.

    Raises:
        ValueError: an observed epoch is below the checkpointed epoch before it (the lineage is broken).
    """
    if observed_from is None:
        return [(epoch, start) for epoch, start in checkpointed if start <= end_offset]
    history = [(epoch, start) for epoch, start in checkpointed if start < observed_from]
    for epoch, start in observed:
        if history and epoch == history[-1][0]:
            continue
        if history and epoch < history[-1][0]:
            raise ValueError(f"chunk at offset {start} has leader epoch {epoch}, below epoch {history[-1][0]} "
                             f"that starts at offset {history[-1][1]}")
        history.append((epoch, start))
    for epoch, start in checkpointed:
        if start == end_offset >= observed_from and (not history or epoch > history[-1][0]):
            history.append((epoch, start))
    return history


def truncation_offset(local: Epochs, local_end_offset: int, leader_answer: EpochEnd,
                      hwm: int) -> tuple[int, bool]:
    """Where a follower truncates after the leader answered OffsetsForLeaderEpoch (KIP-279), and whether
    truncation is complete (else ask again with the largest local epoch below the answer).

    Kafka's ``AbstractFetcherThread.getOffsetTruncationState``: an undefined answer truncates to the HWM;
    an epoch the follower also has truncates to the smaller end offset; an epoch the follower does not have
    truncates to the end of the follower's largest epoch below it, and is not complete.
    """
    if leader_answer.end_offset == UNDEFINED:
        return min(hwm, local_end_offset), True
    if leader_answer.epoch == UNDEFINED:
        return min(leader_answer.end_offset, local_end_offset), True
    follower = end_offset_for_epoch(local, leader_answer.epoch, local_end_offset)
    if follower.end_offset == UNDEFINED:
        return min(hwm, local_end_offset), True
    if follower.epoch != leader_answer.epoch:
        return min(follower.end_offset, local_end_offset), False
    return min(follower.end_offset, leader_answer.end_offset, local_end_offset), True
