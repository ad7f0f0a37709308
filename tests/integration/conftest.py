"""Fixtures that start real broker processes on ephemeral 127.0.0.1 ports."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from cursus.client.connection import Connection
from tests.brokerproc import BrokerProcess

_names = itertools.count(1)


@pytest.fixture(scope="session")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker shared by tests that only need isolation by topic name (see :func:`topic_name`)."""
    broker = BrokerProcess(tmp_path_factory.mktemp("shared") / "data").start()
    yield broker
    broker.stop()


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[object]:
    """Start dedicated brokers (for kill -9, restart and config tests); all stopped at teardown."""
    started: list[BrokerProcess] = []

    def make(name: str = "data", **kwargs: object) -> BrokerProcess:
        proc = BrokerProcess(tmp_path / name, **kwargs)  # type: ignore[arg-type]
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A topic name unique to this test (safe on the shared broker)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"t{next(_names)}-{base}"


def connect(broker: BrokerProcess, **kwargs: object) -> Connection:
    host, port = broker.address
    return Connection(host, port, **kwargs)  # type: ignore[arg-type]
