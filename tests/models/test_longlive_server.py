"""LongLive over a real WebSocket (real CLI, uvicorn, websockets; tiny config, random weights, CPU).

``start(A)``, three ticks, ``input(B)``: the next chunk lists the event and
equals the dense reference's switch; the chunks before it equal a run that
never switches; a second session served beside it (``--max-batch-sessions 2``:
batched when their rounds meet; tests/models/test_longlive_rewrite.py checks batched
rows exactly) equals its alone run; a
rewind to before the switch (with the prompt set back) reproduces the old
continuation. The frames are compared as pixels (raw codec): the server
runs on one torch thread, the reference here on another count, so a grey
level of rounding is allowed, while a wrong rule moves them by far more.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from longlive_reference import DenseLongLive
from servers import session_client, server_process

from arstream.models.longlive.loading import load_longlive
from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.models.wan.vae import to_uint8

A, B, C = "a red fox in the snow", "a city street at night, rain", "an underwater reef, bright fish"
OPTIONS = json.dumps({"config": "tiny", "random_init": True})
TOLERANCE = 2  # grey levels


@pytest.fixture(scope="module")
def pipeline() -> LongLivePipeline:
    return load_longlive(config="tiny", random_init=True)


def reference_frames(pipeline: LongLivePipeline, seed: int, prompts: list[str], **knobs: Any) -> list[np.ndarray]:
    dense = DenseLongLive(pipeline, seed, **knobs)
    frames, cache = [], None
    for prompt in prompts:
        video, cache = pipeline.vae.decode(dense.step(prompt)[None], cache)
        frames.append(to_uint8(video))
    return frames


def gap(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


async def chunk_frames(client: Any) -> tuple[dict[str, Any], np.ndarray]:
    chunk, frames = await client.recv_chunk()
    return chunk, np.stack([pixels for _, pixels in frames])


def test_a_prompt_switch_over_the_websocket_equals_the_reference(pipeline: LongLivePipeline) -> None:
    args = ["--model", "longlive", "--model-options", OPTIONS, "--torch-threads", "1", "--max-batch-sessions", "2",
            "--rewind-seconds", "10"]  # fmt: skip
    with server_process(args) as server:
        server.wait_ready()
        card = server.get("/v1/model").json()
        assert (card["name"], card["frames_per_chunk"], card["first_chunk_frames"]) == ("longlive", 12, 9)
        start_free = server.stats()["kv"]["blocks_free"]

        async def switching() -> list[tuple[dict[str, Any], np.ndarray]]:
            seen = []
            async with session_client(server.ws_url, start={"seed": 1, "codec": "raw", "prompt": A}) as client:
                for tick_id in range(3):
                    await client.send(type="tick", tick_id=tick_id, controls={})
                for _ in range(3):
                    seen.append(await chunk_frames(client))
                await client.send(type="input", event_id=1, prompt=B)
                assert (await client.recv_json())["type"] == "ack"
                for tick_id in (3, 4):
                    await client.send(type="tick", tick_id=tick_id, controls={})
                    seen.append(await chunk_frames(client))
                await client.send(type="input", event_id=2, prompt=A)
                assert (await client.recv_json())["type"] == "ack"
                await client.send(type="tick", tick_id=5, controls={}, rewind_to=3)
                seen.append(await chunk_frames(client))
            return seen

        async def steady() -> list[tuple[dict[str, Any], np.ndarray]]:
            async with session_client(server.ws_url, start={"seed": 2, "codec": "raw", "prompt": C}) as client:
                seen = []
                for ticks in (range(3), range(3, 5)):  # at most max_pending_ticks (4) queued
                    for tick_id in ticks:
                        await client.send(type="tick", tick_id=tick_id, controls={})
                    seen += [await chunk_frames(client) for _ in ticks]
                return seen

        async def both() -> tuple[list[Any], list[Any]]:
            first, second = await asyncio.gather(switching(), steady())
            return first, second

        switched, alone = asyncio.run(both())
        server.settled(start_free)  # every session gone, every KV block back
    assert [c["chunk_index"] for c, _ in switched] == [0, 1, 2, 3, 4, 3]
    assert [c["applied_event_ids"] for c, _ in switched][3] == [1]
    assert switched[5][0]["restarted"] == "rewind"
    expected = reference_frames(pipeline, 1, [A, A, A, B, B])
    unswitched = reference_frames(pipeline, 1, [A, A, A, A, A])
    for (_, got), want in zip(switched[:5], expected):
        assert gap(got, want) <= TOLERANCE
    for (_, got), want in zip(switched[:3], unswitched):  # the chunks before the switch are unchanged
        assert gap(got, want) <= TOLERANCE
    # negative control: the switch shows at its first chunk, and plainly at the next (how much at the first depends
    # on the random weights: 10 grey levels on today's draw, 33 at the second)
    assert gap(switched[3][1], unswitched[3]) > TOLERANCE
    assert gap(switched[4][1], unswitched[4]) > 8 * TOLERANCE
    assert gap(switched[5][1], unswitched[3]) <= TOLERANCE  # the rewind reproduces the old continuation
    for (_, got), want in zip(alone, reference_frames(pipeline, 2, [C] * 5)):
        assert gap(got, want) <= TOLERANCE
