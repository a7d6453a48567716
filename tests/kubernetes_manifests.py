"""deploy/kubernetes/ rendered and read, for the Kubernetes tests: each overlay through ``kubectl kustomize``,
its objects by kind, the replicas' settings and probes, and the validators (``kubernetes-validate --strict``
for Kubernetes' own kinds, KEDA's ScaledObject schema for the one KEDA adds)."""

from __future__ import annotations

import functools
import json
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import referencing
from ruamel.yaml import YAML
from servers import REPO_ROOT
from test_deploy import run_tool, tool

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ("gpu", "gpu-envoy", "gpu-devices", "cpu")
SCALEDOBJECT_SCHEMA = KUBERNETES / "schemas" / "keda-scaledobject-v1alpha1.json"
# The oldest Kubernetes these manifests are checked against (kubernetes-validate ships schemas per version).
KUBERNETES_VERSION = "1.30.0"
Manifest = dict[str, Any]


@functools.cache
def rendered_text(overlay: str) -> str:
    result = run_tool(tool("kubectl"), "kustomize", str(KUBERNETES / "overlays" / overlay))
    assert result.returncode == 0, result.stderr
    return result.stdout


def rendered(overlay: str) -> list[Manifest]:
    """The overlay's objects, as ``kubectl apply -k`` would send them (a fresh copy each call)."""
    return [document for document in YAML(typ="safe").load_all(rendered_text(overlay)) if document]


def one(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def replica_container(objects: list[Manifest]) -> Manifest:
    containers = [c for c in one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"]]
    found: list[Manifest] = [c for c in containers if c["name"] == "arstream"]
    assert len(found) == 1, [c["name"] for c in containers]
    return found[0]


def replica_environment(objects: list[Manifest]) -> dict[str, str]:
    """The replica container's plain variables: its ConfigMap's, overridden by its own ``env`` values."""
    container = replica_container(objects)
    environment: dict[str, str] = {}
    for source in container.get("envFrom", []):
        environment.update(one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    environment.update({v["name"]: v["value"] for v in container.get("env", []) if "value" in v})
    return environment


def config_map_file(objects: list[Manifest], prefix: str, key: str) -> str:
    """A generated ConfigMap's file (kustomize suffixes the name with a hash of its content)."""
    maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(prefix)]
    assert len(maps) == 1, [m["metadata"]["name"] for m in maps]
    text: str = maps[0]["data"][key]
    return text


# ---- validators -------------------------------------------------------------------------------------------


def kubernetes_validate(objects: list[Manifest], folder: Path) -> subprocess.CompletedProcess[str]:
    """``kubernetes-validate --strict`` on the objects Kubernetes itself defines."""
    path = folder / "objects.yaml"
    with path.open("w") as stream:
        YAML(typ="safe").dump_all(objects, stream)
    return run_tool(tool("kubernetes-validate"), "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(path))


@functools.cache
def _scaledobject_validator() -> jsonschema.protocols.Validator:
    """KEDA's ScaledObject schema, its references to Kubernetes' definitions resolved from kubernetes-validate."""
    definitions_file = (
        resources.files("kubernetes_validate")
        / "kubernetes-json-schema"
        / f"v{KUBERNETES_VERSION}-local-strict"
        / "_definitions.json"
    )
    definitions = referencing.Resource.from_contents(json.loads(definitions_file.read_text()))
    schema = json.loads(SCALEDOBJECT_SCHEMA.read_text())
    registry: referencing.Registry[Any] = referencing.Registry().with_resources(
        [(definitions.id() or "", definitions), (schema["$id"], referencing.Resource.from_contents(schema))]
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def scaledobject_errors(scaled_object: Manifest) -> list[str]:
    return [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in _scaledobject_validator().iter_errors(scaled_object)
    ]
