"""A drain moves every session, whatever it is doing, and says what became of each (app/migration.py).

Two real servers on loopback (in-process, fake-kv) and real WebSocket
clients: live streaming sessions, one that had `ready` but no tick, one
detached (its client dropped) and one in the middle of a resume all continue
on the peer, their chunks equal to those of an uninterrupted session. A
client that comes back to the drained replica with its old token gets
`moved`. The resume-vs-drain-start race is forced into its worst order with
gates on the worker (no sleeps). Sessions no peer takes end with the reason,
`arstream drain` exits non-zero and names them, /metrics counts by kind, and
the pools are back at baseline. SIGTERM drains by itself when peers are known.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import numpy as np
import pytest

from arstream.app import migration as migration_module
from servers import RECEIVE_GUARD_S, LiveServer, ProbeClient, running_server, session_client
from test_cluster import wait_until
from test_migration import KEYS, MOVE_AT, SECRET, SEED, cluster_settings, drain, frames_of, reference, two_replicas

GATE_GUARD_S = 60.0  # hang guard for a gate a test opens itself


async def tick_through(client: ProbeClient, ticks: range, want: list[np.ndarray]) -> None:
    """Ticks ``ticks`` with the test's keys; each chunk must be the uninterrupted session's, at its index."""
    for tick_id in ticks:
        await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
        chunk, got = await frames_of(client)
        assert chunk["chunk_index"] == tick_id and chunk["restarted"] is None, chunk
        assert np.array_equal(got, want[tick_id]), f"chunk {tick_id} differs after the move"


async def moved_message(client: ProbeClient) -> dict[str, Any]:
    closed = await client.closed_by_server()
    assert closed.messages[-1] == {"type": "closed", "reason": "moved"}, closed.messages
    moved = closed.messages[-2]
    assert moved["type"] == "moved", closed.messages
    assert closed.code == 1001
    return moved


def resumed_on(server: LiveServer, token: str) -> Any:
    """A context that resumes ``token`` on ``server`` (a balancer routes it there by the prefix)."""
    return session_client(f"{server.ws_url}?resume={token}", start={"resume": token, "codec": "raw"})


async def continue_on_peer(peer: LiveServer, moved: dict[str, Any], session_id: str, want: list[np.ndarray]) -> None:
    token = moved["resume"]
    assert token.startswith("r1."), moved
    async with resumed_on(peer, token) as follower:
        assert follower.ready is not None
        assert follower.ready["resumed"] is True and follower.ready["session_id"] == session_id
        await tick_through(follower, range(moved["next_chunk_index"], len(KEYS)), want)
        await follower.send(type="close")
        await follower.closed_by_server()


async def detach(server: LiveServer, client: ProbeClient, ticks: int, want: list[np.ndarray]) -> str:
    """Tick ``ticks`` chunks, then drop the connection without a close: the session is detached; its token."""
    await tick_through(client, range(ticks), want)
    assert client.ready is not None
    token = str(client.ready["resume"]["token"])
    client.abort()
    await asyncio.to_thread(wait_until, lambda: server.stats()["sessions"]["detached"] == 1, "the session detached")
    return token


def drain_counts(server: LiveServer) -> dict[tuple[str, str], float]:
    text = server.get("/metrics").text
    found = re.findall(r'arstream_drain_sessions_total\{kind="(\w+)",outcome="(\w+)"\} ([0-9.]+)', text)
    return {(kind, outcome): float(value) for kind, outcome, value in found}


def at_baseline(*servers: LiveServer) -> None:
    for server in servers:
        server.settled(server.stats()["kv"]["blocks_total"])


def test_live_ready_and_detached_sessions_all_move_and_each_is_reported_once() -> None:
    with two_replicas() as (r0, r1):
        ids: dict[str, list[str]] = {}

        async def scenario() -> None:
            want = await reference(r1)
            async with AsyncExitStack() as stack:
                start = {"codec": "raw", "seed": SEED}
                live = [await stack.enter_async_context(session_client(r0.ws_url, start=start)) for _ in range(2)]
                ready = await stack.enter_async_context(session_client(r0.ws_url, start=start))
                dropped = await stack.enter_async_context(session_client(r0.ws_url, start=start))
                for client in live:
                    await tick_through(client, range(MOVE_AT), want)
                old_token = await detach(r0, dropped, MOVE_AT, want)
                ids["live"] = [c.ready["session_id"] for c in live if c.ready]
                ids["ready"] = [ready.ready["session_id"]] if ready.ready else []
                ids["detached"] = [dropped.ready["session_id"]] if dropped.ready else []

                response = await asyncio.to_thread(drain, r0, [r1.base_url])
                assert response.status_code == 200, response.text
                report = response.json()
                kinds = {s["session_id"]: s["kind"] for s in report["sessions"]}
                assert len(report["sessions"]) == len(kinds) == 4, report  # each session once
                assert kinds == {sid: kind for kind, sids in ids.items() for sid in sids}, report
                assert report["moved"] == 4 and report["ended"] == 0, report
                assert all(s["peer"] == r1.base_url and s["snapshot_bytes"] > 0 for s in report["sessions"]), report

                for client in live:
                    moved = await moved_message(client)
                    assert moved["next_chunk_index"] == MOVE_AT
                    await continue_on_peer(r1, moved, ids["live"][live.index(client)], want)
                moved = await moved_message(ready)
                assert moved["next_chunk_index"] == 0  # no chunk ran: the peer starts the rollout
                await continue_on_peer(r1, moved, ids["ready"][0], want)
                # The dropped client comes back to the drained replica with its old token: it is told where to go.
                async with session_client(f"{r0.ws_url}?resume={old_token}") as late:
                    await late.send(type="start", resume=old_token, codec="raw")
                    moved = await moved_message(late)
                assert moved["next_chunk_index"] == MOVE_AT
                await continue_on_peer(r1, moved, ids["detached"][0], want)

        asyncio.run(scenario())
        counts = drain_counts(r0)
        assert counts[("live", "moved")] == 2 and counts[("ready", "moved")] == 1, counts
        assert counts[("detached", "moved")] == 1 and counts[("live", "ended")] == 0, counts
        assert "arstream_resumes_total{outcome=\"moved\"} 1.0" in r0.get("/metrics").text
        at_baseline(r0, r1)


@contextmanager
def gated(server: LiveServer, method: str) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold the results of ``server``'s worker ``method`` (session_position), or of the drain's export
    (export_plan: app/transfers.py, which the drain calls with the worker), until the test opens the gate:
    ``entered`` is set when it is called, ``gate`` releases it."""
    assert server.server is not None and server.server.hub.worker is not None
    worker = server.server.hub.worker
    owner: Any = worker if hasattr(worker, method) else migration_module
    original: Callable[..., asyncio.Future[Any]] = getattr(owner, method)
    entered, gate = threading.Event(), threading.Event()

    def held(*args: Any) -> asyncio.Future[Any]:
        inner = original(*args)

        async def after() -> Any:
            result = await inner
            entered.set()
            await asyncio.to_thread(gate.wait, GATE_GUARD_S)
            return result

        return asyncio.ensure_future(after())

    setattr(owner, method, held)
    try:
        yield entered, gate
    finally:
        gate.set()
        if owner is worker:
            delattr(worker, method)  # the class's own method again
        else:
            setattr(owner, method, original)


def migration_of(server: LiveServer) -> Any:
    assert server.server is not None and server.server.migration is not None
    return server.server.migration


def test_a_resume_in_flight_when_the_drain_begins_is_moved_after_it_lands() -> None:
    """The race closed: the resume has claimed the session (it is in no connection and not detached) when the
    drain takes stock; the drain waits for it to land, then moves it. Forced with a gate, in that order."""
    with two_replicas() as (r0, r1):

        async def scenario() -> dict[str, Any]:
            want = await reference(r1)
            async with session_client(r0.ws_url, start={"codec": "raw", "seed": SEED}) as first:
                token = await detach(r0, first, MOVE_AT, want)
                session_id = first.ready["session_id"] if first.ready else ""
            with gated(r0, "session_position") as (entered, gate):
                async with session_client(f"{r0.ws_url}?resume={token}") as resumer:
                    await resumer.send(type="start", resume=token, codec="raw")
                    await asyncio.to_thread(entered.wait, GATE_GUARD_S)  # claimed, not attached: mid-resume
                    draining = asyncio.create_task(asyncio.to_thread(drain, r0, [r1.base_url]))
                    await asyncio.to_thread(
                        wait_until, lambda: session_id in migration_of(r0).moves, "the drain took stock"
                    )
                    gate.set()
                    ready = await resumer.recv_json()
                    assert ready["type"] == "ready" and ready["resumed"] is True, ready
                    moved = await moved_message(resumer)
                    report = (await draining).json()
            assert moved["next_chunk_index"] == MOVE_AT
            await continue_on_peer(r1, moved, session_id, want)
            return report

        report = asyncio.run(scenario())
        assert [(s["kind"], s["moved"]) for s in report["sessions"]] == [("resuming", True)], report
        at_baseline(r0, r1)


def test_a_resume_that_arrives_while_its_detached_session_is_shipped_waits_and_follows() -> None:
    with two_replicas() as (r0, r1):

        async def scenario() -> None:
            want = await reference(r1)
            async with session_client(r0.ws_url, start={"codec": "raw", "seed": SEED}) as first:
                token = await detach(r0, first, MOVE_AT, want)
                session_id = first.ready["session_id"] if first.ready else ""
            with gated(r0, "export_plan") as (entered, gate):
                draining = asyncio.create_task(asyncio.to_thread(drain, r0, [r1.base_url]))
                await asyncio.to_thread(entered.wait, GATE_GUARD_S)  # the drain is shipping the detached session
                async with session_client(f"{r0.ws_url}?resume={token}") as late:
                    await late.send(type="start", resume=token, codec="raw")
                    registry = r0.server.hub.resume if r0.server else None
                    assert registry is not None
                    # It waits on the move (the old code refused it: over_capacity, "draining").
                    await asyncio.to_thread(
                        wait_until, lambda: bool(registry._waiters.get(session_id)), "the resume waits on the move"
                    )
                    gate.set()
                    moved = await moved_message(late)
                report = (await draining).json()
            assert report["moved"] == 1 and report["sessions"][0]["kind"] == "detached", report
            await continue_on_peer(r1, moved, session_id, want)

        asyncio.run(scenario())
        at_baseline(r0, r1)


def arstream_drain(*args: str, secret: str | None = SECRET) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ARSTREAM_CLUSTER_SECRET"}
    if secret is not None:
        env["ARSTREAM_CLUSTER_SECRET"] = secret
    return subprocess.run(
        [sys.executable, "-m", "arstream", "drain", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_sessions_no_peer_takes_end_with_the_reason_and_arstream_drain_exits_non_zero() -> None:
    full = {"model_options": {"window_frames": 6, "session_capacity": 1}}
    with two_replicas(both=full) as (r0, r1):

        async def scenario() -> subprocess.CompletedProcess[str]:
            async with session_client(r1.ws_url, start={"codec": "raw"}) as holder:  # r1 is full
                await holder.send(type="tick", tick_id=0)
                await frames_of(holder)
                async with session_client(r0.ws_url, start={"codec": "raw"}) as client:
                    session_id = client.ready["session_id"] if client.ready else ""
                    found = await asyncio.to_thread(arstream_drain, "--which", session_id, r1.base_url, r0.base_url)
                    assert found.returncode == 0 and found.stdout.startswith(f"{r0.base_url} holds"), found
                    drained = await asyncio.to_thread(arstream_drain, r0.base_url, "--to", r1.base_url, "--no-exit")
                    closed = await client.closed_by_server()
                    assert closed.messages[-1] == {"type": "closed", "reason": "server_shutdown"}, closed.messages
                await holder.send(type="close")
                await holder.closed_by_server()
            return drained

        drained = asyncio.run(scenario())
        assert drained.returncode == 3, drained
        assert "ended 1" in drained.stderr and "(ready): no peer took it" in drained.stderr, drained.stderr
        assert "no room" in drained.stderr, drained.stderr
        assert drain_counts(r0)[("ready", "ended")] == 1
        at_baseline(r0, r1)


def test_the_drain_refusals_say_what_is_missing() -> None:
    with running_server(cluster_settings("r0", cluster_secret=None)) as off, running_server(cluster_settings("r1")) as on:
        refused = arstream_drain(off.base_url)
        assert refused.returncode == 1
        assert "ARSTREAM_CLUSTER_SECRET" in refused.stderr and '{"detail"' not in refused.stderr, refused.stderr
        wrong = arstream_drain(on.base_url, secret="a-different-secret-of-16+")
        assert wrong.returncode == 1 and "different cluster secret" in wrong.stderr, wrong.stderr
        unset = arstream_drain(on.base_url, secret=None)
        assert unset.returncode == 2 and "ARSTREAM_CLUSTER_SECRET" in unset.stderr, unset.stderr
        assert on.get("/readyz").status_code == 200  # none of that drained anything


@pytest.mark.parametrize("peer", ["up", "none"])
def test_sigterm_drains_to_the_configured_peer_then_exits(peer: str) -> None:
    with running_server(cluster_settings("r1")) as r1:
        peers = r1.base_url if peer == "up" else "http://127.0.0.1:9"  # port 9: nobody listens
        with running_server(cluster_settings("r0", cluster_peers=peers)) as r0:

            async def scenario() -> dict[str, Any]:
                want = await reference(r1)
                async with session_client(r0.ws_url, start={"codec": "raw", "seed": SEED}) as client:
                    await tick_through(client, range(MOVE_AT), want)
                    assert r0.server is not None
                    r0.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
                    closed = await client.closed_by_server()
                if peer == "up":
                    assert closed.messages[-1] == {"type": "closed", "reason": "moved"}, closed.messages
                    assert closed.messages[-2]["type"] == "moved"
                    await continue_on_peer(r1, closed.messages[-2], client.ready["session_id"] if client.ready else "", want)
                else:
                    assert closed.messages[-1] == {"type": "closed", "reason": "server_shutdown"}, closed.messages
                assert r0.thread is not None
                await asyncio.to_thread(r0.thread.join, RECEIVE_GUARD_S)
                assert not r0.thread.is_alive(), "the drained replica did not exit"
                return migration_of(r0).report.as_json()

            report = asyncio.run(scenario())
        if peer == "up":
            assert report["moved"] == 1 and report["ended"] == 0, report
        else:
            assert report["moved"] == 0 and "no peer took it" in report["sessions"][0]["reason"], report
        at_baseline(r1)


def test_a_dns_name_stands_for_every_address_it_has() -> None:
    from arstream.app.peers import configured_peers, expand

    assert set(expand("http://localhost:8123")) <= {"http://127.0.0.1:8123", "http://[::1]:8123"}
    assert "http://127.0.0.1:8123" in expand("http://localhost:8123")
    assert expand("https://localhost:8123/") == ["https://localhost:8123"]  # TLS names the host: kept
    settings = cluster_settings("r0", cluster_peers="http://localhost:8123,http://10.1.2.3:8000")
    peers = asyncio.run(configured_peers(settings, own={"http://127.0.0.1:8123", "http://[::1]:8123"}))
    assert peers == ["http://10.1.2.3:8000"]  # its own addresses left out


def test_a_second_sigterm_ends_what_the_drain_has_not_moved() -> None:
    with running_server(cluster_settings("r1")) as r1:
        with running_server(cluster_settings("r0", cluster_peers=r1.base_url)) as r0:

            async def scenario() -> tuple[dict[str, Any], Any]:
                async with session_client(r0.ws_url, start={"codec": "raw", "seed": SEED}) as client:
                    await client.send(type="tick", tick_id=0)
                    await frames_of(client)
                    assert r0.server is not None
                    with gated(r0, "export_plan") as (entered, gate):  # the move hangs at its export
                        r0.server.handle_exit(signal.SIGTERM, None)
                        await asyncio.to_thread(entered.wait, GATE_GUARD_S)
                        r0.server.handle_exit(signal.SIGTERM, None)  # the second: end what is left
                        closed = await client.closed_by_server()
                        gate.set()  # the move was cut short already; let its held export go
                        assert r0.thread is not None
                        await asyncio.to_thread(r0.thread.join, RECEIVE_GUARD_S)
                return migration_of(r0).report.as_json(), closed

            report, closed = asyncio.run(scenario())
            assert not (r0.thread and r0.thread.is_alive()), "the replica did not exit"
        assert closed.messages[-1] == {"type": "closed", "reason": "server_shutdown"}, closed.messages
        assert report["moved"] == 0 and report["sessions"][0]["reason"] == "a second SIGTERM ended the drain", report
        at_baseline(r1)
