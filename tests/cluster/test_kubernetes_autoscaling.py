"""The KEDA ScaledObject's query (deploy/kubernetes/autoscaling/), evaluated by a real Prometheus that scrapes
two real replicas (fake-kv, 2 sessions each) and the real HAProxy in front of them.

The query is read from the rendered manifest and asks for ceil((connected + detached + queued) / (0.8 x the
mean capacity)) replicas; KEDA's threshold of 1 (AverageValue) makes that the HPA's replica count. Played:
idle (0: KEDA's minimum applies); 3 connected and 1 detached (4 sessions held: 3 replicas); that one resumed
and a fifth new session waiting in HAProxy's queue (5: 4 replicas). Each count has room for every session
held, at 80 % full. Negative control in the same run: the query without its detached and queue terms
undercounts both states.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from kubernetes_manifests import one, rendered
from servers import STOP_GUARD_S, ProbeClient
from test_balancer import CAPACITY, Sessions, balancer, free_port, replica, run_sessions, start_or_refusal, wait_until

# Hang guard for Prometheus's start and for a value to show; it asserts nothing about speed.
GUARD_S = 90.0
TARGET_FULLNESS = 0.8


@contextmanager
def prometheus(tmp_path: Path, targets: list[str]) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (scripts/test.sh installs it)"
    listed = ", ".join(f"'{target}'" for target in targets)
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: arstream\n    static_configs: [{{targets: [{listed}]}}]\n"
    )
    port = free_port()
    command = [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}"]
    process = subprocess.Popen(
        [*command, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(url + "/-/ready") and process.poll() is None, "Prometheus is ready")
        yield url
    finally:
        process.terminate()
        process.wait(STOP_GUARD_S)


def answers(url: str) -> bool:
    """Whether URL answers 200 (a server that is not up yet does not)."""
    try:
        return httpx.get(url, timeout=5.0).status_code == 200
    except httpx.TransportError:
        return False


def evaluate(url: str, query: str) -> float | None:
    result = httpx.get(url + "/api/v1/query", params={"query": query}, timeout=10.0).json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def seen(url: str, connected: int, detached: int, queued: int) -> dict[str, float | None]:
    """Each of the query's terms once Prometheus has scraped this state (it scrapes each second)."""
    terms = {
        "connected": ("sum(arstream_sessions_connected)", connected),
        "detached": ("sum(arstream_sessions_detached)", detached),
        "queued": ('sum(haproxy_backend_current_queue{proxy="sessions"})', queued),
    }
    deadline = time.monotonic() + GUARD_S
    while True:
        values = {name: evaluate(url, term) for name, (term, _want) in terms.items()}
        if all(values[name] == want for name, (_term, want) in terms.items()) or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def test_the_autoscaling_query_counts_connected_detached_and_queued_sessions(tmp_path: Path) -> None:
    scaled = one(rendered("gpu"), "ScaledObject")
    [trigger] = scaled["spec"]["triggers"]
    assert (trigger["type"], trigger["metricType"], trigger["metadata"]["threshold"]) == (
        "prometheus",
        "AverageValue",
        "1",
    )
    query = trigger["metadata"]["query"]
    assert f"{TARGET_FULLNESS} * avg(arstream_session_capacity)" in query
    # The negative control: what a query counting only connected sessions would ask for.
    undercount = query.replace("+ sum(arstream_sessions_detached)", "").replace(
        '+ (sum(haproxy_backend_current_queue{proxy="sessions"}) or vector(0))', ""
    )
    assert undercount != query and "detached" not in undercount and "queue" not in undercount
    with ExitStack() as stack:
        replicas = {name: stack.enter_context(replica(name, resume_grace_s=60.0)) for name in ("r0", "r1")}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms", "--queue-timeout", "60s"))
        targets = [f"127.0.0.1:{s.port}" for s in replicas.values()] + [f"127.0.0.1:{lb.stats_port}"]
        url = stack.enter_context(prometheus(tmp_path, targets))
        wait_until(lambda: evaluate(url, "count(up == 1)") == 3.0, "Prometheus scrapes both replicas and HAProxy")
        assert seen(url, 0, 0, 0) == {"connected": 0.0, "detached": 0.0, "queued": 0.0}
        values: dict[str, float | None] = {"idle": evaluate(url, query)}

        async def scenario(sessions: Sessions) -> None:
            clients = [await sessions.open(lb.ws_url) for _ in range(4)]
            dropped = clients[3]
            assert dropped.ready is not None
            token = dropped.ready["resume"]["token"]
            dropped.abort()
            await asyncio.to_thread(
                wait_until, lambda: sum(r.stats()["sessions"]["detached"] for r in replicas.values()) == 1, "detached"
            )
            assert await asyncio.to_thread(seen, url, 3, 1, 0) == {"connected": 3.0, "detached": 1.0, "queued": 0.0}
            values["held"] = await asyncio.to_thread(evaluate, url, query)
            values["held, undercounted"] = await asyncio.to_thread(evaluate, url, undercount)
            await sessions.open(f"{lb.ws_url}?resume={token}", resume=token)
            newcomer = asyncio.create_task(start_or_refusal(lb.ws_url, sessions))
            await asyncio.to_thread(
                wait_until, lambda: newcomer.done() or lb.row("sessions", "BACKEND")["qcur"] == "1", "queued"
            )
            assert not newcomer.done(), f"the fifth session was answered at once: {newcomer.result()}"
            assert await asyncio.to_thread(seen, url, 4, 0, 1) == {"connected": 4.0, "detached": 0.0, "queued": 1.0}
            values["queued"] = await asyncio.to_thread(evaluate, url, query)
            values["queued, undercounted"] = await asyncio.to_thread(evaluate, url, undercount)
            await clients[0].send(type="close")  # a slot frees: the queued session starts, then all close
            await clients[0].closed_by_server()
            arrived = await asyncio.wait_for(newcomer, GUARD_S)
            assert isinstance(arrived, ProbeClient), arrived

        run_sessions(scenario)
    assert values == {
        "idle": 0.0,
        "held": 3.0,  # 4 sessions held (3 + 1 detached) / (0.8 x 2)
        "held, undercounted": 2.0,
        "queued": 4.0,  # 5 sessions (4 + 1 in HAProxy's queue) / (0.8 x 2)
        "queued, undercounted": 3.0,
    }, values
    # Never below the live sessions: each count holds every session there was, at 80 % full.
    held, queued = values["held"], values["queued"]
    assert held is not None and queued is not None
    assert held * CAPACITY * TARGET_FULLNESS >= 4 and queued * CAPACITY * TARGET_FULLNESS >= 5
