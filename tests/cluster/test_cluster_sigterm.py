"""SIGTERM alone drains: scripts/local-cluster.sh (real replica processes, the real HAProxy) on loopback.

The replicas know each other (local-cluster.sh's peers file) and share the
cluster secret, so a replica stopped with SIGTERM moves its sessions before
it exits, and local-cluster.sh starts it again, as an orchestrator would:

- nine sessions on one replica (six streaming, one detached, one that had
  `ready` but no tick, one being resumed as the signal comes) all continue
  on the peer, reached through the balancer by their new tokens, with frames
  equal to an uninterrupted session's (fake-kv, tiny-world, tiny matrix-game-2);
- a rolling restart of both replicas by SIGTERM alone, under scripted load
  (`arstream client`'s loop, which follows `moved`), loses no session;
- with the peer full, or with no peer alive, the sessions end with
  `server_shutdown`, the replica's report (its ``ARSTREAM_DRAIN_REPORT`` log
  line) says why for each, and every pool left is at its baseline.

The nine sessions are opened on the replica's own address so that all of
them are on the one being stopped; every reconnect goes through HAProxy.
The in-process tests (tests/cluster/test_drain_sessions.py) force the resume race
into each order; here the resume and the signal are only sent back to back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from arstream.programs.client import run_script
from servers import ProbeClient, session_client
from test_cluster import Cluster, _alive, launch_cluster, replica_of, wait_until
from test_cluster_drain import KEYS, MOVE_AT, SECRET, SEED, chunk_pixels, cluster_options
from test_drain_sessions import moved_message

STREAMING = 6
HELD = STREAMING + 3  # the detached, the ready-only and the mid-resume sessions
RESTART_GUARD_S = 300.0  # hang guard for a replica's restart (loading a model); asserts nothing about speed


def launch(model: str, capacity: int, folder: Path, delay_s: float = 0.0, restart: bool = True) -> Any:
    env = {"ARSTREAM_CLUSTER_SECRET": SECRET, "ARSTREAM_CLUSTER_DIR": str(folder)}
    if not restart:
        env["ARSTREAM_RESTART"] = "0"
    # Rewind off: its points cost slots (docs/rewind.md), and ten sessions must fit one replica here.
    options = cluster_options(model, capacity, delay_s) + ["--drain-timeout-s", "60", "--rewind-seconds", "0"]
    return launch_cluster(options, env)


def drain_report(folder: Path, replica: str) -> dict[str, Any]:
    """The last drain report the replica logged (its ARSTREAM_DRAIN_REPORT line)."""
    lines = [line for line in (folder / f"{replica}.log").read_text().splitlines() if line.startswith("ARSTREAM_DRAIN")]
    assert lines, f"{replica} logged no drain report"
    return json.loads(lines[-1].split(" ", 1)[1])


def restarted(cluster: Cluster, name: str, old_pid: int) -> None:
    """Wait until local-cluster.sh has started ``name`` again and it answers through the balancer."""
    def ready() -> bool:
        if cluster.replicas[name][1] == old_pid:
            return False
        try:
            return bool(cluster.replica_stats(name)["kv"]["session_capacity"])
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    wait_until(lambda: not _alive(old_pid), f"{name} exited after its drain", RESTART_GUARD_S)
    wait_until(ready, f"{name} started again", RESTART_GUARD_S)


async def ticks(client: ProbeClient, span: range, want: list[np.ndarray]) -> None:
    for tick_id in span:
        await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
        chunk, got = await chunk_pixels(client)
        assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None, chunk
        assert np.array_equal(got, want[tick_id]), f"chunk {tick_id} differs from the uninterrupted session's"


@pytest.fixture(params=["fake-kv", "tiny-world", "matrix-game-2"])
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_sigterm_moves_all_nine_kinds_of_session_and_they_continue_bit_identically(
    model: str, tmp_path: Path
) -> None:
    with launch(model, HELD + 1, tmp_path) as cluster:
        r0_url, r0_pid = cluster.replicas["r0"]
        r0_ws = r0_url.replace("http://", "ws://") + "/v1/sessions"
        baseline = cluster.replica_stats("r1")["kv"]["blocks_free"]

        async def scenario() -> None:
            start = {"codec": "raw", "seed": SEED}
            want: list[np.ndarray] = []
            async with session_client(cluster.replicas["r1"][0].replace("http://", "ws://") + "/v1/sessions",
                                      start=start) as reference:
                for tick_id, keys in enumerate(KEYS):
                    await reference.send(type="tick", tick_id=tick_id, controls={"keys": keys})
                    want.append((await chunk_pixels(reference))[1])
                await reference.send(type="close")
                await reference.closed_by_server()
            async with AsyncExitStack() as stack:
                streaming = [await stack.enter_async_context(session_client(r0_ws, start=start))
                             for _ in range(STREAMING)]
                ready_only = await stack.enter_async_context(session_client(r0_ws, start=start))
                dropped = await stack.enter_async_context(session_client(r0_ws, start=start))
                resuming = await stack.enter_async_context(session_client(r0_ws, start=start))
                for client in [*streaming, dropped, resuming]:
                    await ticks(client, range(MOVE_AT), want)
                tokens = {}
                for client in (dropped, resuming):
                    assert client.ready is not None
                    tokens[id(client)] = client.ready["resume"]["token"]
                    client.abort()
                await asyncio.to_thread(wait_until, lambda: cluster.replica_stats("r0")["sessions"]["detached"] == 2,
                                        "two sessions detached")
                # A resume through the balancer and the SIGTERM, back to back.
                token = tokens[id(resuming)]
                resumer = await stack.enter_async_context(session_client(f"{cluster.ws_url}?resume={token}"))
                await resumer.send(type="start", resume=token, codec="raw")
                os.kill(r0_pid, signal.SIGTERM)
                movers: list[tuple[dict[str, Any], int]] = []
                for client in [*streaming, ready_only]:
                    movers.append((await moved_message(client), 0 if client is ready_only else MOVE_AT))
                message = await resumer.recv_json()
                if message["type"] == "ready":  # resumed before the drain took stock: moved as a live session
                    message = await moved_message(resumer)
                else:  # it waited for the move, then was told where the session went
                    assert message["type"] == "moved", message
                movers.append((message, MOVE_AT))
                # The dropped client comes back late, with its old token: HAProxy routes it to r0 (draining, or
                # already gone and restarted), or the forward answered: either way it learns the new token.
                late = tokens[id(dropped)]
                async with session_client(f"{cluster.ws_url}?resume={late}") as returning:
                    await returning.send(type="start", resume=late, codec="raw")
                    movers.append((await moved_message(returning), MOVE_AT))
                assert len(movers) == HELD
                followers = []
                for moved, first in movers:  # every client reconnects at once (within the peer's grace)
                    assert moved["type"] == "moved" and moved["resume"].startswith("r1."), moved
                    assert moved["next_chunk_index"] == first, moved
                    url = f"{cluster.ws_url}?resume={moved['resume']}"
                    follower = await stack.enter_async_context(
                        session_client(url, start={"resume": moved["resume"], "codec": "raw"})
                    )
                    assert replica_of(follower) == "r1"
                    followers.append((follower, first))
                for follower, first in followers:
                    await ticks(follower, range(first, len(KEYS)), want)
                    await follower.send(type="close")
                    await follower.closed_by_server()

        asyncio.run(scenario())
        report = drain_report(tmp_path, "r0")
        assert report["moved"] == HELD and report["ended"] == 0, report
        kinds = sorted(s["kind"] for s in report["sessions"])
        # The resumer is "resuming" (claimed when the drain took stock), "live" (resumed before it) or
        # "detached" (not yet claimed: its resume then waited for the move); the others are what they were.
        assert kinds.count("ready") == 1 and kinds.count("live") >= STREAMING, kinds
        assert 1 <= kinds.count("detached") <= 2 and len(kinds) == HELD, kinds
        assert len({s["session_id"] for s in report["sessions"]}) == HELD  # each once
        wait_until(lambda: (lambda s: s["sessions"]["connected"] == 0 and s["sessions"]["detached"] == 0
                            and s["kv"]["blocks_free"] == baseline)(cluster.replica_stats("r1")), "r1 at baseline")


def test_a_rolling_restart_by_sigterm_alone_under_load_loses_no_session(tmp_path: Path) -> None:
    sessions = 4
    plan = [("d",)] * 60 + [("w",)] * 60 + [("a",)] * 60
    with launch("fake-kv", sessions * 2, tmp_path, delay_s=0.04) as cluster:

        async def scenario() -> list[Any]:
            reference = await run_script(cluster.ws_url, plan[:40], codec="raw", seed=SEED)
            scripts = [asyncio.create_task(run_script(cluster.ws_url, plan, codec="raw", seed=SEED))
                       for _ in range(sessions)]
            await asyncio.to_thread(wait_until, lambda: all(
                cluster.replica_stats(n)["sessions"]["connected"] == sessions // 2 for n in cluster.replicas),
                "every script streams")
            for name in ("r0", "r1"):
                pid = cluster.replicas[name][1]
                os.kill(pid, signal.SIGTERM)
                await asyncio.to_thread(restarted, cluster, name, pid)
            results = await asyncio.wait_for(asyncio.gather(*scripts), RESTART_GUARD_S)
            return [reference, *results]

        reference, *results = asyncio.run(scenario())
        for result in results:
            assert len(result.frames) == len(plan) * 2  # fake-kv: 2 frames a chunk; every chunk arrived
            assert result.chunk_indexes == list(range(len(plan))) and result.restarts == [], result.restarts
            assert result.closed_reason == "client"
            for got, want in zip(result.frames, reference.frames):  # the same world as one never moved
                assert np.array_equal(got, want)
        for name in ("r0", "r1"):
            report = drain_report(tmp_path, name)
            assert report["ended"] == 0 and report["moved"] >= 1, report


@pytest.mark.parametrize("peer", ["full", "dead"])
def test_sigterm_with_no_room_or_no_peer_ends_sessions_with_the_reason(peer: str, tmp_path: Path) -> None:
    capacity = 2
    with launch("fake-kv", capacity, tmp_path, restart=False) as cluster:
        r0_url, r0_pid = cluster.replicas["r0"]
        r1_url, r1_pid = cluster.replicas["r1"]
        baseline = cluster.replica_stats("r1")["kv"]["blocks_free"]

        async def scenario() -> None:
            async with AsyncExitStack() as stack:
                def ws(url: str) -> str:
                    return url.replace("http://", "ws://") + "/v1/sessions"

                holders = []
                if peer == "full":
                    holders = [await stack.enter_async_context(session_client(ws(r1_url), start={"codec": "raw"}))
                               for _ in range(capacity)]
                else:
                    os.kill(r1_pid, signal.SIGKILL)
                    await asyncio.to_thread(wait_until, lambda: not _alive(r1_pid), "r1 is dead")
                clients = [await stack.enter_async_context(session_client(ws(r0_url), start={"codec": "raw"}))
                           for _ in range(capacity)]
                await clients[0].send(type="tick", tick_id=0)
                await clients[0].recv_chunk()
                os.kill(r0_pid, signal.SIGTERM)
                for client in clients:
                    closed = await client.closed_by_server()
                    assert closed.messages[-1] == {"type": "closed", "reason": "server_shutdown"}, closed.messages
                for holder in holders:
                    await holder.send(type="close")
                    await holder.closed_by_server()

        asyncio.run(scenario())
        wait_until(lambda: not _alive(r0_pid), "r0 exited after its drain")
        report = drain_report(tmp_path, "r0")
        assert report["moved"] == 0 and report["ended"] == capacity, report
        assert sorted(s["kind"] for s in report["sessions"]) == ["live", "ready"], report
        expected = "no room" if peer == "full" else "ConnectError"
        assert all("no peer took it" in s["reason"] and expected in s["reason"] for s in report["sessions"]), report
        if peer == "full":
            wait_until(lambda: cluster.replica_stats("r1")["kv"]["blocks_free"] == baseline, "r1 at baseline")
            assert cluster.replica_stats("r1")["sessions"]["detached"] == 0


def test_arstream_client_starts_afresh_after_server_shutdown(capsys: pytest.CaptureFixture[str]) -> None:
    """No cluster secret: SIGTERM ends the sessions (server_shutdown); `--resume-on-drop` begins the world again
    on the other replica through the balancer, and says so (it used to exit on `server_shutdown`)."""
    plan = [("d",)] * 60
    with launch_cluster(cluster_options("fake-kv", 4, 0.05)) as cluster:

        async def scenario() -> Any:
            script = asyncio.create_task(run_script(cluster.ws_url, plan, codec="raw", seed=SEED, resume_on_drop=True))
            await asyncio.to_thread(wait_until, lambda: any(
                cluster.replica_stats(n)["chunks"]["total"] > 5 for n in cluster.replicas), "the script streams")
            holder = next(n for n in cluster.replicas if cluster.replica_stats(n)["sessions"]["connected"] == 1)
            os.kill(cluster.replicas[holder][1], signal.SIGTERM)
            return await asyncio.wait_for(script, RESTART_GUARD_S)

        result = asyncio.run(scenario())
    assert len(result.frames) == len(plan) * 2 and result.closed_reason == "client"
    out = capsys.readouterr().out
    assert "server_shutdown" in out and "the world starts over" in out, out


def test_a_draining_refusal_is_one_the_client_starts_afresh_after() -> None:
    """The words the client looks for are the ones a draining replica says (app/hub.py's refusal)."""
    from arstream.programs.client import afresh_reason, draining_refusal
    from arstream.programs.client_lib import ServerError
    from arstream.app.hub import SessionHub
    from arstream.app.protocol import ErrorCode, ErrorMessage
    from servers import fake_settings

    hub = SessionHub(fake_settings())
    hub.draining = True
    refusal = ServerError(
        ErrorMessage(code=ErrorCode.OVER_CAPACITY, message=hub.admission_refusal(), tick_id=None, fatal=True)
    )
    assert draining_refusal(refusal) and afresh_reason(refusal) is not None
    full = ServerError(
        ErrorMessage(code=ErrorCode.OVER_CAPACITY, message="all 4 session slots are in use", tick_id=None, fatal=True)
    )
    assert not draining_refusal(full) and afresh_reason(full) is None  # a full server: wait, not start afresh
