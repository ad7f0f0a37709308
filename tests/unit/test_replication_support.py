"""Helpers shared by the replication tests (no tests here): brokers' storage on tmp dirs, an assignment
table standing in for applied metadata, and the in-process fetch transport.

The transport is not a mock of the broker: it drives the real :meth:`LeaderFetchService.serve` with the
follower's requests, exactly what the gRPC bidi stream does, minus gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from cursus.broker.replica import Replica
from cursus.internal.v1 import replication_pb2 as pb
from cursus.metadata.commands import ChangeIsr
from cursus.metadata.state import PartitionAssignment
from cursus.replication.follower import FetcherConfig, ReplicaFetcherManager
from cursus.replication.isr import IsrTracker
from cursus.replication.leader import LeaderFetchConfig, LeaderFetchService, RunBlocking, run_inline
from cursus.storage import Completion, GroupCommitWriter, PartitionLog
from tests.unit.test_storage_support import record_for, records_section, small_config

Key = tuple[str, int]


def apply_completions(completions: list[Completion]) -> None:
    """The broker's completion glue, on the loop: a replica learns its durable end (or its failure), and a
    future waiting on a write gets its result (or error)."""
    for c in completions:
        if isinstance(c.token, Replica):
            if c.error is not None:
                c.token.on_failure(c.error)
            else:
                c.token.on_durable(c.durable_end_offset)
        elif isinstance(c.token, asyncio.Future) and not c.token.done():
            if c.error is not None:
                c.token.set_exception(c.error)
            else:
                c.token.set_result(c.result)


@contextlib.asynccontextmanager
async def node_pool(directory: Path, node_class: Callable[[Path, str], Any]) -> AsyncIterator[Callable[[str], Any]]:
    """Yield ``make(broker_id)``, which builds ``node_class(directory / broker_id, broker_id)``; every node
    made is closed (``await node.close()``) on exit."""
    made: list[Any] = []

    def make(broker_id: str) -> Any:
        made.append(node_class(directory / broker_id, broker_id))
        return made[-1]

    yield make
    for node in made:
        await node.close()


class Clock:
    """A manual monotonic clock in milliseconds."""

    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


class Node:
    """One broker's storage: a writer and one replica per partition, with the broker's completion glue."""

    def __init__(self, directory: Path, broker_id: str) -> None:
        self.directory = directory
        self.broker_id = broker_id
        self.loop = asyncio.get_running_loop()
        self.writer = GroupCommitWriter(self._notify, on_written=self._written)
        self.writer.start()
        self.replicas: dict[Key, Replica] = {}

    def open(self, topic: str = "t", partition: int = 0) -> Replica:
        plog = PartitionLog.open(self.directory / f"{topic}-{partition}", small_config(segment_bytes=64 * 1024))
        replica = Replica(topic, partition, plog, self.writer, broker_id=self.broker_id)
        self.replicas[(topic, partition)] = replica
        return replica

    def _notify(self, completions: list[Completion]) -> None:
        self.loop.call_soon_threadsafe(self._apply, completions)

    def _written(self, tokens: list[object]) -> None:  # the broker's glue: written, not yet fsynced
        for token in tokens:
            if isinstance(token, Replica):
                self.loop.call_soon_threadsafe(token.on_written)

    _apply = staticmethod(apply_completions)

    async def close(self) -> None:
        await self.loop.run_in_executor(None, self.writer.close)
        for replica in self.replicas.values():
            replica.log.close()


class Metadata:
    """Applied partition assignments (what ``broker.metadata.state.assignment`` answers)."""

    def __init__(self) -> None:
        self.assignments: dict[Key, PartitionAssignment] = {}
        self.submitted: list[ChangeIsr] = []

    def lookup(self, topic: str, partition: int) -> PartitionAssignment | None:
        return self.assignments.get((topic, partition))

    def set(self, key: Key, **changes: Any) -> PartitionAssignment:
        self.assignments[key] = dataclasses.replace(self.assignments[key], **changes)
        return self.assignments[key]

    async def submit(self, command: ChangeIsr) -> None:
        """Apply a ChangeIsr as the FSM does (fenced by the leader epoch)."""
        self.submitted.append(command)
        key = (command.topic, command.partition)
        current = self.assignments[key]
        assert command.leader_epoch == current.leader_epoch
        self.set(key, isr=tuple(r for r in current.replicas if r in command.isr))


def records(base: int, count: int, tag: str = "r") -> bytes:
    return records_section([record_for(base + i, tag) for i in range(count)])


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` on the loop until it holds, with a deadline."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


async def publish(replica: Replica, count: int, tag: str = "r") -> int:
    """Append ``count`` records as one client chunk and wait until it is durable on the leader."""
    base = replica.append(records(replica.leo, count, tag), count)
    await until(lambda: replica.durable_end_offset >= base + count)
    return base


def stored_chunks(replica: Replica, start: int = 0) -> list[bytes]:
    return [bytes(chunk) for _, chunk in replica.log.iter_stored_chunks(start)]


def make_service(node: Node, metadata: Metadata, clock: Callable[[], int], config: LeaderFetchConfig | None = None,
                 run_blocking: RunBlocking = run_inline) -> LeaderFetchService:
    return LeaderFetchService(lambda: node.replicas, metadata.lookup, IsrTracker(node.broker_id),
                              config or LeaderFetchConfig(), clock, metadata.submit, run_blocking=run_blocking)


class InProcessStream:
    """A bidi fetch stream into a :class:`LeaderFetchService` (``write`` / ``read`` / ``cancel``).

    ``tamper(response)`` may rewrite responses (to test the follower's refusals)."""

    def __init__(self, service: LeaderFetchService, follower_id: str,
                 tamper: Callable[[pb.FetchResponse], pb.FetchResponse] | None = None) -> None:
        self._requests: asyncio.Queue[pb.FetchRequest] = asyncio.Queue()
        self._responses: asyncio.Queue[pb.FetchResponse] = asyncio.Queue()
        self._tamper = tamper
        self.requests_seen: list[pb.FetchRequest] = []
        self._task = asyncio.get_running_loop().create_task(self._pump(service, follower_id))

    async def _incoming(self) -> AsyncIterator[pb.FetchRequest]:
        while True:
            yield await self._requests.get()

    async def _pump(self, service: LeaderFetchService, follower_id: str) -> None:
        async for response in service.serve(follower_id, self._incoming()):
            await self._responses.put(self._tamper(response) if self._tamper else response)

    async def write(self, request: pb.FetchRequest) -> None:
        self.requests_seen.append(request)
        await self._requests.put(request)

    async def read(self) -> pb.FetchResponse | None:
        getter = asyncio.ensure_future(self._responses.get())
        done, _ = await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        return None  # the stream ended (grpc.aio.EOF)

    def cancel(self) -> None:
        self._task.cancel()


def make_manager(node: Node, metadata: Metadata, clock: Callable[[], int], open_stream: Callable[[str], Any],
                 config: FetcherConfig | None = None, **kwargs: Any) -> ReplicaFetcherManager:
    return ReplicaFetcherManager(node.broker_id, lambda: node.replicas, lambda broker: f"{broker}:1", open_stream,
                                 config or FetcherConfig(max_wait_ms=200, backoff_ms=20, reconnect_backoff_ms=10),
                                 clock, assignment_lookup=metadata.lookup, **kwargs)


def fetch_request(follower: str, *parts: pb.PartitionFetch, max_wait_ms: int = 0,
                  max_bytes: int = 0) -> pb.FetchRequest:
    return pb.FetchRequest(follower_id=follower, max_wait_ms=max_wait_ms, max_bytes=max_bytes, partitions=parts)


def part(offset: int = 0, epoch: int = 1, last_epoch: int = -1, lifecycle: int = 0, topic: str = "t",
         partition: int = 0, max_bytes: int = 0) -> pb.PartitionFetch:
    return pb.PartitionFetch(topic=topic, partition=partition, fetch_offset=offset, last_fetched_epoch=last_epoch,
                             leader_epoch=epoch, lifecycle_epoch=lifecycle, max_bytes=max_bytes)
