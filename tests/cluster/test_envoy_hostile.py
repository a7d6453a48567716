"""The shipped Envoy configuration (deploy/envoy/render.py) against hostile and realtime-dialect clients: a real
Envoy on loopback in front of real replicas (fake-kv), as tests/cluster/test_envoy.py runs it.

Each test is a failure of the configuration before it: Envoy matched the raw path while the replica decodes
it (`/%6detrics` and `/v1/%73tats` answered 200, `/v1/%63luster/*` reached a replica), and the vLLM-Omni
dialect's resumes and new sessions went round robin through the page cluster (a resume to a replica that
does not hold the session, a new session to a full replica).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from servers import LiveServer, ProbeClient, running_server, session_client
from test_balancer import Sessions
from test_balancer_hostile import raw_status
from test_envoy import Envoy, _passes, envoy
from test_cluster import wait_until
from test_migration import cluster_settings, drain

from arstream.app.realtime_video import PATH as REALTIME_PATH

WIDTH, HEIGHT = 16, 16
ENDLESS = 2**40
ROUNDS = 2  # each session is dropped and resumed through Envoy this many times


@contextmanager
def replicas_behind_envoy(tmp_path: Path, capacity: int) -> Iterator[tuple[dict[str, LiveServer], Envoy]]:
    with ExitStack() as stack:
        options = {"window_frames": 6, "session_capacity": capacity, "width": WIDTH, "height": HEIGHT}
        replicas = {
            name: stack.enter_context(running_server(cluster_settings(name, model_options=options)))
            for name in ("r0", "r1")
        }
        yield replicas, stack.enter_context(envoy(tmp_path, replicas))


@pytest.mark.parametrize(
    "request_line",
    [
        "GET /%6detrics HTTP/1.1",
        "GET /v1/%73tats HTTP/1.1",
        "GET /v1%2Fstats HTTP/1.1",
        "GET //metrics HTTP/1.1",
        "GET /v1/./stats HTTP/1.1",
        "GET /%72eplicas/r0/v1/stats HTTP/1.1",
        "POST /v1/%63luster/import HTTP/1.1",
        "POST /v1/cluster%2Fdrain HTTP/1.1",
        "POST /v1//cluster/drain HTTP/1.1",
    ],
)
def test_a_disguised_private_path_is_refused_as_the_plain_one_is(tmp_path: Path, request_line: str) -> None:
    """Old config: /%6detrics and /v1/%73tats were 200, /v1/%63luster/import reached the replica (401)."""
    with ExitStack() as stack:
        replica = stack.enter_context(running_server(cluster_settings("r0")))
        lb = stack.enter_context(envoy(tmp_path, {"r0": replica}))
        method, path, version = request_line.split(" ")
        plain = " ".join([method, "/v1/stats" if "stats" in path else path, version])
        for escaped, letter in (("%6d", "m"), ("%73", "s"), ("%2F", "/"), ("%72", "r"), ("%63", "c"), ("//", "/")):
            plain = plain.replace(escaped, letter)
        expected = raw_status(lb.port, plain)
        assert expected in (403, 404)  # Envoy's own refusal (the replica would say 200 or 401)
        assert raw_status(lb.port, request_line) == expected
        # Ordinary paths, escaped or not, still reach the replica.
        assert raw_status(lb.port, "GET /readyz HTTP/1.1") == 200
        assert raw_status(lb.port, "GET /%72eadyz HTTP/1.1") == 200


async def realtime_event(client: ProbeClient, kind: str) -> dict[str, Any]:
    """Read (skipping video bytes) until an event of ``kind`` or an error, which is returned instead."""
    while True:
        message = await client.recv()
        if isinstance(message, bytes):
            continue
        event: dict[str, Any] = json.loads(message)
        if event["type"] in (kind, "error"):
            return event


async def realtime_open(url: str, sessions: Sessions, **fields: Any) -> tuple[ProbeClient, dict[str, Any]]:
    """A connection to the dialect's path at ``url`` (a query kept), its session.start sent; its video.start
    (or the error that refused it)."""
    context = session_client(url)
    client = await context.__aenter__()
    sessions.contexts.append(context)
    start = {"type": "session.start", "model": "fake-kv", "prompt": "a world", "width": WIDTH, "height": HEIGHT}
    start["num_frames"] = ENDLESS  # without one a session is the model's default length, and ends by itself
    await client.send(**{**start, **fields})
    return client, await realtime_event(client, "video.start")


def realtime_url(base: str, query: str = "") -> str:
    return base.replace("http://", "ws://", 1) + REALTIME_PATH + query


def detached(replica: LiveServer, count: int) -> bool:
    return bool(replica.stats()["sessions"]["detached"] == count)


def test_realtime_resumes_and_moves_reach_the_replica_that_holds_the_session(tmp_path: Path) -> None:
    """Old config: `/v1/realtime/video?resume=` went round robin: about half the resumes reached the replica
    that does not hold the session and were refused (9 of 12 and 3 of 12 in the red team's runs)."""
    with replicas_behind_envoy(tmp_path, capacity=4) as (replicas, lb):

        async def scenario(sessions: Sessions) -> tuple[list[str], list[str]]:
            # Two sessions on each replica, opened on the replica itself: where each lives is known.
            held = []
            for name, replica in replicas.items():
                for _ in range(2):
                    client, started = await realtime_open(realtime_url(replica.base_url), sessions, resumable=True)
                    assert started["type"] == "video.start", started
                    held.append((name, client, started["resume"]["token"]))
            outcomes = []
            for _ in range(ROUNDS):
                for _name, client, _token in held:
                    client.abort()
                for replica in replicas.values():
                    await asyncio.to_thread(wait_until, partial(detached, replica, 2), "dropped")
                resumed = []
                for name, _client, token in held:
                    url = realtime_url(lb.url, f"?resume={token}")
                    client, started = await realtime_open(url, sessions, resume=token)
                    ok = started.get("resumed") is True and started["resume"]["token"].startswith(f"{name}.")
                    outcomes.append("resumed" if ok else str(started.get("code")))
                    resumed.append((name, client, started.get("resume", {}).get("token", token)))
                held = resumed
                if set(outcomes) != {"resumed"}:
                    return outcomes, []  # a session its resume missed is gone from this test
            # A drain of r0: its two sessions get session.moved with r1's tokens, followed through Envoy.
            report = (await asyncio.to_thread(drain, replicas["r0"], [replicas["r1"].base_url])).json()
            assert report["moved"] == 2, report
            followed = []
            for name, client, _token in held:
                if name != "r0":
                    continue
                moved = await realtime_event(client, "session.moved")
                token = moved["resume"]
                url = realtime_url(lb.url, f"?resume={token}")
                _client, started = await realtime_open(url, sessions, resume=token)
                followed.append("resumed" if started.get("resumed") is True else str(started.get("code")))
            return outcomes, followed

        outcomes, followed = run(scenario)
        assert outcomes == ["resumed"] * (4 * ROUNDS), outcomes
        assert followed == ["resumed"] * 2, followed


def test_new_realtime_sessions_go_only_to_replicas_with_room(tmp_path: Path) -> None:
    """Old config: new realtime sessions went round robin through the page cluster, whose check (/servingz)
    passes a full replica: with r0 full and r1 free, about half of them went to r0 and were refused."""
    capacity = 2
    with replicas_behind_envoy(tmp_path, capacity=capacity) as (replicas, lb):
        r0, r1 = replicas["r0"], replicas["r1"]

        async def scenario(sessions: Sessions) -> list[str]:
            for _ in range(capacity):  # r0 full, of sessions opened on it directly
                _client, started = await realtime_open(realtime_url(r0.base_url), sessions)
                assert started["type"] == "video.start", started
            room = {f"127.0.0.1:{r1.port}"}
            await asyncio.to_thread(wait_until, lambda: _passes(lb, "sessions") == room, "r0 full")
            outcomes = []
            for _ in range(capacity):
                _client, started = await realtime_open(realtime_url(lb.url), sessions)
                outcomes.append(str(started.get("code", "started")))
            return outcomes

        assert run(scenario) == ["started"] * capacity


def run(scenario: Any) -> Any:
    async def main() -> Any:
        sessions = Sessions()
        try:
            return await scenario(sessions)
        finally:
            await sessions.close_all()

    return asyncio.run(main())

