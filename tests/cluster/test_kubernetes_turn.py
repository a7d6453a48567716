"""deploy/kubernetes/turn (the overlay gpu-turn), checked without a cluster: every object passes the strict schema
check, and the relay's pieces agree with each other and with the replicas: the Service publishes each relayed port
one to one, the relay relays only into the pod network the replicas trust, the replicas admit the relay (and only
it) on the UDP ports their candidates bind, and their settings load as the server reads them.

The relay itself is played for real, on loopback, in tests/server/test_webrtc_turn.py.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import pytest
from kubernetes_manifests import Manifest, config_map_file, kubernetes_validate, one, rendered, replica_environment

from arstream.app.settings import Settings, parse_port_range

OVERLAY = "gpu-turn"
TURN_LABELS = {"app.kubernetes.io/name": "arstream", "app.kubernetes.io/component": "turn"}


def relay_config(objects: list[Manifest]) -> dict[str, list[str]]:
    """turnserver.conf as the relay reads it: each key's values (a flag's: [""])."""
    values: dict[str, list[str]] = {}
    for line in config_map_file(objects, "arstream-turn-config", "turnserver.conf").splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def test_every_object_passes_the_strict_schema_check(tmp_path: Path) -> None:
    objects = [o for o in rendered(OVERLAY) if o["apiVersion"] != "keda.sh/v1alpha1"]
    result = kubernetes_validate(objects, tmp_path)
    assert result.returncode == 0 and "ERROR" not in result.stdout and "WARN" not in result.stdout, result.stdout
    assert result.stdout.count("INFO") == len(objects)


def test_the_relay_publishes_its_ports_and_relays_only_into_the_pod_network() -> None:
    objects = rendered(OVERLAY)
    config = relay_config(objects)
    relayed = range(int(config["min-port"][0]), int(config["max-port"][0]) + 1)
    listening = int(config["listening-port"][0])
    service = one(objects, "Service", "arstream-turn")
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["selector"] == TURN_LABELS
    published = {(p["protocol"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    wanted = {("UDP", port, port) for port in relayed} | {("UDP", listening, listening), ("TCP", listening, listening)}
    assert published == wanted
    # coturn's checks: credentials only from the shared secret, no TCP relay, every peer refused but the pod network
    assert {"use-auth-secret", "no-tcp-relay"} <= set(config)
    assert config["denied-peer-ip"] == ["0.0.0.0-255.255.255.255", "::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"]
    first, last = (ipaddress.ip_address(a) for a in config["allowed-peer-ip"][0].split("-"))
    (pod_network,) = replica_environment(objects)["ARSTREAM_FORWARDED_ALLOW_IPS"].split(",")
    network = ipaddress.ip_network(pod_network)
    assert (first, last) == (network[0], network[-1])
    # the relay's pod: its secret from the Secret the replicas read too, no API token, a read-only root
    deployment = one(objects, "Deployment", "arstream-turn")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--static-auth-secret=$(TURN_SECRET)" in container["args"]
    secret = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e["valueFrom"]}
    assert secret == {"TURN_SECRET": {"name": "arstream-turn", "key": "secret"}}
    # anyone may reach the relay's ports (players), nothing more
    policy = one(objects, "NetworkPolicy", "arstream-turn")
    (rule,) = policy["spec"]["ingress"]
    assert "from" not in rule and policy["spec"]["podSelector"]["matchLabels"] == TURN_LABELS
    opened = {(p["protocol"], p["port"], p.get("endPort", p["port"])) for p in rule["ports"]}
    assert opened == {("UDP", listening, listening), ("TCP", listening, listening),
                      ("UDP", relayed.start, relayed.stop - 1)}


def test_the_replicas_admit_the_relay_on_their_webrtc_ports_and_load_their_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = rendered(OVERLAY)
    environment = replica_environment(objects)
    ports = parse_port_range(environment["ARSTREAM_WEBRTC_UDP_PORTS"])
    policy = one(objects, "NetworkPolicy", "arstream-replicas")
    without_relay = one(rendered("gpu"), "NetworkPolicy", "arstream-replicas")["spec"]["ingress"]
    *others, relay_rule = policy["spec"]["ingress"]
    assert others == without_relay  # the balancer's, the peers' and Prometheus' rules as in the overlay gpu
    assert relay_rule["from"] == [{"podSelector": {"matchLabels": TURN_LABELS}}]
    assert relay_rule["ports"] == [{"protocol": "UDP", "port": ports.start, "endPort": ports.stop - 1}]
    # the replicas' TURN secret is the relay's
    container = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"].get("secretKeyRef") for e in container["env"] if "valueFrom" in e}
    assert refs["ARSTREAM_WEBRTC_TURN_SECRET"] == {"name": "arstream-turn", "key": "secret"}
    for name in [name for name in os.environ if name.startswith("ARSTREAM_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ARSTREAM_WEBRTC_TURN_SECRET", "from-the-secret")
    settings = Settings()
    assert settings.webrtc and settings.webrtc_port_range() == ports
    assert (settings.webrtc_min_bitrate_kbps, settings.webrtc_max_bitrate_kbps) == (500, 3000)
    urls: list[Any] = [server["urls"] for server in settings.webrtc_ice_servers]
    assert urls == [["turn:turn.example.net:3478?transport=udp"]]
