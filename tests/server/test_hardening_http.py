"""Bounds below the protocol: unauthenticated peers, request heads, slowloris, connection caps,
running out of descriptors, the access log, security headers, docs routes and the Host check.

Attacks use raw sockets; memory and open files are read from the server process (/proc/PID)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from raw_clients import RawWebSocket, closed_by_server, open_files, read_http_head, rss_bytes, tcp_connect
from servers import LiveServer, fake_settings, running_server, server_process, session_client, wait_until

MB = 1024 * 1024


@pytest.fixture(scope="module")
def guarded_process() -> Iterator[LiveServer]:
    """A real `arstream serve` with a token, logging at info (access log on), short close timeout."""
    with server_process(
        ["--model", "fake-kv", "--auth-token", "s3cret", "--log-level", "info", "--close-timeout-s", "1"]
    ) as live:
        yield live


# ---- an unauthenticated client that floods pings and never reads -------------------------------


def test_unauthenticated_ping_flood_holds_no_memory_and_is_dropped(guarded_process: LiveServer) -> None:
    """Before the fix: +41 MB for 374k pings, pongs queued for a peer that never reads, held until it left."""
    assert guarded_process.process is not None
    pid = guarded_process.process.pid
    files_before = open_files(pid)
    before = rss_bytes(pid)
    attacker = RawWebSocket(guarded_process.port)  # no token
    assert attacker.status == 101  # refused on the WebSocket, with `unauthorized` (PROTOCOL.md)
    attacker.sock.settimeout(5.0)
    batch = attacker.ping_frames(1000)
    sent = 0
    while sent < 200_000 and attacker.try_send(batch):
        sent += 1000
    grown = rss_bytes(pid) - before
    assert closed_by_server(attacker.sock)  # dropped, though it never completed the close
    attacker.close()
    wait_until(lambda: open_files(pid) <= files_before)
    assert grown < 8 * MB, f"RSS grew {grown / MB:.1f} MB over {sent} pings"


def test_refused_client_that_reads_still_gets_unauthorized(guarded_process: LiveServer) -> None:
    async def scenario() -> Any:
        async with session_client(guarded_process.ws_url + "?token=wrong") as client:
            return await client.closed_by_server()

    closed = asyncio.run(scenario())
    assert closed.code == 1008 and closed.messages[0]["code"] == "unauthorized"


# ---- the access log ---------------------------------------------------------------------------------


def test_tokens_in_the_query_never_reach_the_log(guarded_process: LiveServer) -> None:
    assert guarded_process.get("/healthz?token=s3cret").status_code == 200

    async def session() -> None:
        async with session_client(guarded_process.ws_url + "?token=s3cret", start={}) as client:
            await client.send(type="close")
            await client.closed_by_server()

    asyncio.run(session())
    wait_until(lambda: any("/v1/sessions?token=" in line for line in guarded_process.output))
    log_text = "".join(guarded_process.output)
    assert "s3cret" not in log_text
    assert "/healthz?token=<redacted>" in log_text and "/v1/sessions?token=<redacted>" in log_text


# ---- request heads ------------------------------------------------------------------------------------


def test_oversized_request_heads_get_431_and_hold_no_memory(guarded_process: LiveServer) -> None:
    """Before the fix: four unfinished requests with 20 MB of headers each held 90 MB."""
    assert guarded_process.process is not None
    pid = guarded_process.process.pid
    before = rss_bytes(pid)
    line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
    answers = []
    for _ in range(4):
        sock = tcp_connect(guarded_process.port, receive_buffer=None)
        sock.settimeout(5.0)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            for _ in range(2000):  # 2 MB, never finished
                sock.sendall(line)
        except OSError:
            pass  # the server answered and closed
        answers.append(read_http_head(sock).split("\r\n")[0])
        sock.close()
    grown = rss_bytes(pid) - before
    assert answers == ["HTTP/1.1 431 Request Header Fields Too Large"] * 4
    assert grown < 8 * MB, f"RSS grew {grown / MB:.1f} MB"


def test_a_head_just_under_the_limit_is_served() -> None:
    with running_server(fake_settings(max_header_bytes=4096)) as server:
        ok = server.get("/healthz", headers={"X-Pad": "a" * 3000})
        too_big = server.get("/healthz", headers={"X-Pad": "a" * 5000})
    assert ok.status_code == 200 and too_big.status_code == 431


@pytest.fixture(scope="module")
def quick_heads() -> Iterator[LiveServer]:
    settings = fake_settings(request_head_timeout_s=0.5, max_connections_per_client=3, forwarded_allow_ips="")
    with running_server(settings) as live:
        yield live


def test_slowloris_is_dropped_on_the_first_and_on_a_keep_alive_request(quick_heads: LiveServer) -> None:
    # First request: a header line now and then, never the blank line that ends the head.
    slow = tcp_connect(quick_heads.port, receive_buffer=None)
    slow.settimeout(0.2)
    slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    dropped = False
    for _ in range(150):  # a hang guard of 30 s; the deadline is 0.5 s
        try:
            slow.sendall(b"X-Slow: 1\r\n")
            if slow.recv(1) == b"":
                dropped = True
                break
        except TimeoutError:
            continue
        except OSError:
            dropped = True
            break
    slow.close()
    assert dropped
    # Keep-alive: a whole first request is answered, a half-sent second one is dropped.
    keep = tcp_connect(quick_heads.port, receive_buffer=None)
    keep.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert read_http_head(keep).startswith("HTTP/1.1 200")
    keep.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert closed_by_server(keep)
    keep.close()


# ---- connection caps ------------------------------------------------------------------------------------


def held(sock: socket.socket) -> bool:
    """Whether the server kept the connection open (a whole request on it is answered)."""
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        return read_http_head(sock).startswith("HTTP/1.1 200")
    except OSError:
        return False


def test_connections_per_client_are_capped_and_refusals_logged_once(
    quick_heads: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="arstream.guard")
    guard = quick_heads.server.config.app.state.guard  # type: ignore[union-attr]
    refused_before = guard.refusals.counts.get("max_connections_per_client", 0)
    kept = [tcp_connect(quick_heads.port, receive_buffer=None) for _ in range(3)]
    assert all(held(sock) for sock in kept)
    extra = [tcp_connect(quick_heads.port, receive_buffer=None) for _ in range(50)]
    assert not any(held(sock) for sock in extra)
    for sock in extra:
        sock.close()
    assert guard.refusals.counts["max_connections_per_client"] - refused_before == 50
    lines = [r for r in caplog.records if "max_connections_per_client" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]  # one line, not fifty
    kept.pop().close()
    wait_until(lambda: guard.open <= 2)
    again = tcp_connect(quick_heads.port, receive_buffer=None)
    assert held(again)
    for sock in [again, *kept]:
        sock.close()


def test_an_address_opening_connections_too_fast_is_closed_before_it_is_read_and_others_are_not() -> None:
    settings = fake_settings(forwarded_allow_ips="127.0.0.2", connection_rate_per_client=2.0, connection_burst_per_client=5)
    with running_server(settings) as server:
        guard = server.server.config.app.state.guard  # type: ignore[union-attr]
        # Connect and hang up, as a reconnecting flood does: the open-connection caps never see more than one.
        for _ in range(5):
            sock = tcp_connect(server.port, receive_buffer=None)
            assert held(sock)
            sock.close()
        flood = [tcp_connect(server.port, receive_buffer=None) for _ in range(20)]
        answered = sum(held(sock) for sock in flood)
        for sock in flood:
            sock.close()
        # The bucket refills at 2/s while the 20 connect: at most a few of them get in.
        assert answered <= 3, f"{answered} of 20 connections past a burst of 5 at 2/s were answered"
        refused = guard.refusals.counts.get("connection_rate_per_client", 0)
        assert refused >= 17, guard.refusals.counts
        # Another address, and a trusted proxy's address, are not slowed by it.
        other = tcp_connect(server.port, receive_buffer=None, source_host="127.0.0.3")
        proxy = [tcp_connect(server.port, receive_buffer=None, source_host="127.0.0.2") for _ in range(10)]
        assert held(other) and all(held(sock) for sock in proxy)
        for sock in [other, *proxy]:
            sock.close()
        # Refused connections spent nothing: the address gets in again once its budget refills.
        wait_until(lambda: answered_and_closed(server.port))


def answered_and_closed(port: int) -> bool:
    sock = tcp_connect(port, receive_buffer=None)
    try:
        return held(sock)
    finally:
        sock.close()


def healthy(live: LiveServer) -> bool:
    try:
        return httpx.get(live.base_url + "/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False  # refused while the closed sockets are still counted


def test_total_connections_are_capped() -> None:
    with running_server(fake_settings(max_connections=4, max_connections_per_client=None)) as server:
        guard = server.server.config.app.state.guard  # type: ignore[union-attr]
        wait_until(lambda: guard.open == 0)
        kept = [tcp_connect(server.port, receive_buffer=None) for _ in range(4)]
        assert all(held(sock) for sock in kept)
        refused = tcp_connect(server.port, receive_buffer=None)
        assert not held(refused)
        refused.close()
        kept.pop().close()
        wait_until(lambda: guard.open == 3)
        admitted = tcp_connect(server.port, receive_buffer=None)
        assert held(admitted)
        for sock in [admitted, *kept]:
            sock.close()
    assert guard.refusals.counts["max_connections"] >= 1


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_running_out_of_descriptors_is_refused_quietly_and_the_server_recovers() -> None:
    """Before the fix: 118,783 tracebacks in 15 s. With 256 descriptors the default cap is 128 connections."""
    with server_process(
        ["--model", "fake-kv", "--max-connections-per-client", "1000"], prefix=["prlimit", "--nofile=256:256"]
    ) as live:
        socks = []
        for _ in range(400):
            try:
                socks.append(tcp_connect(live.port, receive_buffer=None))
            except OSError:
                break
        for sock in socks:
            sock.close()
        wait_until(lambda: healthy(live))
        log_text = "".join(live.output)
    assert "Traceback" not in log_text
    refusal_lines = [line for line in log_text.splitlines() if "refused:" in line]
    # One line per kind (and one more per kind every 10 s): past the cap of 128, or, when a burst of
    # accepts outruns the closing of refused sockets, the loop's own out-of-descriptors report.
    assert 1 <= len(refusal_lines) <= 4, refusal_lines
    assert all(
        "128 connections are open (max_connections)" in line or "Too many open files" in line
        for line in refusal_lines
    ), refusal_lines


# ---- headers on the page, docs routes, Host check ----------------------------------------------------------


@pytest.fixture(scope="module")
def plain() -> Iterator[LiveServer]:
    with running_server(fake_settings()) as live:
        yield live


def test_pages_and_api_carry_security_headers(plain: LiveServer) -> None:
    page, api = plain.get("/"), plain.get("/v1/stats")
    for response in (page, api):
        assert "default-src 'self'" in response.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"
        assert "server" not in response.headers
    assert api.headers["cache-control"] == "no-store"
    assert page.headers["cache-control"] == "no-cache"


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_schema_and_docs_routes_are_not_served(plain: LiveServer, path: str) -> None:
    assert plain.get(path).status_code == 404


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("127.0.0.1", 200),
        ("localhost:8000", 200),
        ("[::1]:1", 200),
        ("evil.example", 400),
        ("127.0.0.1.evil.example", 400),
    ],
)
def test_loopback_server_answers_only_loopback_host_names(plain: LiveServer, host: str, status: int) -> None:
    """DNS rebinding: a page on evil.example that resolves to 127.0.0.1 still sends Host: evil.example."""
    assert plain.get("/healthz", headers={"Host": host}).status_code == status


def test_websocket_with_a_foreign_host_is_refused_before_the_upgrade(plain: LiveServer) -> None:
    sock = tcp_connect(plain.port, receive_buffer=None)
    sock.sendall(
        b"GET /v1/sessions HTTP/1.1\r\nHost: evil.example\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    assert read_http_head(sock).startswith("HTTP/1.1 400")
    sock.close()


def test_configured_hosts_and_wildcards() -> None:
    with running_server(fake_settings(allowed_hosts="App.Example, *.cdn.example")) as server:
        statuses = [
            server.get("/healthz", headers={"Host": host}).status_code
            for host in ("app.example", "a.cdn.example:443", "cdn.example", "127.0.0.1")
        ]
    assert statuses == [200, 200, 400, 400]


# ---- refusing before the upgrade (opt-in) ---------------------------------------------------------------


def test_refuse_before_upgrade_answers_401_or_403_with_the_error_as_body() -> None:
    settings = fake_settings(auth_token="s3cret", refuse_before_upgrade=True, allowed_origins="https://app.example")
    with running_server(settings) as server:
        missing = RawWebSocket(server.port)
        wrong = RawWebSocket(server.port, path="/v1/sessions?token=nope")
        evil = {"Origin": "https://evil.example"}
        bad_origin = RawWebSocket(server.port, path="/v1/sessions?token=s3cret", headers=evil)
        right = RawWebSocket(server.port, headers={"Authorization": "Bearer s3cret"})
        statuses = [client.status for client in (missing, wrong, bad_origin, right)]
        body = (missing.leftover + (b"" if missing.leftover else missing.sock.recv(4096))).decode()
        for client in (missing, wrong, bad_origin, right):
            client.close()
    assert statuses == [401, 403, 403, 101]
    assert "www-authenticate: bearer" in missing.response_head.lower()
    assert '"code":"unauthorized"' in body and "token is required" in body
