"""The shipped HAProxy configuration against real replicas, on loopback: what it learns from their agent checks.

Each test is one failure measured with the configuration before the agent
check: a full cluster after an HAProxy restart,
new sessions sent to a replica whose slots resumed sessions hold, a reload
that forgets the sessions the old process still carries, a replica that is
still loading, a dead replica before its health check notices, and one client
address holding connections without limit.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from arstream.app.balancer import BalancerLedger
from servers import (
    REPO_ROOT,
    RECEIVE_GUARD_S,
    STOP_GUARD_S,
    LiveServer,
    ProbeClient,
    fake_settings,
    running_server,
    session_client,
)
from test_server_http import SlowWarmupFakePipeline

RENDER = REPO_ROOT / "deploy" / "haproxy" / "render.py"
CAPACITY = 2
# Hang guard for polling HAProxy's view; it asserts nothing about speed.
POLL_GUARD_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + POLL_GUARD_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


@contextmanager
def replica(name: str, pipeline: Any = None, *, wait_ready: bool = True, **settings: Any) -> Iterator[LiveServer]:
    values: dict[str, Any] = {
        "replica_id": name,
        "agent_port": 0,
        "resume_grace_s": 30.0,
        "model_options": {"session_capacity": CAPACITY},
    }
    values.update(settings)
    with running_server(fake_settings(**values), pipeline, wait_ready=wait_ready) as server:
        yield server


@dataclass
class Balancer:
    """HAProxy running the shipped template, rendered for some replicas; it can be restarted and reloaded."""

    config: Path
    port: int
    stats_port: int
    admin_port: int
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None  # where HAProxy's log lines (its standard output) go, for a test that reads them

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/sessions"

    def start(self, *extra: str) -> None:
        with self.log.open("ab") if self.log is not None else open(os.devnull, "wb") as out:
            self.process = subprocess.Popen(
                ["haproxy", "-db", "-f", str(self.config), *extra], stdout=out, stderr=subprocess.DEVNULL
            )
        wait_until(self._answers, "HAProxy answers on its statistics port")

    def _answers(self) -> bool:
        assert self.process is not None and self.process.poll() is None, "HAProxy exited"
        try:
            return httpx.get(self.stats_url, timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(STOP_GUARD_S)

    def reload(self) -> subprocess.Popen[bytes]:
        """A new process takes over the ports; the old one keeps its open connections (haproxy -sf)."""
        assert self.process is not None
        old = self.process
        self.start("-sf", str(old.pid))
        return old

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(STOP_GUARD_S)

    @property
    def stats_url(self) -> str:
        return f"http://127.0.0.1:{self.stats_port}/stats"

    def row(self, backend: str, server: str) -> dict[str, str]:
        text = httpx.get(self.stats_url + ";csv", timeout=10.0).text.lstrip("# ")
        return next(r for r in csv.DictReader(io.StringIO(text)) if (r["pxname"], r["svname"]) == (backend, server))


@contextmanager
def balancer(
    tmp_path: Path, replicas: dict[str, LiveServer], *args: str, log: Path | None = None
) -> Iterator[Balancer]:
    port, stats_port, admin_port = free_port(), free_port(), free_port()
    specs = [f"{name}=127.0.0.1:{s.port}/{CAPACITY}@{s.agent_port()}" for name, s in replicas.items()]
    command = [sys.executable, str(RENDER), *(a for spec in specs for a in ("--replica", spec))]
    command += ["--bind", f"127.0.0.1:{port}", "--stats-bind", f"127.0.0.1:{stats_port}"]
    command += ["--admin-bind", f"127.0.0.1:{admin_port}", *args]
    config = tmp_path / "haproxy.cfg"
    config.write_text(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    lb = Balancer(config, port, stats_port, admin_port, log=log)
    lb.start()
    try:
        yield lb
    finally:
        lb.stop()


@contextmanager
def two_replicas(tmp_path: Path) -> Iterator[tuple[dict[str, LiveServer], Balancer, ExitStack]]:
    """Replicas r0 and r1 behind HAProxy checking every 200 ms; the stack, for more clean-up."""
    with ExitStack() as stack:
        replicas = {name: stack.enter_context(replica(name)) for name in ("r0", "r1")}
        yield replicas, stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms")), stack


def run_sessions(scenario: Callable[[Sessions], Awaitable[None]]) -> None:
    """Run ``scenario`` in a new event loop; every session it opened is closed after it."""

    async def main() -> None:
        sessions = Sessions()
        try:
            await scenario(sessions)
        finally:
            await sessions.close_all()

    asyncio.run(main())


def placed(client: ProbeClient) -> str:
    assert client.ready is not None
    return client.ready["resume"]["token"].split(".", 1)[0]


class Sessions:
    """Session clients opened in one event loop, closed at the end (each one's context kept)."""

    def __init__(self) -> None:
        self.contexts: list[Any] = []

    async def open(self, url: str, **start: Any) -> ProbeClient:
        return await self.open_with(url, start=start)

    async def open_with(self, url: str, *, start: dict[str, Any] | None = None, headers: Any = None) -> ProbeClient:
        context = session_client(url, start=start if start is not None else {}, headers=headers)
        client = await context.__aenter__()
        self.contexts.append(context)
        return client

    async def close_all(self) -> None:
        for context in self.contexts:
            await context.__aexit__(None, None, None)


async def start_or_refusal(url: str, sessions: Sessions) -> ProbeClient | str:
    """A started session, or the error code / HTTP status that refused it."""
    context = session_client(url)
    client = await context.__aenter__()
    sessions.contexts.append(context)
    await client.send(type="start")
    reply = await client.recv_json()
    if reply["type"] != "ready":
        return str(reply.get("code"))
    client.ready = reply
    return client


async def close(client: ProbeClient) -> None:
    await client.send(type="close")
    await client.closed_by_server()


async def settle(condition: Callable[[], bool], what: str) -> None:
    await asyncio.to_thread(wait_until, condition, what)


def state(row: dict[str, str]) -> str:
    """UP, DOWN (from the health or the agent check), or NO ROOM: up, but the agent set its weight to 0."""
    if row["status"].startswith("UP") and row["weight"] == "0":
        return "NO ROOM"
    return row["status"].split(" ")[0]


def wait_heard(lb: Balancer, expected: dict[str, str]) -> None:
    """Until HAProxy shows each server in the given state (see :func:`state`), from its checks and agent."""
    wait_until(
        lambda: all(state(lb.row("sessions", name)) == wanted for name, wanted in expected.items()),
        f"HAProxy shows {expected}",
    )


def test_a_full_cluster_after_an_haproxy_restart_queues_new_sessions(tmp_path: Path) -> None:
    """Old config: the resumed sessions counted nowhere, so 4/4 new sessions got over_capacity at once."""
    with two_replicas(tmp_path) as (replicas, lb, stack):

        async def scenario(sessions: Sessions) -> None:
            clients = [await sessions.open(lb.ws_url) for _ in range(4)]
            assert sorted(placed(c) for c in clients) == ["r0", "r0", "r1", "r1"]
            tokens = [c.ready["resume"]["token"] for c in clients if c.ready]
            lb.kill()  # every tunnel through it is cut: the sessions detach on their replicas
            await settle(
                lambda: all(r.stats()["sessions"]["detached"] == 2 for r in replicas.values()), "all detached"
            )
            await asyncio.to_thread(lb.start)
            resumed = [await sessions.open(f"{lb.ws_url}?resume={t}", resume=t) for t in tokens]
            assert all(c.ready and c.ready["resumed"] for c in resumed)
            await asyncio.to_thread(wait_heard, lb, {"r0": "UP", "r1": "UP"})
            # A new session now waits in HAProxy's queue for a slot ...
            newcomer = asyncio.create_task(start_or_refusal(lb.ws_url, sessions))
            await settle(
                lambda: newcomer.done() or lb.row("sessions", "BACKEND")["qcur"] == "1", "queued or answered"
            )
            assert not newcomer.done(), f"a new session was answered at once: {newcomer.result()}"
            # ... and starts where a slot frees.
            leaving = next(c for c in resumed if placed(c) == "r1")
            await close(leaving)
            arrived = await asyncio.wait_for(newcomer, RECEIVE_GUARD_S)
            assert isinstance(arrived, ProbeClient) and placed(arrived) == "r1", arrived

        run_sessions(scenario)


def test_new_sessions_go_where_resumed_sessions_left_room(tmp_path: Path) -> None:
    """Old config: resumes had their own backend, so new sessions went to the replica they filled (3/3 refused)."""
    with two_replicas(tmp_path) as (replicas, lb, stack):

        async def scenario(sessions: Sessions) -> None:
            clients = [await sessions.open(lb.ws_url) for _ in range(4)]
            on_r0 = [c for c in clients if placed(c) == "r0"]
            on_r1 = [c for c in clients if placed(c) == "r1"]
            # r0's two sessions drop and come back as resumes; one of r1's leaves: r1 has the only free slot.
            tokens = [c.ready["resume"]["token"] for c in on_r0 if c.ready]
            for client in on_r0:
                client.abort()
            await settle(lambda: replicas["r0"].stats()["sessions"]["detached"] == 2, "r0's sessions detached")
            for token in tokens:
                await sessions.open(f"{lb.ws_url}?resume={token}", resume=token)
            await close(on_r1[0])
            await settle(lambda: replicas["r1"].stats()["sessions"]["connected"] == 1, "r1 has a free slot")
            outcomes = []
            for _ in range(3):
                outcome = await start_or_refusal(lb.ws_url, sessions)
                outcomes.append(outcome if isinstance(outcome, str) else placed(outcome))
                if not isinstance(outcome, str):
                    break
            assert outcomes == ["r1"], f"new sessions while r1 had the only free slot: {outcomes}"

        run_sessions(scenario)


def test_watch_links_reach_the_replica_holding_the_session_even_when_it_is_full(tmp_path: Path) -> None:
    """Old config: ``?share=`` went to the sessions backend like a new session, least connections and at most the
    free slots: viewers landed on the other replica (share_failed) or waited for a slot nobody would free."""
    with two_replicas(tmp_path) as (replicas, lb, stack):

        wait_heard(lb, {"r0": "UP", "r1": "UP"})  # both take sessions before the four players come

        async def scenario(sessions: Sessions) -> None:
            players = [await sessions.open(lb.ws_url) for _ in range(2 * CAPACITY)]
            await settle(
                lambda: all(r.stats()["sessions"]["connected"] == CAPACITY for r in replicas.values()), "both full"
            )
            for player in players:
                assert player.ready is not None
                token = player.ready["share"]["token"]
                assert token.split(".", 1)[0] == placed(player)
                for _ in range(2):
                    viewer = await sessions.open(f"{lb.ws_url}?share={token}", watch=token)
                    assert viewer.ready is not None and viewer.ready["role"] == "viewer"
                    assert viewer.ready["session_id"] == player.ready["session_id"]
            assert [r.stats()["sessions"]["viewers"] for r in replicas.values()] == [2 * CAPACITY, 2 * CAPACITY]

        run_sessions(scenario)


def test_after_a_reload_new_sessions_avoid_replicas_full_of_the_old_process_sessions(tmp_path: Path) -> None:
    """Old config: the reloaded process counted from zero; 2 new sessions split 1/1 over a 2/0 load."""
    with two_replicas(tmp_path) as (replicas, lb, stack):

        async def scenario(sessions: Sessions) -> None:
            clients = [await sessions.open(lb.ws_url) for _ in range(4)]
            for client in [c for c in clients if placed(c) == "r1"]:
                await close(client)
            old = await asyncio.to_thread(lb.reload)
            stack.callback(old.wait, STOP_GUARD_S)
            stack.callback(old.kill)
            assert old.poll() is None, "the old process should keep r0's two sessions"
            # The new process has heard r0's agent: r0's slots are taken, by connections it cannot see.
            await asyncio.to_thread(wait_heard, lb, {"r0": "NO ROOM", "r1": "UP"})
            outcomes = [await start_or_refusal(lb.ws_url, sessions) for _ in range(2)]
            where = [o if isinstance(o, str) else placed(o) for o in outcomes]
            assert where == ["r1", "r1"], f"2 new sessions after the reload, r0 full: {where}"
            for client in clients:
                if placed(client) == "r0":
                    await close(client)
            old.wait(STOP_GUARD_S)  # its last connection gone, the old process exits

        run_sessions(scenario)


def test_a_loading_replica_gets_no_new_sessions(tmp_path: Path) -> None:
    """Old config: /healthz said alive, so a replica still loading was sent sessions it refused."""
    loading = SlowWarmupFakePipeline()
    with ExitStack() as stack:
        ready = stack.enter_context(replica("r0"))
        slow = stack.enter_context(replica("r1", loading, wait_ready=False))
        stack.callback(loading.release_warmup.set)
        lb = stack.enter_context(balancer(tmp_path, {"r0": ready, "r1": slow}, "--check-interval", "200ms"))

        async def scenario(sessions: Sessions) -> None:
            await asyncio.to_thread(wait_heard, lb, {"r0": "UP", "r1": "DOWN"})
            outcomes = [await start_or_refusal(lb.ws_url, sessions) for _ in range(2)]
            where = [o if isinstance(o, str) else placed(o) for o in outcomes]
            assert where == ["r0", "r0"], f"2 new sessions while r1 loads: {where}"
            loading.release_warmup.set()
            await asyncio.to_thread(wait_heard, lb, {"r1": "UP"})
            third = await start_or_refusal(lb.ws_url, sessions)
            assert not isinstance(third, str) and placed(third) == "r1", third

        run_sessions(scenario)


def test_new_sessions_survive_a_dead_replica_before_its_health_check_notices(tmp_path: Path) -> None:
    """Old config: no redispatch, so arrivals sent to the dead replica got a 503 until it was marked down."""
    with ExitStack() as stack:
        survivor = stack.enter_context(replica("r0"))
        doomed_stack = ExitStack()
        doomed = doomed_stack.enter_context(replica("r1"))
        # Checks every 20 s: the whole test runs inside the window before HAProxy notices.
        lb = stack.enter_context(
            balancer(tmp_path, {"r0": survivor, "r1": doomed}, "--check-interval", "20s", "--maxconn", str(CAPACITY))
        )

        async def scenario(sessions: Sessions) -> None:
            await asyncio.to_thread(doomed_stack.close)  # r1 stops: its port refuses connections
            assert lb.row("sessions", "r1")["status"].startswith("UP")
            outcomes = []
            for _ in range(CAPACITY):
                try:
                    outcome = await start_or_refusal(lb.ws_url, sessions)
                    outcomes.append(outcome if isinstance(outcome, str) else placed(outcome))
                except InvalidStatus as refused:
                    outcomes.append(f"HTTP {refused.response.status_code}")
            # Least connections offers the dead replica every other arrival.
            assert outcomes == ["r0"] * CAPACITY, f"new sessions while r1 is dead, not yet marked down: {outcomes}"

        run_sessions(scenario)


def test_one_address_cannot_hold_more_than_its_connections(tmp_path: Path) -> None:
    """The old config: idle connections from one address had no limit (100 filled a replica)."""
    with ExitStack() as stack:
        replicas = {name: stack.enter_context(replica(name)) for name in ("r0", "r1")}
        lb = stack.enter_context(
            balancer(tmp_path, replicas, "--check-interval", "200ms", "--per-source-connections", "3")
        )

        async def scenario() -> list[str]:
            outcomes: list[str] = []
            async with AsyncExitStack() as held:
                for index in range(5):
                    # Connections that never send `start`, half of them resumes with a made-up token.
                    url = lb.ws_url + ("?resume=r0.never-issued" if index % 2 else "")
                    try:
                        await held.enter_async_context(connect(url, proxy=None, open_timeout=RECEIVE_GUARD_S))
                        outcomes.append("open")
                    except InvalidStatus as refused:
                        outcomes.append(f"HTTP {refused.response.status_code}")
            return outcomes

        outcomes = asyncio.run(scenario())
        assert outcomes == ["open"] * 3 + ["HTTP 429"] * 2, outcomes
        # The limit is per address and per open connection: with those closed, the address is welcome again.
        wait_until(lambda: httpx.get(lb.url + "/readyz", timeout=10.0).status_code == 200, "the address served")


def fresh_connection_get(url: str, source: str) -> str:
    """GET ``url`` on a new connection from loopback address ``source``: its status, or how it failed."""
    transport = httpx.HTTPTransport(local_address=source, retries=0)
    try:
        with httpx.Client(transport=transport, timeout=10.0) as client:
            return str(client.get(url).status_code)
    except httpx.TransportError as failed:
        return type(failed).__name__


def test_one_address_cannot_open_connections_faster_than_its_rate(tmp_path: Path) -> None:
    """Issue 20: reconnecting as fast as possible cost an honest session 5.5x its chunk latency (no rate bound)."""
    with ExitStack() as stack:
        replicas = {"r0": stack.enter_context(replica("r0"))}
        lb = stack.enter_context(
            balancer(tmp_path, replicas, "--check-interval", "200ms", "--per-source-connection-rate", "5")
        )
        outcomes = [fresh_connection_get(lb.url + "/healthz", "127.0.0.2") for _ in range(9)]
        # Five in any 10 s are served; past that each connection is closed before HAProxy reads it.
        assert outcomes[:5] == ["200"] * 5 and "200" not in outcomes[5:], outcomes
        assert fresh_connection_get(lb.url + "/healthz", "127.0.0.3") == "200"  # another address is not slowed


@pytest.mark.parametrize("path", ["/metrics", "/v1/stats", "/replicas/r0/v1/stats", "/replicas/r0/metrics"])
def test_private_routes_are_not_on_the_public_port(tmp_path: Path, path: str) -> None:
    with ExitStack() as stack:
        replicas = {"r0": stack.enter_context(replica("r0"))}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))
        assert httpx.get(lb.url + path, timeout=10.0).status_code == 404
        private = f"http://127.0.0.1:{lb.stats_port}"
        if path.startswith("/replicas/"):
            # The replica's own answer (HAProxy's exporter also answers /metrics on this port).
            answer = httpx.get(private + path, timeout=10.0)
            assert answer.status_code == 200 and ("arstream_sessions_connected" in answer.text or "kv" in answer.json())
        assert httpx.get(lb.url + "/readyz", timeout=10.0).status_code == 200


# ---- the replica's side, without HAProxy ----------------------------------------------------------


def agent_line(server: LiveServer) -> str:
    with socket.create_connection(("127.0.0.1", server.agent_port()), timeout=10.0) as sock:
        data = b""
        while chunk := sock.recv(256):
            data += chunk
    return data.decode()


def test_the_ledger_takes_the_newest_balancer_at_each_address() -> None:
    now = [0.0]
    ledger = BalancerLedger(clock=lambda: now[0])
    ledger.heard("10.0.0.5", "lb/100")
    now[0] = 1.0
    ledger.heard("10.0.0.5", "lb/200")  # a reload: a new process
    now[0] = 2.0
    ledger.heard("10.0.0.5", "lb/100")  # the old one still checking does not win back
    ledger.heard("10.0.0.6", "other/7")
    for junk in (None, "", "lb", "lb/x", "lb/1/2", "a b/1", "x" * 70 + "/1"):
        ledger.heard("10.0.0.5", junk)
    assert ledger.newest_at("10.0.0.5") == "lb/200" and ledger.newest_at("10.0.0.6") == "other/7"
    live, starting = (lambda: True), (lambda: False)
    with (
        ledger.connection("lb/100", live),
        ledger.connection("lb/200", live),
        ledger.connection("lb/200", live),
        ledger.connection("lb/200", starting),  # not admitted yet: it may still take a free slot
        ledger.connection(None, live),
    ):
        assert ledger.held_by_newest_at("10.0.0.5") == 2 and ledger.held_by_newest_at("10.0.0.6") == 0
    assert ledger.held_by_newest_at("10.0.0.5") == 0
    for pid in range(300, 320):  # many restarts: a bounded memory, the newest still wins
        now[0] += 1.0
        ledger.heard("10.0.0.5", f"lb/{pid}")
    assert ledger.newest_at("10.0.0.5") == "lb/319"


def test_the_agent_reports_loading_free_slots_and_no_room() -> None:
    loading = SlowWarmupFakePipeline()
    with running_server(fake_settings(agent_port=0), loading, wait_ready=False) as slow:
        try:
            assert agent_line(slow).startswith("down #the model is loading")
        finally:
            loading.release_warmup.set()
        slow.wait_ready()
    with replica("r0") as server:
        assert agent_line(server) == f"up 100% maxconn:{CAPACITY}\n"
        stamp = [("X-ARStream-Balancer", "lb/42")]
        assert server.get("/healthz", headers=dict(stamp)).status_code == 200  # lb/42 checks from 127.0.0.1

        async def scenario() -> list[str]:
            lines = []
            async with connect(server.ws_url, additional_headers=stamp, proxy=None):
                # lb/42's connection before its start: it is about to take a free slot, which is not offered twice.
                lines.append(await asyncio.to_thread(agent_line, server))
            sessions = Sessions()
            try:
                ours = await sessions.open_with(server.ws_url, headers=stamp)
                # lb/42's own session: it may still hold CAPACITY here (it counts this one itself).
                lines.append(await asyncio.to_thread(agent_line, server))
                await sessions.open_with(server.ws_url)
                # One it cannot see (another balancer's, or straight in): it may keep its one, add none.
                lines.append(await asyncio.to_thread(agent_line, server))
                await close(ours)
                await sessions.open_with(server.ws_url)
                # Full of sessions it cannot see: weight 0.
                lines.append(await asyncio.to_thread(agent_line, server))
            finally:
                await sessions.close_all()
            return lines

        full = f"up 100% maxconn:{CAPACITY}\n"
        assert asyncio.run(scenario()) == [full, full, "up 100% maxconn:1\n", "up 0%\n"]
