"""Launch ``deploy/docker-compose.yml`` as written, without Docker: each service's image entrypoint with the
image ENV and the service's environment, its volumes as temp directories, its hostname as its own loopback
address (tests/deploy/deployfiles.py lists the translations). Then the compose health checks,
``cursusctl cluster-status`` from inside the compose network, and an acks=all round trip.

The round trip and a healthy cluster with a replicated topic NEED the replication merge (acks=all with
ISR = replicas); the cluster forming and the health checks do not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cursus.client import Admin, Consumer, Producer
from tests.deploy.deployfiles import (
    HostMap,
    LocalContainer,
    compose_environment,
    container_environment,
    documented_cert_hosts,
    healthy_cluster_status,
    load_compose,
    make_certs,
    parse_image,
    start_all,
    write_shims,
)

#: compose hostname -> the loopback address that stands for the container's network namespace
ADDRESSES = {"cursus-1": "127.0.15.1", "cursus-2": "127.0.15.2", "cursus-3": "127.0.15.3"}
TOKEN = "compose-test-token-0123456789"


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LocalContainer]]:
    root = Path(tmp_path_factory.mktemp("compose"))
    shims = write_shims(root / "bin")
    # The documented one-liner writes deploy/certs with the compose hostnames; the addresses they stand
    # for here are added, since the internal gRPC client checks the dialled host against the SAN.
    certs = root / "certs"
    make_certs(certs, [*documented_cert_hosts("deploy/certs"), *ADDRESSES.values()], shims)
    doc = load_compose({"CURSUS_INTERNAL_TOKEN": TOKEN})
    image = parse_image()
    hosts = HostMap(ADDRESSES)
    containers: dict[str, LocalContainer] = {}
    for name, service in doc["services"].items():
        address = ADDRESSES[service["hostname"]]
        mounts: dict[str, Path] = {"/tmp": root / name / "tmp"}
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            assert source == "./certs" or source in doc["volumes"], f"unexpected volume {volume}"
            mounts[target] = certs if source == "./certs" else root / "volumes" / source
        for path in mounts.values():
            path.mkdir(parents=True, exist_ok=True)
        env = container_environment(image, compose_environment(service), address=address, hosts=hosts,
                                    mounts=mounts, shims=shims)
        argv = [*(service.get("entrypoint") or image.entrypoint), *(service.get("command") or image.cmd)]
        argv = [hosts.rewrite(arg) for arg in argv]
        containers[name] = LocalContainer(name, address, argv, env, cwd=mounts[image.workdir],
                                          log_path=root / f"{name}.log")
    try:
        start_all(list(containers.values()), lambda c: int(c.env["HEALTH_CHECK_PORT"]))
        yield containers
    finally:
        for container in containers.values():
            container.stop()


def test_each_service_passes_its_compose_health_check(compose: dict[str, LocalContainer]) -> None:
    doc = load_compose({"CURSUS_INTERNAL_TOKEN": TOKEN})
    for name, container in compose.items():
        test = doc["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        done = container.run(test[1:])
        assert done.returncode == 0, f"{name} health check failed: {done.stderr}"
        assert container.http_status(int(container.env["HEALTH_CHECK_PORT"]), "/live") == 200


def test_cluster_status_from_inside_the_network_is_healthy(compose: dict[str, LocalContainer]) -> None:
    client = compose["cursus-2"]
    # Any broker answers for the whole cluster; dial them by their compose hostnames (mapped).
    for name in compose:
        broker = f"{ADDRESSES[name]}:{compose[name].env['BROKER_PORT']}"
        doc = healthy_cluster_status(client, broker, f"cluster-status via {name}")
        assert sorted(b["id"] for b in doc["brokers"]) == ["node-1", "node-2", "node-3"]
        assert {b["client_addr"] for b in doc["brokers"]} == {
            f"{ADDRESSES[n]}:{c.env['BROKER_PORT']}" for n, c in compose.items()}


def test_acks_all_round_trip_and_replicated_topic_is_healthy(compose: dict[str, LocalContainer]) -> None:
    """NEEDS the replication merge."""
    bootstrap = f"{ADDRESSES['cursus-1']}:{compose['cursus-1'].env['BROKER_PORT']}"
    with Admin(bootstrap) as admin:
        admin.create_topic("deploy-compose", partitions=3)
    values = [f"record-{i}".encode() for i in range(30)]
    with Producer(bootstrap, acks="all") as producer:
        for future in [producer.send("deploy-compose", value, key=f"k{i}") for i, value in enumerate(values)]:
            future.result()
    with Consumer("deploy-compose", bootstrap, start="earliest") as consumer:
        seen = sorted(record.value for record in consumer.records(until_end=True))
    assert seen == sorted(values)
    doc = healthy_cluster_status(compose["cursus-3"], bootstrap, "healthy cluster with a replicated topic")
    topic = [p for p in doc["partitions"] if p["topic"] == "deploy-compose"]
    assert len(topic) == 3 and all(len(p["isr"]) == 3 for p in topic)
