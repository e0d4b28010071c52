"""Reads deploy/'s manifests the way their runtimes would: every shoal process of docker compose,
Kubernetes and systemd as one ``Launch`` (its ``shoal`` argv with the variables its runtime
expands already expanded, its environment, the image it runs), for tests/unit/
test_deploy_manifests.py."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "docker-compose.yml"
K8S_DIR = DEPLOY / "k8s"
SYSTEMD_DIR = DEPLOY / "systemd"
IMAGE = "shoal:latest"
SHOAL_BIN = "/opt/shoal/venv/bin/shoal"
_COMPOSE_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?(?::?\?[^}]*)?\}")
_K8S_VAR = re.compile(r"\$\((\w+)\)")
_SYSTEMD_VAR = re.compile(r"\$\{(\w+)\}")


@dataclass
class Launch:
    """One shoal process (or a probe run in its container) as a manifest starts it."""

    where: str  # manifest and service/container, for messages
    argv: list[str]  # after ``shoal``
    env: dict[str, str] = field(default_factory=dict)
    image: str = IMAGE
    is_probe: bool = False

    @property
    def kind(self) -> str:
        return self.argv[1]

    @property
    def role(self) -> str:
        """Whose NATS user it runs as (``bus.nats_ops.permissions``)."""
        return "provisioner" if self.argv[0] == "nats-init" else self.kind


def load_yaml_documents(path: Path) -> list[Any]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def compose_default(text: str) -> str:
    """``${VAR:-default}`` → default (``${VAR:?message}`` → ``<VAR>``), as with no .env."""
    return _COMPOSE_VAR.sub(lambda m: m.group(2) if m.group(2) is not None else f"<{m[1]}>", text)


def compose_launches() -> Iterator[Launch]:
    (compose,) = load_yaml_documents(COMPOSE_FILE)
    for name, service in compose["services"].items():
        if service.get("entrypoint") or "command" not in service:  # nats-server, nginx
            continue
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        image = compose_default(service["image"])
        yield Launch(f"compose {name}", list(service["command"]), env, image)
        test = service.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "shoal"]:
            yield Launch(f"compose {name} healthcheck", test[2:], env, image, is_probe=True)


def k8s_workloads() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in load_yaml_documents(path):
            if doc.get("kind") in ("Deployment", "StatefulSet", "Job"):
                yield path.name, doc


def _k8s_env(container: dict[str, Any], pod_index: int, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet sets it (downward API values filled in)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = _K8S_VAR.sub(lambda m: env.get(m[1], m[0]), item["value"])
            continue
        ref = item["valueFrom"]
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            env[item["name"]] = str(pod_index) if "pod-index" in path else pod_name
        else:  # a Secret's key: its name stands in for the value
            env[item["name"]] = (
                f"<secret {ref['secretKeyRef']['name']}/{ref['secretKeyRef']['key']}>"
            )
    return env


def _expand_k8s(arg: str, env: dict[str, str]) -> str:
    """``$(VAR)`` in a container's args, as the kubelet expands it."""
    return _K8S_VAR.sub(lambda m: env.get(m[1], m[0]), arg)


def k8s_launches() -> Iterator[Launch]:
    for file, workload in k8s_workloads():
        name = workload["metadata"]["name"]
        for index in range(workload["spec"].get("replicas", 1)):
            pod = workload["spec"]["template"]["spec"]
            for container in pod["containers"]:
                if container.get("command"):  # the nats-server nodes
                    continue
                env = _k8s_env(container, index, f"{name}-{index}")
                argv = [
                    _K8S_VAR.sub(lambda m, e=env: e.get(m[1], m[0]), a) for a in container["args"]
                ]
                where = f"k8s {file} {name}-{index}/{container['name']}"
                yield Launch(where, argv, env, container["image"])
                probe = container.get("readinessProbe", {}).get("exec", {}).get("command", [])
                if probe[:1] == ["shoal"]:  # no variables expanded in exec probes
                    yield Launch(f"{where} probe", probe[1:], env, container["image"], True)


def read_env_file(path: Path) -> dict[str, str]:
    """A systemd EnvironmentFile (KEY=VALUE lines, a value maybe in single quotes)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip().removeprefix("'").removesuffix("'")
    return env


def unit_settings(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def installed_source(path: str) -> Path:
    """Where the file a unit names under /etc/shoal comes from in deploy/ (docs/deploy.md)."""
    relative = path.removeprefix("/etc/shoal/")
    if relative.startswith("nats/"):
        return DEPLOY / relative
    example = SYSTEMD_DIR / f"{relative}.example"
    return example if example.exists() else SYSTEMD_DIR / relative


SAMPLE_INSTANCES = {"gateway": "0", "engine": "1", "worker": "1-0", "tier": "kv-cpu-fs0"}


def systemd_expand(command: str, env: dict[str, str], instance: str) -> list[str]:
    """systemd's ExecStart: ``${VAR}`` one word, ``$VAR`` split on whitespace, ``%i``."""
    argv: list[str] = []
    for word in shlex.split(command.replace("%i", instance)):
        if word.startswith("$") and not word.startswith("${"):
            argv += env.get(word[1:], "").split()
        else:
            argv.append(_SYSTEMD_VAR.sub(lambda m: env.get(m[1], ""), word))
    return argv


def systemd_units() -> list[Path]:
    """The actors' template units and the one-shot ``shoal-nats-init.service``."""
    return sorted(SYSTEMD_DIR.glob("shoal-*.service"))


def systemd_launches() -> Iterator[Launch]:
    for unit in systemd_units():
        settings = unit_settings(unit)
        env: dict[str, str] = {}
        for file in settings.get("EnvironmentFile", []):
            env.update(read_env_file(installed_source(file)))
        role = unit.name.removeprefix("shoal-").removesuffix(".service").removesuffix("@")
        for command in settings["ExecStart"]:
            if command.startswith(SHOAL_BIN):
                argv = systemd_expand(command, env, SAMPLE_INSTANCES.get(role, "0"))
                yield Launch(f"systemd {unit.name}", argv[1:], env)


def all_launches() -> list[Launch]:
    return [*compose_launches(), *k8s_launches(), *systemd_launches()]
