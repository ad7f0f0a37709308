"""Launch the StatefulSet of ``deploy/k8s`` (the kustomize output) as written, without Kubernetes: each pod's
container command and args, its environment as the kubelet builds it (image ENV, ``envFrom`` the
ConfigMap, downward-API pod name and namespace, Secret keys, ``$(VAR)`` expansion), its volume mounts as
temp directories and its pod DNS names as its own loopback address (tests/deploy/deployfiles.py). Then the
probes as declared, ``cursusctl cluster-status`` from inside a pod, and an acks=all round trip through the
client Service's port.

The round trip and a healthy cluster with a replicated topic NEED the replication merge; the rest does not.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cursus.client import Admin, Consumer, Producer
from tests.deploy.deployfiles import (
    HostMap,
    LocalContainer,
    container_environment,
    documented_cert_hosts,
    documented_secret_files,
    find_resource,
    healthy_cluster_status,
    k8s_expand,
    kustomize_build,
    make_certs,
    map_mounts,
    parse_image,
    pod_environment,
    start_all,
    write_shims,
)

NAMESPACE = "cursus-test"
TOKEN = "k8s-test-token-0123456789"
#: pod ordinal -> the loopback address that stands for the pod's IP
ADDRESSES = {0: "127.0.15.11", 1: "127.0.15.12", 2: "127.0.15.13"}


def _pod_names(sts: dict[str, Any], ordinal: int, headless: str) -> list[str]:
    """The DNS names of pod ``ordinal``: short (same namespace), namespaced ``.svc`` and fully qualified."""
    base = f"{sts['metadata']['name']}-{ordinal}.{headless}"
    return [base, f"{base}.{NAMESPACE}.svc", f"{base}.{NAMESPACE}.svc.cluster.local"]


@pytest.fixture(scope="module")
def resources() -> list[dict[str, Any]]:
    return kustomize_build()


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory,
         resources: list[dict[str, Any]]) -> Iterator[dict[str, LocalContainer]]:
    root = Path(tmp_path_factory.mktemp("k8s"))
    shims = write_shims(root / "bin")
    sts = find_resource(resources, "StatefulSet", "cursus")
    headless = sts["spec"]["serviceName"]
    names = {name: ADDRESSES[i] for i in range(sts["spec"]["replicas"]) for name in _pod_names(sts, i, headless)}
    hosts = HostMap(names)
    # docs/deploy.md's commands: certificates for the pods' short DNS names (here also for the addresses
    # they stand for: gRPC checks the dialled host), the Secret cursus-internal-tls from the files it lists.
    out = "deploy/k8s/certs"
    make_certs(root / out, [*documented_cert_hosts(out), *ADDRESSES.values()], shims)
    secret_dirs = {"cursus-internal-tls": root / "secret-tls"}
    secret_dirs["cursus-internal-tls"].mkdir()
    for key, source in documented_secret_files("cursus-internal-tls").items():
        shutil.copy(root / source, secret_dirs["cursus-internal-tls"] / key)
    secrets = {"cursus-internal-token": {"token": TOKEN}}  # no next-token: the optional key is absent
    config_maps = {r["metadata"]["name"]: r["data"] for r in resources if r["kind"] == "ConfigMap"}
    image = parse_image()
    pod_spec = sts["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    result: dict[str, LocalContainer] = {}
    for ordinal, address in ADDRESSES.items():
        pod = f"{sts['metadata']['name']}-{ordinal}"
        mounts: dict[str, Path] = {}
        for mount in container["volumeMounts"]:
            volume = mount["name"]
            if volume in claims:
                mounts[mount["mountPath"]] = root / pod / f"pvc-{volume}"
            elif "emptyDir" in volumes[volume]:
                mounts[mount["mountPath"]] = root / pod / f"emptydir-{volume}"
            else:
                mounts[mount["mountPath"]] = secret_dirs[volumes[volume]["secret"]["secretName"]]
        for path in mounts.values():
            path.mkdir(parents=True, exist_ok=True)
        spec_env = pod_environment(container, pod_name=pod, namespace=NAMESPACE, config_maps=config_maps,
                                   secrets=secrets)
        env = container_environment(image, spec_env, address=address, hosts=hosts, mounts=mounts, shims=shims)
        argv = [*(container.get("command") or image.entrypoint), *(container.get("args") or image.cmd)]
        argv = [hosts.rewrite(map_mounts(k8s_expand(arg, spec_env), mounts)) for arg in argv]
        result[pod] = LocalContainer(pod, address, argv, env, cwd=mounts.get(image.workdir, root),
                                     log_path=root / f"{pod}.log", spec_env=spec_env)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    try:
        start_all(list(result.values()), lambda c: ports["health"])
        yield result
    finally:
        for pod_container in result.values():
            pod_container.stop()


def test_probes_as_declared_succeed(pods: dict[str, LocalContainer], resources: list[dict[str, Any]]) -> None:
    sts = find_resource(resources, "StatefulSet", "cursus")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for pod in pods.values():
        assert ports["health"] == int(pod.env["HEALTH_CHECK_PORT"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
            assert pod.http_status(port, get["path"]) == 200, f"{pod.name} {probe}"


def test_pods_derive_ids_and_advertise_pod_dns_names(pods: dict[str, LocalContainer]) -> None:
    for ordinal, pod in enumerate(pods.values()):
        assert pod.spec_env["ADVERTISED_HOST"] == f"cursus-{ordinal}.cursus-headless.{NAMESPACE}.svc"
        assert pod.spec_env["INTERNAL_ADVERTISED_ADDRESS"] == f"cursus-{ordinal}.cursus-headless:9300"
    # kubectl exec cursus-1 -- cursusctl cluster-status (the pod's own client port)
    doc = healthy_cluster_status(pods["cursus-1"], "127.0.0.1:9000", "cluster-status from inside a pod")
    brokers = {b["id"]: b["client_addr"] for b in doc["brokers"]}
    assert brokers == {f"node-{i + 1}": f"{ADDRESSES[i]}:9000" for i in ADDRESSES}


def test_acks_all_round_trip_through_the_client_service(pods: dict[str, LocalContainer],
                                                        resources: list[dict[str, Any]]) -> None:
    """NEEDS the replication merge."""
    service = find_resource(resources, "Service", "cursus")
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "client"
    bootstrap = f"{ADDRESSES[2]}:{port['port']}"  # the Service picked cursus-2
    with Admin(bootstrap) as admin:
        admin.create_topic("deploy-k8s", partitions=3)
    values = [f"record-{i}".encode() for i in range(30)]
    with Producer(bootstrap, acks="all") as producer:
        for future in [producer.send("deploy-k8s", value, key=f"k{i}") for i, value in enumerate(values)]:
            future.result()
    with Consumer("deploy-k8s", bootstrap, start="earliest") as consumer:
        seen = sorted(record.value for record in consumer.records(until_end=True))
    assert seen == sorted(values)
    doc = healthy_cluster_status(pods["cursus-0"], "127.0.0.1:9000", "healthy cluster with a replicated topic")
    topic = [p for p in doc["partitions"] if p["topic"] == "deploy-k8s"]
    assert len(topic) == 3 and all(len(p["isr"]) == 3 for p in topic)
