"""Idempotence rules per partition (spec section 9, facts decision 13).

Per (producer id, partition) the broker keeps the producer epoch, the last sequence number and the last
five batches (first seq, last seq, first offset). A batch is checked before anything is appended:

* lower epoch: ``stale_producer_epoch`` (fenced);
* higher epoch: fences the old session and must start at sequence 1;
* an exact repeat of a remembered batch: a duplicate, answered with the offsets first assigned;
* first sequence = last sequence + 1: appended;
* anything else: ``idempotency_gap`` (no append).

The state itself and its persistence live with the log (:mod:`cursus.storage.producer_state`: rebuilt from
the last snapshot plus the chunks after it). The broker's table starts as a copy of the log's state at open
and is updated when a batch is handed to the writer (so pipelined batches from several connections chain
correctly); idle producers are dropped after ``producer_state_ttl_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cursus.storage.producer_state import ProducerState
from cursus.wire.errors import BrokerError


@dataclass(frozen=True, slots=True)
class Duplicate:
    """The batch repeats one already appended at ``first_offset``."""

    first_offset: int


class ProducerStateTable(ProducerState):
    """Producer sequence state of one partition, with the idempotence rules. Loop thread only."""

    @classmethod
    def copy_of(cls, state: ProducerState) -> ProducerStateTable:
        """A table starting from a (deep) copy of ``state`` (the log's state at open)."""
        table = cls(state.ttl_ms)
        table.entries = state.copy_entries()
        return table

    def check(self, producer_id: str, epoch: int, first_seq: int, last_seq: int, now_ms: int) -> Duplicate | None:
        """Validate a batch against the state; return :class:`Duplicate` or None (append it).

        Raises:
            BrokerError: ``stale_producer_epoch`` or ``idempotency_gap``; ``invalid_seq_num`` when
                ``first_seq < 1`` or ``last_seq < first_seq``.
        """
        if first_seq < 1 or last_seq < first_seq:
            raise BrokerError.of("invalid_seq_num", producer=producer_id, seq_start=first_seq, seq_end=last_seq)
        entry = self.entries.get(producer_id)
        if entry is not None and now_ms - entry.last_active_ms > self.ttl_ms:
            del self.entries[producer_id]
            entry = None
        if entry is None or epoch > entry.epoch:
            if first_seq != 1:
                raise BrokerError.of(
                    "idempotency_gap", producer=producer_id, epoch=epoch, expected=1, got=first_seq,
                    reason="a new producer session must start at seqNum=1",
                )
            return None
        if epoch < entry.epoch:
            raise BrokerError.of("stale_producer_epoch", producer=producer_id, current=entry.epoch, got=epoch)
        for b_first, b_last, b_offset in entry.batches:
            if b_first == first_seq and b_last == last_seq:
                entry.last_active_ms = now_ms
                return Duplicate(b_offset)
        if first_seq != entry.last_seq + 1:
            raise BrokerError.of(
                "idempotency_gap", producer=producer_id, epoch=epoch, expected=entry.last_seq + 1, got=first_seq,
            )
        return None
