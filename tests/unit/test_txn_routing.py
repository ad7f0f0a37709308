"""Cluster routing of transaction commands: NOT_COORDINATOR to the shard owner of the FSM's table."""

from __future__ import annotations

import types

import pytest

from cursus.broker.handlers.txn import _coordinator
from cursus.metadata.apply import apply
from cursus.metadata.commands import BrokerHeartbeat, FenceBroker
from cursus.metadata.state import BrokerInfo, MetadataState, transaction_coordinator
from cursus.wire.errors import BrokerError


def _broker(state: MetadataState, broker_id: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        config=types.SimpleNamespace(enabled_distribution=True), metadata=types.SimpleNamespace(state=state),
        broker_id=broker_id, transactions=object(),
        broker_address=lambda b: state.brokers[b].client_address if b in state.brokers else "")


def _code(broker: types.SimpleNamespace, tid: str) -> BrokerError:
    with pytest.raises(BrokerError) as info:
        _coordinator(broker, "BEGIN_TXN", tid)  # type: ignore[arg-type]
    return info.value


def test_non_owners_redirect_and_the_owner_coordinates():
    state = MetadataState(cluster=True)
    for b, port in (("a", 1), ("b", 2), ("c", 3)):
        state, _ = apply(state, BrokerHeartbeat(f"h{b}", BrokerInfo(b, f"host-{b}:{port}"), 50))
    owner = transaction_coordinator(state, "payments")
    assert owner is not None
    other = next(b for b in "abc" if b != owner)
    err = _code(_broker(state, other), "payments").error
    assert err.code == "NOT_COORDINATOR" and err.fields == {"host": f"host-{owner}", "port": str(" abc".index(owner))}
    broker = _broker(state, owner)
    assert _coordinator(broker, "BEGIN_TXN", "payments") is broker.transactions  # type: ignore[arg-type]
    for b in "abc":
        state, _ = apply(state, FenceBroker(f"f{b}", b))
    assert _code(_broker(state, "a"), "payments").error.code == "coordinator_not_available"
