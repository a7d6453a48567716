"""compose.yaml, the Dockerfile and deploy/ (HAProxy, Prometheus, Grafana), checked without a Docker daemon.

Each file goes through the tool its users' tools would use: the compose
specification's JSON schema (check-jsonschema), ``haproxy -c``, ``promtool
check config``, ``promtool test rules`` (the alert rules' unit tests) and
hadolint; the files are cross-checked (every replica service in compose has
HAProxy server slots and a Prometheus DNS name), the replica entry point's GPU
locks are run with a fake ``python``, and every metric the Grafana dashboard
and the alert rules query exists in a live server's and a live HAProxy's
``/metrics``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
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


def replica_services() -> dict[str, dict[str, Any]]:
    """The replica services (every profile): those built from this repository's image."""
    return {name: service for name, service in compose()["services"].items() if service.get("build") == "."}


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


def test_replicas_scale_with_one_number_and_each_gpu_replica_locks_its_own_gpu() -> None:
    services = replica_services()
    assert sorted(services) == ["cpu-replica", "replica"]
    gpu, cpu = services["replica"], services["cpu-replica"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    # No replica id in the environment: the entry point takes the container's name (replica-1, ...).
    for service in services.values():
        assert "ARSTREAM_REPLICA_ID" not in service["environment"]
        assert service["environment"]["ARSTREAM_AGENT_PORT"] == "8001"
        assert "ARSTREAM_MODEL_OPTIONS" in service["environment"]
        assert service["deploy"]["replicas"] >= 1
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    ]
    assert gpu["environment"]["ARSTREAM_DEVICE"] == "cuda" and cpu["environment"]["ARSTREAM_DEVICE"] == "cpu"
    locks = gpu["environment"]["ARSTREAM_GPU_LOCKS"]
    assert f"gpu-locks:{locks}" in gpu["volumes"] and "gpu-locks" in compose()["volumes"]
    # GPUs a replica (the entry point spans them), and shared memory for NCCL between them
    assert gpu["environment"]["ARSTREAM_GPUS_PER_REPLICA"] == "${ARSTREAM_GPUS_PER_REPLICA:-1}"
    assert compose_default(gpu["shm_size"]) == "8gb"
    assert "COMPOSE_PROFILES=gpu" in (REPO_ROOT / ".env").read_text().splitlines()


def test_secrets_come_from_the_environment_and_prometheus_keeps_its_data() -> None:
    services = compose()["services"]
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?"), password  # compose refuses to start without it
    assert "prometheus-data:/prometheus" in services["prometheus"]["volumes"]
    # Private ports only on loopback: HAProxy's statistics and per-replica routes, Prometheus, Grafana.
    private = [port for name in ("prometheus", "grafana") for port in services[name]["ports"]]
    private += [port for port in services["haproxy"]["ports"] if port.endswith((":8404", ":8405"))]
    assert len(private) == 4 and all(port.startswith("127.0.0.1:") for port in private), private
    # The admin page's password comes from the environment, with no default (unset: the page refuses all).
    assert services["haproxy"]["environment"]["ARSTREAM_LB_ADMIN_PASSWORD"] == "${ARSTREAM_LB_ADMIN_PASSWORD:-}"


def test_replicas_and_the_balancer_run_on_a_read_only_root_filesystem() -> None:
    """What a replica writes (temporary files, compile caches under its home folder) goes to a tmpfs."""
    services = compose()["services"]
    assert services["haproxy"]["read_only"] is True
    for name, service in replica_services().items():
        assert service["read_only"] is True, name
        assert set(service["tmpfs"]) == {"/tmp", "/home/arstream"}, name


def compose_default(value: str) -> str:
    """The value compose uses for ``${NAME:-default}`` when NAME is unset (a plain value as it is)."""
    match = re.fullmatch(r"\$\{[A-Z_]+:-([^}]*)\}", value)
    return match.group(1) if match else value


def test_replicas_trust_forwarded_addresses_from_the_balancer_alone() -> None:
    """Old compose.yaml: the replicas trusted every private range, so any client or container with a private
    address could name itself any client in X-Forwarded-For (issue 31, finding 9)."""
    services = compose()
    network = services["networks"]["default"]["ipam"]["config"][0]
    subnet = ipaddress.ip_network(compose_default(network["subnet"]))
    dynamic = ipaddress.ip_network(compose_default(network["ip_range"]))
    haproxy = services["services"]["haproxy"]
    balancer = ipaddress.ip_address(compose_default(haproxy["networks"]["default"]["ipv4_address"]))
    # HAProxy's address is fixed, in the network, and never handed to another container.
    assert balancer in subnet and dynamic.subnet_of(subnet) and balancer not in dynamic  # type: ignore[arg-type]
    for name, service in replica_services().items():
        trusted = compose_default(service["environment"]["ARSTREAM_FORWARDED_ALLOW_IPS"])
        assert [ipaddress.ip_address(entry) for entry in trusted.split(",")] == [balancer], name


def test_the_turn_relay_is_a_profile_of_its_own_and_relays_only_to_the_replicas() -> None:
    """compose.yaml's coturn: off in the default profiles, its secret from the environment, its relay ports
    published as its configuration names them, and its peers only the replicas' addresses (the network's dynamic
    range), so it opens no way to the balancer, Prometheus or anything else."""
    services = compose()
    turn = services["services"]["turn"]
    assert turn["profiles"] == ["turn"] and turn["read_only"] is True
    assert turn["environment"]["TURN_SECRET"] == "${ARSTREAM_TURN_SECRET:-}"
    assert "test -n \"$$TURN_SECRET\"" in turn["entrypoint"][-1]  # refused unset: no relay open to anyone
    config = (DEPLOY / "coturn" / "turnserver.conf").read_text().splitlines()
    settings = [line.split("=", 1) for line in config if line and not line.startswith("#")]
    values: dict[str, list[str]] = {}
    for key, *value in settings:
        values.setdefault(key, []).append(value[0] if value else "")
    low, high = values["min-port"][0], values["max-port"][0]
    assert f"{low}-{high}:{low}-{high}/udp" in turn["ports"]
    assert "use-auth-secret" in values and "no-tcp-relay" in values
    assert values["denied-peer-ip"] == ["0.0.0.0-255.255.255.255", "::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"]
    dynamic = ipaddress.ip_network(compose_default(services["networks"]["default"]["ipam"]["config"][0]["ip_range"]))
    first, last = values["allowed-peer-ip"][0].split("-")
    assert (ipaddress.ip_address(first), ipaddress.ip_address(last)) == (dynamic[0], dynamic[-1])
    for name, service in replica_services().items():
        environment = service["environment"]
        assert compose_default(environment["ARSTREAM_WEBRTC"]) == "false", name  # off unless asked for
        assert environment["ARSTREAM_WEBRTC_TURN_SECRET"] == "${ARSTREAM_TURN_SECRET:-}", name


def test_the_replicas_webrtc_settings_load_from_compose_with_each_tracks_bitrate_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With WebRTC on, each replica's WebRTC variables (their compose defaults) load as the server reads them, the
    bitrate bounds among them: aiortc's H.264 bounds, so what the relay carries has a ceiling."""
    from arstream.app.settings import Settings

    for name, service in replica_services().items():
        webrtc = {key: compose_default(value) for key, value in service["environment"].items() if "WEBRTC" in key}
        for variable in [variable for variable in os.environ if variable.startswith("ARSTREAM_")]:
            monkeypatch.delenv(variable)
        for key, value in {**webrtc, "ARSTREAM_WEBRTC": "true"}.items():
            monkeypatch.setenv(key, value)
        settings = Settings()
        assert (settings.webrtc_min_bitrate_kbps, settings.webrtc_max_bitrate_kbps) == (500, 3000), name


def test_prometheus_finds_every_replica_by_dns_and_loads_the_alert_rules() -> None:
    result = run_tool(tool("promtool"), "check", "config", "deploy/prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    discovered = jobs["arstream"]["dns_sd_configs"]
    assert [sorted(d["names"]) for d in discovered] == [sorted(replica_services())]
    assert all((d["type"], d["port"]) == ("A", 8000) for d in discovered)
    assert jobs["haproxy"]["static_configs"] == [{"targets": ["haproxy:8404"]}]
    assert config["rule_files"] == ["alerts.yml"]
    mounted = compose()["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounted


def test_alert_rules_pass_their_unit_tests() -> None:
    result = run_tool(tool("promtool"), "test", "rules", "deploy/prometheus/alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", (DEPLOY / "prometheus" / "alerts.test.yml").read_text()))
    rules = load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"][0]["rules"]
    assert tested == {rule["alert"] for rule in rules}, "every alert has a unit test"


def test_the_alert_unit_tests_fail_a_rule_that_never_fires(tmp_path: Path) -> None:
    """Negative control: the same unit tests against rules whose overload threshold cannot be crossed."""
    rules = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    broken = rules.replace("> on (replica) arstream_realtime_capacity_sessions", "> on (replica) arstream_realtime_capacity_sessions * 1e9")
    assert broken != rules
    (tmp_path / "alerts.yml").write_text(broken)
    (tmp_path / "alerts.test.yml").write_text((DEPLOY / "prometheus" / "alerts.test.yml").read_text())
    result = run_tool(tool("promtool"), "test", "rules", str(tmp_path / "alerts.test.yml"))
    assert result.returncode != 0 and "ARStreamOverloaded" in result.stdout + result.stderr


class FakeReplicas:
    """deploy/replica-entrypoint.sh with a fake `python` (the GPU count, the reverse DNS name, and a server that
    reports its id, GPUs and devices, then holds its locks until stopped)."""

    def __init__(self, tmp_path: Path, gpus: int, **env: str) -> None:
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "python").write_text(
            "#!/usr/bin/env bash\n"
            'case "$1" in\n'
            '  -) cat >/dev/null; echo "$FAKE_REVERSE_NAME" ;;\n'
            '  -c) echo "$FAKE_GPUS" ;;\n'
            '  -m) echo "serving id=$ARSTREAM_REPLICA_ID gpu=$CUDA_VISIBLE_DEVICES devices=${ARSTREAM_DEVICES:-}";'
            " exec sleep 60 ;;\n"
            "esac\n"
        )
        (fake / "python").chmod(0o755)
        locks = tmp_path / "locks"
        locks.mkdir()
        self.env = {"PATH": f"{fake}:/usr/bin:/bin", "ARSTREAM_GPU_LOCKS": str(locks), "FAKE_GPUS": str(gpus), **env}
        self.started: list[subprocess.Popen[str]] = []

    def start(self, index: int) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            ["bash", str(DEPLOY / "replica-entrypoint.sh")],
            env={**self.env, "FAKE_REVERSE_NAME": f"arstream-replica-{index}.arstream_default"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.started.append(process)
        return process

    def stop(self) -> None:
        for process in self.started:
            process.kill()
            process.wait(STOP_GUARD_S)
            for stream in (process.stdout, process.stderr):
                assert stream is not None
                stream.close()


def test_replica_entrypoint_gives_each_replica_its_own_gpu_and_its_container_name(tmp_path: Path) -> None:
    replicas = FakeReplicas(tmp_path, gpus=2)
    try:
        first, second = replicas.start(1), replicas.start(2)
        lines = sorted(p.stdout.readline().strip() for p in (first, second))  # type: ignore[union-attr]
        assert lines == ["serving id=replica-1 gpu=0 devices=", "serving id=replica-2 gpu=1 devices="] or lines == [
            "serving id=replica-1 gpu=1 devices=",
            "serving id=replica-2 gpu=0 devices=",
        ], lines
        third = replicas.start(3)
        assert third.wait(STOP_GUARD_S) == 1
        assert "only 0 of 2 are free" in third.stderr.read()  # type: ignore[union-attr]
        first.kill()
        first.wait(STOP_GUARD_S)
        freed = lines[0].split(" ")[2].removeprefix("gpu=")
        fourth = replicas.start(4)
        assert fourth.stdout.readline().strip() == f"serving id=replica-4 gpu={freed} devices="  # type: ignore[union-attr]
    finally:
        replicas.stop()


def test_replica_entrypoint_gives_a_replica_of_two_gpus_two_free_ones_and_spans_them(tmp_path: Path) -> None:
    """ARSTREAM_GPUS_PER_REPLICA=2 on four GPUs: two replicas hold two each and span them (--devices as the
    process sees them); a third finds one GPU short, fails, and leaves no lock behind."""
    replicas = FakeReplicas(tmp_path, gpus=4, ARSTREAM_GPUS_PER_REPLICA="2")
    try:
        first, second = replicas.start(1), replicas.start(2)
        lines = {p.stdout.readline().strip() for p in (first, second)}  # type: ignore[union-attr]
        held = sorted(line.split(" ")[2].removeprefix("gpu=") for line in lines)
        assert held == ["0,1", "2,3"], lines
        assert all(line.endswith(" devices=cuda:0,cuda:1") for line in lines), lines
        first.kill()
        first.wait(STOP_GUARD_S)
        (freed,) = [line.split(" ")[2].removeprefix("gpu=") for line in lines if "replica-1 " in line]
        # only one of the two freed GPUs would do for a replica of three: refused, its partial lock released
        replicas.env["ARSTREAM_GPUS_PER_REPLICA"] = "3"
        third = replicas.start(3)
        assert third.wait(STOP_GUARD_S) == 1
        assert "3 GPU(s) a replica, and only 2 of 4 are free" in third.stderr.read()  # type: ignore[union-attr]
        replicas.env["ARSTREAM_GPUS_PER_REPLICA"] = "2"
        fourth = replicas.start(4)
        assert fourth.stdout.readline().strip() == f"serving id=replica-4 gpu={freed} devices=cuda:0,cuda:1"  # type: ignore[union-attr]
    finally:
        replicas.stop()


# ---- HAProxy --------------------------------------------------------------------------------------


def test_compose_haproxy_config_is_the_template_rendered_for_the_compose_replicas() -> None:
    committed = COMPOSE_HAPROXY.read_text()
    maxconn = re.search(r"^    server replica-1 arstream-replica-1:8000 maxconn (\d+) check ", committed, re.MULTILINE)
    assert maxconn is not None
    slots = [arg for name in sorted(replica_services()) for arg in ("--compose", f"{name}=8")]
    rendered = render(*slots, "--maxconn", maxconn.group(1), "--bind", ":8080")
    assert committed == rendered, "re-render deploy/haproxy/haproxy.compose.cfg (docs/deployment.md)"
    result = run_tool(tool("haproxy"), "-c", "-q", "-f", str(COMPOSE_HAPROXY))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rendered_config_routes_and_limits_as_documented(tmp_path: Path) -> None:
    text = render("--replica", "r0=127.0.0.1:9001/3@9101", "--replica", "r1=127.0.0.1:9002", "--maxconn", "5")
    assert "    balance leastconn" in text
    assert "    server r0 127.0.0.1:9001 maxconn 3 check agent-check agent-port 9101" in text
    assert "    server r1 127.0.0.1:9002 maxconn 5 check agent-check agent-port 8001" in text
    assert "    use-server r1 if { var(txn.replica) -m str r1 }" in text
    assert "    option redispatch 1" in text and "track-sc0 src" in text
    assert "uri /healthz" in text
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    result = run_tool(tool("haproxy"), "-c", "-q", "-f", str(config))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "spec", ["r0", "r.0=127.0.0.1:1", "r0=nohostport", "r0=127.0.0.1:1/0", "r0=127.0.0.1:1@0", "r0=127.0.0.1:1/x"]
)
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


def test_image_runs_as_non_root_with_a_health_check_the_extras_and_the_weights() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", dockerfile, re.MULTILINE)
    assert "COPY deploy/replica-entrypoint.sh /usr/local/bin/arstream-replica" in dockerfile
    assert 'ENTRYPOINT ["arstream-replica"]' in dockerfile
    assert 'pip install --no-cache-dir ".[video,wan,webrtc]"' in dockerfile  # H.264, matrix-game-2's VAE, WebRTC
    assert "exec python -m arstream serve" in (DEPLOY / "replica-entrypoint.sh").read_text()
    assert "COPY models ./models" in dockerfile  # tiny-world's weights are package data under models/
    assert list((REPO_ROOT / "models" / "tiny_world" / "weights").glob("*.safetensors"))
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert not {"models", "app", "runner", "static", "arstream"} & set(ignored)
    assert "!deploy/replica-entrypoint.sh" in ignored


def healthcheck_command() -> list[str]:
    """The Dockerfile's HEALTHCHECK command (exec form)."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", "")
    match = re.search(r"^HEALTHCHECK .*? CMD (\[.*\])$", dockerfile, re.MULTILINE)
    assert match, "no exec-form HEALTHCHECK in the Dockerfile"
    command: list[str] = json.loads(match.group(1))
    return command


def test_the_health_check_asks_the_port_the_server_listens_on() -> None:
    """Old Dockerfile: the check asked port 8000 whatever ARSTREAM_PORT said (issue 33)."""
    command = [sys.executable if part == "python" else part for part in healthcheck_command()]

    def check(port: int) -> int:
        env = {"ARSTREAM_PORT": str(port), "PATH": "/usr/bin:/bin"}
        return subprocess.run(command, env=env, capture_output=True, timeout=60).returncode

    with running_server(fake_settings()) as server:
        assert check(int(server.base_url.rsplit(":", 1)[1])) == 0
    assert check(free_port()) != 0  # nothing listening there: the check fails (negative control)


# ---- Grafana ------------------------------------------------------------------------------------

# Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = {"up"}
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
    with running_server(fake_settings(agent_port=0)) as server:
        assert server.server is not None

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
            f"r0=127.0.0.1:{server.port}@{server.agent_port()}",
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
    missing = sorted(queried - live_metrics - PROMETHEUS_SERIES)
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
        # overload and a dead replica at a glance
        "up",
        "arstream_ready",
        "arstream_model_fps",
        "arstream_sessions_active",
        "arstream_chunk_period_seconds",
        "arstream_queue_wait_seconds_bucket",
        "arstream_realtime_capacity_sessions",
        "arstream_free_session_slots",
        "arstream_queue_depth",
        "arstream_resumes_total",
        "arstream_drains_total",
    ):
        assert wanted in queried, wanted


def test_alert_rules_query_metrics_that_exist(live_metrics: set[str]) -> None:
    rules = load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"][0]["rules"]
    queried = set().union(*(metric_names(rule["expr"]) for rule in rules))
    missing = sorted(queried - live_metrics - PROMETHEUS_SERIES)
    assert not missing, f"the alert rules query metrics no live /metrics exports: {missing}"


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


def test_the_local_cluster_example_can_be_drained_and_the_script_warns_without_a_secret(tmp_path: Path) -> None:
    # The documented local cluster exports the secret before it starts, so `arstream drain` works on it.
    doc = (REPO_ROOT / "docs/deployment.md").read_text()
    block = doc[doc.index("```\nexport ARSTREAM_CLUSTER_SECRET") :]
    block = block[: block.index("```", 4)]
    assert block.index("export ARSTREAM_CLUSTER_SECRET") < block.index("scripts/local-cluster.sh"), block
    # Started without one, the script says at once that its replicas cannot drain (here before it looks for
    # HAProxy, which is made missing so that nothing starts).
    env = {k: v for k, v in os.environ.items() if k != "ARSTREAM_CLUSTER_SECRET"}
    env |= {"HAPROXY": str(tmp_path / "no-haproxy"), "ARSTREAM_CLUSTER_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts/local-cluster.sh"), "1"], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "haproxy not found" in done.stderr
    assert "ARSTREAM_CLUSTER_SECRET is not set: these replicas cannot drain" in done.stderr, done.stderr
    env["ARSTREAM_CLUSTER_SECRET"] = "a-secret-of-enough-length"
    assert "not set" not in subprocess.run(
        ["bash", str(REPO_ROOT / "scripts/local-cluster.sh"), "1"], env=env, capture_output=True, text=True
    ).stderr
