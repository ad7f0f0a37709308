"""The leader read lease rule (chaos finding F), with a fake clock."""

from __future__ import annotations

from cursus.cluster.controller import Controller, lease_valid
from cursus.metadata.state import BrokerInfo


async def _never(command):  # pragma: no cover - not called
    raise AssertionError


def test_lease_rule() -> None:
    assert not lease_valid(None, 10.0, 2.0, 0.3)
    assert lease_valid(10.0, 11.6, 2.0, 0.3)
    assert not lease_valid(10.0, 11.75, 2.0, 0.3)


def test_lease_starts_at_the_submit_time_of_the_applied_own_heartbeat() -> None:
    now = [100.0]
    local = BrokerInfo("b1", "127.0.0.1:1")
    c = Controller(_never, lambda: None, lambda: False, local, 1, 0.3, 2.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert not c.lease_valid()
    hb = c.heartbeat_command()
    now[0] = 101.0
    c.observe(hb)  # applied 1 s after it was sent: the lease counts from the send
    assert c.lease_valid()
    now[0] = 101.8
    assert not c.lease_valid()  # 1.8 s since sent >= 2.0 - 0.3
    other = Controller(_never, lambda: None, lambda: False, BrokerInfo("b2", "x:2"), 1, 0.3, 2.0,
                       clock=lambda: now[0])  # type: ignore[arg-type]
    c.observe(other.heartbeat_command())  # another broker's heartbeat does not renew it
    assert not c.lease_valid()
    c.observe(hb)  # a replay of the same heartbeat does not renew it either
    assert not c.lease_valid()
    c.observe(c.heartbeat_command())
    assert c.lease_valid()
