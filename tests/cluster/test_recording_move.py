"""A recorded session moved by a drain takes its recording along (PROTOCOL.md, "Recording").

Two real servers on loopback, each recording into its own directory (a drained replica's disk goes with it):
a session records on r0, r0 is drained mid-recording, the client resumes on r1, and r1 lists the whole
recording under the share token the session has there. Its files decode with PyAV to the frames the client
received on both sides of the move, and r0 keeps no copy.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from servers import RECEIVE_GUARD_S, LiveServer, running_server, session_client
from test_migration import SEED, cluster_settings, drain, frames_of

av = pytest.importorskip("av")

# H.264 at quality 80 on the fake model's flat colours: a pixel may move by a few levels, never more.
CODEC_TOLERANCE = 6
KEYS = [["d"], ["w"], ["a"], ["s"], ["d"], []]
MOVE_AT = 3


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer, Path, Path]]:
    dirs = tmp_path_factory.mktemp("r0-recordings"), tmp_path_factory.mktemp("r1-recordings")
    with ExitStack() as stack:
        r0, r1 = (
            stack.enter_context(running_server(cluster_settings(name, record_dir=str(directory))))
            for name, directory in zip(("r0", "r1"), dirs)
        )
        yield r0, r1, *dirs


def decoded(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def complete_files(server: LiveServer, token: str, count: int) -> list[dict[str, Any]]:
    """The session's recordings once ``count`` files are listed and all are complete (its encoder lane has
    finished the last one after the session ended)."""
    deadline = time.monotonic() + RECEIVE_GUARD_S
    while True:
        files = server.get("/v1/recordings", params={"share": token}).json()["recordings"]
        if (len(files) == count and all(f["complete"] for f in files)) or time.monotonic() > deadline:
            return files
        time.sleep(0.01)


def test_a_recording_moves_with_its_session(replicas: tuple[LiveServer, LiveServer, Path, Path]) -> None:
    r0, r1, r0_dir, r1_dir = replicas

    async def scenario() -> tuple[str, str, list[np.ndarray], list[np.ndarray]]:
        before, after = [], []
        start = {"codec": "raw", "seed": SEED, "record": True}
        async with session_client(r0.ws_url, start=start) as client:
            assert client.ready is not None
            old_share = client.ready["share"]["token"]
            for tick_id in range(MOVE_AT):
                await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                before += list((await frames_of(client))[1])
            report = (await asyncio.to_thread(drain, r0, [r1.base_url])).json()
            assert report["moved"] == 1, report
            moved = (await client.closed_by_server()).messages[-2]
        token = moved["resume"]
        async with session_client(f"{r1.ws_url}?resume={token}", start={"resume": token, "codec": "raw"}) as client:
            assert client.ready is not None and client.ready["resumed"] is True
            new_share = client.ready["share"]["token"]
            for tick_id in range(MOVE_AT, len(KEYS)):
                await client.send(type="tick", tick_id=tick_id, controls={"keys": KEYS[tick_id]})
                chunk, frames = await frames_of(client)
                assert chunk["chunk_index"] == tick_id
                after += list(frames)
            await client.send(type="close")
            await client.closed_by_server()
        return old_share, new_share, before, after

    old_share, new_share, before, after = asyncio.run(scenario())
    assert new_share.startswith("r1.") and old_share.startswith("r0.")
    files = complete_files(r1, new_share, 2)
    # The move is a cut in the files: what r0 wrote, then what r1 wrote from the move on.
    assert [(f["name"], f["complete"]) for f in files] == [("part-0000.mp4", True), ("part-0001.mp4", True)]
    for f, frames in zip(files, (before, after), strict=True):
        response = r1.get(f"/v1/recordings/{f['name']}", params={"share": new_share})
        assert response.status_code == 200 and len(response.content) == f["bytes"]
        video = decoded(response.content)
        assert len(video) == len(frames)
        height, width = frames[0].shape[:2]
        worst = max(int(np.abs(a[:height, :width].astype(int) - b.astype(int)).max()) for a, b in zip(video, frames))
        assert worst <= CODEC_TOLERANCE, f"{f['name']} differs by {worst}"
    # The recording lives with its session now: r0 keeps no copy, and its old share token lists nothing.
    assert r0.get("/v1/recordings", params={"share": old_share}).json() == {"recordings": []}
    assert list(r0_dir.rglob("*.mp4")) == []
    assert not list(r1_dir.glob("incoming-*"))  # the files' folder while they arrived is the session's now
    r0.settled(r0.stats()["kv"]["blocks_total"])
    r1.settled(r1.stats()["kv"]["blocks_total"])
