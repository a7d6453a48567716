"""scripts/local-cluster.sh: 2 real replicas (fake-kv, 2 sessions each) behind the real HAProxy, on loopback.

One cluster for the whole story, in order: readiness through the balancer,
new sessions split by least connections, a full cluster queueing a new
session until a slot frees (maxconn), drop + resume on the owning replica,
a killed replica's resume refused (a 503 while it is down, `resume_failed` once it
is back) and never sent elsewhere, the killed replica started again, and SIGTERM
stopping every process the script started.
"""

from __future__ import annotations

import asyncio
import csv
import functools
import io
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from arstream.app.settings import Settings
from websockets.exceptions import InvalidStatus

from servers import (
    REPO_ROOT,
    RECEIVE_GUARD_S,
    STARTUP_GUARD_S,
    STOP_GUARD_S,
    ProbeClient,
    session_client,
    stop_process,
)

CAPACITY = 2
# Hang guard for polling HAProxy's view; it asserts nothing about speed.
POLL_GUARD_S = 30.0


@dataclass
class Cluster:
    process: subprocess.Popen[str]
    lb: str = ""
    stats: str = ""
    private: str = ""
    replicas: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (url, pid)
    output: list[str] = field(default_factory=list)

    @property
    def ws_url(self) -> str:
        return self.lb.replace("http://", "ws://", 1) + "/v1/sessions"

    def replica_stats(self, name: str) -> dict[str, Any]:
        """The replica's /v1/stats, by way of the balancer's per-replica route."""
        response = httpx.get(f"{self.private}/replicas/{name}/v1/stats", timeout=10.0)
        response.raise_for_status()
        return response.json()

    def haproxy_rows(self) -> list[dict[str, str]]:
        text = httpx.get(self.stats + ";csv", timeout=10.0).text.lstrip("# ")
        return list(csv.DictReader(io.StringIO(text)))

    def server_row(self, backend: str, server: str) -> dict[str, str]:
        return next(r for r in self.haproxy_rows() if (r["pxname"], r["svname"]) == (backend, server))


def wait_until(condition: Callable[[], bool], what: str, guard_s: float = POLL_GUARD_S) -> None:
    deadline = time.monotonic() + guard_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


@contextmanager
def launch_cluster(options: list[str], env: dict[str, str] | None = None, replicas: int = 2) -> Iterator[Cluster]:
    """scripts/local-cluster.sh with ``replicas`` replicas and ``options``; stopped with SIGTERM on exit."""
    process = subprocess.Popen(
        ["bash", str(REPO_ROOT / "scripts" / "local-cluster.sh"), str(replicas), *options],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    cluster = Cluster(process)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            cluster.output.append(line)
            words = line.split()
            if words[:1] == ["ARSTREAM_REPLICA"]:
                cluster.replicas[words[1]] = (words[2], int(words[3]))
            elif words[:1] == ["ARSTREAM_LB_STATS"]:
                cluster.stats = words[1]
            elif words[:1] == ["ARSTREAM_LB_PRIVATE"]:
                cluster.private = words[1]
            elif words[:1] == ["ARSTREAM_LB"]:
                cluster.lb = words[1]
                ready.set()
        ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    ready.wait(STARTUP_GUARD_S)
    if not cluster.lb:
        process.kill()
        process.wait()
        reader.join(STOP_GUARD_S)
        assert process.stdout is not None
        process.stdout.close()
        raise RuntimeError("the cluster did not start:\n" + "".join(cluster.output))
    try:
        yield cluster
    finally:
        stop_process(process, reader, signal.SIGTERM)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    options = ["--model", "fake-kv", "--model-options", f'{{"session_capacity": {CAPACITY}}}', "--log-level", "info"]
    with launch_cluster(options, {"ARSTREAM_GPUS": "0,1"}) as started:
        yield started


def replica_of(client: ProbeClient) -> str:
    """The replica that holds the session: its ticket's token begins with the replica id."""
    assert client.ready is not None
    return client.ready["resume"]["token"].split(".", 1)[0]


async def one_chunk(client: ProbeClient, tick_id: int) -> dict[str, Any]:
    await client.send(type="tick", tick_id=tick_id)
    chunk, _ = await client.recv_chunk()
    return chunk


def test_each_replica_gets_its_own_gpu(cluster: Cluster) -> None:
    for index, name in enumerate(("r0", "r1")):
        environ = Path(f"/proc/{cluster.replicas[name][1]}/environ").read_bytes().split(b"\0")
        assert f"CUDA_VISIBLE_DEVICES={index}".encode() in environ


def test_cluster_routes_sessions_resumes_and_survives_a_dead_replica(cluster: Cluster) -> None:
    assert sorted(cluster.replicas) == ["r0", "r1"]
    r0_free_at_start = cluster.replica_stats("r0")["kv"]["blocks_free"]
    # Ready through the balancer, and each replica's own HTTP routes reachable through it.
    assert httpx.get(cluster.lb + "/readyz", timeout=10.0).status_code == 200
    for name in ("r0", "r1"):
        assert cluster.replica_stats(name)["kv"]["session_capacity"] == CAPACITY
        assert "arstream_sessions_detached" in httpx.get(f"{cluster.private}/replicas/{name}/metrics", timeout=10.0).text
        assert httpx.get(f"{cluster.lb}/replicas/{name}/metrics", timeout=10.0).status_code == 404  # private
        assert cluster.server_row("sessions", name)["slim"] == str(CAPACITY)  # maxconn: the session capacity
    assert "haproxy_backend_current_sessions" in httpx.get(cluster.stats.removesuffix("stats") + "metrics").text

    tokens: list[str] = []

    async def scenario() -> None:
        clients: list[ProbeClient] = []
        contexts = [session_client(cluster.ws_url, start={}) for _ in range(4)]
        for context in contexts:
            clients.append(await context.__aenter__())
        try:
            tokens.extend(c.ready["resume"]["token"] for c in clients if c.ready)
            # Least connections: 2 and 2.
            placed = [replica_of(c) for c in clients]
            assert sorted(placed) == ["r0", "r0", "r1", "r1"], placed
            for name in ("r0", "r1"):
                assert cluster.replica_stats(name)["sessions"]["connected"] == 2
            for i, client in enumerate(clients):
                assert (await one_chunk(client, 0))["chunk_index"] == 0, i

            # Both replicas full: a fifth session waits in HAProxy's queue (it is not refused) ...
            fifth_context = session_client(cluster.ws_url, start={})
            fifth_task = asyncio.create_task(fifth_context.__aenter__())
            await asyncio.to_thread(
                wait_until, lambda: cluster.server_row("sessions", "BACKEND")["qcur"] == "1", "the fifth session queued"
            )
            # ... until a slot frees on r1, where it then lands.
            on_r1 = next(c for c in clients if replica_of(c) == "r1")
            await on_r1.send(type="close")
            await on_r1.closed_by_server()
            clients.remove(on_r1)
            fifth = await asyncio.wait_for(fifth_task, RECEIVE_GUARD_S)
            contexts.append(fifth_context)
            clients.append(fifth)
            assert replica_of(fifth) == "r1"

            # Drop + resume: the balancer routes the token to the replica that holds the session.
            dropped = next(c for c in clients if replica_of(c) == "r0")
            assert dropped.ready is not None
            session_id, token = dropped.ready["session_id"], dropped.ready["resume"]["token"]
            dropped.abort()
            await asyncio.to_thread(
                wait_until,
                lambda: cluster.replica_stats("r0")["sessions"]["detached"] == 1,
                "r0 holds a detached session",
            )
            async with session_client(f"{cluster.ws_url}?resume={token}", start={"resume": token}) as resumed:
                assert resumed.ready is not None
                assert resumed.ready["session_id"] == session_id and resumed.ready["resumed"] is True
                assert replica_of(resumed) == "r0"
                tokens.append(resumed.ready["resume"]["token"])
                chunk = await one_chunk(resumed, 1)
                assert (chunk["chunk_index"], chunk["restarted"]) == (1, None)
                await resumed.send(type="close")
                await resumed.closed_by_server()

            # A killed replica: its tokens are refused (never sent to another replica), and it is started again.
            r1_token = fifth.ready["resume"]["token"] if fifth.ready else ""
            killed_pid = cluster.replicas["r1"][1]
            os.kill(killed_pid, signal.SIGKILL)
            try:
                async with session_client(f"{cluster.ws_url}?resume={r1_token}") as resuming:
                    await resuming.send(type="start", resume=r1_token)
                    # r1 back: still loading (over_capacity), or ready and it knows no such session
                    refusal = (await resuming.recv_json())["code"]
            except InvalidStatus as refused:
                refusal = str(refused.response.status_code)  # r1 down: HAProxy answers
            assert refusal in ("503", "over_capacity", "resume_failed"), refusal
            await asyncio.to_thread(
                wait_until, lambda: cluster.replicas["r1"][1] != killed_pid, "local-cluster.sh restarts r1"
            )
            # A new replica process loads torch and its model first: the start-up guard.
            await asyncio.to_thread(
                wait_until,
                lambda: cluster.server_row("sessions", "r1")["status"] == "UP",
                "HAProxy sees r1 again",
                STARTUP_GUARD_S,
            )
            async with session_client(cluster.ws_url, start={}) as survivor_session:
                assert (await one_chunk(survivor_session, 0))["chunk_index"] == 0
                await survivor_session.send(type="close")
                await survivor_session.closed_by_server()
        finally:
            for context in contexts:
                await context.__aexit__(None, None, None)

    asyncio.run(scenario())
    # r0's last session ends by its socket closing, so it is detached and keeps its blocks for the resume grace
    # (the replicas' default) before the registry releases them: the guard covers that wait too.
    resume_grace_s = float(Settings.model_fields["resume_grace_s"].default)
    wait_until(
        lambda: (lambda s: s["sessions"]["connected"] == 0 and s["kv"]["blocks_free"] == r0_free_at_start)(
            cluster.replica_stats("r0")
        ),
        "r0 back at its baseline",
        resume_grace_s + POLL_GUARD_S,
    )
    # Resume tokens travel in URLs: neither HAProxy's log nor a replica's holds one.
    log_dir = Path(re.search(r"logs in (\S+);", "".join(cluster.output)).group(1))  # type: ignore[union-attr]
    logs = {path.name: path.read_text() for path in log_dir.glob("*.log")}
    assert sorted(logs) == ["haproxy.log", "r0.log", "r1.log"]
    assert '"GET /v1/sessions HTTP/1.1"' in logs["haproxy.log"]  # requests are logged, by path
    assert '"WebSocket /v1/sessions?resume=' in logs["r0.log"]  # and the resume, its query redacted
    for token in tokens:
        secret = token.split(".", 1)[1]
        assert not [name for name, text in logs.items() if secret[:12] in text], token


def test_sigterm_stops_every_process_the_script_started(cluster: Cluster) -> None:
    haproxy_pids = subprocess.run(
        ["pgrep", "-P", str(cluster.process.pid), "haproxy"], capture_output=True, text=True
    ).stdout.split()
    assert len(haproxy_pids) == 1
    started = [pid for _, pid in cluster.replicas.values()] + [int(haproxy_pids[0])]
    cluster.process.send_signal(signal.SIGTERM)
    assert cluster.process.wait(STOP_GUARD_S) == 0
    for pid in started:
        wait_until(functools.partial(_stopped, pid), f"process {pid} stopped")


def _stopped(pid: int) -> bool:
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running either.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"
