"""The transactional workload: one transactional producer and its read_committed reads.

Process ``txn-0`` runs transactions on its own topic ``chaos-txn`` (created by the worker, so the other
workloads and the final drain never see its values): ``INIT_PRODUCER_ID`` (one epoch per transaction),
``BEGIN_TXN``, 1-3 ``TXN_PUBLISH`` of unique values (``txn-0:<n>``) to random partitions, then ``END_TXN``
commit (70%) or abort. Requests go to the id's coordinator (``FIND_COORDINATOR transactional_id=``,
re-resolved after ``NOT_COORDINATOR`` or a lost connection). History operations:

* ``txn`` (invoked when END_TXN is sent): value ``{tid, epoch, topic, values, result}`` (every value whose
  TXN_PUBLISH was sent, acknowledged or not); ``ok`` result ``{state}``; ``fail`` = the coordinator refused
  before deciding (fenced, not open: nothing of it may become visible); ``info`` = unknown (an END_TXN
  retried with the same epoch for :data:`RETRY_WINDOW_S` that never answered);
* ``txn-read``: a ``CONSUME isolation=read_committed`` of one partition: value ``{topic, partition, offset,
  final}``, result ``records: [[offset, value, key], ...]`` (markers dropped). After the run the worker reads
  every partition in full (``final: true``), retrying until the LSO has passed every committed value.

:func:`chaos.checkers.check_txn_reads` checks them.
"""

from __future__ import annotations

import time
from typing import Any

from chaos.history import FAIL, INFO, OK
from chaos.nodes import Node
from chaos.workloads import TRANSPORT_ERRORS, Context, Worker, decode_records, describe, error_text
from cursus.client.connection import ok_text_fields
from cursus.wire import (
    TXN_CONTROL_MARKER_PAYLOAD,
    Frame,
    Status,
    decode_error,
    encode_crq2,
    parse_command_text,
)

TOPIC = "chaos-txn"
PARTITIONS = 2
ABORT_P = 0.3
RETRY_WINDOW_S = 20.0
FINAL_READ_S = 20.0
#: END_TXN refusals that leave the transaction certainly undecided-then-aborted (never committed).
DEFINITE = frozenset({"producer_fenced", "invalid_epoch", "transaction_not_open", "transaction_not_found",
                      "transaction_aborted"})
_MARKER = TXN_CONTROL_MARKER_PAYLOAD.decode()


class TxnWorker(Worker):
    """See the module docstring."""

    def __init__(self, name: str, ctx: Context) -> None:
        super().__init__(name, ctx)
        self.tid = f"chaos-{name}"
        self.producer_id = ""
        self.epoch = 0
        self.count = 0
        self.seq = 0
        self.ready = False
        self.coordinator: Node | None = None
        #: partition -> the leader a NOT_LEADER reply named (reads)
        self.leader_hint: dict[int, Node | None] = {}
        #: values of transactions acknowledged committed (the final read waits for them)
        self.committed: set[str] = set()

    # ---------------------------------------------------------------------------------- plumbing

    def _up(self) -> list[Node]:
        return [n for n in self.ctx.cluster.nodes if n.state == "up" and n.port] or list(self.ctx.cluster.nodes)

    def _call(self, node: Node, command: str) -> Frame | None:
        conn = self.connection(node)
        if conn is None:
            return None
        cmd, payload = parse_command_text(command)
        try:
            return self.request(cmd, encode_crq2(payload))
        except TRANSPORT_ERRORS:
            return None
        finally:
            self.inflight_since = None

    def _node_at(self, host: str, port: int) -> Node | None:
        """The node at ``host:port`` (in the private network every node has its own address, maybe the same
        port)."""
        return next((n for n in self.ctx.cluster.nodes if n.address == (host, port)), None)

    def _coordinator(self) -> Node | None:
        if self.coordinator is None:
            node = self.rng.choice(self._up())
            frame = self._call(node, f"FIND_COORDINATOR transactional_id={self.tid}")
            if frame is None or frame.status != Status.OK:
                return None
            fields = ok_text_fields(frame.payload.decode("utf-8", "replace"))
            self.coordinator = self._node_at(fields.get("host", ""), int(fields.get("port", "0") or 0))
        return self.coordinator

    def _txn_command(self, command: str) -> tuple[Frame | None, str | None]:
        """Send to the coordinator; (frame, error code). A redirect or lost connection forgets it."""
        node = self._coordinator()
        if node is None:
            return None, None
        frame = self._call(node, command)
        if frame is None:
            self.coordinator = None
            return None, None
        if frame.status == Status.ERROR:
            code = error_text(frame)[0]
            if code in ("NOT_COORDINATOR", "coordinator_not_available"):
                self.coordinator = None
            return frame, code
        return frame, None

    @property
    def _ids(self) -> str:
        return f"transactional_id={self.tid} producerId={self.producer_id} epoch={self.epoch}"

    # ---------------------------------------------------------------------------------- the loop

    def step(self) -> None:
        if not self.ready:
            node = self.rng.choice(self._up())
            frame = self._call(node, f"CREATE topic={TOPIC} partitions={PARTITIONS}")
            if frame is None or (frame.status != Status.OK and error_text(frame)[0] != "topic_exists"):
                time.sleep(0.2)
                return
            self.ready = True
        frame, code = self._txn_command(f"INIT_PRODUCER_ID transactional_id={self.tid}")
        if frame is None or code is not None:
            return
        fields = ok_text_fields(frame.payload.decode("utf-8", "replace"))
        self.producer_id, self.epoch, self.seq = fields["producerId"], int(fields["epoch"]), 0
        frame, code = self._txn_command(f"BEGIN_TXN {self._ids}")
        if frame is None or code is not None:
            return
        values: list[str] = []
        result = "abort" if self.rng.random() < ABORT_P else "commit"
        for _ in range(self.rng.randint(1, 3)):
            self.count += 1
            self.seq += 1
            value = f"{self.name}:{self.count}"
            values.append(value)
            partition = self.rng.randrange(PARTITIONS)
            frame, code = self._txn_command(f"TXN_PUBLISH {self._ids} topic={TOPIC} partition={partition} "
                                            f"seqNum={self.seq} message={value}")
            if frame is None or code is not None:
                result = "abort"  # a publish of unknown outcome: never commit without it
                break
        self._end(values, result)
        self._read(self.rng.randrange(PARTITIONS), final=False)

    def _end(self, values: list[str], result: str) -> None:
        pending = self.history.invoke(self.name, "txn", {"tid": self.tid, "epoch": self.epoch, "topic": TOPIC,
                                                          "values": values, "result": result})
        deadline = time.monotonic() + RETRY_WINDOW_S
        last = "no answer"
        while time.monotonic() < deadline and not (self.ctx.stop.is_set() and time.monotonic() > deadline - 15):
            frame, code = self._txn_command(f"END_TXN {self._ids} result={result}")
            if frame is not None and code is None:
                state = ok_text_fields(frame.payload.decode("utf-8", "replace")).get("state", "")
                self.history.complete(pending, OK, {"state": state})
                if state == "committed":
                    self.committed.update(values)
                return
            if code in DEFINITE:
                self.history.complete(pending, FAIL, {"code": code}, error=error_text(frame)[1] if frame else code)
                return
            last = error_text(frame)[1] if frame is not None else "connection lost"
            time.sleep(0.2)
        self.history.complete(pending, INFO, error=f"END_TXN unresolved: {last}")

    def _read(self, partition: int, *, final: bool, offset: int = 0) -> tuple[list[list[Any]], int] | None:
        """One read_committed CONSUME from ``offset`` (recorded); (records, next offset) or None."""
        node = self.ctx.target_name(TOPIC, partition) if self.ctx.clustered else self.ctx.cluster.nodes[0]
        if self.leader_hint.get(partition) is not None:
            node = self.leader_hint[partition]
        conn = self.connection(node)
        if conn is None:
            return None
        cmd, payload = parse_command_text(
            f"CONSUME topic={TOPIC} partition={partition} offset={offset} isolation=read_committed")
        pending = self.history.invoke(self.name, "txn-read", {"topic": TOPIC, "partition": partition,
                                                               "offset": offset, "final": final})
        try:
            frame = self.request(cmd, encode_crq2(payload))
        except TRANSPORT_ERRORS as exc:
            self.history.complete(pending, INFO, error=describe(exc))
            self.inflight_since = None
            return None
        self.inflight_since = None
        if frame.status != Status.OK:
            code, rendered, _ = error_text(frame)
            self.history.complete(pending, FAIL, {"code": code}, error=rendered)
            self.leader_hint[partition] = None
            if code == "NOT_LEADER":  # follow the hint next time
                host, _, port = str(decode_error(frame.payload).fields.get("leader", "")).rpartition(":")
                self.leader_hint[partition] = self._node_at(host, int(port)) if port.isdigit() else None
            return None
        try:
            records = decode_records(frame.payload)
        except Exception as exc:  # noqa: BLE001 - a reply that does not decode is evidence, not a crash
            self.history.complete(pending, INFO, error=f"undecodable: {describe(exc)}")
            return None
        data = [r for r in records if r[1] != _MARKER]
        self.history.complete(pending, OK, {"records": data})
        return data, (records[-1][0] + 1 if records else offset)

    def finish(self) -> None:
        """Read every partition in full (read_committed), until the committed values are all there."""
        if not self.ready:
            return
        deadline = time.monotonic() + FINAL_READ_S
        while True:
            seen: set[str] = set()
            for partition in range(PARTITIONS):
                offset = 0
                while True:
                    got = self._read(partition, final=True, offset=offset)
                    if got is None:
                        got = self._read(partition, final=True, offset=offset)  # after a redirect
                    if got is None:
                        break
                    data, following = got
                    seen.update(r[1] for r in data)
                    if following == offset:  # nothing more below the LSO
                        break
                    offset = following
            if self.committed <= seen or time.monotonic() > deadline:
                return
            time.sleep(0.5)
