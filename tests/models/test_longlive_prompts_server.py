"""LongLive's prompt cleaning over a real server (in this process; tiny config, random weights, CPU): once per
prompt, as it arrives, on the transport's side; never per chunk on the model thread.

Before, every chunk cleaned its session's prompt (ftfy, HTML entities, whitespace runs) on the model thread
before the cache lookup: a ``start`` prompt of 32,000 newlines cost 0.5 s a chunk. The cleans are counted by
wrapping ``clean_prompt`` wherever LongLive's modules hold it, in both dialects.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

import arstream.models.longlive.base as base_module
import arstream.models.longlive.prompts as prompts_module
import arstream.models.longlive.text as text_module
from arstream.app.realtime_video import PATH
from arstream.models.longlive.loading import load_longlive
from arstream.models.longlive.pipeline import LongLivePipeline
from servers import LiveServer, fake_settings, running_server, session_client

TINY = {"config": "tiny", "random_init": True}
MESSY = "a red fox\n\n  in the   snow &amp;amp; ice "  # Wan's cleaning: "a red fox in the snow & ice"
OTHER = "a city\tstreet at night,  rain"


class CountedCleans:
    """``clean_prompt`` as LongLive's modules call it, with each call's text kept."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self._clean = text_module.clean_prompt

    def __call__(self, text: str) -> str:
        self.texts.append(text)
        return self._clean(text)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LiveServer, LongLivePipeline, CountedCleans]]:
    cleans = CountedCleans()
    with pytest.MonkeyPatch.context() as patch:
        for module in (text_module, prompts_module, base_module):
            patch.setattr(module, "clean_prompt", cleans, raising=False)
        pipeline = load_longlive(config="tiny", random_init=True)
        settings = fake_settings(model="longlive", model_options=TINY, max_batch_sessions=1)
        with running_server(settings, pipeline) as live:
            yield live, pipeline, cleans


def test_protocol_1_prompts_are_cleaned_once_as_they_arrive(
    served: tuple[LiveServer, LongLivePipeline, CountedCleans],
) -> None:
    live, pipeline, cleans = served
    cleans.texts.clear()

    async def scenario() -> tuple[str, list[int]]:
        cleaned_after: list[int] = []  # cleans so far, after each chunk
        async with session_client(live.ws_url, start={"codec": "raw", "seed": 1, "prompt": MESSY}) as client:
            for tick_id in range(4):  # the prompt again with every other tick, as a client may send it
                await client.send(type="tick", tick_id=tick_id, controls={}, prompt=MESSY if tick_id % 2 else None)
                await client.recv_chunk()
                cleaned_after.append(len(cleans.texts))
            assert client.ready is not None
            session_id = client.ready["session_id"]
            used = pipeline.session_prompt(session_id)
            await client.send(type="input", event_id=1, prompt=OTHER)
            assert (await client.recv_json())["type"] == "ack"
            for tick_id in range(4, 7):
                await client.send(type="tick", tick_id=tick_id, controls={})
                await client.recv_chunk()
                cleaned_after.append(len(cleans.texts))
        assert used is not None
        return used, cleaned_after

    used, cleaned_after = asyncio.run(scenario())
    assert used == "a red fox in the snow & ice"  # what the model read: Wan's cleaning of the prompt sent
    assert cleaned_after == [1, 1, 1, 1, 2, 2, 2]  # one clean per prompt that arrived, none per chunk
    assert cleans.texts == [MESSY, OTHER]


def test_realtime_video_prompts_are_cleaned_once_as_they_arrive(
    served: tuple[LiveServer, LongLivePipeline, CountedCleans],
) -> None:
    live, _, cleans = served
    cleans.texts.clear()
    first, second = f"{MESSY}, at dusk", f"{OTHER}, at dawn"  # not seen before: the server remembers prompts
    card = live.get("/v1/model").json()
    start = {"type": "session.start", "model": "longlive", "prompt": first, "width": card["width"],
             "height": card["height"], "num_frames": 10**9}  # fmt: skip
    change = {"type": "session.interaction", "interaction": {"event_id": "p", "event": {"prompt": second}}}
    url = live.base_url.replace("http://", "ws://", 1) + PATH

    async def chunks(client: Any, count: int, cleaned_after: list[int]) -> None:
        while count:
            message = await client.recv()
            if isinstance(message, bytes):  # a chunk's video, after its metadata
                count -= 1
                cleaned_after.append(len(cleans.texts))
            else:
                assert json.loads(message)["type"] != "error", message

    async def scenario() -> list[int]:
        cleaned_after: list[int] = []
        async with session_client(url) as client:
            await client.send(**start)
            await chunks(client, 3, cleaned_after)
            await client.send(**change)
            await chunks(client, 3, cleaned_after)
            await client.send(type="session.stop")
        return cleaned_after

    cleaned_after = asyncio.run(scenario())
    assert cleaned_after[:3] == [1, 1, 1] and cleaned_after[-1] == 2  # the change applies at a later chunk
    assert cleans.texts == [first, second]
