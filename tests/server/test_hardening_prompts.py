"""Prompts against a real server (fake-kv, whose card reads prompts): bounded in size when parsed, and a
session's new prompts bounded in rate, each refusal a clear error the session goes on after.

Before, a prompt was bounded only by the message size, and every prompt was taken however fast they came."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest

from arstream.app.prompts import MAX_PROMPT_CHARS, MAX_PROMPT_LINES, PROMPT_CHANGE_BURST
from servers import LiveServer, fake_settings, running_server, session_client


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with running_server(fake_settings(model_options={"reads_prompt": True})) as server:
        yield server


def test_a_prompt_over_its_bounds_is_refused_and_the_session_goes_on(live: LiveServer) -> None:
    async def scenario() -> tuple[dict[str, object], dict[str, object], str, dict[str, object]]:
        async with session_client(live.ws_url) as client:
            await client.send(type="start", prompt="x" * (MAX_PROMPT_CHARS + 1))
            refused_start = await client.recv_json()
        async with session_client(live.ws_url, start={"codec": "raw", "prompt": "a meadow"}) as client:
            await client.send(type="tick", tick_id=1, controls={}, prompt="line\n" * MAX_PROMPT_LINES)
            refused_tick = await client.recv_json()
            await client.send(type="tick", tick_id=2, controls={}, prompt="a meadow at dusk")
            chunk, _ = await client.recv_chunk()
            await client.send(type="input", event_id=1, prompt="y" * (MAX_PROMPT_CHARS + 1))
            refused_input = await client.recv_json()
        return refused_start, refused_tick, str(chunk["type"]), refused_input

    start, tick, chunk, event = asyncio.run(scenario())
    assert start["code"] == "invalid_message" and "at most 2000 characters, got 2001" in str(start["message"])
    assert tick["code"] == "invalid_message" and tick["tick_id"] == 1 and "at most 64 lines, got 65" in str(tick)
    assert chunk == "chunk"  # the session went on
    assert event["code"] == "invalid_message" and "at most 2000 characters" in str(event["message"])


def test_new_prompts_past_the_rate_are_refused_before_they_are_prepared(live: LiveServer) -> None:
    """40 new prompts at once: the burst's 8 are taken (a token comes back every 0.25 s), the rest refused with
    too_many_ticks; a prompt already seen costs nothing and is taken."""
    assert live.server is not None
    prompts = live.server.hub.prompts

    async def scenario() -> tuple[Counter[str], dict[str, object], int]:
        async with session_client(live.ws_url, start={"codec": "raw", "prompt": "a meadow"}) as client:
            prepared_before = prompts.prepared
            for event_id in range(1, 41):
                await client.send(type="input", event_id=event_id, prompt=f"a new prompt, number {event_id}")
            replies = [await client.recv_json() for _ in range(40)]
            prepared = prompts.prepared - prepared_before
            await client.send(type="input", event_id=41, prompt="a new prompt, number 1")  # seen before
            again = await client.recv_json()
        kinds = Counter(str(r.get("code", r["type"])) for r in replies)
        return kinds, again, prepared

    kinds, again, prepared = asyncio.run(scenario())
    assert kinds["ack"] + kinds["too_many_ticks"] == 40
    assert PROMPT_CHANGE_BURST <= kinds["ack"] < 40 and prepared == kinds["ack"]
    assert again["type"] == "ack"
