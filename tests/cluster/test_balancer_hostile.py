"""The shipped HAProxy configuration against hostile clients (issue 31, findings 5, 9 and 10; issue 33's
cluster routes): real HAProxy, real replicas on loopback.

Each test is an attack that worked through the configuration before it: a
percent-encoded private path (the replica decodes it, HAProxy matched the raw
one), the cluster routes through the private port, a forged X-Forwarded-For
that HAProxy appended to, a forged balancer-identity header on a watch
connection, the realtime dialect round-robined past the agent's slots, and the
stats page's admin actions (cut sessions, MAINT) open to anyone on the private port.
"""

from __future__ import annotations

import asyncio
import json
import socket
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from arstream.app.realtime_video import PATH as REALTIME_PATH
from servers import RECEIVE_GUARD_S, LiveServer, ProbeClient, server_process, session_client, wait_until
from test_balancer import CAPACITY, Sessions, agent_line, balancer, replica, wait_heard

SECRET = "a-cluster-secret"
WIDTH, HEIGHT = 16, 16


def hub_of(server: LiveServer) -> Any:
    assert server.server is not None
    return server.server.hub


def raw_status(port: int, request_line: str) -> int:
    """The status of one request sent byte for byte as given (httpx would normalise the path)."""
    with socket.create_connection(("127.0.0.1", port), timeout=RECEIVE_GUARD_S) as sock:
        sock.sendall(f"{request_line}\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        head = b""
        while b"\r\n" not in head and (chunk := sock.recv(4096)):
            head += chunk
    return int(head.split(b" ", 2)[1])


@pytest.mark.parametrize(
    "request_line",
    [
        "GET /%6detrics HTTP/1.1",
        "GET /v1/%73tats HTTP/1.1",
        "GET /v1%2Fstats HTTP/1.1",
        "GET /%72eplicas/r0/v1/stats HTTP/1.1",
        "POST /v1/%63luster/import HTTP/1.1",
        "POST /v1/cluster%2Fdrain HTTP/1.1",
    ],
)
def test_a_percent_encoded_private_path_is_refused_as_the_plain_one_is(tmp_path: Path, request_line: str) -> None:
    """Old config: /%6detrics and /v1/%73tats were 200 and /v1/%63luster/import reached the replica (401)."""
    with ExitStack() as stack:
        replicas = {"r0": stack.enter_context(replica("r0", cluster_secret=SECRET))}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))
        plain = request_line.replace("%6d", "m").replace("%73", "s").replace("%2F", "/").replace("%72", "r")
        plain = plain.replace("%63", "c")
        expected = raw_status(lb.port, plain)
        assert expected in (403, 404)  # the plain path's refusal, by HAProxy (the replica would say 200 or 401)
        assert raw_status(lb.port, request_line) == expected
        # Escapes that do not decode are refused, and ordinary paths still reach the replicas.
        assert raw_status(lb.port, "GET /%zz HTTP/1.1") == 400
        assert raw_status(lb.port, "GET /readyz HTTP/1.1") == 200
        assert raw_status(lb.port, "GET /%72eadyz HTTP/1.1") == 200


@pytest.mark.parametrize(
    "path", ["/v1/cluster/drain", "/replicas/r0/v1/cluster/drain", "/replicas/r0/v1/%63luster/import"]
)
def test_the_private_port_does_not_forward_the_cluster_routes_either(tmp_path: Path, path: str) -> None:
    """Old config: the private port forwarded /v1/cluster/drain and /replicas/r0/v1/cluster/* (401 from the replica)."""
    with ExitStack() as stack:
        replicas = {"r0": stack.enter_context(replica("r0", cluster_secret=SECRET))}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))
        assert raw_status(lb.stats_port, f"POST {path} HTTP/1.1") == 403
        assert raw_status(lb.stats_port, "GET /replicas/r0/readyz HTTP/1.1") == 200  # the rest still works


def test_a_forged_x_forwarded_for_is_replaced_by_the_clients_own_address(tmp_path: Path) -> None:
    """Old config: HAProxy appended to the client's header, so a replica trusting the client's range (compose
    trusted every private range) took the forged address as the client's: it could get a victim banned."""
    with ExitStack() as stack:
        replicas = {"r0": stack.enter_context(replica("r0", forwarded_allow_ips="127.0.0.0/8"))}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))

        async def scenario() -> list[str]:
            forged = [("X-Forwarded-For", "203.0.113.7"), ("Forwarded", "for=203.0.113.8")]
            async with connect(lb.ws_url, additional_headers=forged, local_addr=("127.0.0.2", 0), proxy=None) as ws:
                client = ProbeClient(ws)
                await client.start()
                return [c.client_host for c in hub_of(replicas["r0"]).connections.values()]

        assert asyncio.run(scenario()) == ["127.0.0.2"]


def test_a_watch_connection_cannot_claim_to_be_a_session_the_balancer_counts(tmp_path: Path) -> None:
    """Old config: the balancer header was set only on the sessions backend, so a `?share=` connection (the plain
    backend) could carry HAProxy's own id: each one raised the slots the agent offered by one."""
    with ExitStack() as stack:
        replicas = {"r0": stack.enter_context(replica("r0", model_options={"session_capacity": 3}))}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))
        assert lb.process is not None
        haproxy_id = f"{socket.gethostname()}/{lb.process.pid}"

        async def scenario() -> list[str]:
            sessions = Sessions()
            try:
                player = await sessions.open(lb.ws_url)
                assert player.ready is not None
                token = player.ready["share"]["token"]
                lines = [await asyncio.to_thread(agent_line, replicas["r0"])]
                for _ in range(2):
                    await sessions.open_with(
                        f"{lb.ws_url}?share={token}",
                        start={"watch": token},
                        headers=[("X-ARStream-Balancer", haproxy_id)],
                    )
                lines.append(await asyncio.to_thread(agent_line, replicas["r0"]))
                return lines
            finally:
                await sessions.close_all()

        # 3 slots, one session through this HAProxy: it may hold 3 (2 free + its 1); the viewers change nothing.
        assert asyncio.run(scenario()) == ["up 100% maxconn:3\n"] * 2


async def realtime_start(url: str, sessions: Sessions) -> str:
    """Open a realtime dialect session through ``url``: ``started``, or the error event that refused it."""
    context = session_client(url.replace("/v1/sessions", REALTIME_PATH))
    client = await context.__aenter__()
    sessions.contexts.append(context)
    await client.send(type="session.start", model="fake-kv", prompt="a world", width=WIDTH, height=HEIGHT)
    while True:
        message = await client.recv()
        if isinstance(message, bytes):
            continue
        event = json.loads(message)
        if event["type"] == "video.start":
            return "started"
        if event["type"] == "error":
            return str(event.get("code"))


def test_the_realtime_dialect_gets_the_agents_slots_and_the_queue(tmp_path: Path) -> None:
    """Old config: /v1/realtime/video was round-robined through the plain backend: with r0 full and r1 free,
    one of two new realtime sessions went to r0 and was refused."""
    options = {"session_capacity": CAPACITY, "width": WIDTH, "height": HEIGHT}
    with ExitStack() as stack:
        replicas = {name: stack.enter_context(replica(name, model_options=options)) for name in ("r0", "r1")}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))

        async def scenario() -> tuple[list[str], str]:
            sessions = Sessions()
            try:
                for _ in range(CAPACITY):  # r0 full, of sessions this HAProxy never saw
                    await sessions.open(replicas["r0"].ws_url)
                await asyncio.to_thread(wait_heard, lb, {"r0": "NO ROOM", "r1": "UP"})
                outcomes = [await realtime_start(lb.ws_url, sessions) for _ in range(CAPACITY)]
                # Both on r1, counted there as this HAProxy's own (once r1 has heard a health check name it, which
                # may come after the sessions): it may keep them and add none.
                own = f"up 100% maxconn:{CAPACITY}\n"
                await asyncio.to_thread(wait_until, lambda: agent_line(replicas["r1"]) == own)
                return outcomes, await asyncio.to_thread(agent_line, replicas["r1"])
            finally:
                await sessions.close_all()

        outcomes, r1_agent = asyncio.run(scenario())
        assert outcomes == ["started"] * CAPACITY
        assert r1_agent == f"up 100% maxconn:{CAPACITY}\n"
        assert len(hub_of(replicas["r1"]).connections) == 0  # every session closed again


def test_the_replica_decodes_percent_escapes_in_its_paths() -> None:
    """Why HAProxy must decode too: the replica routes /%6detrics to /metrics (and raw_status sends it as given)."""
    with replica("r0") as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        assert raw_status(port, "GET /%6detrics HTTP/1.1") == 200
        assert raw_status(port, "GET /%72eadyz HTTP/1.1") == 200


def test_an_old_share_link_puts_its_token_in_no_log_line(tmp_path: Path) -> None:
    """Old code: uvicorn's access line had the whole `?watch=` / `?branch=` token (the page now builds
    `#watch=` links, which a browser never sends; links made before still work, so both logs redact)."""
    haproxy_log = tmp_path / "haproxy.log"
    serve = ["--model", "fake-kv", "--log-level", "info", "--agent-port", "0", "--replica-id", "r0"]
    with ExitStack() as stack:
        r0 = stack.enter_context(server_process(serve))
        lb = stack.enter_context(balancer(tmp_path, {"r0": r0}, "--check-interval", "200ms", log=haproxy_log))
        for query in ("watch=r0.WATCHSECRET", "branch=r0.BRANCHSECRET&chunk=3"):
            assert httpx.get(f"{lb.url}/?{query}", timeout=10.0).status_code == 200
        wait_until(lambda: sum("GET /?" in line for line in r0.output) >= 2)
        wait_until(lambda: haproxy_log.read_text().count('"GET / HTTP/1.1"') >= 2)
        logs = "".join(r0.output) + haproxy_log.read_text()
        assert "WATCHSECRET" not in logs and "BRANCHSECRET" not in logs
        assert "/?watch=<redacted>" in logs and "chunk=3" in logs  # redacted, not left out


ADMIN_PASSWORD = "an-operators-password-for-tests"
STATS_ACTIONS = ("shutdown", "maint")  # cut the server's sessions; put it in maintenance


def stats_post(url: str, action: str, servers: list[str], auth: tuple[str, str] | None = None) -> int:
    """One admin action of HAProxy's stats page, as its form sends it, on the `sessions` backend's servers."""
    form = [("s", name) for name in servers] + [("action", action), ("b", "sessions")]
    body = "&".join(f"{key}={value}" for key, value in form)
    headers = {"content-type": "application/x-www-form-urlencoded"}
    return httpx.post(url, content=body, headers=headers, auth=auth, timeout=10.0).status_code


def test_the_stats_page_acts_only_for_an_operator_with_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old config: the private port's /stats had admin rights and no password: one unauthenticated POST cut 4
    of 4 live sessions, another put both replicas in maintenance. Now that page is read-only; the admin
    page (its own port) acts only with the operator's password, which the runbook's drain still uses."""
    monkeypatch.setenv("ARSTREAM_LB_ADMIN_PASSWORD", ADMIN_PASSWORD)
    with ExitStack() as stack:
        replicas = {name: stack.enter_context(replica(name)) for name in ("r0", "r1")}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))
        admin_url = f"http://127.0.0.1:{lb.admin_port}/stats"
        names = list(replicas)

        async def scenario() -> tuple[int, list[str], list[int]]:
            sessions = Sessions()
            try:
                clients = [await sessions.open(lb.ws_url) for _ in range(2 * CAPACITY)]
                # Every unauthenticated way in: the private port, the admin port bare, a wrong password.
                attempts = [(lb.stats_url, None), (admin_url, None), (admin_url, ("operator", "wrong-password-x"))]
                answers = [
                    await asyncio.to_thread(stats_post, url, action, names, auth)
                    for url, auth in attempts
                    for action in STATS_ACTIONS
                ]
                alive = 0
                for client in clients:
                    try:
                        await client.send(type="tick", tick_id=0)
                        await client.recv_chunk()
                        alive += 1
                    except ConnectionClosed:
                        pass
                states = [lb.row("sessions", name)["status"] for name in names]
                return alive, states, answers
            finally:
                await sessions.close_all()

        alive, states, answers = asyncio.run(scenario())
        assert alive == 2 * CAPACITY, answers
        assert all(status.startswith("UP") for status in states), (states, answers)
        assert answers[2:] == [401] * 4  # the admin port, without the right password: asked for it
        # The operator's action goes through: the runbook's drain, then back to ready.
        assert stats_post(admin_url, "drain", ["r0"], ("operator", ADMIN_PASSWORD)) in (200, 303)
        assert lb.row("sessions", "r0")["status"].startswith("DRAIN")
        assert stats_post(admin_url, "ready", ["r0"], ("operator", ADMIN_PASSWORD)) in (200, 303)
        assert lb.row("sessions", "r0")["status"].startswith("UP")


@pytest.mark.parametrize("password", [None, "", "short-password"])
def test_without_a_long_enough_password_the_admin_page_refuses_everyone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, password: str | None
) -> None:
    """An unset password would otherwise be an empty one: `operator` with no password would be admitted."""
    if password is None:
        monkeypatch.delenv("ARSTREAM_LB_ADMIN_PASSWORD", raising=False)
    else:
        monkeypatch.setenv("ARSTREAM_LB_ADMIN_PASSWORD", password)
    with ExitStack() as stack:
        replicas = {"r0": stack.enter_context(replica("r0"))}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))
        admin_url = f"http://127.0.0.1:{lb.admin_port}/stats"
        answers = [stats_post(admin_url, "maint", ["r0"], ("operator", password or "")) for _ in range(2)]
        answers.append(stats_post(admin_url, "maint", ["r0"]))
        assert answers == [403] * 3
        assert lb.row("sessions", "r0")["status"].startswith("UP")


def test_arstream_drain_given_the_balancers_url_says_to_give_the_replicas_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stranger's first try (the URL they play on) got HAProxy's 403 page printed as HTML; now one line that
    names the URL to give instead."""
    from arstream.cli import main

    monkeypatch.setenv("ARSTREAM_CLUSTER_SECRET", SECRET)
    with ExitStack() as stack:
        replicas = {"r0": stack.enter_context(replica("r0", cluster_secret=SECRET))}
        lb = stack.enter_context(balancer(tmp_path, replicas, "--check-interval", "200ms"))
        assert main(["drain", lb.url, "--no-exit"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"arstream drain: {lb.url} refused: 403: 403 Forbidden Request forbidden by administrative rules." in err
    assert "give the replica's own URL" in err
