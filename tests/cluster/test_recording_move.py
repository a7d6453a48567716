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


def recorded_snapshot(session_id: str, files: dict[str, bytes]) -> bytes:
    """A fake-kv session's snapshot, recorded, carrying ``files`` as its recording (as a draining replica ships it)."""
    import torch

    from arstream.models.fake import FakeKVPipeline
    from arstream.runner.runner import runner_for_sessions
    from arstream.runner.snapshot import export_session
    from arstream.runner.snapshot_stream import snapshot_bytes
    from arstream.runner.types import TickRequest

    runner = runner_for_sessions(FakeKVPipeline(window_frames=6), 1)
    runner.execute_tick(TickRequest(session_id=session_id, request_id=0))
    snapshot = export_session(runner, session_id, protocol_version=1)
    snapshot.header["session"] = {
        "id": session_id, "codec": "raw", "quality": 80, "seed": None, "controls": {}, "prompt": None,
        "staged_controls": None, "staged_prompt": None, "pending_event_ids": [], "last_tick_id": 0,
        "last_reset_tick_id": None, "event_floor": None, "recent_event_ids": [], "record": True,
    }
    for name, data in files.items():
        snapshot.tensors[f"recording/{name}"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return snapshot_bytes(snapshot)


def test_a_moved_recording_that_is_not_one_or_is_cut_short_leaves_nothing(
    replicas: tuple[LiveServer, LiveServer, Path, Path]
) -> None:
    from test_migration import _post_import

    _r0, r1, _r0_dir, r1_dir = replicas
    free = r1.stats()["kv"]["blocks_free"]
    before = sorted(path.name for path in r1_dir.iterdir())
    named_badly = recorded_snapshot("s-00000000000000a1", {"../escape.mp4": b"x" * 64})
    refused = _post_import(r1, named_badly)
    assert refused.status_code == 400 and "not a recording file" in refused.json()["detail"], refused.text
    whole = recorded_snapshot("s-00000000000000a2", {"part-0000.mp4": bytes(range(256)) * 64})
    cut = _post_import(r1, whole[: len(whole) - 4096])  # its recording's last bytes never come
    assert cut.status_code == 400 and "ended early" in cut.json()["detail"], cut.text
    # Neither left a file, a folder (incoming-* included) or a block behind.
    assert sorted(path.name for path in r1_dir.iterdir()) == before
    assert r1.stats()["kv"]["blocks_free"] == free and r1.stats()["sessions"]["detached"] == 0
    taken = _post_import(r1, whole)
    assert taken.status_code == 200 and taken.json()["recording_kept"] is True, taken.text
    [folder] = [path for path in r1_dir.iterdir() if path.name not in before]
    assert (folder / "part-0000.mp4").read_bytes() == bytes(range(256)) * 64

    async def resume_and_close(token: str) -> bool | None:
        async with session_client(f"{r1.ws_url}?resume={token}", start={"resume": token, "codec": "raw"}) as client:
            assert client.ready is not None
            await client.send(type="close")
            await client.closed_by_server()
            return client.ready.get("record")

    # It goes on recording there (ready says so), and nothing of it is held once it ends.
    assert asyncio.run(resume_and_close(taken.json()["resume"])) is True
    r1.settled(r1.stats()["kv"]["blocks_total"])
