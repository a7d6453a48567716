"""Fatal errors and their close codes: start handshake, size limit, idle timeout, capacity, auth, origin."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from servers import LiveServer, ProbeClient, fake_settings, running_server, session_client


@pytest.fixture(scope="module")
def quick() -> Iterator[LiveServer]:
    """Short start timeout and a small message limit."""
    with running_server(fake_settings(start_timeout_s=1.0, max_message_bytes=1024)) as live:
        yield live


async def try_start(client: ProbeClient) -> dict[str, Any]:
    """Send `start` (a refused connection may already be closing) and return the first reply."""
    try:
        await client.send(type="start")
    except ConnectionClosed:
        pass  # refused before reading anything; the error message is still queued for us
    return await client.recv_json()


def assert_fatal(closed: Any, code: str, close_code: int, *, closed_reason: str | None = None) -> dict[str, Any]:
    error = closed.messages[0]
    assert error["type"] == "error" and error["code"] == code and error["fatal"] is True, closed.messages
    assert closed.code == close_code
    if closed_reason is None:
        assert closed.messages == [error]
    else:
        assert closed.messages == [error, {"type": "closed", "reason": closed_reason}]
    return error


# ---- start handshake ---------------------------------------------------------------------


def test_no_start_within_the_timeout_is_start_required(quick: LiveServer) -> None:
    async def scenario() -> Any:
        async with session_client(quick.ws_url) as client:
            return await client.closed_by_server()

    assert_fatal(asyncio.run(scenario()), "start_required", 1008)


@pytest.mark.parametrize(
    "first",
    ['{"type": "tick", "tick_id": 1}', '{"type": "ping"}', "not json", b"\x00binary"],
    ids=["tick", "ping", "not-json", "binary"],
)
def test_first_message_not_start_is_start_required(quick: LiveServer, first: str | bytes) -> None:
    async def scenario() -> Any:
        async with session_client(quick.ws_url) as client:
            await client.ws.send(first)
            return await client.closed_by_server()

    assert_fatal(asyncio.run(scenario()), "start_required", 1008)


def test_malformed_start_is_invalid_message_and_start_may_follow(quick: LiveServer) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with session_client(quick.ws_url) as client:
            await client.send(type="start", quality=101)
            error = await client.recv_json()
            ready = await client.start(codec="raw")
            return error, ready

    error, ready = asyncio.run(scenario())
    assert error["code"] == "invalid_message" and error["fatal"] is False
    assert ready["type"] == "ready" and ready["codec"] == "raw"


# ---- message size --------------------------------------------------------------------------


def test_text_over_the_limit_is_message_too_large_1009(quick: LiveServer) -> None:
    async def scenario() -> Any:
        async with session_client(quick.ws_url, start={}) as client:
            await client.send_text(json.dumps({"type": "ping", "pad": "x" * 1024}))
            return await client.closed_by_server()

    assert_fatal(asyncio.run(scenario()), "message_too_large", 1009, closed_reason="error")
    quick.wait_for_stats(lambda s: s["sessions"]["connected"] == 0)


def test_text_at_the_limit_is_accepted(quick: LiveServer) -> None:
    async def scenario() -> dict[str, Any]:
        async with session_client(quick.ws_url, start={}) as client:
            text = json.dumps({"type": "ping", "t": 1, "pad": ""})
            text = text.replace('"pad": ""', '"pad": "' + "x" * (1024 - len(text)) + '"')
            assert len(text.encode()) == 1024
            await client.send_text(text)
            return await client.recv_json()

    assert asyncio.run(scenario())["type"] == "pong"


def test_message_too_large_before_start(quick: LiveServer) -> None:
    async def scenario() -> Any:
        async with session_client(quick.ws_url) as client:
            await client.send_text(json.dumps({"type": "start", "prompt": "y" * 2000}))
            return await client.closed_by_server()

    assert_fatal(asyncio.run(scenario()), "message_too_large", 1009)


# ---- idle timeout ----------------------------------------------------------------------------


def test_idle_session_gets_idle_timeout_4001() -> None:
    with running_server(fake_settings(idle_timeout_s=1.0)) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> Any:
            async with session_client(server.ws_url, start={}) as client:
                assert client.ready is not None and client.ready["limits"]["idle_timeout_s"] == 1
                await client.send(type="tick", tick_id=1)
                await client.recv_chunk()
                return await client.closed_by_server()

        assert_fatal(asyncio.run(scenario()), "idle_timeout", 4001, closed_reason="idle_timeout")
        server.wait_for_stats(
            lambda s: s["kv"]["blocks_free"] == start_free and s["sessions"]["connected"] == 0
        )


# ---- capacity --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [{"model_options": {"session_capacity": 1}}, {"max_sessions": 1}],
    ids=["model-capacity", "max-sessions-flag"],
)
def test_over_capacity_1013_until_a_slot_frees(settings: dict[str, Any]) -> None:
    with running_server(fake_settings(**settings)) as server:
        assert server.stats()["kv"]["session_capacity"] == 1

        async def scenario() -> tuple[Any, dict[str, Any]]:
            async with session_client(server.ws_url, start={}) as first:
                assert server.get("/readyz").status_code == 503
                async with session_client(server.ws_url) as second:
                    await second.send(type="start")
                    refused = await second.closed_by_server()
                await first.send(type="close")
                await first.closed_by_server()
            await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["connected"] == 0)
            async with session_client(server.ws_url, start={}) as third:
                assert third.ready is not None
                await third.send(type="tick", tick_id=0)
                chunk, _ = await third.recv_chunk()
            return refused, chunk

        refused, chunk = asyncio.run(scenario())
        error = assert_fatal(refused, "over_capacity", 1013)
        assert "all 1 session slots are in use" in error["message"]
        assert chunk["chunk_index"] == 0
        assert server.get("/readyz").status_code == 200


def test_connected_sessions_never_exceed_capacity() -> None:
    with running_server(fake_settings(model_options={"session_capacity": 2})) as server:

        async def scenario() -> list[str]:
            outcomes = []
            async with session_client(server.ws_url) as a, session_client(server.ws_url) as b, session_client(
                server.ws_url
            ) as c:
                for client in (a, b, c):
                    await client.send(type="start")
                for client in (a, b, c):
                    outcomes.append((await client.recv_json())["type"])
            return outcomes

        assert sorted(asyncio.run(scenario())) == ["error", "ready", "ready"]


# ---- auth and origin ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded() -> Iterator[LiveServer]:
    with running_server(fake_settings(auth_token="s3cret")) as live:
        yield live


@pytest.mark.parametrize(
    ("query", "headers"),
    [("", []), ("?token=wrong", []), ("", [("Authorization", "Bearer wrong")]), ("", [("Authorization", "s3cret")])],
    ids=["missing", "wrong-query", "wrong-header", "not-bearer"],
)
def test_missing_or_wrong_token_is_unauthorized_1008(
    guarded: LiveServer, query: str, headers: list[tuple[str, str]]
) -> None:
    async def scenario() -> Any:
        async with session_client(guarded.ws_url + query, headers=headers) as client:
            return await client.closed_by_server()

    error = assert_fatal(asyncio.run(scenario()), "unauthorized", 1008)
    assert "token" in error["message"]


@pytest.mark.parametrize(
    ("query", "headers"),
    [("?token=s3cret", []), ("", [("Authorization", "Bearer s3cret")])],
    ids=["query", "bearer-header"],
)
def test_right_token_is_admitted(guarded: LiveServer, query: str, headers: list[tuple[str, str]]) -> None:
    async def scenario() -> dict[str, Any]:
        async with session_client(guarded.ws_url + query, headers=headers, start={}) as client:
            assert client.ready is not None
            return client.ready

    assert asyncio.run(scenario())["type"] == "ready"


def test_default_origins_allow_same_host_and_scripts_only() -> None:
    with running_server(fake_settings()) as server:

        async def outcome(origin: str | None) -> str:
            async with session_client(server.ws_url, origin=origin) as client:
                message = await try_start(client)
                return message["type"] if message["type"] == "ready" else message["code"]

        async def scenario() -> dict[str | None, str]:
            origins = [
                None,
                f"http://127.0.0.1:{server.port}",
                f"http://localhost:{server.port}",
                "http://evil.example",
                "http://localhost:1",
            ]
            return {origin: await outcome(origin) for origin in origins}

        results = asyncio.run(scenario())
        assert results == {
            None: "ready",
            f"http://127.0.0.1:{server.port}": "ready",
            f"http://localhost:{server.port}": "ready",
            "http://evil.example": "unauthorized",
            "http://localhost:1": "unauthorized",
        }


@pytest.mark.parametrize(
    ("allowed", "origin", "admitted"),
    [
        ("http://app.example, https://other.example", "http://app.example", True),
        ("http://app.example", "http://evil.example", False),
        ("*", "http://anything.example", True),
    ],
)
def test_configured_origins(allowed: str, origin: str, admitted: bool) -> None:
    with running_server(fake_settings(allowed_origins=allowed)) as server:

        async def scenario() -> Any:
            async with session_client(server.ws_url, origin=origin) as client:
                first = await try_start(client)
                if first["type"] == "ready":
                    return first
                return await client.closed_by_server(), first

        result = asyncio.run(scenario())
        if admitted:
            assert result["type"] == "ready"
        else:
            closed, error = result
            assert error["code"] == "unauthorized" and "origin" in error["message"]
            assert closed.code == 1008


def test_non_websocket_request_to_sessions_is_refused(quick: LiveServer) -> None:
    assert quick.get("/v1/sessions").status_code in (400, 403, 404, 426)


def test_handshake_to_unknown_path_fails(quick: LiveServer) -> None:
    async def scenario() -> None:
        async with session_client(quick.ws_url.replace("/v1/sessions", "/v1/nope")):
            pass

    with pytest.raises(InvalidStatus):
        asyncio.run(scenario())
