"""deploy/kubernetes/, checked without a cluster: every overlay renders (``kubectl kustomize``), every object
passes a strict schema check (``kubernetes-validate --strict``; KEDA's ScaledObject schema), and the manifests
agree with the server and with each other: probe paths the server answers on the port it listens on, a
grace period longer than the drain, a preStop command the image has, the balancers' server slots and the
drain's peers named as the StatefulSet names its pods. Each check has a negative control that fails.

The rolling update itself is played for real in tests/cluster/test_kubernetes_rollout.py, the autoscaling query in
tests/cluster/test_kubernetes_autoscaling.py, Envoy in tests/cluster/test_envoy.py.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes_manifests import (
    KUBERNETES,
    OVERLAYS,
    Manifest,
    config_map_file,
    kubernetes_validate,
    one,
    rendered,
    replica_container,
    replica_environment,
    scaledobject_errors,
)
from servers import REPO_ROOT, fake_settings, running_server, session_client
from test_deploy import run_tool, tool
from test_server_http import SlowWarmupFakePipeline

from arstream.programs import drain
from arstream.app.server import create_app
from arstream.app.settings import Settings
from arstream.cli import COMMANDS

HAPROXY_RENDER = REPO_ROOT / "deploy" / "haproxy" / "render.py"
ENVOY_RENDER = REPO_ROOT / "deploy" / "envoy" / "render.py"
# The manifests' own render commands (deploy/kubernetes/haproxy/kustomization.yaml, .../envoy/kustomization.yaml),
# less the parts the StatefulSet and the ScaledObject decide (names, ports, slot count).
HAPROXY_OPTIONS = ("--maxconn", "4", "--bind", ":8080", "--stats-bind", ":8404", "--admin-bind", "127.0.0.1:8405")
ENVOY_OPTIONS = ("--bind", "0.0.0.0:8080", "--admin", "127.0.0.1:9901")
SECRET = "kubernetes-test-cluster-secret"


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ---- schemas ------------------------------------------------------------------------------------------------


def test_every_object_of_every_overlay_passes_the_strict_schema_check(overlay: str, tmp_path: Path) -> None:
    objects = rendered(overlay)
    builtin = [o for o in objects if o["apiVersion"] != "keda.sh/v1alpha1"]
    result = kubernetes_validate(builtin, tmp_path)
    assert result.returncode == 0 and "ERROR" not in result.stdout and "WARN" not in result.stdout, result.stdout
    assert result.stdout.count("INFO") == len(builtin)  # each object checked, none skipped for want of a schema
    for scaled in (o for o in objects if o["kind"] == "ScaledObject"):
        assert scaledobject_errors(scaled) == []
    kinds = sorted({o["kind"] for o in objects})
    expected = ["ConfigMap", "Deployment", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Service"]
    expected.append("StatefulSet")
    assert kinds == sorted(expected + (["ScaledObject"] if overlay != "cpu" else []))


def test_the_schema_check_fails_a_misspelt_field_and_a_mistyped_value(tmp_path: Path) -> None:
    """Negative control: the same check on the StatefulSet with one field misspelt, then one value of the wrong type."""
    replicas = one(rendered("gpu"), "StatefulSet")
    misspelt = copy.deepcopy(replicas)
    pod = misspelt["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    result = kubernetes_validate([misspelt], tmp_path)
    assert result.returncode != 0 and "terminationGracePeriodSecond" in result.stdout, result.stdout
    mistyped = copy.deepcopy(replicas)
    mistyped["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSeconds"] = "two"
    result = kubernetes_validate([mistyped], tmp_path)
    assert result.returncode != 0 and "periodSeconds" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("path", "wrong"),
    [
        (("spec", "maxReplicaCnt"), 8),  # misspelt: KEDA would ignore it and keep the default of 100
        (("spec", "triggers", 0, "metadata", "serverAdress"), "http://x:9090"),  # a misspelt scaler parameter
        (("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleUp", "stabilisationWindowSeconds"), 0),
        (("spec", "minReplicaCount"), "2"),  # a string where KEDA wants an integer
    ],
)
def test_the_scaledobject_schema_fails_a_misspelt_or_mistyped_field(path: tuple[Any, ...], wrong: object) -> None:
    """Negative control for KEDA's schema: the shipped ScaledObject passes, each broken copy fails at its field."""
    scaled = one(rendered("gpu"), "ScaledObject")
    assert scaledobject_errors(scaled) == []
    broken = copy.deepcopy(scaled)
    parent: Any = broken
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = wrong
    errors = scaledobject_errors(broken)
    assert errors and any(str(path[-1]) in error or ".".join(map(str, path[:-1])) in error for error in errors), errors


# ---- the replicas against the server --------------------------------------------------------------------------


def probe_problems(objects: list[Manifest], server_paths: set[str]) -> list[str]:
    """What is wrong with the replica container's probes: a path the server has no route for, a port it does
    not listen on, a readiness path that is not the one meaning "loaded and not draining"."""
    container = replica_container(objects)
    listening = int(replica_environment(objects)["ARSTREAM_PORT"])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    problems = []
    for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container[probe_name]["httpGet"]
        port = ports.get(probe["port"], probe["port"])
        if port != listening:
            problems.append(f"{probe_name} asks port {probe['port']} ({port}); the server listens on {listening}")
        if probe["path"] not in server_paths:
            problems.append(f"{probe_name} asks {probe['path']}, which the server does not serve")
    if container["readinessProbe"]["httpGet"]["path"] != "/servingz":
        problems.append("readiness must be /servingz: /readyz is 503 when full, which would hold up rollouts")
    if container["livenessProbe"]["httpGet"]["path"] != "/healthz":
        problems.append("liveness must be /healthz, which answers while the model loads")
    startup = container["startupProbe"]
    if startup["periodSeconds"] * startup["failureThreshold"] < 300:
        problems.append("the startup probe must allow minutes of model loading")
    return problems


def server_routes() -> set[str]:
    return {str(getattr(route, "path", "")) for route in create_app(fake_settings()).routes}


def test_probes_ask_paths_the_server_serves_on_the_port_it_listens_on(overlay: str) -> None:
    objects = rendered(overlay)
    assert probe_problems(objects, server_routes()) == []
    # ... and those paths answer 200 on a real, loaded server.
    container = replica_container(objects)
    with running_server(fake_settings()) as server:
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            path = container[probe_name]["httpGet"]["path"]
            assert server.get(path).status_code == 200, (probe_name, path)


@pytest.mark.parametrize(
    ("probe", "field", "wrong"),
    [("readinessProbe", "port", 8001), ("livenessProbe", "path", "/health"), ("readinessProbe", "path", "/readyz")],
)
def test_the_probe_check_fails_a_wrong_port_or_path(probe: str, field: str, wrong: object) -> None:
    """Negative control: a probe on the agent's port, a path the server lacks, readiness that means "has room"."""
    objects = rendered("gpu")
    replica_container(objects)[probe]["httpGet"][field] = wrong
    assert probe_problems(objects, server_routes())


def drain_problems(objects: list[Manifest]) -> list[str]:
    """The preStop drain against the drain's limits: the grace period must outlast both, and the command must
    be one the image has (the project's console script, with arguments ``arstream drain`` accepts)."""
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    container = replica_container(objects)
    drain_timeout = float(replica_environment(objects)["ARSTREAM_DRAIN_TIMEOUT_S"])
    grace = pod["terminationGracePeriodSeconds"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    problems = []
    if command[0] not in scripts:
        problems.append(f"preStop runs {command[0]!r}, not a script the image installs ({sorted(scripts)})")
    if tuple(command[1:2]) not in {c.words for c in COMMANDS}:
        problems.append(f"preStop runs arstream {command[1:2]}, which is no subcommand")
        return problems
    parser = argparse.ArgumentParser(exit_on_error=False)
    drain.add_arguments(parser)
    try:
        args = parser.parse_args(command[2:])
    except (argparse.ArgumentError, SystemExit) as exc:
        return [*problems, f"arstream drain refuses the preStop arguments {command[2:]}: {exc}"]
    listening = replica_environment(objects)["ARSTREAM_PORT"]
    if len(args.url) != 1 or not re.fullmatch(rf"http://(127\.0\.0\.1|localhost):{listening}/?", args.url[0]):
        problems.append(f"preStop drains {args.url}, not this pod's own server on port {listening}")
    if not drain_timeout < args.timeout < grace:
        problems.append(f"need drain timeout {drain_timeout} < preStop's --timeout {args.timeout} < grace {grace}")
    secret = {v["name"]: v for v in container["env"]}.get(drain.SECRET_ENV, {})
    if "secretKeyRef" not in secret.get("valueFrom", {}):
        problems.append(f"{drain.SECRET_ENV} must come from a Secret (the drain and the peers need it)")
    return problems


def test_the_grace_period_outlasts_the_drain_and_prestop_is_a_command_the_image_has(overlay: str) -> None:
    objects = rendered(overlay)
    assert drain_problems(objects) == []
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert 'pip install --no-cache-dir ".[video,wan,webrtc]"' in dockerfile  # installs the project: its console script
    command = replica_container(objects)["lifecycle"]["preStop"]["exec"]["command"]
    result = run_tool(str(Path(sys.executable).parent / command[0]), *command[1:2], "--help")
    assert result.returncode == 0, result.stderr  # the very script the preStop names, installed here as in the image


@pytest.mark.parametrize("case", ["short grace", "no such subcommand", "another port", "unknown option"])
def test_the_drain_check_fails_a_short_grace_period_or_a_wrong_command(case: str) -> None:
    """Negative control: each mistake the drain check exists for."""
    objects = rendered("gpu")
    command = replica_container(objects)["lifecycle"]["preStop"]["exec"]["command"]
    if case == "short grace":
        one(objects, "StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    elif case == "no such subcommand":
        command[1] = "drian"
    elif case == "another port":
        command[2] = "http://127.0.0.1:8001"
    else:
        command.append("--to-all")
    assert drain_problems(objects)


def test_replica_settings_are_settings_the_server_knows(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ARSTREAM_* the manifests set is a serve setting, and the whole set loads from the environment as
    the server reads it (no typo goes unnoticed)."""
    fields = {f"ARSTREAM_{name.upper()}" for name in Settings.model_fields}
    environment = replica_environment(rendered(overlay))
    assert not sorted(set(environment) - fields), f"not settings: {sorted(set(environment) - fields)}"
    for name in [name for name in os.environ if name.startswith("ARSTREAM_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert (settings.port, settings.agent_port, settings.host) == (8000, 8001, "0.0.0.0")
    assert settings.drain_timeout_s == float(environment["ARSTREAM_DRAIN_TIMEOUT_S"])


def test_each_pod_is_its_own_replica_with_its_gpus_weights_from_a_volume_and_the_secret() -> None:
    for overlay in OVERLAYS:
        objects = rendered(overlay)
        replicas = one(objects, "StatefulSet")
        container = replica_container(objects)
        env = {v["name"]: v for v in container["env"]}
        assert env["ARSTREAM_REPLICA_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["ARSTREAM_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"] == {
            "name": "arstream-cluster",
            "key": "secret",
        }
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == {"cpu": None, "gpu-devices": 2}.get(overlay, 1), overlay
        assert replica_environment(objects)["ARSTREAM_DEVICE"] == ("cpu" if overlay == "cpu" else "cuda")
        assert replica_environment(objects).get("ARSTREAM_DEVICES") == devices_for_gpus(objects), overlay
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in replicas["spec"]["template"]["spec"]["volumes"]}
        assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
        claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
        assert one(objects, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadOnlyMany"]


def devices_for_gpus(objects: list[Manifest]) -> str | None:
    """The ARSTREAM_DEVICES a pod with its GPU limit needs: every GPU it is given, as the pod sees them (None for
    one GPU or none)."""
    gpus = replica_container(objects)["resources"]["limits"].get("nvidia.com/gpu") or 1
    return ",".join(f"cuda:{i}" for i in range(gpus)) if gpus > 1 else None


def quantity(text: str) -> int:
    """A Kubernetes memory quantity in Mi or Gi, in bytes."""
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", text).groups()  # type: ignore[union-attr]
    return int(number) * {"Mi": 2**20, "Gi": 2**30}[unit]


def test_a_pod_over_several_gpus_has_shared_memory_for_nccl_and_a_device_count_its_model_can_split() -> None:
    """The gpu-devices overlay: one replica over every GPU of its pod, /dev/shm a memory volume large enough for
    NCCL (a container's own is 64 MiB), the model's heads divisible by the device count, and the base's probes."""
    from arstream.app.settings import Settings
    from arstream.models.registry import load_pipeline

    objects = rendered("gpu-devices")
    container = replica_container(objects)
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    shm_bytes = quantity(volumes[shm["name"]]["emptyDir"]["sizeLimit"])
    assert shm_bytes >= 2**30 and shm_bytes < quantity(container["resources"]["limits"]["memory"])
    environment = replica_environment(objects)
    settings = Settings(model=environment["ARSTREAM_MODEL"], devices=environment["ARSTREAM_DEVICES"])
    pipeline: Any = load_pipeline(settings.model, "meta", config="14b")
    heads = pipeline.kv_cache_spec().num_kv_heads
    assert heads % len(settings.replica_devices()) == 0 and len(settings.replica_devices()) == 2
    single = replica_container(rendered("gpu"))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe] == single[probe], probe


def test_rollouts_and_disruptions_take_one_pod_at_a_time() -> None:
    objects = rendered("gpu")
    replicas = one(objects, "StatefulSet")
    assert replicas["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
    budget = one(objects, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert (
        budget["spec"]["selector"]["matchLabels"].items() <= replicas["spec"]["template"]["metadata"]["labels"].items()
    )


# ---- names: the StatefulSet, its Services, the balancers, the drain's peers, KEDA -------------------------------


def statefulset_names(objects: list[Manifest]) -> tuple[str, str, int, list[str]]:
    """The StatefulSet's name, its headless Service, its serving port, and its pods' names up to KEDA's maximum."""
    replicas = one(objects, "StatefulSet")
    maximum = one(rendered("gpu"), "ScaledObject")["spec"]["maxReplicaCount"]
    name = replicas["metadata"]["name"]
    port = {p["name"]: p["containerPort"] for p in replica_container(objects)["ports"]}["http"]
    return name, replicas["spec"]["serviceName"], port, [f"{name}-{ordinal}" for ordinal in range(maximum)]


def haproxy_servers(config: str) -> dict[str, list[str]]:
    """Each backend's server names."""
    servers: dict[str, list[str]] = {}
    backend = ""
    for line in config.splitlines():
        if line.startswith("backend "):
            backend = line.split()[1]
        elif line.startswith("    server "):
            servers.setdefault(backend, []).append(line.split()[1])
    return servers


def test_the_headless_service_publishes_every_pod_by_name_loading_or_draining() -> None:
    objects = rendered("gpu")
    _name, service, port, _pods = statefulset_names(objects)
    headless = one(objects, "Service", service)["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"].items() <= one(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"].items()
    assert {p["name"]: p["port"] for p in headless["ports"]} == {"http": port, "agent": 8001}


def test_haproxy_config_is_render_py_for_the_statefulset_and_passes_haproxy_check(tmp_path: Path) -> None:
    objects = rendered("gpu")
    name, service, port, pods = statefulset_names(objects)
    committed = config_map_file(objects, "arstream-haproxy", "haproxy.cfg")
    assert committed == (KUBERNETES / "haproxy" / "haproxy.cfg").read_text()
    args = ["--statefulset", f"{name}={len(pods)}", "--headless-service", service, "--replica-port", str(port)]
    result = run_tool(sys.executable, str(HAPROXY_RENDER), *args, *HAPROXY_OPTIONS)
    assert result.returncode == 0, result.stderr
    assert committed == result.stdout, "re-render deploy/kubernetes/haproxy/haproxy.cfg (its kustomization.yaml)"
    assert haproxy_servers(committed) == {"sessions": pods, "http": pods}
    for pod in pods:
        assert f"use-server {pod} if {{ var(txn.replica) -m str {pod} }}" in committed
        assert f'"{pod}.{service}.${{POD_NAMESPACE}}.svc.cluster.local:{port}"' in committed
    config = tmp_path / "haproxy.cfg"
    config.write_text(committed)
    check = subprocess.run(
        [tool("haproxy"), "-c", "-q", "-f", str(config)],
        env={"POD_NAMESPACE": "arstream"},
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    balancer = one(objects, "Deployment", "arstream-balancer")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in balancer["env"]


def test_envoy_config_is_render_py_for_the_statefulset() -> None:
    objects = rendered("gpu-envoy")
    name, service, port, pods = statefulset_names(objects)
    committed = config_map_file(objects, "arstream-envoy", "envoy.json")
    args = ["--statefulset", f"{name}={len(pods)}", "--headless-service", service, "--replica-port", str(port)]
    result = run_tool(sys.executable, str(ENVOY_RENDER), *args, *ENVOY_OPTIONS)
    assert result.returncode == 0, result.stderr
    assert committed == result.stdout, "re-render deploy/kubernetes/envoy/envoy.json (its kustomization.yaml)"
    assert all(f'"prefix": "{pod}."' in committed and f'"address": "{pod}.{service}"' in committed for pod in pods)


def test_the_drain_peers_are_the_headless_service_and_the_autoscaler_scales_the_statefulset() -> None:
    objects = rendered("gpu")
    name, service, port, _pods = statefulset_names(objects)
    # One DNS name, the headless Service's: every pod's address at drain time (app/peers.py).
    assert replica_environment(objects)["ARSTREAM_CLUSTER_PEERS"] == f"http://{service}:{port}"
    target = one(objects, "ScaledObject")["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name}


def test_the_name_check_fails_a_renamed_statefulset(tmp_path: Path) -> None:
    """Negative control: the balancer's slots no longer match once the StatefulSet's pods are named otherwise."""
    objects = rendered("gpu")
    one(objects, "StatefulSet")["metadata"]["name"] = "world"
    _name, _service, _port, pods = statefulset_names(objects)
    committed = config_map_file(objects, "arstream-haproxy", "haproxy.cfg")
    assert haproxy_servers(committed) != {"sessions": pods, "http": pods}


def test_servingz_is_ready_when_full_and_not_while_loading_or_draining() -> None:
    """/servingz (the readiness probe): 503 while loading; 200 for a full replica, where /readyz says no room;
    503 once draining, where /healthz (liveness) still says alive."""
    pipeline = SlowWarmupFakePipeline()
    settings = fake_settings(cluster_secret=SECRET, max_sessions=1)
    with running_server(settings, pipeline, wait_ready=False) as server:
        try:
            loading = server.get("/servingz")
            assert loading.status_code == 503 and "loading" in loading.json()["reason"], loading.text
        finally:
            pipeline.release_warmup.set()
        server.wait_ready()

        async def full() -> tuple[int, int]:
            async with session_client(server.ws_url, start={}):
                serving = await asyncio.to_thread(server.get, "/servingz")
                ready = await asyncio.to_thread(server.get, "/readyz")
            return serving.status_code, ready.status_code

        assert asyncio.run(full()) == (200, 503)
        drained = httpx.post(
            server.base_url + "/v1/cluster/drain",
            json={"peers": [], "exit": False},
            headers={"authorization": f"Bearer {SECRET}"},
            timeout=30.0,
        )
        assert drained.status_code == 200, drained.text
        answer = server.get("/servingz")
        assert answer.status_code == 503 and "draining" in answer.json()["reason"], answer.text
        assert server.get("/healthz").status_code == 200


# ---- who may reach whom, and what a pod may write ------------------------------------------------------------


PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}  # kube-prometheus-stack's and the operator's pod label


def pod_labels(objects: list[Manifest], kind: str) -> dict[str, str]:
    labels: dict[str, str] = one(objects, kind)["spec"]["template"]["metadata"]["labels"]
    return labels


def admitted(policy: Manifest, port: str) -> list[dict[str, str] | None]:
    """Whom ``policy`` admits on the named ``port``: each source's pod labels (None: anyone at all)."""
    sources: list[dict[str, str] | None] = []
    for rule in policy["spec"].get("ingress", []):
        if "ports" in rule and not any(p.get("port") == port for p in rule["ports"]):
            continue
        for peer in rule.get("from", [{}]):  # a rule without "from" admits everyone
            labels = peer.get("podSelector", {}).get("matchLabels")
            sources.append(labels or None)  # an ipBlock, or an empty selector: anyone
    return sources


def selects(selector: dict[str, str] | None, labels: dict[str, str] | None) -> bool:
    """Whether pods matching ``selector`` (None: anyone) include those labelled ``labels`` (None: anyone)."""
    if selector is None:
        return True
    return labels is not None and selector.items() <= labels.items()


def network_problems(objects: list[Manifest], overlay: str) -> list[str]:
    """What is wrong with the NetworkPolicies: a port open to pods other than those that need it (the replicas'
    to the balancer, the peers and Prometheus), a port shut to one that needs it, a pod with no policy."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    replicas, balancer = pod_labels(objects, "StatefulSet"), pod_labels(objects, "Deployment")
    needed: dict[str, tuple[dict[str, str], dict[str, list[dict[str, str] | None]]]] = {
        "replicas": (replicas, {"http": [balancer, replicas, PROMETHEUS], "agent": [balancer]}),
        "balancer": (balancer, {"public": [None], **({"private": [PROMETHEUS]} if overlay != "gpu-envoy" else {})}),
    }
    problems = []
    for name, (pods, ports) in needed.items():
        selecting = [p for p in policies if selects(p["spec"]["podSelector"].get("matchLabels"), pods)]
        if len(selecting) != 1 or "Ingress" not in selecting[0]["spec"].get("policyTypes", []):
            problems.append(f"the {name} need exactly one ingress NetworkPolicy, found {len(selecting)}")
            continue
        for port, sources in ports.items():
            let_in = admitted(selecting[0], port)
            problems += [
                f"{name} port {port}: {source or 'anyone'} is not admitted"
                for source in sources
                if not any(selects(selector, source) for selector in let_in)
            ]
            problems += [
                f"{name} port {port}: admits {selector or 'anyone'}, beyond {sources}"
                for selector in let_in
                if not any(selector == source for source in sources)
            ]
    return problems


def test_network_policies_admit_only_the_balancer_the_peers_and_prometheus(overlay: str) -> None:
    """Old manifests: no NetworkPolicy, and replicas trusting X-Forwarded-For from every private range, so any pod
    could claim any client address (10 sessions under a per-client cap of 4) and guess the cluster secret."""
    objects = rendered(overlay)
    assert network_problems(objects, overlay) == []
    trusted = replica_environment(objects)["ARSTREAM_FORWARDED_ALLOW_IPS"].split(",")
    assert trusted == ["10.244.0.0/16"], trusted  # the pod network (kubeadm, kind, minikube), never every range
    # The replicas' policy selects the StatefulSet's pods and the balancer's selects the Deployment's.
    policies = {p["metadata"]["name"]: p for p in objects if p["kind"] == "NetworkPolicy"}
    assert policies["arstream-replicas"]["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(
        objects, "StatefulSet"
    ).items()
    assert policies["arstream-balancer"]["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(
        objects, "Deployment"
    ).items()


@pytest.mark.parametrize("case", ["open to every pod", "no agent rule", "prometheus shut out", "no policy"])
def test_the_network_check_fails_an_open_or_missing_policy(case: str) -> None:
    """Negative control: each mistake the network check exists for."""
    objects = rendered("gpu")
    replicas_policy = one(objects, "NetworkPolicy", "arstream-replicas")
    rules = replicas_policy["spec"]["ingress"]
    if case == "open to every pod":
        rules.append({"ports": [{"port": "http"}]})
    elif case == "no agent rule":
        rules[0]["ports"] = [{"port": "http"}]
    elif case == "prometheus shut out":
        del rules[2]
    else:
        objects.remove(replicas_policy)
    assert network_problems(objects, "gpu")


def test_pods_carry_no_api_token_and_write_only_to_their_named_volumes(overlay: str) -> None:
    """Every pod: no service account token mounted, a read-only root filesystem, and what it writes on emptyDir
    volumes it names (the replicas': temporary files, compile caches under the home folder, spill files)."""
    objects = rendered(overlay)
    for kind in ("StatefulSet", "Deployment"):
        pod = one(objects, kind)["spec"]["template"]["spec"]
        assert pod.get("automountServiceAccountToken") is False, kind
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, (kind, container["name"])
            writable = {
                m["mountPath"]: m["name"] for m in container.get("volumeMounts", []) if not m.get("readOnly", False)
            }
            assert all("emptyDir" in volumes[name] for name in writable.values()), (kind, writable)
            assert "/tmp" in writable, (kind, writable)
    replica_writes = {m["mountPath"] for m in replica_container(objects)["volumeMounts"] if not m.get("readOnly")}
    shared_memory = {"/dev/shm"} if overlay == "gpu-devices" else set()  # NCCL's, between a pod's ranks
    assert replica_writes == {"/tmp", "/home/arstream", "/var/spool/arstream"} | shared_memory, replica_writes
    spill = "# ARSTREAM_PARK_SPILL_DIR: /var/spool/arstream"
    assert spill in (KUBERNETES / "base" / "settings.yaml").read_text()  # where parking's spill files would go
