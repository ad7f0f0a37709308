"""Zombie fencing the right way round and abort() after failures, against a real standalone broker.

A zombie is an old instance of a transactional id (paused, partitioned away) that wakes up after a newer
instance took the id over. One epoch runs one transaction, so every instance re-initializes after each
finished transaction; that automatic re-init is guarded (INIT_PRODUCER_ID ``producerId= epoch=``): it
bumps only the id's current session, so the zombie is fenced instead of fencing the new instance.
"""

from __future__ import annotations

import time

import pytest

from cursus.client import (
    Admin,
    ConflictError,
    ProducerFencedError,
    TransactionalProducer,
)
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields
from tests.integration.txnsupport import Session, committed_values

pytestmark = pytest.mark.timeout(120)


def test_guarded_init_on_the_wire(shared_broker, topic_name):
    tid = f"{topic_name}-tx"
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=1)
        a = Session(conn, tid)
        a.init()
        a.begin()
        a.publish(topic_name, "a1", partition=0)
        a.end("commit")
        pid, old_epoch = a.producer_id, a.epoch
        b = Session(conn, tid)
        b.init()  # plain form (spec): bumps and fences the older session
        assert b.epoch == old_epoch + 1
        b.begin()
        b.publish(topic_name, "b1", partition=0)
        b.end("commit")
        # the zombie's guarded re-init: refused, nothing bumped, nothing aborted
        err = error_of(conn.command(f"INIT_PRODUCER_ID transactional_id={tid} producerId={pid} epoch={old_epoch}"))
        assert err.code == "producer_fenced" and not err.retryable
        status = ok_fields(conn.command(f"TXN_STATUS transactional_id={tid}"))
        assert (status["epoch"], status["state"]) == (str(b.epoch), "committed")
        err = error_of(conn.command(f"INIT_PRODUCER_ID transactional_id={tid} producerId=999999 epoch={b.epoch}"))
        assert err.code == "producer_fenced"
        err = error_of(conn.command(f"INIT_PRODUCER_ID transactional_id={tid} producerId={pid} epoch={b.epoch + 5}"))
        assert err.code == "invalid_epoch"
        err = error_of(conn.command(f"INIT_PRODUCER_ID transactional_id={tid}-never producerId={pid} epoch=1"))
        assert err.code == "producer_fenced"
        assert error_of(conn.command(f"INIT_PRODUCER_ID transactional_id={tid} epoch=1")).code \
            == "missing_producer_id"
        assert error_of(conn.command(f"INIT_PRODUCER_ID transactional_id={tid} producerId={pid}")).code \
            == "invalid_epoch"
        # the latest owner's guarded re-init bumps; retried (a lost reply) it answers the same bump
        fields = ok_fields(conn.command(f"INIT_PRODUCER_ID transactional_id={tid} producerId={pid} epoch={b.epoch}"))
        assert (fields["producerId"], fields["epoch"]) == (pid, str(b.epoch + 1))
        again = ok_fields(conn.command(f"INIT_PRODUCER_ID transactional_id={tid} producerId={pid} epoch={b.epoch}"))
        assert again["epoch"] == fields["epoch"]
        # a guarded re-init of the current owner's open transaction aborts it (like the plain form)
        b.producer_id, b.epoch = fields["producerId"], int(fields["epoch"])
        b.begin()
        b.publish(topic_name, "b-open", partition=0)
        fields = ok_fields(conn.command(f"INIT_PRODUCER_ID transactional_id={tid} producerId={pid} epoch={b.epoch}"))
        assert fields["epoch"] == str(b.epoch + 1)
    assert committed_values(shared_broker.bootstrap, topic_name) == [b"a1", b"b1"]


def test_zombie_after_its_commit_cannot_fence_the_new_instance(shared_broker, topic_name):
    """Before the guard the zombie's automatic re-init got a higher epoch and fenced the new instance."""
    address = shared_broker.bootstrap
    with Admin(address) as admin:
        admin.create_topic(topic_name, partitions=1)
    tid = f"{topic_name}-tx"
    with TransactionalProducer(address, tid) as zombie, TransactionalProducer(address, tid) as fresh:
        zombie.begin()
        zombie.send(topic_name, b"z1", partition=0)
        assert zombie.commit() == "committed"
        # ... the zombie pauses here; the new instance takes the id over
        fresh.begin()
        fresh.send(topic_name, b"f1", partition=0)
        assert fresh.commit() == "committed"
        # the zombie resumes: its next transaction's re-init is refused
        with pytest.raises(ProducerFencedError):
            zombie.begin()
        with pytest.raises(ProducerFencedError):
            zombie.begin()  # terminal
        # the new instance keeps committing
        for i in range(2, 5):
            fresh.begin()
            fresh.send(topic_name, f"f{i}".encode(), partition=0)
            assert fresh.commit() == "committed"
    assert committed_values(address, topic_name) == [b"z1", b"f1", b"f2", b"f3", b"f4"]


def test_zombie_with_an_open_transaction_is_fenced_and_stays_fenced(shared_broker, topic_name):
    address = shared_broker.bootstrap
    with Admin(address) as admin:
        admin.create_topic(topic_name, partitions=1)
    tid = f"{topic_name}-tx"
    with TransactionalProducer(address, tid) as zombie, TransactionalProducer(address, tid) as fresh:
        zombie.begin()
        zombie.send(topic_name, b"lost", partition=0)
        fresh.begin()  # aborts the zombie's open transaction
        with pytest.raises(ProducerFencedError):
            zombie.send(topic_name, b"late", partition=0)
        fresh.send(topic_name, b"kept", partition=0)
        assert fresh.commit() == "committed"
        with pytest.raises(ProducerFencedError):
            zombie.begin()
        fresh.begin()
        fresh.send(topic_name, b"kept2", partition=0)
        assert fresh.commit() == "committed"
    assert committed_values(address, topic_name) == [b"kept", b"kept2"]


def test_abort_after_failures_is_idempotent_and_clear(broker_factory, topic_name):
    broker = broker_factory(settings={"transaction_timeout_ms": 300}).start()
    address = broker.bootstrap
    with Admin(address) as admin:
        admin.create_topic(topic_name, partitions=1)
    with TransactionalProducer(address, f"{topic_name}-tx") as txn:
        assert txn.abort() == "empty"  # no session yet: nothing to abort
        txn.init()
        assert txn.abort() == "empty"  # initialized, nothing begun (broker: transaction_not_open state=empty)
        # the broker times the transaction out; the commit fails; abort() then succeeds
        txn.begin()
        txn.send(topic_name, b"timed-out", partition=0)
        deadline = time.monotonic() + 10
        while txn.status()["state"] != "aborted":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(ConflictError) as failed:
            txn.commit()
        assert failed.value.code == "transaction_aborted"
        assert txn.abort() == "aborted"
        assert txn.abort() == "aborted"  # idempotent
        # after a commit, abort() says so
        txn.begin()
        txn.send(topic_name, b"committed", partition=0)
        assert txn.commit() == "committed"
        with pytest.raises(ConflictError) as late:
            txn.abort()
        assert late.value.code == "transaction_already_committed"
        txn.begin()  # still usable
        txn.send(topic_name, b"second", partition=0)
        assert txn.commit() == "committed"
    assert committed_values(address, topic_name) == [b"committed", b"second"]


def test_a_transaction_too_large_is_refused_up_front_and_still_commits(broker_factory, topic_name):
    """transaction_state_max_bytes (in a cluster also the 64 KiB TxnSync cap): the TXN_PUBLISH to a new
    partition or the SEND_OFFSETS_TO_TXN that would outgrow it is refused (transaction_too_large, nothing
    appended or staged); the transaction stays open and its commit (a larger encoding) still succeeds."""
    from tests.integration.txnsupport import read_all

    broker = broker_factory(settings={"transaction_state_max_bytes": 1024}).start()
    partitions = 40
    with connect(broker) as conn:
        create_topic(conn, topic_name, partitions=partitions)
        s = Session(conn, f"{topic_name}-tx")
        s.init()
        s.begin()
        accepted = 0
        for p in range(partitions):
            s.seq += 1
            frame = conn.command(f"TXN_PUBLISH {s.ids} topic={topic_name} partition={p} seqNum={s.seq} message=m{p}")
            if frame.status.name != "OK":
                err = error_of(frame)
                assert err.code == "transaction_too_large" and not err.retryable, err
                assert int(err.fields["limit"]) == 1024
                break
            accepted += 1
        assert 3 < accepted < partitions
        refused = accepted
        assert read_all(conn, topic_name, refused, isolation="read_uncommitted") == []  # nothing appended
        s.publish(topic_name, "again", partition=0)  # a partition it already has: no growth, accepted
        assert s.status()["state"] == "open" and s.status()["participants"] == str(accepted)
        # offsets that would outgrow it: refused, nothing staged
        joined = ok_fields(conn.command(f"JOIN_GROUP topic={topic_name} group={topic_name}-g member=w"))
        offsets = ",".join(f"P{p}:0" for p in range(partitions))
        frame = conn.command(f"SEND_OFFSETS_TO_TXN {s.ids} topic={topic_name} group={topic_name}-g "
                             f"member={joined['member']} generation={joined['generation']} offsets={offsets}")
        assert error_of(frame).code == "transaction_too_large"
        assert s.status()["offsets"] == "0"
        done = s.end("commit")
        assert done["state"] == "committed" and done["messages"] == str(accepted + 1)
        assert [r.payload for r in read_all(conn, topic_name, 0)] == [b"m0", b"again"]
        assert [r.payload for r in read_all(conn, topic_name, accepted - 1)] == [f"m{accepted - 1}".encode()]
