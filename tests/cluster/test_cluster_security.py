"""Token authentication on all three brokers of a cluster (every broker enforces its own copy of the same
sasl_users): authentication and permissions come before routing, so a client learns where a partition's
leader is (``NOT_LEADER``) only once it is authenticated and allowed; topic ACLs hold on every node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cursus.client.connection import Connection
from cursus.wire import Command, Status
from tests.cluster.clustersupport import Cluster, wait_for
from tests.integration.helpers import ack_of, create_topic, error_of, ok_fields, publish_batch, render

pytestmark = pytest.mark.timeout(180)

USERS = {"ops": ("c-tok-ops-A1", "*"), "writer": ("c-tok-writer-B2", "topic.write"),
         "reader": ("c-tok-reader-C3", "topic.read|group"), "outsider": ("c-tok-out-D4", "topic.write")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Cluster:
    c = Cluster(Path(tmp_path_factory.mktemp("security")), pki, enable_sasl="true", auth_failure_delay_ms=20)
    users = ",".join(f"{p}:{token}:{perms}" for p, (token, perms) in USERS.items())
    for broker in c.brokers:
        broker.env["SASL_USERS"] = users
    try:
        c.start()
        yield c
    finally:
        c.stop()


def login(broker, principal: str | None = None) -> Connection:
    if principal is None:
        return Connection(*broker.address, timeout_s=10)
    return Connection(*broker.address, timeout_s=10, principal=principal, token=USERS[principal][0])


def partition_row(broker, topic: str) -> dict:
    with login(broker, "ops") as c:
        text = c.command("CLUSTER_STATUS").payload.decode()
    doc = json.loads(text[len("OK cluster="):])
    rows = [p for p in doc.get("partitions", []) if p.get("topic") == topic and p.get("partition") == 0]
    return rows[0] if rows else {}


def test_auth_on_every_node_and_before_redirects(cluster):
    for broker in cluster.brokers:
        with login(broker) as anon:
            assert error_of(anon.command("METADATA topic=x")).code == "authentication_required"
            err = error_of(anon.call(Command.AUTH, {"principal": "ops", "token": "guess"}))
            assert err.code == "authentication_failed"
            assert ok_fields(anon.call(Command.AUTH, {"principal": "ops", "token": USERS["ops"][0]}))[
                "authenticated"] == "true"
    with login(cluster.brokers[1], "ops") as ops:  # any node: the metadata change goes through Raft
        create_topic(ops, "sec-c", 1, replication_factor="3", auth_policy="acl", write_acl="writer",
                     read_acl="reader")
    row = wait_for(lambda: (r := partition_row(cluster.brokers[0], "sec-c")) and r.get("leader")
                   and len(r.get("isr", [])) == 3 and r, 30, "sec-c-0 with a leader and a full ISR")
    leader = cluster.by_id(row["leader"])
    follower = next(b for b in cluster.brokers if b is not leader)
    with login(leader, "writer") as writer:  # the leader may still be opening the partition: retry that only
        def published() -> bool:
            frame = publish_batch(writer, "sec-c", 0, [b"one", b"two"], acks="all")
            if frame.status == Status.OK:
                ack_of(frame)
                return True
            assert error_of(frame).code == "leader_not_available", render(frame)
            return False

        wait_for(published, 20, "the leader serves sec-c-0")
    with login(follower) as anon:  # not authenticated: no redirect, no topic information
        assert error_of(publish_batch(anon, "sec-c", 0, [b"x"])).code == "authentication_required"
    with login(follower, "outsider") as outsider:  # allowed to write topics, but not this one
        err = error_of(outsider.command("PUBLISH topic=sec-c partition=0 producerId=o message=x"))
        assert (err.code, err.fields["operation"]) == ("NOT_AUTHORIZED_FOR_TOPIC", "write")
    with login(follower, "writer") as writer:  # authenticated and allowed: now the redirect
        err = error_of(publish_batch(writer, "sec-c", 0, [b"x"]))
        assert err.code == "NOT_LEADER", render
    for broker in cluster.brokers:  # the ACL holds on every node
        with login(broker, "reader") as reader:
            assert "sec-c" in ok_fields(reader.command("LIST"))["topics"].split(",")
        with login(broker, "writer") as writer:
            err = error_of(writer.command("METADATA topic=sec-c"))
            assert err.code == "NOT_AUTHORIZED_FOR_OPERATION" and err.fields["permission"] == "topic.read"
    with login(leader, "reader") as reader:
        frame = reader.command("CONSUME topic=sec-c partition=0 offset=0")
        assert frame.status == Status.OK and frame.payload, render(frame)
    for broker in cluster.brokers:
        for token, _ in USERS.values():
            assert token not in broker.output()
