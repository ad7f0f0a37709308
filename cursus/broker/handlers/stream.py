"""STREAM: continuous push of one partition (spec "STREAM (continuous push)", facts A6 STREAM, B3.5,
decisions 6, 7 and 14).

``STREAM topic= partition= [group=] [member=] [offset=] [batch=] [max_bytes=] [isolation=]`` answers with
kind-5 Stream frames on the request's id until a ``STREAM_END`` frame ends it:

* data: status OK, one CBV2 batch (at least one record, at most ``batch`` records and ``max_bytes``), built
  exactly like a CONSUME reply. The stream sleeps on the replica's data event (woken by appends reaching the
  HWM) and, once woken, waits at most ``stream_batch_wait_ms`` (100 ms) for a fuller batch;
* keepalive: status OK, empty payload, after ``stream_keepalive_ms`` (at most 3 s) without any frame;
* end: status STREAM_END, payload ``STREAM_CONTROL type=CLOSE reason=<reason> offset=<next offset>`` with
  ``requested= earliest= latest=`` appended for ``offset_out_of_range``. Reasons: ``stopped`` (broker
  shutdown), ``removed`` (the topic or partition was deleted), ``timeout`` (``stream_timeout_ms`` without
  client activity: the stream opening, a heartbeat of ``member``, a commit of ``group`` on the topic),
  ``error`` (storage failure), ``offset_out_of_range`` (the next offset fell below the retained log).

Start offset: no ``offset=``: the group's committed offset, else the log start; with ``offset=``: the larger
of it and the committed offset (as CONSUME, decision 14). STREAM never commits and never checks ownership
(it is a stateless partition read). Errors found before the stream starts (bad arguments, unknown topic,
an offset past the log end, ``too_many_connections`` beyond ``max_stream_connections``) are ordinary ERROR
replies. A stream whose broker stops leading the partition, or may no longer show its HWM, ends with an
ERROR frame as a CONSUME there would be answered: ``NOT_LEADER leader=`` (facts A6: clients follow it) or
the retryable ``leader_not_available``.
"""

from __future__ import annotations

import asyncio
import logging

from cursus.broker.args import ReadArgs
from cursus.broker.core import Broker
from cursus.broker.handlers.fetch import read_batch, read_target
from cursus.broker.replica import Replica
from cursus.broker.request import Parts, Request, StreamReply, StreamSink
from cursus.wire import Status
from cursus.wire.errors import BrokerError, encode_error

log = logging.getLogger("cursus.stream")

#: Records per data frame when the request gives no ``batch=``.
DEFAULT_STREAM_BATCH = 1000
#: Decision 7: a keepalive at least every 3 s.
MAX_KEEPALIVE_MS = 3000
CLOSE_REASONS = ("stopped", "removed", "timeout", "error", "offset_out_of_range")


async def handle_stream(broker: Broker, req: Request, args: ReadArgs) -> StreamReply:
    """Validate a STREAM request and return the :class:`PartitionStream` the session drives."""
    target = read_target(broker, args, default_batch=DEFAULT_STREAM_BATCH, session=req.session)
    replica, start = target.replica, target.start
    group, member = args.group, args.member
    if start > replica.leo:
        raise BrokerError.of("OFFSET_OUT_OF_RANGE", requested=start, earliest=replica.log_start_offset,
                             latest=replica.hwm)
    limit = broker.config.max_stream_connections
    if len(broker.streams) >= limit:
        raise BrokerError.of("too_many_connections", command="STREAM", limit=limit,
                             reason="max_stream_connections_reached")
    return PartitionStream(broker, replica, start, group=group, member=member, batch=target.max_records,
                           max_bytes=target.max_bytes, isolation=target.isolation)


class PartitionStream(StreamReply):
    """One open STREAM of one partition (registered in ``broker.streams`` from creation to its end).

    Args:
        broker: the broker (config, coordinator for activity, streams registry).
        replica: the partition read.
        offset: the next offset to send.
        group, member: for activity (timeout) and logs only; never for ownership checks.
        batch, max_bytes: per data frame.
    """

    def __init__(self, broker: Broker, replica: Replica, offset: int, *, group: str | None, member: str | None,
                 batch: int, max_bytes: int, isolation: str = "read_uncommitted") -> None:
        cfg = broker.config
        self.isolation = isolation
        self.broker = broker
        self.replica = replica
        self.topic = replica.topic
        self.offset = offset
        self.group = group
        self.member = member
        self.batch = batch
        self.max_bytes = max_bytes
        self.keepalive_s = min(cfg.stream_keepalive_ms, MAX_KEEPALIVE_MS) / 1000.0
        self.batch_wait_s = cfg.stream_batch_wait_ms / 1000.0
        self.timeout_ms = cfg.stream_timeout_ms
        self.opened_ms = broker.clock.monotonic_ms()
        #: The reason the stream ended (None while open).
        self.close_reason: str | None = None
        self._sink: StreamSink | None = None
        self._waiter: asyncio.Future[None] | None = None
        broker.streams.add(self)

    # ---------------------------------------------------------------------------------------- control

    def close_text(self, reason: str) -> bytes:
        """The ``STREAM_CONTROL type=CLOSE`` payload for ``reason`` at the current offset."""
        text = f"STREAM_CONTROL type=CLOSE reason={reason} offset={self.offset}"
        if reason == "offset_out_of_range":
            text += (f" requested={self.offset} earliest={self.replica.log_start_offset}"
                     f" latest={self.replica.hwm}")
        return text.encode("ascii")

    def stop(self, reason: str) -> None:
        """End the stream now: the STREAM_END frame is written synchronously (shutdown path); idempotent."""
        if self.close_reason is not None:
            return
        self.close_reason = reason
        self.broker.streams.discard(self)
        if self._sink is not None:
            self._sink.send_now(Status.STREAM_END, self.close_text(reason))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()

    async def _end_unless_serving(self) -> bool:
        """End the stream with an ERROR frame (:meth:`_not_serving`) and return True, or return False."""
        error = self._not_serving()
        if error is None:
            return False
        self.close_reason = "error"
        self.broker.streams.discard(self)
        log.debug("STREAM %s/%d ended at %d: %s", self.topic, self.replica.partition, self.offset, error.error.code)
        await self._send(Status.ERROR, encode_error(error.error))
        return True

    async def _close(self, reason: str) -> None:
        if self.close_reason is not None:
            return
        self.close_reason = reason
        self.broker.streams.discard(self)
        assert self._sink is not None
        log.debug("STREAM %s/%d closed: %s at %d", self.topic, self.replica.partition, reason, self.offset)
        await self._send(Status.STREAM_END, self.close_text(reason))

    async def _send(self, status: Status, payload: bytes | Parts) -> None:
        """Write a frame; a client that does not read for ``stream_timeout_ms`` loses its connection."""
        assert self._sink is not None
        await asyncio.wait_for(self._sink.send(status, payload), self.timeout_ms / 1000.0)

    async def _wait_for_data(self, offset: int, timeout_s: float) -> None:
        """Sleep until the HWM passes ``offset``, ``timeout_s`` passes, or :meth:`stop` is called."""
        self._waiter = asyncio.ensure_future(
            self.broker.transactions.wait_readable(self.replica, offset, timeout_s, self.isolation))
        try:
            await self._waiter
        except asyncio.CancelledError:
            if self.close_reason is None:
                raise  # we ourselves are being cancelled (client EOF)
        finally:
            self._waiter = None

    # ---------------------------------------------------------------------------------------- the loop

    def _idle_ms(self) -> int:
        activity = max(self.opened_ms, self.broker.coordinator.last_activity_ms(self.group, self.member, self.topic))
        return self.broker.clock.monotonic_ms() - activity

    def _not_serving(self) -> BrokerError | None:
        """The error that ends the stream when this broker may no longer show the partition's HWM, else None.

        A stream is served only while its replica leads and is readable, as every CONSUME is
        (:meth:`Broker.replica`, :meth:`Replica.check_readable`): a broker that lost the leadership answers
        ``NOT_LEADER leader=`` (the client follows it), one whose leadership is in doubt (read lease expired,
        a new leader preparing) the retryable ``leader_not_available``. Without this check a deposed leader
        kept pushing as a follower, up to an HWM the new leader had not applied yet (chaos finding I).
        """
        try:
            self.broker.replica(self.topic, self.replica.partition).check_readable()
        except BrokerError as exc:
            return exc
        return None

    def _ended(self) -> str | None:
        """A close reason if the stream cannot continue, else None."""
        replica = self.replica
        if replica.deleted or self.broker.replicas.get((self.topic, replica.partition)) is not replica:
            return "removed"
        if replica.fenced is not None:
            return "error"
        if self.offset < replica.log_start_offset:
            return "offset_out_of_range"
        if self._idle_ms() >= self.timeout_ms:
            return "timeout"
        return None

    async def run(self, sink: StreamSink) -> None:
        """Push data frames and keepalives until a close reason appears (see the module docstring)."""
        self._sink = sink
        loop = asyncio.get_running_loop()
        last_frame = loop.time()
        woken = False
        try:
            while self.close_reason is None:
                reason = self._ended()
                if reason is not None:
                    await self._close(reason)
                    return
                if await self._end_unless_serving():
                    return
                replica = self.replica
                readable = self.broker.transactions.readable_end(replica, self.isolation)
                if self.offset < readable:
                    if woken and self.batch_wait_s > 0 and readable - self.offset < self.batch:
                        await self._wait_for_data(self.offset + self.batch - 1, self.batch_wait_s)
                        woken = False
                        continue
                    woken = False
                    try:
                        payload, next_offset = await read_batch(self.broker, replica, self.topic, self.offset,
                                                                self.batch, self.max_bytes, self.isolation)
                    except BrokerError:
                        continue  # fell below the log start: _ended() closes with offset_out_of_range
                    except Exception:
                        log.exception("STREAM read of %s/%d at %d failed", self.topic, replica.partition,
                                      self.offset)
                        await self._close("error")
                        return
                    if self.close_reason is not None or await self._end_unless_serving():
                        return
                    await self._send(Status.OK, payload)
                    self.offset = next_offset
                    last_frame = loop.time()
                    continue
                idle_s = self.keepalive_s - (loop.time() - last_frame)
                if idle_s <= 0:
                    await self._send(Status.OK, b"")
                    last_frame = loop.time()
                    continue
                timeout_left_s = max(0.001, (self.timeout_ms - self._idle_ms()) / 1000.0)
                await self._wait_for_data(self.offset, min(idle_s, timeout_left_s))
                woken = True
        finally:
            self.broker.streams.discard(self)
