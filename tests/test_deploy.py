"""compose.yaml, the Dockerfile and deploy/ (HAProxy, Prometheus, Grafana), checked without a Docker daemon.

Each file goes through the tool its users' tools would use: the compose
specification's JSON schema (check-jsonschema), ``haproxy -c``, ``promtool
check config`` and hadolint; the files are cross-checked (every replica in
compose is a HAProxy server and a Prometheus target), and every metric the
Grafana dashboard queries exists in a live server's and a live HAProxy's
``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ruamel.yaml import YAML

from servers import REPO_ROOT, STOP_GUARD_S, fake_settings, running_server, session_client

DEPLOY = REPO_ROOT / "deploy"
RENDER = DEPLOY / "haproxy" / "render.py"
COMPOSE_HAPROXY = DEPLOY / "haproxy" / "haproxy.compose.cfg"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "arstream.json"
# Hang guard for HAProxy's start-up; it asserts nothing about speed.
STARTUP_GUARD_S = 30.0


def tool(name: str) -> str:
    """A command-line tool: the test extra installs the Python ones beside this interpreter."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed (scripts/test.sh installs it)"
    return found


def run_tool(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def load_yaml(path: Path) -> Any:
    return YAML(typ="safe").load(path.read_text())


def compose() -> dict[str, Any]:
    return load_yaml(REPO_ROOT / "compose.yaml")


def replica_services(profile: str) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in compose()["services"].items()
        if profile in service.get("profiles", []) and "ARSTREAM_REPLICA_ID" in service.get("environment", {})
    }


def render(*args: str) -> str:
    result = run_tool(sys.executable, str(RENDER), *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- compose.yaml -------------------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification() -> None:
    result = run_tool(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_schema_check_refuses_a_broken_file(tmp_path: Path) -> None:
    """Negative control: the same check fails a file with a misspelt key and a mistyped GPU reservation."""
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        "services:\n  replica:\n    image: arstream\n    portz: ['8000']\n"
        "    deploy: {resources: {reservations: {devices: [{driver: nvidia, capabilities: gpu}]}}}\n"
    )
    result = run_tool(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(broken))
    assert result.returncode != 0
    assert "portz" in result.stdout + result.stderr


def test_each_gpu_replica_reserves_its_own_gpu_and_the_cpu_profile_mirrors_them() -> None:
    gpu = replica_services("gpu")
    cpu = replica_services("cpu")
    assert len(gpu) >= 2
    ids = [service["environment"]["ARSTREAM_REPLICA_ID"] for service in gpu.values()]
    assert ids == [f"r{i}" for i in range(len(gpu))]
    devices = [service["deploy"]["resources"]["reservations"]["devices"] for service in gpu.values()]
    for reserved in devices:
        assert reserved == [{"driver": "nvidia", "device_ids": [reserved[0]["device_ids"][0]], "capabilities": ["gpu"]}]
    assert len({d[0]["device_ids"][0] for d in devices}) == len(gpu), "two replicas share a GPU"
    assert all(service["environment"]["ARSTREAM_DEVICE"] == "cuda" for service in gpu.values())
    # The CPU profile answers to the same names on the network, so HAProxy and Prometheus need no change.
    assert sorted(alias for s in cpu.values() for alias in s["networks"]["default"]["aliases"]) == sorted(gpu)
    assert sorted(s["environment"]["ARSTREAM_REPLICA_ID"] for s in cpu.values()) == sorted(ids)
    assert all(s["environment"]["ARSTREAM_DEVICE"] == "cpu" for s in cpu.values())
    assert "COMPOSE_PROFILES=gpu" in (REPO_ROOT / ".env").read_text().splitlines()


def test_prometheus_scrapes_every_replica_and_haproxy() -> None:
    result = run_tool(tool("promtool"), "check", "config", "deploy/prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    scraped = {(c["targets"][0], c["labels"]["replica"]) for c in jobs["arstream"]}
    gpu = replica_services("gpu")
    expected = {(f"{name}:8000", service["environment"]["ARSTREAM_REPLICA_ID"]) for name, service in gpu.items()}
    assert scraped == expected
    assert jobs["haproxy"] == [{"targets": ["haproxy:8404"]}]
    haproxy_ports = compose()["services"]["haproxy"]["ports"]
    assert any(port.endswith(":8404") for port in haproxy_ports)


# ---- HAProxy --------------------------------------------------------------------------------------


def test_compose_haproxy_config_is_the_template_rendered_for_the_compose_replicas() -> None:
    committed = COMPOSE_HAPROXY.read_text()
    maxconn = re.search(r"^    server r0 \S+ maxconn (\d+) check$", committed, re.MULTILINE)
    assert maxconn is not None
    replicas = [f"{s['environment']['ARSTREAM_REPLICA_ID']}={name}:8000" for name, s in replica_services("gpu").items()]
    rendered = render(
        *(arg for r in replicas for arg in ("--replica", r)), "--maxconn", maxconn.group(1), "--bind", ":8080"
    )
    assert committed == rendered, "re-render deploy/haproxy/haproxy.compose.cfg (docs/deployment.md)"
    result = run_tool(tool("haproxy"), "-c", "-q", "-f", str(COMPOSE_HAPROXY))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rendered_config_routes_and_limits_as_documented(tmp_path: Path) -> None:
    text = render("--replica", "r0=127.0.0.1:9001/3", "--replica", "r1=127.0.0.1:9002", "--maxconn", "5")
    assert "    balance leastconn" in text
    assert "    server r0 127.0.0.1:9001 maxconn 3 check" in text
    assert "    server r1 127.0.0.1:9002 maxconn 5 check" in text
    assert "    use-server r1 if { var(txn.replica) -m str r1 }" in text and "    force-persist if TRUE" in text
    assert "uri /healthz" in text
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    result = run_tool(tool("haproxy"), "-c", "-q", "-f", str(config))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("spec", ["r0", "r.0=127.0.0.1:1", "r0=nohostport", "r0=127.0.0.1:1/0"])
def test_render_refuses_bad_replica_specs(spec: str) -> None:
    result = run_tool(sys.executable, str(RENDER), "--replica", spec)
    assert result.returncode == 2 and "render.py:" in result.stderr


# ---- the image ----------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    result = run_tool(tool("hadolint"), "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    """Negative control: the linter does report problems (here: latest tag, root user's sudo)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN sudo apt-get install curl\n")
    result = run_tool(tool("hadolint"), str(bad))
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_image_runs_as_non_root_with_a_health_check_and_the_weights() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", dockerfile, re.MULTILINE)
    assert 'ENTRYPOINT ["python", "-m", "arstream", "serve"]' in dockerfile
    assert "COPY models ./models" in dockerfile  # tiny-world's weights are package data under models/
    assert list((REPO_ROOT / "models" / "tiny_world" / "weights").glob("*.safetensors"))
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert not {"models", "app", "runner", "static", "arstream"} & set(ignored)


# ---- Grafana ------------------------------------------------------------------------------------

# PromQL words that are not metric names.
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, ranges, groupings and functions removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        after = expr[match.end() :].lstrip()
        if after.startswith("(") or match.group() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def test_metric_names_reads_the_names_and_nothing_else() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, replica) (rate(arstream_x_bucket{state="a b"}[1m]))) / on (replica) up'
    assert metric_names(expr) == {"arstream_x_bucket", "up"}


def series_names(exposition: str) -> set[str]:
    samples = (line for line in exposition.splitlines() if line and not line.startswith("#"))
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in samples}


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Series names from a live fake-kv server (after a chunk and an error) and a live HAProxy in front of it."""
    with running_server(fake_settings()) as server:
        async def traffic() -> None:
            async with session_client(server.ws_url, start={}) as client:
                await client.send(type="input", event_id=0, controls={"keys": ["w"]})
                await client.recv_json()
                await client.send(type="tick", tick_id=0)
                await client.recv_chunk()
                await client.send(type="tick", tick_id=0)  # stale_tick: arstream_errors_total gets a sample
                await client.recv_json()
                await client.send(type="close")
                await client.closed_by_server()

        asyncio.run(traffic())
        names = series_names(server.get("/metrics").text)
        stats_port = free_port()
        config = render(
            "--replica",
            f"r0=127.0.0.1:{server.port}",
            "--bind",
            f"127.0.0.1:{free_port()}",
            "--stats-bind",
            f"127.0.0.1:{stats_port}",
        )
        config_path = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
        config_path.write_text(config)
        haproxy = subprocess.Popen(
            [tool("haproxy"), "-db", "-f", str(config_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + STARTUP_GUARD_S
            while True:
                try:
                    exporter = httpx.get(f"http://127.0.0.1:{stats_port}/metrics", timeout=5.0)
                    break
                except httpx.TransportError:
                    assert haproxy.poll() is None and time.monotonic() < deadline, "HAProxy did not start"
                    time.sleep(0.05)
            names |= series_names(exporter.text)
        finally:
            haproxy.send_signal(signal.SIGTERM)
            haproxy.wait(STOP_GUARD_S)
        yield names


def test_dashboard_parses_with_unique_panel_ids_and_queries_that_exist(live_metrics: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    queried: set[str] = set()
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            queried |= metric_names(target["expr"])
    missing = sorted(queried - live_metrics)
    assert not missing, f"the dashboard queries metrics no live /metrics exports: {missing}"
    # What the issue asks the dashboard to show.
    for wanted in (
        "arstream_sessions_connected",
        "arstream_sessions_detached",
        "arstream_kv_blocks",
        "arstream_chunk_compute_seconds_bucket",
        "arstream_action_to_frame_seconds_bucket",
        "arstream_frames_sent_total",
        "arstream_errors_total",
        "arstream_evictions_total",
    ):
        assert wanted in queried, wanted


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard_folder() -> None:
    datasources = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert datasources == [
        {
            "name": "Prometheus",
            "uid": "prometheus",
            "type": "prometheus",
            "access": "proxy",
            "url": "http://prometheus:9090",
            "isDefault": True,
        }
    ]
    dashboard = json.loads(DASHBOARD.read_text())
    used = {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert used == {"prometheus"}
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "arstream.yml")["providers"][0]
    grafana = compose()["services"]["grafana"]
    mounted = {volume.split(":")[1] for volume in grafana["volumes"]}
    assert provider["options"]["path"] in mounted
