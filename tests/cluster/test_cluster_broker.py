"""Three broker processes as one Raft metadata cluster (loopback, mutual TLS): formation, metadata on
every node, routing, failover, restart. One cluster per module keeps CI time bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cursus.client.connection import Connection
from tests.cluster.clustersupport import Cluster, wait_for
from tests.integration.helpers import create_topic, error_of, ok_fields, render


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Cluster:
    c = Cluster(Path(tmp_path_factory.mktemp("cluster")), pki)
    c.start()
    yield c
    c.stop()


def conn(broker) -> Connection:
    return Connection(*broker.address, timeout_s=10)


def status(broker) -> dict:
    with conn(broker) as c:
        frame = c.command("CLUSTER_STATUS")
    text = frame.payload.decode()
    assert text.startswith("OK cluster="), render(frame)
    return json.loads(text[len("OK cluster="):])


def test_forms_from_empty_dirs_and_create_is_visible_everywhere(cluster: Cluster) -> None:
    for broker in cluster.brokers:
        code, _ = broker.http_get("/ready")
        assert code == 200
        assert (broker.log_dir / "raft" / ".cursus-raft-format").read_text().strip() == "9"
    with conn(cluster.brokers[1]) as c:
        create_topic(c, "orders", 3)
    for broker in cluster.brokers:
        with conn(broker) as c:
            wait_for(lambda c=c: c.command("LIST").payload.decode().find("orders") >= 0, 10, "topic visible")
            doc = json.loads(c.command("DESCRIBE topic=orders").payload)
            assert [p["id"] for p in doc["partitions"]] == [0, 1, 2]
    st = status(cluster.brokers[0])
    assert st["active_brokers"] == 3 and st["raft_leader"]
    assert {p["leader"] for p in st["partitions"] if p["topic"] == "orders"} <= {"node-1", "node-2", "node-3"}
