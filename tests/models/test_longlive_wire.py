"""LongLive's fail-closed re-cache and its moves, over a real WebSocket (real uvicorn servers, tiny config, fp32).

- A prompt switch whose re-cache fails (a fake fault, injected into the real
  pipeline's re-cache after it wrote its blocks) ends that session's rollout
  with ``session_failed``: the pool is back at what the other session holds,
  that session's chunks are the ones it gets alone, and a reset starts the
  failed one afresh.
- A session that switched prompts and is then drained to a peer (the
  migration route: export on one server, import into a second) continues
  there bit-identically: every chunk equals an uninterrupted session's
  (LongLive, and Causal Forcing frame-wise on the same path).

Both servers run in this process, so frames are compared byte for byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from arstream.app.wire import DRAIN_PATH
from arstream.models.longlive.loading import load_longlive
from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.models.longlive.prompts import PromptEntry
from arstream.runner.kv_state import SessionKVState
from servers import LiveServer, ProbeClient, fake_settings, running_server, session_client

A, B = "a red fox in the snow", "a city street at night, rain"
FAULT = "a prompt whose re-cache the fake fault breaks"
TINY = {"config": "tiny", "random_init": True}
CAUSAL_FORCING_FRAMEWISE = {"config": "tiny-causal-forcing-framewise", "random_init": True}
SECRET = "a-cluster-secret-for-the-longlive-move"
SEED = 3


class FakeRecacheFault:
    """Stands in for a device fault inside LongLive's re-cache: runs the real one (its fresh blocks written),
    then raises when the new prompt is ``prompt``."""

    def __init__(self, recache: Callable[[SessionKVState, Any, PromptEntry], None], prompt: str) -> None:
        self.recache = recache
        self.prompt = prompt
        self.raised = 0

    def __call__(self, state: SessionKVState, latents: Any, entry: PromptEntry) -> None:
        self.recache(state, latents, entry)
        if entry.text == self.prompt:
            self.raised += 1
            raise RuntimeError("fake device fault in the re-cache")


async def chunk(client: ProbeClient) -> tuple[dict[str, Any], np.ndarray]:
    message, frames = await client.recv_chunk()
    return message, np.stack([pixels for _, pixels in frames])


async def ticks(client: ProbeClient, tick_ids: range) -> list[tuple[dict[str, Any], np.ndarray]]:
    """One tick at a time (a chunk each), so the test decides what runs beside what."""
    out = []
    for tick_id in tick_ids:
        await client.send(type="tick", tick_id=tick_id, controls={})
        out.append(await chunk(client))
    return out


async def switch(client: ProbeClient, event_id: int, prompt: str) -> None:
    await client.send(type="input", event_id=event_id, prompt=prompt)
    assert (await client.recv_json())["type"] == "ack"


async def close(client: ProbeClient) -> None:
    await client.send(type="close")
    await client.closed_by_server()


def free_blocks(server: LiveServer) -> int:
    return int(server.stats()["kv"]["blocks_free"])


def test_a_failed_recache_over_the_websocket_frees_every_block_and_the_other_session_continues() -> None:
    pipeline: LongLivePipeline = load_longlive(config="tiny", random_init=True)
    fault = FakeRecacheFault(pipeline._recache, pipeline.prompts.get(FAULT).text)
    pipeline._recache = fault  # type: ignore[method-assign]
    settings = fake_settings(model="longlive", model_options=TINY, max_batch_sessions=1, rewind_seconds=2.0)
    with running_server(settings, pipeline) as server:
        baseline = free_blocks(server)

        async def scenario() -> None:
            steady = {"seed": 5, "codec": "raw", "prompt": B}
            async with session_client(server.ws_url, start=steady) as alone:
                want = [frames for _, frames in await ticks(alone, range(6))]
                await close(alone)
            await asyncio.to_thread(server.settled, baseline)
            async with (
                session_client(server.ws_url, start=steady) as other,
                session_client(server.ws_url, start={"seed": SEED, "codec": "raw", "prompt": A}) as failing,
            ):
                got = [frames for _, frames in await ticks(other, range(3))]
                other_holds = baseline - free_blocks(server)
                assert other_holds > 0
                await ticks(failing, range(3))
                await switch(failing, 1, FAULT)
                await failing.send(type="tick", tick_id=3, controls={})
                error = await failing.recv_json()
                assert (error["type"], error["code"], error.get("tick_id")) == ("error", "session_failed", 3), error
                assert fault.raised == 1
                # every block the failing session held (history, rewind points, the re-cache's fresh blocks) is back
                stats = server.stats()
                assert stats["kv"]["blocks_free"] == baseline - other_holds and stats["kv"]["sessions_resident"] == 1
                assert stats["sessions"]["failures_total"] == 1
                got += [frames for _, frames in await ticks(other, range(3, 6))]  # the other session continues
                # the failed rollout is over; a reset starts it afresh (the prompt set back first)
                await switch(failing, 2, A)
                await failing.send(type="tick", tick_id=4, controls={}, reset=True)
                restarted, _ = await chunk(failing)
                assert restarted["chunk_index"] == 0
                await close(failing)
                await close(other)
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))

        asyncio.run(scenario())
        server.settled(baseline)


def cluster_settings(replica: str, model: str, options: dict[str, Any]) -> Any:
    return fake_settings(replica_id=replica, resume_grace_s=30.0, cluster_secret=SECRET, model=model,
                         model_options=options, max_batch_sessions=1)  # fmt: skip


@contextmanager
def two_replicas(model: str = "longlive", options: dict[str, Any] = TINY) -> Iterator[tuple[LiveServer, LiveServer]]:
    with ExitStack() as stack:
        yield tuple(stack.enter_context(running_server(cluster_settings(r, model, options)))  # type: ignore[misc]
                    for r in ("r0", "r1"))  # fmt: skip


def drain(server: LiveServer, peer: LiveServer) -> httpx.Response:
    return httpx.post(server.base_url + DRAIN_PATH, json={"peers": [peer.base_url], "exit": False},
                      headers={"authorization": f"Bearer {SECRET}"}, timeout=60.0)  # fmt: skip


@pytest.mark.parametrize(
    ("model", "options", "move_at"),
    [("longlive", TINY, 5), ("longlive", TINY, 3), ("causal-forcing", CAUSAL_FORCING_FRAMEWISE, 5)],
    ids=["after-the-switch-chunk", "with-the-switch-staged", "causal-forcing-framewise"],
)
def test_a_session_moved_after_a_prompt_switch_continues_bit_identically_on_the_peer(
    model: str, options: dict[str, Any], move_at: int
) -> None:
    """Chunks 0-2 under A, B sent before chunk 3; moved before chunk ``move_at``: with B already re-cached into
    its history (5), or with B staged and the switch chunk not yet run (3: the peer runs the re-cache). Causal
    Forcing frame-wise: one latent frame a chunk (its drain moves a history of single-frame chunks)."""
    with two_replicas(model, options) as (r0, r1):

        async def scenario() -> None:
            start = {"seed": SEED, "codec": "raw", "prompt": A}
            async with session_client(r1.ws_url, start=start) as uninterrupted:
                want = await ticks(uninterrupted, range(3))
                await switch(uninterrupted, 1, B)
                want += await ticks(uninterrupted, range(3, 8))
                await close(uninterrupted)
            assert want[3][0]["applied_event_ids"] == [1]
            async with session_client(r0.ws_url, start=start) as client:
                got = await ticks(client, range(3))
                await switch(client, 1, B)
                got += await ticks(client, range(3, move_at))
                report = (await asyncio.to_thread(drain, r0, r1)).json()
                assert report["moved"] == 1 and report["ended"] == 0, report
                closed = await client.closed_by_server()
                moved = closed.messages[-2]
                assert moved["type"] == "moved" and moved["next_chunk_index"] == move_at, moved
            token = moved["resume"]
            async with session_client(f"{r1.ws_url}?resume={token}", start={"resume": token, "codec": "raw"}) as client:
                assert client.ready is not None and client.ready["resumed"] is True
                got += await ticks(client, range(move_at, 8))
                await close(client)
            assert [c["chunk_index"] for c, _ in got] == list(range(8))
            assert [c["applied_event_ids"] for c, _ in got] == [c["applied_event_ids"] for c, _ in want]
            assert all(c["restarted"] is None for c, _ in got)
            for index, ((_, a), (_, b)) in enumerate(zip(got, want, strict=True)):
                assert np.array_equal(a, b), f"chunk {index} differs from the uninterrupted session's"
            assert not np.array_equal(got[3][1], got[2][1])  # not a frozen stream: the comparison can fail

        asyncio.run(scenario())
        for server in (r0, r1):
            server.settled(server.stats()["kv"]["blocks_total"])
