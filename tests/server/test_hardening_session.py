"""Bounds on what one session can take: input events, non-reading clients, idleness, message cost
and rate, and sessions per client address and per token. Real servers; raw sockets where the attack needs
a client that never reads; memory read from the server process (/proc/PID/status)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

import pytest

from arstream.app.prompts import MAX_PROMPT_CHARS
from arstream.app.protocol import InputMessage, ProtocolError
from arstream.app.session import MAX_PENDING_EVENTS, Session, SessionState
from raw_clients import RawWebSocket, rss_bytes
from servers import (
    GatedFakePipeline,
    LiveServer,
    fake_settings,
    running_server,
    server_process,
    session_client,
    wait_until,
)

MB = 1024 * 1024
# Far above anything the tests send: these tests are about memory and blocking, not the rate.
NO_RATE_LIMIT = {"max_messages_per_s": 1e6, "message_burst": 1_000_000}


# ---- input events pile up ---------------------------------------------------------------


async def send_large_inputs(url: str, count: int, first_id: int) -> dict[str, Any]:
    """``count`` input events with the largest prompt allowed, each ack read, then one tick; returns its chunk.

    The prompt is the same each time: new prompts are bounded in rate (app/prompts.py), and 60 KB ones, which
    this test sent before prompts were bounded, are refused when parsed. Each message's copy of it is its own."""
    async with session_client(url, start={}) as client:
        for event_id in range(first_id, first_id + count):
            await client.send(type="input", event_id=event_id, prompt="p" * MAX_PROMPT_CHARS)
            ack = await client.recv_json()
            assert ack == {"type": "ack", "event_id": event_id, "status": "accepted"}
        await client.send(type="tick", tick_id=0)
        chunk, _ = await client.recv_chunk()
        await client.send(type="close")
        await client.closed_by_server()
        return chunk


def test_many_large_input_events_hold_one_payload_and_memory_comes_back() -> None:
    """Before the fix 2000 such events grew the server by 116 MB that never came back."""
    unlimited = ["--max-messages-per-s", "1000000", "--message-burst", "1000000"]
    with server_process(["--model", "fake-kv", *unlimited]) as live:
        assert live.process is not None
        pid = live.process.pid
        asyncio.run(send_large_inputs(live.ws_url, 50, first_id=0))  # warm the allocator's pools
        before = rss_bytes(pid)
        chunk = asyncio.run(send_large_inputs(live.ws_url, 2000, first_id=0))
        after = rss_bytes(pid)
        live.wait_for_stats(lambda s: s["sessions"]["connected"] == 0)
    assert chunk["applied_event_ids"] == list(range(2000))  # every id is still reported
    assert after - before < 16 * MB, f"RSS grew {(after - before) / MB:.1f} MB"


def test_pending_events_keep_only_the_latest_values_and_are_capped() -> None:
    session = Session("s-1", codec="raw", quality=80, seed=None, prompt=None, max_pending_ticks=4)
    session.transition(SessionState.ACTIVE)
    for event_id in range(MAX_PENDING_EVENTS):
        session.accept_event(InputMessage(type="input", event_id=event_id, prompt=f"prompt {event_id}"))
    with pytest.raises(ProtocolError) as refused:
        session.accept_event(InputMessage(type="input", event_id=MAX_PENDING_EVENTS, prompt="one too many"))
    assert refused.value.code == "too_many_ticks" and "send a tick" in refused.value.message
    assert session.event_floor == MAX_PENDING_EVENTS - 1  # the refused event did not move the floor
    # Only the latest prompt is held, not one per event.
    held = [value for value in vars(session).values() if isinstance(value, str) and value.startswith("prompt")]
    staged = [u.prompt for u in (session._staged_controls, session._staged_prompt) if u is not None]
    assert held == [] and staged == [f"prompt {MAX_PENDING_EVENTS - 1}"]


# ---- bugs 2 and 3: a client that never reads ---------------------------------------------------------


STALL = {
    "codec": "raw",
    "model_options": {"session_capacity": 1, "width": 512, "height": 512},  # frames overflow the socket buffers
}


def ping_flood(count: int) -> list[str]:
    return [json.dumps({"type": "ping", "t": i}) for i in range(count)]


def test_a_client_that_never_reads_is_closed_when_idle_and_its_slot_freed() -> None:
    """Bug 2: after `start` it floods pings and ticks and reads nothing; before the fix it kept its slot forever."""
    with running_server(fake_settings(idle_timeout_s=1.0, **STALL)) as server:
        start_free = server.stats()["kv"]["blocks_free"]
        attacker = RawWebSocket(server.port)
        assert attacker.status == 101
        attacker.send_text(json.dumps({"type": "start", "codec": "raw"}))
        attacker.sock.settimeout(2.0)
        flood = [json.dumps({"type": "tick", "tick_id": i}) for i in range(4)] + ping_flood(2000)
        attacker.try_send(attacker.text_frames(flood))
        server.wait_for_stats(lambda s: s["sessions"]["connected"] == 0, attempts=800)

        async def newcomer() -> dict[str, Any]:
            async with session_client(server.ws_url, start={}) as client:
                assert client.ready is not None
                return client.ready

        assert asyncio.run(newcomer())["type"] == "ready"  # the only slot is free again
        server.settled(start_free)  # and every KV block is back
        attacker.close()


def test_a_non_reader_sending_malformed_starts_is_closed_at_the_start_timeout() -> None:
    """Bug 3: errors for malformed starts back up behind a client that never reads; the start timeout holds."""
    with running_server(fake_settings(start_timeout_s=1.0, close_timeout_s=0.5, **NO_RATE_LIMIT)) as server:
        attacker = RawWebSocket(server.port)
        attacker.sock.settimeout(2.0)
        malformed = json.dumps({"type": "start", "quality": 1000, "pad": "x" * 2000})
        sent = 0
        while sent < 20_000 and attacker.try_send(attacker.text_frames([malformed] * 100)):
            sent += 100
        assert sent < 20_000, "the server never stopped reading: the attack did not back up its writes"
        guard = server.server.config.app.state.guard  # type: ignore[union-attr]
        # The session handler has returned and the transport is gone (the attacker never closed it).
        wait_until(lambda: guard.open == 0 and "arstream_websocket_open 0.0" in server.get("/metrics").text)
        attacker.close()


# ---- idleness: a client waiting on the server is not idle ---------------------------------------------


@pytest.fixture()
def gated_idle() -> Iterator[tuple[LiveServer, GatedFakePipeline]]:
    pipeline = GatedFakePipeline()
    with running_server(fake_settings(idle_timeout_s=0.5), pipeline) as server:
        pipeline.gate.set()
        yield server, pipeline
        pipeline.gate.set()


def test_a_client_waiting_for_a_slow_chunk_is_not_idle_and_the_clock_restarts_after_it(
    gated_idle: tuple[LiveServer, GatedFakePipeline],
) -> None:
    server, pipeline = gated_idle

    async def scenario() -> tuple[list[dict[str, Any]], Any]:
        async with session_client(server.ws_url, start={}) as client:
            pipeline.gate.clear()  # the server stalls, as a slow model or a busy device would
            await client.send(type="tick", tick_id=0)
            await client.send(type="tick", tick_id=1)
            await asyncio.to_thread(pipeline.waiting.wait, 30)
            await asyncio.sleep(4 * 0.5)  # four idle timeouts without a message, while the ticks wait
            pipeline.gate.set()
            chunks = [(await client.recv_chunk())[0] for _ in range(2)]
            # Nothing queued now: silence is idleness again, counted from the last chunk.
            return chunks, await client.closed_by_server()

    chunks, closed = asyncio.run(scenario())
    assert [c["tick_id"] for c in chunks] == [0, 1]
    assert closed.code == 4001 and closed.messages[0]["code"] == "idle_timeout"
    assert "no tick was queued or running" in closed.messages[0]["message"]


# ---- cheap messages that cost the event loop --------------------------------------------------------


class CountingValidator:
    """Wraps the hub's JSON Schema validator and counts the controls objects it is asked to walk."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def iter_errors(self, instance: Any) -> Any:
        self.calls += 1
        return self.inner.iter_errors(instance)


def test_oversized_controls_are_refused_before_schema_validation() -> None:
    with running_server(fake_settings(max_control_items=16)) as server:
        hub = server.server.config.app.state.hub  # type: ignore[union-attr]
        counting = CountingValidator(hub.controls_validator)
        hub.controls_validator = counting

        async def scenario() -> list[dict[str, Any]]:
            async with session_client(server.ws_url, start={}) as client:
                keys = ["w"] * 12_800  # about 64 KB: the red team's 50 ms of schema validation
                await client.send_text(json.dumps({"type": "input", "event_id": 1, "controls": {"keys": keys}}))
                await client.send_text(json.dumps({"type": "tick", "tick_id": 1, "controls": {"a": {"b": [[0] * 20]}}}))
                await client.send(type="input", event_id=2, controls={"keys": ["w", "d"]})
                return [await client.recv_json() for _ in range(3)]

        big, nested, honest = asyncio.run(scenario())
    assert big["code"] == "invalid_controls" and "max_control_items" in big["message"] and not big["fatal"]
    assert nested["code"] == "invalid_controls" and nested["tick_id"] == 1
    assert honest == {"type": "ack", "event_id": 2, "status": "accepted"}
    assert counting.calls == 1  # only the honest event reached the schema


def test_messages_past_the_rate_are_read_more_slowly() -> None:
    """25 pings at once with a burst of 5 at 20/s: the server reads the last one at least 1 s after the first."""
    with running_server(fake_settings(max_messages_per_s=20.0, message_burst=5)) as server:

        async def scenario() -> list[dict[str, Any]]:
            async with session_client(server.ws_url, start={}) as client:
                for i in range(25):
                    await client.send(type="ping", t=i)
                return [await client.recv_json() for _ in range(25)]

        pongs = asyncio.run(scenario())
    assert [p["t"] for p in pongs] == list(range(25))
    # Server-side timestamps: the token bucket guarantees the spread; a slow machine only widens it.
    assert pongs[-1]["server_time"] - pongs[0]["server_time"] >= (25 - 5 - 1) / 20.0


# ---- fairness at admission ----------------------------------------------------------------------------


async def outcome(stack: AsyncExitStack, url: str, headers: list[tuple[str, str]]) -> str:
    """`ready`, or the refusal's code, for one connection kept open until ``stack`` closes."""
    client = await stack.enter_async_context(session_client(url, headers=headers))
    await client.send(type="start")
    first = await client.recv_json()
    return first["type"] if first["type"] == "ready" else first["code"]


def test_sessions_per_client_address_are_capped_behind_a_trusted_proxy() -> None:
    """Through a proxy on loopback (trusted for X-Forwarded-For) each forwarded address gets 2 sessions."""
    with running_server(fake_settings(max_sessions_per_client=2)) as server:

        async def scenario() -> list[str]:
            greedy = [("X-Forwarded-For", "203.0.113.7")]
            async with AsyncExitStack() as stack:
                results = [await outcome(stack, server.ws_url, greedy) for _ in range(3)]
                results.append(await outcome(stack, server.ws_url, [("X-Forwarded-For", "198.51.100.2")]))
                # the proxy's own address is not capped
                results += [await outcome(stack, server.ws_url, []) for _ in range(3)]
                return results

        assert asyncio.run(scenario()) == ["ready", "ready", "over_capacity", "ready", "ready", "ready", "ready"]


def test_sessions_per_client_address_without_a_proxy() -> None:
    with running_server(fake_settings(max_sessions_per_client=1, forwarded_allow_ips="")) as server:

        async def scenario() -> list[str]:
            async with AsyncExitStack() as stack:
                return [await outcome(stack, server.ws_url, []) for _ in range(2)]

        assert asyncio.run(scenario()) == ["ready", "over_capacity"]


def test_sessions_per_token_are_capped() -> None:
    with running_server(fake_settings(auth_token="alpha,bravo", max_sessions_per_token=1)) as server:

        async def scenario() -> list[str]:
            alpha = [("Authorization", "Bearer alpha")]
            async with AsyncExitStack() as stack:
                return [
                    await outcome(stack, server.ws_url, alpha),
                    await outcome(stack, server.ws_url, alpha),
                    await outcome(stack, server.ws_url + "?token=alpha", []),
                    await outcome(stack, server.ws_url + "?token=bravo", []),
                ]

        assert asyncio.run(scenario()) == ["ready", "over_capacity", "over_capacity", "ready"]
