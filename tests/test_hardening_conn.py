"""Bounds on what one connection can take: taken-over non-readers, floods of tiny
WebSocket frames, refused connections, replies that amplify their input, send buffers, what keeps a session
alive, and the lows (log injection, query spellings, tenants on resume, lone surrogates).

Real servers; raw sockets where the attack needs a client that never reads or that writes frames no
library would; memory read from the server process (/proc/PID/status)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed

from arstream.app.protocol import ErrorCode, ProtocolError, StartMessage, error_message, parse_client_message
from arstream.app.resume import token_hint
from raw_clients import RawWebSocket, close_code, closed_by_server, rss_bytes
from servers import LiveServer, fake_settings, running_server, server_process, session_client, wait_until

MB = 1024 * 1024
# Raw 1024x1024 frames (6 MB a chunk, more than the kernel's socket buffers take): a client that does not
# read backs the server's writes up at its first chunk.
HUGE_FRAMES = {"codec": "raw", "model_options": {"session_capacity": 2, "width": 1024, "height": 1024}}


def guard_of(server: LiveServer) -> Any:
    assert server.server is not None
    return server.server.config.app.state.guard  # type: ignore[union-attr]


def refusals_of(server: LiveServer) -> Any:
    assert server.server is not None
    return server.server.config.app.state.refusals  # type: ignore[union-attr]


def errors_sent(server: LiveServer, code: str) -> float:
    """The server's count of `error` messages with ``code`` (from /metrics)."""
    prefix = f'arstream_errors_total{{code="{code}"}} '
    lines = [line for line in server.get("/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0].removeprefix(prefix)) if lines else 0.0


def raw_session(
    port: int, *, start: dict[str, Any] | None = None, query: str = ""
) -> tuple[RawWebSocket, dict[str, Any]]:
    """A raw client that sent `start` and read its `ready` (and reads nothing more unless told)."""
    client = RawWebSocket(port, path="/v1/sessions" + query)
    assert client.status == 101, client.response_head
    client.send_text(json.dumps({"type": "start", **(start or {})}))
    ready = json.loads(client.read_text())
    assert ready["type"] == "ready", ready
    return client, ready


# ---- a taken-over connection whose peer never reads ------------------------------------------


def test_a_taken_over_non_reader_is_dropped_and_shown_in_stats() -> None:
    """Before the fix the old connection stayed open for as long as its peer kept the socket: its close waited
    behind replies nobody read, and its discarded ticks counted as in the worker, so idle never started."""
    settings = fake_settings(replica_id="r0", resume_grace_s=30.0, close_timeout_s=3.0, **HUGE_FRAMES)
    with running_server(settings) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        guard = guard_of(server)
        attacker, ready = raw_session(server.port, start={"codec": "raw"})
        token = ready["resume"]["token"]
        attacker.sock.settimeout(2.0)
        ticks = [json.dumps({"type": "tick", "tick_id": i}) for i in range(4)]
        attacker.try_send(attacker.text_frames(ticks))
        # Its chunks are made and stuck in the socket (credits not back), then its replies queue behind them.
        server.wait_for_stats(
            lambda s: s["chunks"]["total"] >= 4 and s["queue"]["depth"] == 0 and s["sessions"]["pending_ticks"] >= 3
        )
        attacker.try_send(attacker.text_frames([json.dumps({"type": "ping", "t": i}) for i in range(200)]))
        server.wait_for_stats(lambda s: s["sessions"]["replies_queued"] > 0)

        async def resume_and_close() -> None:
            url = f"{server.ws_url}?resume={token}"
            async with session_client(url, start={"resume": token, "codec": "raw"}) as new:
                assert new.ready is not None and new.ready["resumed"] is True
                during = server.wait_for_stats(lambda s: s["sessions"]["closing"] == 1)
                assert during["sessions"]["connected"] == 1, during["sessions"]  # the old one is not a session
                try:
                    wait_until(lambda: guard.open == 1)
                except AssertionError:
                    raise AssertionError(f"the taken-over non-reader is still open: {guard.open} connections") from None
                assert server.stats()["sessions"]["closing"] == 0
                await new.send(type="tick", tick_id=4)  # the old connection's ticks 0-3 were accepted, then dropped
                await new.recv_chunk()
                await new.send(type="close")
                await new.closed_by_server()

        asyncio.run(resume_and_close())
        attacker.close()
        server.settled(start_free)


# ---- floods of tiny WebSocket frames ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["fragments", "pongs"])
def test_a_flood_of_tiny_frames_is_closed_1008(kind: str) -> None:
    """Before the fix every 1-byte fragment or empty pong was parsed, one by one, for as long as it came."""
    with running_server(fake_settings(start_timeout_s=120.0)) as server:
        attacker = RawWebSocket(server.port)
        assert attacker.status == 101
        attacker.sock.settimeout(5.0)
        flood = attacker.fragment_frames(20_000) if kind == "fragments" else attacker.pong_frames(20_000)
        attacker.try_send(flood)
        attacker.sock.settimeout(30.0)
        try:
            opcode, payload = attacker.read_frame()
        except TimeoutError:
            raise AssertionError("the server took 20,000 tiny frames and never closed the connection") from None
        assert (opcode, close_code(payload)) == (0x8, 1008), (opcode, payload)
        assert b"max_frames_per_s" in payload
        assert closed_by_server(attacker.sock)
        attacker.close()
        assert refusals_of(server).counts.get("frame_budget") == 1


def test_an_address_that_flooded_frames_is_refused_connections_for_a_while() -> None:
    """Reconnecting made the flood cheap to repeat: each new connection had a fresh budget."""
    # No trusted proxy: loopback is a client address like any other here.
    with running_server(fake_settings(forwarded_allow_ips="", frame_flood_ban_s=120.0)) as server:
        attacker = RawWebSocket(server.port)
        attacker.sock.settimeout(5.0)
        attacker.try_send(attacker.pong_frames(1000))
        assert closed_by_server(attacker.sock)
        attacker.close()
        try:
            again = RawWebSocket(server.port)
        except ConnectionError:
            pass  # dropped (reset) before a byte was parsed
        else:
            again.close()
            assert again.status == 0, f"a banned address was answered: {again.response_head}"
        assert refusals_of(server).counts.get("frame_flood_ban") == 1


def test_behind_a_proxy_the_flooding_client_is_banned_not_the_proxy() -> None:
    """Behind HAProxy the ban never applied (the proxy's address is trusted): each reconnect had a fresh budget."""
    with running_server(fake_settings(frame_flood_ban_s=120.0)) as server:  # loopback is a trusted proxy
        flooder = {"X-Forwarded-For": "203.0.113.9"}
        attacker = RawWebSocket(server.port, headers=flooder)
        attacker.sock.settimeout(5.0)
        attacker.try_send(attacker.pong_frames(1000))
        assert closed_by_server(attacker.sock)
        attacker.close()
        again = RawWebSocket(server.port, headers=flooder)
        again.close()
        assert again.status == 503 and "frame_flood_ban_s" in again.response_head + again.leftover.decode(), (
            again.response_head
        )
        # Other clients of the same proxy, and the proxy itself, are still served.
        for headers in ({"X-Forwarded-For": "203.0.113.10"}, {}):
            other = RawWebSocket(server.port, headers=headers)
            other.close()
            assert other.status == 101, other.response_head
        assert refusals_of(server).counts.get("frame_flood_ban") == 1


def test_an_honest_session_within_the_frame_budget_is_served() -> None:
    with running_server(fake_settings(max_frames_per_s=50.0, frame_burst=20)) as server:

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}) as client:
                for tick_id in range(10):
                    await client.send(type="tick", tick_id=tick_id)
                    await client.recv_chunk()
                await client.ws.ping()
                await client.send(type="close")
                closed = await client.closed_by_server()
                assert closed.code == 1000

        asyncio.run(scenario())


def test_a_refused_connection_is_not_read_until_its_close_timeout() -> None:
    """Before the fix a connection refused for its token was read (every frame parsed) until close_timeout_s."""
    with running_server(fake_settings(auth_token="s3cret", close_timeout_s=120.0)) as server:
        attacker = RawWebSocket(server.port)  # no token
        assert attacker.status == 101
        error = json.loads(attacker.read_text())
        assert error["code"] == "unauthorized"
        opcode, payload = attacker.read_frame()
        assert (opcode, close_code(payload)) == (0x8, 1008)
        attacker.sock.settimeout(5.0)
        attacker.try_send(attacker.pong_frames(50_000))
        attacker.sock.settimeout(30.0)
        assert closed_by_server(attacker.sock), "the refused connection was kept open (and read) past the refusal"
        attacker.close()
        wait_until(lambda: guard_of(server).open == 0)


# ---- replies that amplify their input; send buffers bounded by bytes --------------------------

WIDE = "é" * 30_000  # 60 KB of UTF-8; each one is six bytes as a JSON escape


def test_an_error_reply_echoes_a_bounded_part_of_the_input() -> None:
    """Before the fix a 64 KB bad message got a 192 KB error reply."""
    with running_server(fake_settings()) as server:

        async def scenario() -> list[str]:
            async with session_client(server.ws_url, start={}) as client:
                replies: list[str] = []
                for bad in (
                    {"type": WIDE},
                    {"type": "input", "event_id": 0, "controls": {WIDE: 1}},
                    {"type": "tick", "tick_id": 1, "controls": {"keys": [WIDE]}},
                ):
                    await client.send_text(json.dumps(bad, ensure_ascii=False))
                    reply = await client.recv()
                    assert isinstance(reply, str)  # an error is a text message
                    replies.append(reply)
                return replies

        replies = asyncio.run(scenario())
    for reply in replies:
        assert isinstance(reply, str) and json.loads(reply)["type"] == "error"
        sent = len(json.dumps(WIDE, ensure_ascii=False).encode())
        assert len(reply) < 2048, f"a {sent}-byte message got a {len(reply)}-byte reply"


def test_error_messages_are_bounded_at_their_source() -> None:
    message = error_message(ErrorCode.INVALID_MESSAGE, "x" * 100_000)["message"]
    assert len(message) <= 512 and message.endswith("more characters)")


def test_sixteen_non_reading_sessions_sending_bad_messages_hold_little_memory() -> None:
    """Before the fix 16 sessions within every cap added 199 MB: 64 queued replies of 192 KB each."""
    with server_process(["--model", "fake-kv", "--log-level", "warning"]) as live:
        assert live.process is not None
        pid = live.process.pid
        warm, _ = raw_session(live.port)  # warm the allocator's pools with one session first
        warm.close()
        live.wait_for_stats(lambda s: s["sessions"]["connected"] == 0)
        before = rss_bytes(pid)
        bad = json.dumps({"type": WIDE}, ensure_ascii=False)
        attackers = []
        for _ in range(16):
            attacker, _ = raw_session(live.port)
            attacker.sock.settimeout(2.0)
            attacker.try_send(attacker.text_frames([bad] * 100))
            attackers.append(attacker)
        # Every session has had at least its 64 replies' worth read (the old code stopped there, holding them).
        wait_until(lambda: errors_sent(live, "invalid_message") >= 16 * 64)
        grown = rss_bytes(pid) - before
        for attacker in attackers:
            attacker.close()
    assert grown < 32 * MB, f"16 non-reading sessions grew the server by {grown / MB:.0f} MB"


def test_a_non_reader_past_the_send_buffer_bound_is_dropped() -> None:
    """Before the fix only credits bounded it: queued chunks stayed until the idle timeout."""
    # The bound holds one 6 MB chunk, not the four its credits allow.
    settings = fake_settings(max_send_buffer_bytes=8 * MB, idle_timeout_s=120.0, **HUGE_FRAMES)
    with running_server(settings) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        attacker, _ = raw_session(server.port, start={"codec": "raw"})
        try:
            attacker.sock.settimeout(2.0)
            attacker.try_send(attacker.text_frames([json.dumps({"type": "tick", "tick_id": i}) for i in range(4)]))
            try:
                wait_until(lambda: guard_of(server).open == 0)
            except AssertionError:
                raise AssertionError(f"the non-reader was not dropped: {server.stats()['sessions']}") from None
            assert refusals_of(server).counts.get("send_buffer") == 1
        finally:
            attacker.close()
        server.settled(start_free)

        async def honest() -> None:  # the same chunks, read: served
            async with session_client(server.ws_url, start={"codec": "raw"}) as client:
                for tick_id in range(4):
                    await client.send(type="tick", tick_id=tick_id)
                    await client.recv_chunk()
                await client.send(type="close")
                await client.closed_by_server()

        asyncio.run(honest())


# ---- pings keep the connection, not the session's slot ---------------------------------------


def test_pings_do_not_keep_a_session_alive() -> None:
    """Before the fix a client that only pinged held its slot for as long as it pinged."""
    with running_server(fake_settings(idle_timeout_s=1.0)) as server:

        async def scenario() -> tuple[int | None, int]:
            async with session_client(server.ws_url, start={}) as client:
                await client.send(type="tick", tick_id=0)
                await client.recv_chunk()
                pongs = 0
                try:
                    for t in range(200):  # 20 s of pings, far past the 1 s idle timeout
                        await client.send(type="ping", t=t)
                        message = await client.recv_json()
                        if message["type"] != "pong":
                            assert message["code"] == "idle_timeout", message
                            return (await client.closed_by_server()).code, pongs
                        pongs += 1
                        await asyncio.sleep(0.1)
                except ConnectionClosed as closed:  # closed (4001) while a ping was on its way
                    return (closed.rcvd.code if closed.rcvd else None), pongs
                return None, pongs

        code, pongs = asyncio.run(scenario())
    assert code == 4001, f"still open after {pongs} pings (close code {code})"


def test_input_events_keep_a_session_alive() -> None:
    with running_server(fake_settings(idle_timeout_s=1.0)) as server:

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}) as client:
                for event_id in range(25):  # 2.5 s of inputs, past the 1 s idle timeout
                    await client.send(type="input", event_id=event_id, controls={"keys": ["w"]})
                    assert (await client.recv_json())["type"] == "ack"
                    await asyncio.sleep(0.1)
                await client.send(type="tick", tick_id=0)
                chunk, _ = await client.recv_chunk()
                assert chunk["applied_event_ids"] == list(range(25))
                await client.send(type="close")
                assert (await client.closed_by_server()).code == 1000

        asyncio.run(scenario())


# ---- the lows ---------------------------------------------------------------------------------


def test_token_hints_cannot_forge_log_lines() -> None:
    hint = token_hint("r0\n2026-01-01 INFO forged line\r\x1b[31m.abcdefgh")
    assert "\n" not in hint and "\r" not in hint and "\x1b" not in hint
    assert len(token_hint("x" * 10_000 + ".abcd")) < 100


def test_every_spelling_of_the_token_query_is_redacted() -> None:
    """Before the fix `?%74oken=T` was accepted as the token and logged as it came."""
    with server_process(["--model", "fake-kv", "--auth-token", "s3cret", "--log-level", "info"]) as live:

        async def session(query: str) -> None:
            async with session_client(live.ws_url + query, start={}) as client:
                await client.send(type="close")
                await client.closed_by_server()

        for query in ("?%74oken=s3cret", "?%74%6Fken=s3cret&x=1", "?x=1&tok%65n=s3cret"):
            asyncio.run(session(query))
        wait_until(lambda: sum("/v1/sessions?" in line for line in live.output) >= 3)
    log_text = "".join(live.output)
    assert "s3cret" not in log_text, [line for line in live.output if "s3cret" in line]


@pytest.fixture
def two_tenants() -> Iterator[LiveServer]:
    with running_server(fake_settings(replica_id="r0", resume_grace_s=30.0, auth_token="tenant-a,tenant-b")) as live:
        yield live


def test_a_resume_must_present_the_tenant_that_started_the_session(two_tenants: LiveServer) -> None:
    """Before the fix tenant B's token could take over a session started with tenant A's."""
    server = two_tenants

    async def scenario() -> None:
        async with session_client(server.ws_url + "?token=tenant-a", start={}) as owner:
            assert owner.ready is not None
            token = owner.ready["resume"]["token"]
            async with session_client(f"{server.ws_url}?token=tenant-b&resume={token}") as other:
                await other.send(type="start", resume=token)
                closed = await other.closed_by_server()
            assert closed.code == 4002 and closed.messages[0]["code"] == "resume_failed"
            assert "token" in closed.messages[0]["message"]
            # The refusal spent nothing: the owner may still resume with its own token.
            async with session_client(f"{server.ws_url}?token=tenant-a&resume={token}") as same:
                await same.send(type="start", resume=token)
                ready = await same.recv_json()
                assert ready["type"] == "ready" and ready["resumed"] is True
                await same.send(type="close")
                await same.closed_by_server()

    asyncio.run(scenario())


@pytest.mark.parametrize("field", ["prompt", "resume"])
def test_a_lone_surrogate_is_invalid_message(field: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_client_message('{"type": "start", "%s": "ok \\ud800 no"}' % field)
    assert refused.value.code == ErrorCode.INVALID_MESSAGE and "surrogate" in refused.value.message
    paired = parse_client_message('{"type": "start", "prompt": "a pair \\ud83d\\ude00 is fine"}')
    assert isinstance(paired, StartMessage) and paired.prompt == "a pair 😀 is fine"
