"""deploy/'s manifests (docker compose, Kubernetes, systemd) checked against the code they launch:
every ``shoal`` command line parses with the real CLI parser and names an actor of its own
deployment's plan; the actors of one deployment get the same engine flags; every image is the
one the Dockerfile builds; credentials come only as SHOAL_NATS_USER / SHOAL_NATS_PASSWORD from
the environment; every file, Secret, ConfigMap and volume named exists; the NATS cluster is the
agreed 3 nodes, whose routes (and their password) come only from the generated
``cluster-auth.conf`` included inside ``cluster {}``, mounted beside each config like
``auth.conf``; in Kubernetes only the NATS pods reach the routes' port. (The dashboard's metric
names: tests/integration/test_deploy_dashboard.py.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.bus.nats_ops.permissions import user_name
from shoal.config.deployment import OPTION_GROUPS
from shoal.deploy.actors import actor_target
from shoal.deploy.arguments import config_from_namespace, option_default
from shoal.deploy.cli import build_parser
from tests.unit.deploy_manifests import (
    COMPOSE_FILE,
    DEPLOY,
    IMAGE,
    K8S_DIR,
    SYSTEMD_DIR,
    Launch,
    all_launches,
    compose_default,
    installed_source,
    k8s_workloads,
    load_yaml_documents,
    systemd_units,
    unit_settings,
)

NATS_HOSTS = ("nats-0", "nats-1", "nats-2")
CREDENTIAL_ENV = {"SHOAL_NATS_USER", "SHOAL_NATS_PASSWORD"}
# shoal nats-auth --namespace shoal --cluster-auth-file cluster-auth.conf (docs/deploy.md)
GENERATED = {"auth.conf", "cluster-auth.conf"}
NATS_PORTS = {"client": 4222, "cluster": 6222, "monitor": 8222}
# Not engine options: where and as whom one actor runs.
PLACE = {"command", "kind", "model", "actor_id", "host", "port", "api_key", "sse_keep_alive_s"}
PLACE |= {"shutdown_delay_s"}
PLACE |= {"log_level", "tp_init_method", "ep_init_method"}
LAUNCHES = all_launches()
LOAD_BALANCER = "gateway-lb"  # compose's nginx in front of the gateways


def parse(argv: list[str]) -> argparse.Namespace:
    """``shoal ARGV`` parsed by the real parser (``SystemExit`` on an error)."""
    with contextlib.redirect_stderr(io.StringIO()):
        return build_parser().parse_args(argv)


def unknown_args(argv: list[str]) -> list[str]:
    with contextlib.redirect_stderr(io.StringIO()):
        return build_parser().parse_known_args(argv)[1]


def actors() -> list[Launch]:
    return [launch for launch in LAUNCHES if launch.argv[0] == "actor"]


def test_the_manifests_launch_every_role() -> None:
    kinds = {(launch.where.split()[0], launch.kind) for launch in actors()}
    for runtime in ("compose", "k8s", "systemd"):
        roles = {kind for where, kind in kinds if where == runtime}
        assert roles == {"gateway", "engine", "worker", "tier", "recovery"}, runtime


def test_every_command_line_parses() -> None:
    failures = []
    for launch in LAUNCHES:
        try:
            parse(launch.argv)
        except SystemExit:
            failures.append((launch.where, unknown_args(launch.argv)))
    assert failures == []


def test_unknown_flags_fail_to_parse() -> None:
    argv = [*actors()[0].argv, "--no-such-flag"]
    with pytest.raises(SystemExit):
        parse(argv)


def _plan_namespace(launch: Launch, model: Path) -> tuple[argparse.Namespace, Any]:
    ns = parse(launch.argv)
    return ns, config_from_namespace(ns, str(model))


def test_every_actor_is_in_its_deployments_plan(tiny_checkpoint: Callable[..., Path]) -> None:
    model = tiny_checkpoint("llama")
    for launch in actors():
        ns, config = _plan_namespace(launch, model)
        container = not launch.where.startswith("systemd")
        assert ns.model == ("/models/model" if container else "/srv/models/my-model"), launch.where
        assert ns.actor_id, f"{launch.where}: no --id"
        try:
            actor_target(ns.kind, config, ns.actor_id, ns)
        except ValueError as exc:
            pytest.fail(f"{launch.where}: {exc}")


def _engine_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags every actor of one deployment must share (the CPU tier's id is per host)."""
    options = {k: v for k, v in vars(ns).items() if k not in PLACE}
    kv = options.get("kv_transfer_config")
    if kv is not None:
        extra = {k: v for k, v in kv["kv_connector_extra_config"].items() if k != "cpu_tier_id"}
        options["kv_transfer_config"] = {**kv, "kv_connector_extra_config": extra}
    return options


def test_one_deployments_actors_share_their_engine_flags() -> None:
    for runtime in ("compose", "k8s", "systemd"):
        launches = [launch for launch in actors() if launch.where.startswith(runtime)]
        options = [_engine_options(parse(launch.argv)) for launch in launches]
        assert all(o == options[0] for o in options), runtime
        assert set(OPTION_GROUPS) & set(options[0])  # engine options were compared


def test_data_parallel_ranks_match_the_engines_launched() -> None:
    for runtime in ("compose", "k8s"):
        launches = [launch for launch in actors() if launch.where.startswith(runtime)]
        engines = {parse(launch.argv).actor_id for launch in launches if launch.kind == "engine"}
        workers = {parse(launch.argv).actor_id for launch in launches if launch.kind == "worker"}
        dp = parse(launches[0].argv).data_parallel_size
        assert engines == {f"engine-{d}" for d in range(dp)}, runtime
        assert workers == {f"worker-{d}-0" for d in range(dp)}, runtime


def test_every_process_connects_to_the_three_nats_nodes() -> None:
    for launch in LAUNCHES:
        ns = parse(launch.argv)
        url = ns.nats_url
        hosts = [re.sub(r"^nats://|(\.nats)?:4222$", "", u) for u in url.split(",")]
        assert hosts == list(NATS_HOSTS), launch.where


def test_credentials_only_from_the_agreed_environment() -> None:
    for launch in LAUNCHES:
        assert not [a for a in launch.argv if "password" in a.lower()], launch.where
        named = {k for k in launch.env if "NATS" in k and re.search("USER|PASS", k)}
        assert named == CREDENTIAL_ENV, launch.where
        user = launch.env["SHOAL_NATS_USER"]
        secret = f"<secret shoal-nats-{launch.role}/SHOAL_NATS_USER>"
        assert user in (user_name("shoal", launch.role), secret), launch.where


def test_every_image_is_the_one_the_dockerfile_builds() -> None:
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert f"-t {IMAGE} " in dockerfile
    assert 'ENTRYPOINT ["shoal"]' in dockerfile
    (compose,) = load_yaml_documents(COMPOSE_FILE)
    images = {name: compose_default(s["image"]) for name, s in compose["services"].items()}
    assert images.pop(LOAD_BALANCER) == "nginx:1.27-alpine"  # the one that is not shoal
    assert set(images.values()) == {IMAGE}
    for _, workload in k8s_workloads():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            assert container["image"] == IMAGE
    (kustomization,) = load_yaml_documents(K8S_DIR / "kustomization.yaml")
    assert kustomization["images"] == [{"name": "shoal", "newTag": "latest"}]


def test_compose_files_exist_and_nats_nodes_are_the_agreed_ones() -> None:
    (compose,) = load_yaml_documents(COMPOSE_FILE)
    nats = {n: s for n, s in compose["services"].items() if s.get("entrypoint") == ["nats-server"]}
    assert sorted(nats) == list(NATS_HOSTS)
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = compose_default(volume).split(":")[0]
            if source.startswith("."):
                path = (COMPOSE_FILE.parent / source).resolve()
                assert path.exists() or path.name in GENERATED, source


def _includes(config: str) -> list[str]:
    return re.findall(r"^\s*include \./(\S+)$", config, re.M)


def _cluster_block(config: str) -> str:
    found = re.search(r"^\s*cluster \{\n(.*?)^\s*\}$", config, re.S | re.M)
    assert found is not None, config
    return found[1]


def _routes_only_generated(config: str) -> None:
    """No route (nor its password) in a committed config: they come from the generated file,
    included inside the cluster block."""
    config = re.sub(r"#.*", "", config)
    assert "nats-route://" not in config and not re.search(r"^\s*routes\s*[:=\[]", config, re.M)
    assert _includes(_cluster_block(config)) == ["cluster-auth.conf"]
    assert set(_includes(config)) == GENERATED


def _nats_k8s() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    config_map, service, statefulset = load_yaml_documents(K8S_DIR / "nats.yaml")
    return config_map, service, statefulset


def test_nats_configs_make_one_jetstream_cluster() -> None:
    for i, host in enumerate(NATS_HOSTS):
        text = (DEPLOY / "nats" / f"{host}.conf").read_text()
        assert f'server_name: "{host}"' in text
        assert 'listen: "0.0.0.0:4222"' in text and 'listen: "0.0.0.0:6222"' in text
        assert 'http: "0.0.0.0:8222"' in text and "jetstream" in text, i
        _routes_only_generated(text)
    (config_map, service, statefulset) = _nats_k8s()
    assert statefulset["spec"]["replicas"] == 3 and service["spec"]["clusterIP"] == "None"
    _routes_only_generated(config_map["data"]["nats.conf"])


def test_the_generated_nats_files_are_mounted_beside_each_config() -> None:
    (compose,) = load_yaml_documents(COMPOSE_FILE)
    for host in NATS_HOSTS:
        mounts = dict(v.split(":")[1::-1] for v in compose["services"][host]["volumes"])
        config = (COMPOSE_FILE.parent / mounts["/etc/nats/nats.conf"]).resolve()
        for name in _includes(config.read_text()):
            assert mounts[f"/etc/nats/{name}"] == f"../nats/{name}", host
    (config_map, _, statefulset) = _nats_k8s()
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    for name in _includes(config_map["data"]["nats.conf"]):
        mount = mounts[f"/etc/nats/{name}"]
        assert secrets[mount["name"]] == "shoal-nats-auth" and mount["subPath"] == name
    unit = (SYSTEMD_DIR / "shoal-nats@.service").read_text()
    assert all(name in unit for name in GENERATED)  # the unit says what goes beside the config


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # no matchExpressions to evaluate here
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_only_the_nats_pods_reach_the_routes() -> None:
    (kustomization,) = load_yaml_documents(K8S_DIR / "kustomization.yaml")
    assert "network-policy.yaml" in kustomization["resources"]
    (policy,) = load_yaml_documents(K8S_DIR / "network-policy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    pods = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in k8s_workloads()}
    nats_labels = _nats_k8s()[2]["spec"]["template"]["metadata"]["labels"]
    assert _selects(policy["spec"]["podSelector"], nats_labels)
    assert [n for n, labels in pods.items() if _selects(policy["spec"]["podSelector"], labels)] == [
        "nats.yaml"
    ]
    peers: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            peers.setdefault(port["port"], []).extend(rule["from"])
    assert set(peers) == set(NATS_PORTS.values())  # every port named, nothing else open
    (route_peer,) = peers[NATS_PORTS["cluster"]]
    assert set(route_peer) == {"podSelector"}  # no namespaceSelector, no ipBlock
    reaching = [n for n, labels in pods.items() if _selects(route_peer["podSelector"], labels)]
    assert reaching == ["nats.yaml"]
    for port in (NATS_PORTS["client"], NATS_PORTS["monitor"]):
        assert peers[port] == [{"podSelector": {}}]  # every pod of this namespace, no other


def _k8s_defined() -> dict[str, set[str]]:
    defined: dict[str, set[str]] = {}
    for path in K8S_DIR.glob("*.yaml"):
        for doc in load_yaml_documents(path):
            defined.setdefault(doc["kind"], set()).add(doc.get("metadata", {}).get("name", ""))
    return defined


def test_k8s_references_exist() -> None:
    defined = _k8s_defined()
    (kustomization,) = load_yaml_documents(K8S_DIR / "kustomization.yaml")
    assert all((K8S_DIR / r).is_file() for r in kustomization["resources"])
    secrets = {
        doc["metadata"]["name"]: doc["stringData"]
        for doc in load_yaml_documents(K8S_DIR / "secrets.example.yaml")
    }
    for _, workload in k8s_workloads():
        pod = workload["spec"]["template"]["spec"]
        claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])} | {c: {} for c in claims}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in defined["ConfigMap"]
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert claim in defined["PersistentVolumeClaim"]
        for container in pod["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= set(volumes)
            for mount in container.get("volumeMounts", []):
                secret = volumes[mount["name"]].get("secret", {}).get("secretName")
                if secret is not None and "subPath" in mount:
                    assert mount["subPath"] in secrets[secret], mount
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["key"] in secrets[ref["name"]], ref


def test_k8s_probes() -> None:
    for _, workload in k8s_workloads():
        if workload["kind"] == "Job":  # runs to completion: nothing to probe
            continue
        for container in workload["spec"]["template"]["spec"]["containers"]:
            probe = container.get("readinessProbe")
            assert probe is not None, container["name"]
            if container.get("args", [None, None])[:2] == ["actor", "gateway"]:
                assert probe["httpGet"]["path"] == "/health"
    probes = [launch for launch in LAUNCHES if launch.is_probe and launch.where.startswith("k8s")]
    for launch in probes:  # the ID comes from $SHOAL_ACTOR_ID: it must be the actor's own
        assert parse(launch.argv).actor_id is None and launch.env["SHOAL_ACTOR_ID"]
    assert {parse(launch.argv).kind for launch in probes} == {
        "engine",
        "worker",
        "tier",
        "recovery",
    }


def test_systemd_units_files_and_restart() -> None:
    units = systemd_units()
    assert {u.name for u in units} >= {f"shoal-{r}@.service" for r in ("engine", "gateway")}
    for unit in units:
        settings = unit_settings(unit)
        assert settings["Restart"] == ["on-failure"], unit.name
        files = settings.get("EnvironmentFile", [])
        files += re.findall(r"/etc/shoal/\S+", " ".join(settings["ExecStart"]))
        for file in files:
            for host in NATS_HOSTS:
                source = installed_source(file.replace("%i", host.removeprefix("nats-")))
                assert source.is_file(), f"{unit.name}: {file}"
        role = unit.name.removeprefix("shoal-").removesuffix(".service").removesuffix("@")
        role = {"nats-init": "provisioner"}.get(role, role)
        if role != "nats":
            assert f"/etc/shoal/credentials/{role}.env" in files


INIT_OPTIONS = ("namespace", "jetstream_replicas", "kv_events_snapshot_interval_s")


def test_nats_init_runs_once_per_deployment_with_its_actors_settings() -> None:
    for runtime in ("compose", "k8s", "systemd"):
        inits = [x for x in LAUNCHES if x.where.startswith(runtime) and x.argv[0] == "nats-init"]
        assert len(inits) == 1, runtime
        init = parse(inits[0].argv)
        actor = parse(next(x for x in actors() if x.where.startswith(runtime)).argv)
        for option in INIT_OPTIONS:
            given = getattr(actor, option)
            assert getattr(init, option) == (option_default(option) if given is None else given)
    (compose,) = load_yaml_documents(COMPOSE_FILE)
    for name, service in compose["services"].items():
        if service.get("command", [None])[0] == "actor":  # starts once the buckets exist
            assert service["depends_on"]["nats-init"] == {
                "condition": "service_completed_successfully"
            }, name


def test_dashboard_is_grafana_json() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "shoal-dashboard.json").read_text())
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "first token", "inter-token", "end-to-end", "running", "kv cache"):
        assert topic in titles
    for topic in ("prefix cache hit", "acceptance", "tiering"):
        assert topic in titles
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert any("histogram_quantile" in e and "_bucket" in e for e in exprs)


def test_two_gateways_cover_each_others_restart() -> None:
    (compose,) = load_yaml_documents(COMPOSE_FILE)
    gateways = [launch for launch in actors() if parse(launch.argv).kind == "gateway"]
    compose_ids = {parse(g.argv).actor_id for g in gateways if g.where.startswith("compose")}
    assert compose_ids == {"gateway-0", "gateway-1"}
    nginx = (COMPOSE_FILE.parent / "nginx.conf").read_text()
    assert set(re.findall(r"server (gateway-\d+):8000", nginx)) == compose_ids
    assert re.search(r"proxy_next_upstream error", nginx) and "proxy_buffering off" in nginx
    assert compose["services"][LOAD_BALANCER]["ports"] == ["8000:8000"]
    assert all("ports" not in compose["services"][g] for g in compose_ids)
    for _, workload in k8s_workloads():
        (container, *_) = workload["spec"]["template"]["spec"]["containers"]
        if container.get("args", [None, None])[:2] != ["actor", "gateway"]:
            continue
        assert workload["spec"]["replicas"] >= 2
        probe = container["readinessProbe"]
        out_after_s = probe["periodSeconds"] * probe.get("failureThreshold", 3)
        assert parse(container["args"]).shutdown_delay_s > out_after_s
