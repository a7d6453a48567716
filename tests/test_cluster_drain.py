"""Draining through scripts/local-cluster.sh: 2 real replicas behind the real HAProxy, on loopback.

Sessions streaming on one replica are drained (``arstream drain``) to the
other; their clients follow ``moved`` through the balancer (the token's prefix
routes them), and the chunks after the move equal those of an uninterrupted
session with the same seed and controls. The drained replica exits. The
balancer never exposes the cluster routes. ``arstream client`` follows a move
by itself, and starts afresh (saying so) when its replica is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from arstream.programs.client import run_script
from servers import ProbeClient, session_client
from test_cluster import Cluster, _alive, launch_cluster, replica_of, wait_until

SECRET = "drain-test-cluster-secret"
SEED = 11
KEYS = [["d"], ["w"], ["w", "d"], [], ["a"], ["s"], ["d"], ["d"], ["a", "s"], []]
MOVE_AT = 4
SESSIONS = 4


def cluster_options(model: str, capacity: int, delay_s: float = 0.0) -> list[str]:
    options: dict[str, Any] = {"session_capacity": capacity}
    if model == "fake-kv":
        options.update(window_frames=6, compute_delay_s=delay_s)
    if model == "matrix-game-2":
        options.update(config="tiny", random_init=True)
    return [
        "--model", model, "--model-options", json.dumps(options), "--resume-grace-s", "30",
        "--max-batch-sessions", "1", "--log-level", "info",
    ]


@pytest.fixture(params=["fake-kv", "tiny-world", "matrix-game-2"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    capacity = SESSIONS if request.param == "fake-kv" else 2
    with launch_cluster(cluster_options(request.param, capacity), {"ARSTREAM_CLUSTER_SECRET": SECRET}) as started:
        started.model = request.param  # type: ignore[attr-defined]
        yield started


async def chunk_pixels(client: ProbeClient) -> tuple[dict[str, Any], np.ndarray]:
    chunk, frames = await client.recv_chunk()
    return chunk, np.stack([pixels for _header, pixels in frames])


def arstream_drain(replica_url: str, peer_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arstream", "drain", replica_url, "--to", peer_url],
        env={**os.environ, "ARSTREAM_CLUSTER_SECRET": SECRET},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_drained_sessions_follow_to_the_peer_and_continue_bit_identically(cluster: Cluster) -> None:
    sessions = SESSIONS if cluster.model == "fake-kv" else 2  # type: ignore[attr-defined]
    baselines = {name: cluster.replica_stats(name)["kv"]["blocks_free"] for name in cluster.replicas}
    # The balancer never lets the cluster routes through, not even under /replicas/rN/.
    for path in ("/v1/cluster/drain", "/replicas/r0/v1/cluster/drain", "/replicas/r0/v1/cluster/import"):
        response = httpx.post(cluster.lb + path, headers={"authorization": f"Bearer {SECRET}"}, timeout=10.0)
        # 403 for the cluster routes; the per-replica routes are private on the public port altogether (404)
        assert response.status_code in (403, 404), (path, response.status_code)

    async def scenario() -> None:
        # An uninterrupted reference with the same seed and controls (on r1, which will stay).
        want: list[np.ndarray] = []
        contexts = [session_client(cluster.ws_url, start={"codec": "raw", "seed": SEED}) for _ in range(sessions)]
        clients = [await context.__aenter__() for context in contexts]
        try:
            placed = [replica_of(c) for c in clients]
            assert sorted(placed) == sorted(["r0", "r1"] * (sessions // 2)), placed  # least connections
            reference = next(c for c in clients if replica_of(c) == "r1")
            for tick_id, keys in enumerate(KEYS):
                await reference.send(type="tick", tick_id=tick_id, controls={"keys": keys})
                want.append((await chunk_pixels(reference))[1])
            movers = [c for c in clients if replica_of(c) == "r0"]
            assert movers, placed
            for client in movers:
                for tick_id in range(MOVE_AT):
                    await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                    assert np.array_equal((await chunk_pixels(client))[1], want[tick_id])
            # The reference leaves, so r1 has room for every mover.
            await reference.send(type="close")
            await reference.closed_by_server()
            drained = await asyncio.to_thread(arstream_drain, cluster.replicas["r0"][0], cluster.replicas["r1"][0])
            assert drained.returncode == 0, drained.stderr
            report = json.loads(drained.stdout.strip().splitlines()[-1])
            assert report["moved"] == len(movers) and report["ended"] == 0, report
            for client in movers:
                assert client.ready is not None
                session_id = client.ready["session_id"]
                closed = await client.closed_by_server()
                moved = closed.messages[-2]
                assert closed.messages[-1] == {"type": "closed", "reason": "moved"}, closed.messages
                assert moved["type"] == "moved" and moved["next_chunk_index"] == MOVE_AT, moved
                token = moved["resume"]
                assert token.startswith("r1.")
                # Through the balancer: the token's prefix routes the reconnect to r1.
                async with session_client(
                    f"{cluster.ws_url}?resume={token}", start={"resume": token, "codec": "raw"}
                ) as follower:
                    assert follower.ready is not None and follower.ready["session_id"] == session_id
                    assert replica_of(follower) == "r1"
                    for tick_id in range(MOVE_AT, len(KEYS)):
                        await follower.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                        chunk, got = await chunk_pixels(follower)
                        assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None, chunk
                        assert np.array_equal(got, want[tick_id]), f"chunk {tick_id} differs after the move"
                    await follower.send(type="close")
                    await follower.closed_by_server()
        finally:
            for context in contexts:
                await context.__aexit__(None, None, None)

    # Read before the drain: local-cluster.sh starts a replica that exits again, and the table then names the new one.
    r0_pid = cluster.replicas["r0"][1]
    asyncio.run(scenario())
    # The drained replica exits by itself; the peer is back at its baseline.
    wait_until(lambda: not _alive(r0_pid), "the drained replica exited")
    wait_until(
        lambda: (lambda s: s["sessions"]["connected"] == 0 and s["sessions"]["detached"] == 0
                 and s["kv"]["blocks_free"] == baselines["r1"])(cluster.replica_stats("r1")),
        "r1 back at its baseline",
    )


@pytest.fixture
def slow_cluster() -> Iterator[Cluster]:
    """fake-kv at about 20 chunks a second, so a scripted client is still streaming when the move comes."""
    with launch_cluster(cluster_options("fake-kv", SESSIONS, 0.05), {"ARSTREAM_CLUSTER_SECRET": SECRET}) as started:
        yield started


def drain_now(replica_url: str, peer_url: str) -> dict[str, Any]:
    response = httpx.post(
        replica_url + "/v1/cluster/drain",
        json={"peers": [peer_url]},
        headers={"authorization": f"Bearer {SECRET}"},
        timeout=120.0,
    )
    response.raise_for_status()
    return response.json()


def _holder(cluster: Cluster) -> str:
    return next(n for n in cluster.replicas if cluster.replica_stats(n)["sessions"]["connected"] == 1)


def test_arstream_client_follows_a_move_by_itself(slow_cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = slow_cluster
    plan = [("d",)] * 80 + [("w",)] * 80

    async def scenario() -> Any:
        script = asyncio.create_task(run_script(cluster.ws_url, plan, codec="raw", seed=SEED))
        await asyncio.to_thread(wait_until, lambda: any(
            cluster.replica_stats(n)["chunks"]["total"] > 5 for n in cluster.replicas), "the script streams")
        source = await asyncio.to_thread(_holder, cluster)
        peer = next(n for n in cluster.replicas if n != source)
        report = await asyncio.to_thread(drain_now, cluster.replicas[source][0], cluster.replicas[peer][0])
        assert report["moved"] == 1, report
        return await asyncio.wait_for(script, 120)

    result = asyncio.run(scenario())
    assert len(result.frames) == len(plan) * 2  # fake-kv: 2 frames a chunk; every chunk arrived
    assert result.closed_reason == "client"
    assert "moved to replica" in capsys.readouterr().out


def test_arstream_client_starts_afresh_when_its_replica_is_killed(
    slow_cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = slow_cluster
    plan = [("d",)] * 60

    async def scenario() -> Any:
        script = asyncio.create_task(run_script(cluster.ws_url, plan, codec="raw", seed=SEED, resume_on_drop=True))
        await asyncio.to_thread(wait_until, lambda: any(
            cluster.replica_stats(n)["chunks"]["total"] > 5 for n in cluster.replicas), "the script streams")
        source = await asyncio.to_thread(_holder, cluster)
        os.kill(cluster.replicas[source][1], signal.SIGKILL)
        return await asyncio.wait_for(script, 120)

    result = asyncio.run(scenario())
    assert len(result.frames) == len(plan) * 2
    out = capsys.readouterr().out
    assert "the server holding the session is gone" in out and "the world starts over" in out, out
