"""Read the files in ``deploy/`` the way Docker, Compose and Kubernetes do, and run them as local processes.

There is no container engine or Kubernetes cluster on the test machines, so a "container" here is a
broker process started with exactly the command, environment and mounts the files give it. Four small,
explicit translations stand in for what the engine would provide:

- **Names to addresses**: each compose hostname / pod DNS name maps to its own loopback address
  (``127.0.15.x``), rewritten wherever it appears in an environment value or argument (:class:`HostMap`).
- **Own network namespace**: inside a container, a wildcard bind (``HOST=0.0.0.0``) and ``127.0.0.1`` are
  the container's own address; here they become the node's loopback address.
- **Mounts**: a mount target (``/data``, ``/etc/cursus/tls``, ``/tmp``) in an environment value or an
  argument becomes the temp directory mounted there.
- **Executables**: ``cursus-broker``, ``cursusctl`` and ``python`` resolve, through ``PATH``, to shims
  running this checkout with the test's interpreter (the image's ``/opt/cursus/bin``).

Everything else (ENV defaults, entrypoint, compose interpolation, ``envFrom``, ``fieldRef``,
``secretKeyRef``, Kubernetes ``$(VAR)`` expansion, probes) follows the files as written.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
K8S_DIR = DEPLOY / "k8s"

#: Pinned Kubernetes version the manifests are validated against (schemas shipped by kubernetes-validate).
K8S_VERSION = "1.31.0"

#: Environment names the files may set that are not broker configuration keys.
NON_CONFIG_ENV = frozenset({"PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "TMPDIR", "POD_NAME",
                            "POD_NAMESPACE"})


# --- YAML -----------------------------------------------------------------------------------------------

def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty document of a YAML file (safe loader: merge keys resolved, no tags)."""
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


# --- Dockerfile -----------------------------------------------------------------------------------------

@dataclass
class Image:
    """What the final stage of ``deploy/Dockerfile`` declares."""

    stages: list[str] = field(default_factory=list)   # every FROM line's arguments
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults before the first FROM
    env: dict[str, str] = field(default_factory=dict)
    user: str = ""
    workdir: str = ""
    volumes: list[str] = field(default_factory=list)
    exposed: list[int] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)  # the exec-form CMD of HEALTHCHECK
    healthcheck_options: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    instructions: list[tuple[str, str]] = field(default_factory=list)  # final stage, (INSTRUCTION, rest)


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continuation"
    result = []
    for line in lines:
        name, _, rest = line.partition(" ")
        result.append((name.upper(), rest.strip()))
    return result


def parse_image(path: Path = DOCKERFILE) -> Image:
    """The final stage's settings (earlier stages only contribute their FROM line)."""
    image = Image()
    for name, rest in dockerfile_instructions(path):
        if name == "ARG" and not image.stages:
            key, _, default = rest.partition("=")
            image.args[key] = default
        elif name == "FROM":
            image.stages.append(rest)
            image.env, image.instructions = {}, []
            image.user = image.workdir = ""
            image.volumes, image.exposed, image.healthcheck, image.entrypoint, image.cmd = [], [], [], [], []
            continue
        image.instructions.append((name, rest))
        if name == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                image.env[key] = value
        elif name == "USER":
            image.user = rest
        elif name == "WORKDIR":
            image.workdir = rest
        elif name == "VOLUME":
            image.volumes += json.loads(rest)
        elif name == "EXPOSE":
            image.exposed += [int(port.split("/")[0]) for port in rest.split()]
        elif name == "HEALTHCHECK":
            options, _, command = rest.partition("CMD ")
            image.healthcheck_options = dict(opt.lstrip("-").split("=", 1) for opt in options.split())
            image.healthcheck = json.loads(command)
        elif name == "ENTRYPOINT":
            image.entrypoint = json.loads(rest)
        elif name == "CMD":
            image.cmd = json.loads(rest)
    return image


# --- Compose --------------------------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$")


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Compose interpolation of ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``,
    ``${VAR?error}`` and ``$$``. Raises ValueError for a required variable that is missing and for any other
    ``$`` form (the files do not use them, and this emulation does not know them)."""

    def one(match: re.Match[str]) -> str:
        whole, name, op, arg = match.group(0), match.group(1), match.group(2), match.group(3)
        if whole == "$$":
            return "$"
        if name is None:
            raise ValueError(f"unsupported interpolation in {text!r}")
        value = variables.get(name)
        if op is None:
            return value or ""
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if unset else str(value)
        if unset:
            raise ValueError(f"required variable {name} is missing: {arg}")
        return str(value)

    return _INTERPOLATION.sub(one, text)


def _interpolate_tree(node: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, list):
        return [_interpolate_tree(item, variables) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, variables) for key, value in node.items()}
    return node


def load_compose(variables: Mapping[str, str], path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The compose file as Compose sees it: YAML (anchors and merge keys resolved), then interpolated with
    ``variables`` (what ``deploy/.env`` and the shell would provide)."""
    (doc,) = load_yaml_documents(path)
    return dict(_interpolate_tree(doc, variables))


def compose_environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or ``KEY=VALUE`` list) as strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(key): "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            for key, value in env.items()}


# --- Kubernetes -----------------------------------------------------------------------------------------

#: kustomization.yaml fields the local renderer implements; any other field fails the render.
_KUSTOMIZE_FIELDS = frozenset({"apiVersion", "kind", "resources", "labels", "images"})


def _set_images(resource: dict[str, Any], images: list[dict[str, str]]) -> None:
    """kustomize ``images``: rewrite each container image whose name matches an entry's ``name``."""
    pod = resource.get("spec", {}).get("template", {}).get("spec", {})
    for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
        ref = container["image"]
        name = ref.split("@")[0].rsplit(":", 1)[0] if ":" in ref.rsplit("/", 1)[-1] else ref.split("@")[0]
        for entry in images:
            assert set(entry) <= {"name", "newName", "newTag", "digest"}, entry
            if entry["name"] == name:
                new = entry.get("newName", name)
                container["image"] = (f"{new}@{entry['digest']}" if "digest" in entry
                                      else f"{new}:{entry['newTag']}" if "newTag" in entry
                                      else new + ref[len(name):])


def kustomize_build(directory: Path = K8S_DIR) -> list[dict[str, Any]]:
    """Render ``directory`` like ``kubectl kustomize``, for the subset of kustomization fields in use:
    ``resources`` (files, in order), ``labels`` (pairs added to every resource's ``metadata.labels``;
    with ``includeSelectors`` / ``includeTemplates`` also to selectors / pod templates) and ``images``
    (what ``kustomize edit set image`` writes). Raises
    AssertionError for any other field, so a new field forces this renderer to learn it."""
    (kustomization,) = load_yaml_documents(directory / "kustomization.yaml")
    unknown = set(kustomization) - _KUSTOMIZE_FIELDS
    assert not unknown, f"kustomization fields the local renderer does not implement: {sorted(unknown)}"
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        resources += load_yaml_documents(directory / name)
    for entry in kustomization.get("labels", []):
        assert set(entry) <= {"pairs", "includeSelectors", "includeTemplates"}, entry
        for resource in resources:
            resource.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
            spec = resource.get("spec", {})
            if entry.get("includeSelectors"):
                if "selector" in spec:
                    target = spec["selector"].get("matchLabels", spec["selector"])
                    target.update(entry["pairs"])
            if entry.get("includeTemplates") or entry.get("includeSelectors"):
                if "template" in spec:
                    spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    for resource in resources:
        _set_images(resource, kustomization.get("images", []))
    return resources


def find_resource(resources: Iterable[Mapping[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return dict(matches[0])


_K8S_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def k8s_expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion in ``env[].value``, ``command`` and ``args``: ``$(VAR)`` becomes VAR's value
    when VAR is defined (else stays as written), ``$$`` becomes ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _K8S_REFERENCE.sub(one, text)


def pod_environment(container: Mapping[str, Any], *, pod_name: str, namespace: str,
                    config_maps: Mapping[str, Mapping[str, str]],
                    secrets: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ``envFrom`` first, then ``env`` in order
    (values expanded against what is defined so far), ``fieldRef`` for the pod's name and namespace,
    ``configMapKeyRef`` / ``secretKeyRef`` (an absent key of an ``optional`` reference leaves the variable
    unset)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]])
        else:
            env.update(secrets[source["secretRef"]["name"]])
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = k8s_expand(str(item["value"]), env)
            continue
        ref = item["valueFrom"]
        if "fieldRef" in ref:
            env[name] = fields[ref["fieldRef"]["fieldPath"]]
            continue
        kind = "secretKeyRef" if "secretKeyRef" in ref else "configMapKeyRef"
        store = secrets if kind == "secretKeyRef" else config_maps
        key_ref = ref[kind]
        data = store.get(key_ref["name"])
        if data is None or key_ref["key"] not in data:
            assert key_ref.get("optional"), f"{name}: {kind} {key_ref['name']}/{key_ref['key']} is missing"
            continue
        env[name] = data[key_ref["key"]]
    return env


# --- Local "containers" ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostMap:
    """Compose hostnames / pod DNS names -> loopback addresses, rewritten as whole names."""

    names: Mapping[str, str]

    def rewrite(self, text: str) -> str:
        if not self.names:
            return text
        alternatives = "|".join(re.escape(name) for name in sorted(self.names, key=len, reverse=True))
        pattern = re.compile(rf"(?<![\w.-])({alternatives})(?![\w.-])")
        return pattern.sub(lambda m: self.names[m.group(1)], text)


def map_mounts(text: str, mounts: Mapping[str, Path]) -> str:
    """Replace each mount target (as a whole path or a path prefix) with the host directory mounted there."""
    if not mounts:
        return text
    alternatives = "|".join(re.escape(target) for target in sorted(mounts, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?![\w.-])")  # one pass: host paths stay as they are
    return pattern.sub(lambda m: str(mounts[m.group(1)]), text)


def write_shims(directory: Path) -> Path:
    """``cursus-broker``, ``cursusctl`` and ``python`` for this checkout (the image's ``/opt/cursus/bin``)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, args in (("cursus-broker", "-m cursus.cli.broker"), ("cursusctl", "-m cursus.cli.ctl"),
                       ("python", "")):
        shim = directory / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {args} "$@"\n')
        shim.chmod(0o755)
    return directory


@dataclass
class LocalContainer:
    """One broker "container": its address, argv, environment and working directory, as a process."""

    name: str
    address: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    spec_env: dict[str, str] = field(default_factory=dict)  # the environment before the local translations
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def http_status(self, port: int, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.address}:{port}{path}", timeout=3) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def run(self, argv: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run another command "inside" this container (same environment, ``127.0.0.1`` is its address)."""
        argv = [arg.replace("127.0.0.1", self.address) for arg in argv]
        return subprocess.run(argv, env=self.env, cwd=self.cwd, capture_output=True, text=True,
                              timeout=timeout_s, check=False)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def container_environment(image: Image, spec_env: Mapping[str, str], *, address: str, hosts: HostMap,
                          mounts: Mapping[str, Path], shims: Path) -> dict[str, str]:
    """Image ENV < the spec's environment, then the four local translations (module docstring)."""
    env = {**image.env, **spec_env}
    env = {key: hosts.rewrite(map_mounts(value, mounts)) for key, value in env.items()}
    if env.get("HOST", "0.0.0.0") in ("0.0.0.0", "::", ""):
        env["HOST"] = address  # the container's wildcard bind: its own network namespace, its own address
    env["PATH"] = f"{shims}{os.pathsep}/usr/bin:/bin"
    env["PYTHONPATH"] = str(REPO)
    return env


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str,
               alive: Callable[[], str | None] = lambda: None) -> Any:
    """Poll ``predicate`` until truthy; ``alive()`` returning text means a process died (fail at once)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            value = predicate()
        except Exception as exc:  # not up yet: keep polling until the deadline
            value, last = None, exc
        if value:
            return value
        dead = alive()
        if dead:
            raise AssertionError(f"{what}: {dead}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")
        time.sleep(0.1)


def start_all(containers: list[LocalContainer], health_port: Callable[[LocalContainer], int],
              timeout_s: float = 45.0) -> None:
    """Start every container at once and wait until each answers 200 on ``/ready``."""
    for container in containers:
        container.start()

    def died() -> str | None:
        for c in containers:
            if c.proc is not None and c.proc.poll() is not None:
                return f"{c.name} exited with {c.proc.returncode}:\n{c.output()[-4000:]}"
        return None

    for container in containers:
        port = health_port(container)
        wait_until(functools.partial(lambda c, p: c.http_status(p, "/ready") == 200, container, port), timeout_s,
                   f"{container.name} ready", died)


def cluster_status(container: LocalContainer, broker: str) -> dict[str, Any]:
    """``cursusctl --broker BROKER cluster-status --json`` run inside ``container``; the parsed document
    (``healthy`` false when the command exits 1)."""
    done = container.run(["cursusctl", "--broker", broker, "--json", "cluster-status"])
    assert done.returncode in (0, 1), f"cursusctl failed ({done.returncode}): {done.stderr}{done.stdout}"
    doc: dict[str, Any] = json.loads(done.stdout)
    assert bool(doc.get("healthy")) == (done.returncode == 0)
    return doc


def healthy_cluster_status(container: LocalContainer, broker: str, what: str,
                           timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll :func:`cluster_status` until the cluster reports healthy; the healthy document."""

    def healthy() -> dict[str, Any] | None:
        doc = cluster_status(container, broker)
        return doc if doc.get("healthy") else None

    result: dict[str, Any] = wait_until(healthy, timeout_s, what)
    return result


def make_certs(out: Path, hosts: Iterable[str], shims: Path, nodes: int = 3) -> None:
    """``cursusctl certs`` as docs/deploy.md runs it, for ``hosts`` (names and the addresses they map to)."""
    argv = [str(shims / "cursusctl"), "certs", "--out", str(out), "--nodes", str(nodes)]
    for host in hosts:
        argv += ["--host", host]
    subprocess.run(argv, check=True, capture_output=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
                   timeout=60)


# --- docs/deploy.md -------------------------------------------------------------------------------------

DEPLOY_DOC = REPO / "docs" / "deploy.md"


def documented_commands(program: str, path: Path = DEPLOY_DOC) -> list[list[str]]:
    """Every ``program ...`` command in the page's ``sh`` blocks, continuation lines joined, split at
    ``&&`` into single commands (each as its argv)."""
    commands: list[list[str]] = []
    for block in re.findall(r"```sh\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if argv[:1] == [program]:
                    commands.append(argv)
    return commands


def documented_cert_hosts(out: str) -> list[str]:
    """The ``--host`` values of the documented ``cursusctl certs --out OUT`` command."""
    (argv,) = [a for a in documented_commands("cursusctl") if a[1:2] == ["certs"] and a[a.index("--out") + 1] == out]
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--host"]


def documented_secret_files(secret: str) -> dict[str, str]:
    """Secret key -> file (relative to the certs directory's parent) of the documented
    ``kubectl create secret generic SECRET --from-file ...`` command."""
    (argv,) = [a for a in documented_commands("kubectl") if "generic" in a and a[a.index("generic") + 1] == secret]
    files = {}
    for arg in argv:
        if arg.startswith("--from-file="):
            value = arg.split("=", 1)[1]
            key, _, source = value.rpartition("=")
            files[key or Path(source).name] = source
    return files
