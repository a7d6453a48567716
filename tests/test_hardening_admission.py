"""Admission for resumes, detached sessions per client, and connections waiting to start.

Each attack runs against a real server. Client addresses come from ``X-Forwarded-For`` through the loopback
proxy the servers trust by default (as behind HAProxy); connections that never send `start` are raw sockets.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from arstream.models.fake import FakeKVPipeline
from raw_clients import RawWebSocket, closed_by_server
from servers import LiveServer, ProbeClient, fake_settings, running_server, session_client, wait_until

GREEDY = "203.0.113.7"
HONEST = "198.51.100.2"
OTHER = "192.0.2.44"
SEED = 7


def forwarded(address: str) -> list[tuple[str, str]]:
    return [("X-Forwarded-For", address)]


def resume_settings(**overrides: Any) -> Any:
    return fake_settings(replica_id="r0", resume_grace_s=30.0, **overrides)


async def start_and_drop(server: LiveServer, headers: list[tuple[str, str]], *, chunks: int = 0) -> str | None:
    """Start a session, run ``chunks`` chunks, drop the TCP connection; its resume token (None if refused).

    Waits until the server has seen the drop, so the next session never races the last one's detach.
    """
    async with session_client(server.ws_url, headers=headers) as client:
        await client.send(type="start", seed=SEED)
        reply = await client.recv_json()
        for tick_id in range(chunks if reply["type"] == "ready" else 0):
            await client.send(type="tick", tick_id=tick_id)
            await client.recv_chunk()
        client.abort()
    await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["connected"] == 0)
    return reply["resume"]["token"] if reply["type"] == "ready" else None


async def churn(server: LiveServer, count: int, headers: list[tuple[str, str]]) -> list[str]:
    """The attack: open and drop ``count`` sessions one after another; the tokens of those admitted."""
    tokens = [await start_and_drop(server, headers) for _ in range(count)]
    return [token for token in tokens if token is not None]


async def resume_outcome(
    stack: AsyncExitStack, server: LiveServer, token: str, headers: list[tuple[str, str]]
) -> tuple[str, ProbeClient]:
    """"resumed", or the refusal's code, for one resume kept open until ``stack`` closes; and its client."""
    url = f"{server.ws_url}?resume={token}"
    client = await stack.enter_async_context(session_client(url, headers=headers))
    await client.send(type="start", resume=token)
    reply = await client.recv_json()
    return ("resumed" if reply["type"] == "ready" else reply["code"]), client


async def churn_then_resume_all(
    server: LiveServer, count: int, headers: list[tuple[str, str]]
) -> tuple[list[str], int]:
    """Drop ``count`` sessions, resume every one of them and hold them: the outcomes and the live sessions held.

    The resumed sessions are closed after, so the test can check that every KV block came back.
    """
    tokens = await churn(server, count, headers)
    async with AsyncExitStack() as stack:
        results = [await resume_outcome(stack, server, token, headers) for token in tokens]
        stats = await asyncio.to_thread(server.stats)
        for outcome, client in results:
            if outcome == "resumed":
                await client.send(type="close")
                await client.closed_by_server()
    return [outcome for outcome, _ in results], stats["sessions"]["connected"]


# ---- a resume passes the same admission as a new session -------------------------------------


def test_resumes_cannot_take_an_address_past_its_session_cap() -> None:
    """Before: 8 sessions dropped and resumed from one address were 8 live sessions against a cap of 2."""
    with running_server(resume_settings(max_sessions_per_client=2)) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        outcomes, held = asyncio.run(churn_then_resume_all(server, 8, forwarded(GREEDY)))
        assert held <= 2, (
            f"one address holds {held} live sessions against max_sessions_per_client 2 "
            f"(8 sessions opened and dropped, then resumed: {outcomes})"
        )
        # Each new session released the address's own longest-detached one: only the last two were left.
        assert outcomes == ["resume_failed"] * 6 + ["resumed"] * 2, outcomes
        server.settled(start_free)


def test_resumes_cannot_take_a_token_past_its_session_cap() -> None:
    """Before: one token held 8 live sessions against a cap of 2 by dropping and resuming them."""
    settings = resume_settings(auth_token="alpha,bravo", max_sessions_per_token=2)
    with running_server(settings) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        outcomes, held = asyncio.run(churn_then_resume_all(server, 8, [("Authorization", "Bearer alpha")]))
        assert held <= 2, f"one token holds {held} live sessions against max_sessions_per_token 2 (resumes: {outcomes})"
        assert outcomes == ["resume_failed"] * 6 + ["resumed"] * 2, outcomes
        server.settled(start_free)


# 16 fps, 4 frames a chunk: 250 ms of video per chunk; 100 ms forwards, one session each: realtime for 2.
SLOW: dict[str, Any] = {"compute_delay_s": 0.1, "frames_per_chunk": 4, "window_frames": 8, "session_capacity": 8}


def test_resumes_pass_realtime_admission() -> None:
    """Before: with realtime room for 2, six sessions dropped one at a time were all resumed and held."""
    settings = resume_settings(admission="realtime", max_batch_sessions=1)
    with running_server(settings, FakeKVPipeline(**SLOW)) as server:
        assert server.stats()["sessions"]["realtime_capacity"] == 2
        outcomes, held = asyncio.run(churn_then_resume_all(server, 6, []))
        assert held <= 2, f"realtime admission with room for 2 holds {held} live sessions (resumes: {outcomes})"
        assert outcomes == ["resumed"] * 2 + ["over_capacity"] * 4, outcomes
        # Refused resumes spend nothing: those four sessions are still detached, their tokens still good.
        assert server.stats()["sessions"]["detached"] == 4


def test_a_resume_over_a_cap_spends_nothing_and_a_session_never_counts_against_itself() -> None:
    with running_server(resume_settings(max_sessions_per_client=1)) as server:

        async def scenario() -> tuple[str, str]:
            token = await start_and_drop(server, forwarded(HONEST), chunks=1)
            assert token is not None
            async with session_client(server.ws_url, start={}, headers=forwarded(OTHER)):
                async with AsyncExitStack() as stack:
                    # OTHER is at its cap of 1: the resume is refused, and the ticket survives it.
                    refused, _ = await resume_outcome(stack, server, token, forwarded(OTHER))
            async with AsyncExitStack() as stack:
                # HONEST holds only the session it resumes, which does not count against its own cap.
                resumed, client = await resume_outcome(stack, server, token, forwarded(HONEST))
                await client.send(type="close")
                await client.closed_by_server()
            return refused, resumed

        assert asyncio.run(scenario()) == ("over_capacity", "resumed")


# ---- one address's churn releases its own detached sessions, never another's first --------------


@pytest.mark.parametrize("per_client", [4, None], ids=["capped", "uncapped"])
def test_one_address_churning_sessions_keeps_another_address_detached_session(per_client: int | None) -> None:
    """Before: 64 sessions opened and dropped by one address released an honest session detached just before."""
    settings = resume_settings(max_sessions_per_client=per_client, model_options={"session_capacity": 8})
    with running_server(settings) as server:

        async def scenario() -> tuple[str, int]:
            token = await start_and_drop(server, forwarded(HONEST), chunks=1)
            assert token is not None
            await churn(server, 64, forwarded(GREEDY))
            detached = (await asyncio.to_thread(server.stats))["sessions"]["detached"]
            async with AsyncExitStack() as stack:
                outcome, _ = await resume_outcome(stack, server, token, forwarded(HONEST))
                return outcome, detached

        outcome, detached = asyncio.run(scenario())
        assert outcome == "resumed", (
            f"the honest session's resume got {outcome} after another address opened and dropped 64 sessions "
            f"(pool of 8, max_sessions_per_client {per_client}; {detached} sessions detached after the churn)"
        )
        if per_client is not None:
            assert detached <= per_client + 1  # the churner's own sessions, live or detached, stay within its cap


# ---- connections that have not started a session ----------------------------------------------


@pytest.fixture
def waiting_server() -> Iterator[LiveServer]:
    settings = resume_settings(
        max_connections=10,
        max_connections_per_client=None,
        max_unstarted_connections=6,
        max_unstarted_connections_per_client=2,
        start_timeout_s=60.0,  # far past the test: a connection refused at all was refused at once
    )
    with running_server(settings) as live:
        yield live


def idle_connection(server: LiveServer, path: str, address: str) -> RawWebSocket | None:
    """A WebSocket upgrade from ``address`` that will never send `start`; None when dropped at the connection cap."""
    try:
        return RawWebSocket(server.port, path, headers={"X-Forwarded-For": address})
    except OSError:
        return None


def healthz_answers(server: LiveServer, attempts: int = 40) -> bool:
    for _ in range(attempts):
        try:
            if httpx.get(server.base_url + "/healthz", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass  # refused at the connection cap
        time.sleep(0.025)
    return False


def test_connections_waiting_to_start_are_capped_per_address_and_in_all(waiting_server: LiveServer) -> None:
    """Before: idle connections (half of them ?resume=) took all 10 connections and /healthz was refused."""
    server = waiting_server
    paths = ["/v1/sessions", "/v1/sessions?resume=r0.never-sent"]
    idle: list[RawWebSocket | None] = []
    try:
        for index in range(3):
            idle.append(idle_connection(server, paths[index % 2], GREEDY))
        for index in range(12):
            idle.append(idle_connection(server, paths[index % 2], f"192.0.2.{index}"))
        statuses = [sock.status if sock is not None else 0 for sock in idle]
        refused = [sock for sock in idle if sock is not None and sock.status == 503]
        # The server closes a refused connection itself, at once: it holds no slot of max_connections.
        assert all(closed_by_server(sock.sock) for sock in refused)
        for refused_sock in refused:
            refused_sock.close()
        health = healthz_answers(server)
        figures = f"upgrade statuses {statuses} (0: dropped at the connection cap), /healthz answered: {health}"
        assert statuses == [101, 101, 503] + [101] * 4 + [503] * 8 and health, figures
        bodies = [json.loads(sock.leftover or b"{}") for sock in refused]
        assert all(body.get("code") == "over_capacity" for body in bodies), bodies
        assert "max_unstarted_connections_per_client 2" in bodies[0]["message"], bodies[0]
        assert "max_unstarted_connections 6" in bodies[1]["message"], bodies[1]

        # A waiting connection that goes away gives its place back; a started session holds none.
        for sock in idle[:2]:
            assert sock is not None
            sock.close()

        async def start_two() -> list[str]:
            async with session_client(server.ws_url, start={}, headers=forwarded(GREEDY)) as one:
                async with session_client(server.ws_url, start={}, headers=forwarded(GREEDY)) as two:
                    assert one.ready is not None and two.ready is not None
                    third = RawWebSocket(server.port, headers={"X-Forwarded-For": GREEDY})
                    third.close()
                    return [one.ready["type"], two.ready["type"], str(third.status)]

        wait_until(lambda: healthz_answers(server, attempts=1) and _waiting(server) == 4)
        assert asyncio.run(start_two()) == ["ready", "ready", "101"]
    finally:
        for sock in idle:
            if sock is not None:
                sock.close()


def _waiting(server: LiveServer) -> int:
    assert server.server is not None
    return server.server.hub.unstarted.count
