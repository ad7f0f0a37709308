"""Helpers for transaction tests over a real broker connection (wire commands, no SDK)."""

from __future__ import annotations

from dataclasses import dataclass

from cursus.client import Consumer
from cursus.client.connection import Connection
from cursus.wire import TXN_CONTROL_MARKER_PAYLOAD, Record, Status, decode_batch
from tests.integration.helpers import error_of, ok_fields, render


@dataclass
class Session:
    """One transactional producer session driven by raw commands."""

    conn: Connection
    tid: str
    producer_id: str = ""
    epoch: int = 0
    seq: int = 0

    def init(self) -> dict[str, str]:
        fields = ok_fields(self.conn.command(f"INIT_PRODUCER_ID transactional_id={self.tid}"))
        self.producer_id, self.epoch, self.seq = fields["producerId"], int(fields["epoch"]), 0
        return fields

    @property
    def ids(self) -> str:
        return f"transactional_id={self.tid} producerId={self.producer_id} epoch={self.epoch}"

    def begin(self) -> dict[str, str]:
        return ok_fields(self.conn.command(f"BEGIN_TXN {self.ids}"))

    def publish(self, topic: str, message: str, *, partition: int = -1, key: str | None = None,
                seq: int | None = None) -> dict[str, str]:
        if seq is None:
            self.seq += 1
            seq = self.seq
        extra = f" key={key}" if key else ""
        return ok_fields(self.conn.command(
            f"TXN_PUBLISH {self.ids} topic={topic} partition={partition} seqNum={seq}{extra} message={message}"))

    def send_offsets(self, topic: str, group: str, member: str, generation: int, offsets: dict[int, int]
                     ) -> dict[str, str]:
        spec = ",".join(f"P{p}:{o}" for p, o in sorted(offsets.items()))
        return ok_fields(self.conn.command(
            f"SEND_OFFSETS_TO_TXN {self.ids} topic={topic} group={group} member={member} generation={generation}"
            f" offsets={spec}"))

    def end(self, result: str = "commit") -> dict[str, str]:
        return ok_fields(self.conn.command(f"END_TXN {self.ids} result={result}"))

    def end_error(self, result: str = "commit") -> str:
        return error_of(self.conn.command(f"END_TXN {self.ids} result={result}")).code

    def status(self) -> dict[str, str]:
        return ok_fields(self.conn.command(f"TXN_STATUS transactional_id={self.tid}"))


def read(conn: Connection, topic: str, partition: int, offset: int = 0, *, isolation: str = "read_committed",
         **fields: object) -> list[Record]:
    """One CONSUME with the given isolation level (records as decoded)."""
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    frame = conn.command(f"CONSUME topic={topic} partition={partition} offset={offset} isolation={isolation} "
                         f"{extra}".strip())
    assert frame.status == Status.OK, render(frame)
    records = decode_batch(frame.payload).records if frame.payload else []
    return _visible(records, isolation)


def _visible(records: list[Record], isolation: str) -> list[Record]:
    """read_committed: a reply may end on a marker (so the client moves past it); clients skip markers by
    payload (facts A6), and so do these helpers."""
    if isolation != "read_committed":
        return records
    return [r for r in records if r.payload != TXN_CONTROL_MARKER_PAYLOAD]


def read_all(conn: Connection, topic: str, partition: int, *, isolation: str = "read_committed") -> list[Record]:
    """Everything readable at this isolation level, from offset 0."""
    out: list[Record] = []
    offset = 0
    while True:
        frame = conn.command(f"CONSUME topic={topic} partition={partition} offset={offset} isolation={isolation}")
        assert frame.status == Status.OK, render(frame)
        if not frame.payload:
            return out
        batch = decode_batch(frame.payload)
        if not batch.records:
            return out
        out.extend(_visible(batch.records, isolation))
        offset = batch.records[-1].offset + 1


def payloads(records: list[Record]) -> list[bytes]:
    return [r.payload for r in records]


def committed_values(bootstrap: str, topic: str) -> list[bytes]:
    """Every committed value of ``topic`` (read_committed, from the earliest offset to the end), in offset order."""
    with Consumer(topic, bootstrap, start="earliest", isolation_level="read_committed") as consumer:
        return [r.value for r in consumer.records(until_end=True)]
