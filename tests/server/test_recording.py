"""Server-side recordings (PROTOCOL.md, "Recording"): fragmented MP4 of what the player saw, cut at a rewind.

End to end against a real server (uvicorn, fake-kv): a session that asks records, its files decode with PyAV to
the frames the client received, only its share token lists or downloads them, /metrics counts the bytes, and a
folder an earlier process left is swept at start. The byte budgets and the retention time are unit tests of
:class:`arstream.app.recorder.Recordings` on real files.
"""

from __future__ import annotations

import asyncio
import io
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from arstream.app.metrics import ServerMetrics
from arstream.app.recorder import Recordings, folder_name
from arstream.programs.client_lib import Chunk, Session
from servers import RECEIVE_GUARD_S, LiveServer, fake_settings, running_server

av = pytest.importorskip("av")

STALE = "0" * 32  # a recording folder an earlier process left
# H.264 at quality 80 on the fake model's flat colours: a pixel may move by a few levels, never more.
CODEC_TOLERANCE = 6


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("recordings")
    (directory / STALE).mkdir()
    (directory / STALE / "part-0000.mp4").write_bytes(b"left by a killed process")
    (directory / "notes.txt").write_text("not a recording: left alone")
    return directory


@pytest.fixture(scope="module")
def server(record_dir: Path) -> Iterator[LiveServer]:
    settings = fake_settings(model_options={"compute_delay_s": 0.002}, record_dir=str(record_dir))
    with running_server(settings) as live:
        yield live


def decoded(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


async def play(url: str, *, record: bool) -> tuple[str, list[Chunk]]:
    """Four chunks, a rewind to boundary 1, two more; the session's share token and every chunk received."""
    async with await Session.connect(url) as session:
        ready = await session.start(codec="raw", seed=7, record=record)
        assert ready.share is not None
        received = []
        for keys in (["d"], ["w"], ["a"], ["s"]):
            await session.tick(keys=keys)
        received += [chunk async for chunk in session.chunks()]
        await session.rewind(1, keys=["w", "d"])
        await session.tick(keys=["d"])
        received += [chunk async for chunk in session.chunks()]
        assert await session.close() == "client"
        return ready.share.token, received


def test_a_recording_decodes_to_what_the_player_saw_cut_at_the_rewind(server: LiveServer, record_dir: Path) -> None:
    token, received = asyncio.run(play(server.ws_url, record=True))
    assert [(chunk.chunk_index, chunk.restarted) for chunk in received][3:] == [(3, None), (1, "rewind"), (2, None)]
    listed = server.get("/v1/recordings", params={"share": token})
    assert listed.status_code == 200
    files = listed.json()["recordings"]
    assert [f["name"] for f in files] == ["part-0000.mp4", "part-0001.mp4"]
    server.settled(server.stats()["kv"]["blocks_total"])
    # The session ended: its last file is complete once its encoder lane has run the finish after its chunks.
    deadline = time.monotonic() + RECEIVE_GUARD_S
    while not all(f["complete"] for f in files) and time.monotonic() < deadline:
        time.sleep(0.01)
        files = server.get("/v1/recordings", params={"share": token}).json()["recordings"]
    assert [f["complete"] for f in files] == [True, True]
    videos = []
    for f in files:
        response = server.get(f"/v1/recordings/{f['name']}", params={"share": token})
        assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
        assert len(response.content) == f["bytes"]
        videos.append(decoded(response.content))
    before_cut = [frame for chunk in received[:4] for frame in chunk.frames]
    after_cut = [frame for chunk in received[4:] for frame in chunk.frames]
    assert [len(v) for v in videos] == [len(before_cut), len(after_cut)]
    for video, frames in zip(videos, (before_cut, after_cut), strict=True):
        height, width = frames[0].shape[:2]
        worst = max(int(np.abs(a[:height, :width].astype(int) - b.astype(int)).max()) for a, b in zip(video, frames))
        assert worst <= CODEC_TOLERANCE
    recorded = sum(f["bytes"] for f in files)
    assert metric(server, "arstream_recorded_bytes_total") >= recorded
    assert (record_dir / folder_name(token) / "part-0000.mp4").stat().st_size == files[0]["bytes"]


def test_a_recording_is_never_readable_without_its_token(server: LiveServer) -> None:
    token, _ = asyncio.run(play(server.ws_url, record=True))
    assert server.get("/v1/recordings").status_code == 401
    assert server.get("/v1/recordings/part-0000.mp4").status_code == 401
    other = token.partition(".")[0] + ".not-the-token"
    assert server.get("/v1/recordings", params={"share": other}).json() == {"recordings": []}
    assert server.get("/v1/recordings/part-0000.mp4", params={"share": other}).status_code == 404
    for name in ("..%2Fnotes.txt", "part-0000.mp4%00", "notes.txt"):
        assert server.get(f"/v1/recordings/{name}", params={"share": token}).status_code == 404


def test_a_session_that_does_not_ask_is_not_recorded(server: LiveServer) -> None:
    token, received = asyncio.run(play(server.ws_url, record=False))
    assert received
    assert server.get("/v1/recordings", params={"share": token}).json() == {"recordings": []}


def test_what_an_earlier_process_left_is_swept_at_start(server: LiveServer, record_dir: Path) -> None:
    assert not (record_dir / STALE).exists()
    assert (record_dir / "notes.txt").read_text() == "not a recording: left alone"


def metric(server: LiveServer, name: str) -> float:
    text = server.get("/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found is not None, name
    return float(found.group(1))


# ---- the bounds, on the recorder itself ----------------------------------------------------


def chunk_frames(value: int) -> np.ndarray:
    return np.full((2, 16, 16, 3), value, np.uint8)


def recorder(directory: Path, metrics: ServerMetrics | None = None, **bounds: float) -> Recordings:
    values = {"session_bytes": 10**9, "total_bytes": 10**9, "retention_s": 3600.0, **bounds}
    return Recordings(
        directory, session_bytes=int(values["session_bytes"]), total_bytes=int(values["total_bytes"]),
        retention_s=values["retention_s"], quality=80, metrics=metrics,
    )


def drops(metrics: ServerMetrics, reason: str) -> float:
    return float(metrics.recording_drops.labels(reason=reason)._value.get())


def own_metrics() -> ServerMetrics:
    return ServerMetrics(lambda: None, lambda: 0, lambda: 0)


def write_chunks(recordings: Recordings, session_id: str, token: str, count: int) -> None:
    for index in range(count):
        recordings.write(session_id, token, chunk_frames(10 * index), chunk_index=index, restarted=None, fps=16)


def test_a_session_past_its_byte_budget_records_nothing_more(tmp_path: Path) -> None:
    probe = recorder(tmp_path / "probe")
    write_chunks(probe, "s", "r0.a", 1)
    first_chunk = probe.files("r0.a")[0].bytes  # the init segment and one fragment
    metrics = own_metrics()
    recordings = recorder(tmp_path / "bounded", metrics, session_bytes=first_chunk + 1)
    write_chunks(recordings, "s", "r0.a", 5)
    assert drops(metrics, "session_bytes") == 1  # the chunk that passed it; nothing is written after
    [kept] = recordings.files("r0.a")
    assert kept.bytes == first_chunk  # the file ends at its last whole chunk
    assert len(decoded((tmp_path / "bounded" / folder_name("r0.a") / kept.name).read_bytes())) == 2


def test_all_recordings_past_the_total_budget_record_nothing_more(tmp_path: Path) -> None:
    probe = recorder(tmp_path / "probe")
    write_chunks(probe, "s", "r0.a", 2)
    two_chunks = probe.files("r0.a")[0].bytes
    metrics = own_metrics()
    recordings = recorder(tmp_path / "bounded", metrics, total_bytes=two_chunks + 10)
    write_chunks(recordings, "s1", "r0.a", 2)
    write_chunks(recordings, "s2", "r0.b", 2)
    assert drops(metrics, "total_bytes") == 1
    assert [f.bytes for f in recordings.files("r0.a")] == [two_chunks]
    assert recordings.files("r0.b") == []  # its first chunk is already past what is left
    on_disk = sum(path.stat().st_size for path in (tmp_path / "bounded").rglob("*.mp4"))
    assert on_disk == two_chunks


def test_finished_recordings_past_their_retention_are_deleted(tmp_path: Path) -> None:
    recordings = recorder(tmp_path, retention_s=0.0)
    write_chunks(recordings, "s1", "r0.a", 2)
    assert [f.complete for f in recordings.files("r0.a")] == [False]  # being written: never expired
    recordings.finish("s1")
    write_chunks(recordings, "s2", "r0.b", 1)  # a recording begins: expired ones go first
    assert recordings.files("r0.a") == []
    assert not (tmp_path / folder_name("r0.a")).exists()


def test_a_rewind_reset_or_gap_cuts_the_recording(tmp_path: Path) -> None:
    recordings = recorder(tmp_path)
    for index, restarted in ((0, None), (1, None), (1, "rewind"), (0, "reset"), (5, None)):
        recordings.write("s", "r0.a", chunk_frames(index), chunk_index=index, restarted=restarted, fps=16)
    files = recordings.files("r0.a")
    assert [f.name for f in files] == [f"part-{n:04d}.mp4" for n in range(4)]
    lengths = [len(decoded((tmp_path / folder_name("r0.a") / f.name).read_bytes())) for f in files]
    assert lengths == [4, 2, 2, 2]


def test_arstream_client_record_asks_for_a_recording(server: LiveServer) -> None:
    from arstream.programs import client

    result = asyncio.run(client.run_script(server.ws_url, [("d",), ("w",)], codec="jpeg", record=True))
    token = result.ready["share"]["token"]
    files = server.get("/v1/recordings", params={"share": token}).json()["recordings"]
    assert [f["name"] for f in files] == ["part-0000.mp4"] and files[0]["bytes"] > 0


def test_record_all_without_a_directory_is_refused() -> None:
    with pytest.raises(ValueError, match="--record-dir"):
        fake_settings(record_all=True)


def test_a_part_that_expired_during_its_session_never_has_its_name_reused(tmp_path: Path) -> None:
    recordings = recorder(tmp_path, retention_s=0.0)
    for index, restarted in ((0, None), (1, None), (0, "rewind")):
        recordings.write("s", "r0.a", chunk_frames(index), chunk_index=index, restarted=restarted, fps=16)
    assert [f.name for f in recordings.files("r0.a")] == ["part-0001.mp4"]  # part-0000 was finished: expired
    recordings.write("s", "r0.a", chunk_frames(9), chunk_index=0, restarted="reset", fps=16)
    files = recordings.files("r0.a")
    assert [f.name for f in files] == ["part-0002.mp4"]  # part-0001 finished at the reset and expired in turn
    assert len(decoded((tmp_path / folder_name("r0.a") / "part-0002.mp4").read_bytes())) == 2


def test_record_all_records_a_session_that_did_not_ask(tmp_path: Path) -> None:
    settings = fake_settings(record_dir=str(tmp_path), record_all=True)
    with running_server(settings) as live:
        token, received = asyncio.run(play(live.ws_url, record=False))
        files = live.get("/v1/recordings", params={"share": token}).json()["recordings"]
        assert [f["name"] for f in files] == ["part-0000.mp4", "part-0001.mp4"]
        assert metric(live, 'arstream_recording_drops_total{reason="session_bytes"}') == 0


def test_a_branch_records_its_own_files_from_its_boundary(server: LiveServer) -> None:
    async def scenario() -> tuple[str, str, list[Chunk]]:
        async with await Session.connect(server.ws_url) as source:
            ready = await source.start(codec="raw", seed=7, record=True)
            assert ready.share is not None
            for keys in (["d"], ["w"], ["a"]):
                await source.tick(keys=keys)
            _ = [chunk async for chunk in source.chunks()]
            async with await Session.connect(server.ws_url, share=ready.share.token) as branch:
                branched = await branch.start(codec="raw", branch=(ready.share.token, 1), record=True)
                assert branched.share is not None and branched.share.token != ready.share.token
                for keys in (["s"], ["s"]):
                    await branch.tick(keys=keys)
                received = [chunk async for chunk in branch.chunks()]
                assert await branch.close() == "client"
            assert await source.close() == "client"
            return ready.share.token, branched.share.token, received

    source_token, branch_token, received = asyncio.run(scenario())
    assert [chunk.chunk_index for chunk in received] == [1, 2]
    source_files = server.get("/v1/recordings", params={"share": source_token}).json()["recordings"]
    branch_files = server.get("/v1/recordings", params={"share": branch_token}).json()["recordings"]
    assert [f["name"] for f in source_files] == ["part-0000.mp4"]  # the source's recording is untouched
    assert [f["name"] for f in branch_files] == ["part-0000.mp4"]  # the branch's own, from its boundary on
    data = server.get("/v1/recordings/part-0000.mp4", params={"share": branch_token}).content
    video = decoded(data)
    frames = [frame for chunk in received for frame in chunk.frames]
    assert len(video) == len(frames)
    height, width = frames[0].shape[:2]
    worst = max(int(np.abs(a[:height, :width].astype(int) - b.astype(int)).max()) for a, b in zip(video, frames))
    assert worst <= CODEC_TOLERANCE
    source_video = decoded(server.get("/v1/recordings/part-0000.mp4", params={"share": source_token}).content)
    assert len(source_video) == 3 * len(received[0].frames)  # its three chunks, nothing of the branch's


def test_a_moved_recording_lands_within_the_peers_budgets(tmp_path: Path) -> None:
    sender = recorder(tmp_path / "r0")
    write_chunks(sender, "s", "r0.a", 2)
    [path] = sender.hand_over("s", "r0.a")  # the move is a cut: the file ends here
    size = path.stat().st_size
    metrics = own_metrics()
    peer = Recordings(tmp_path / "r1", session_bytes=10**9, total_bytes=3 * size, retention_s=3600.0,
                      quality=80, metrics=metrics)
    incoming = peer.receive({path.name: size})
    assert incoming is not None
    # Reserved while they arrive: a second move past what is left of the total comes without its files.
    assert peer.receive({path.name: 2 * size + 1}) is None
    assert drops(metrics, "total_bytes") == 1
    incoming.write(path.name, 0, memoryview(path.read_bytes()))
    incoming.keep("s", "r1.b")
    sender.moved_away("s", "r0.a")
    assert sender.files("r0.a") == [] and list((tmp_path / "r0").iterdir()) == []
    assert [(f.name, f.bytes) for f in peer.files("r1.b")] == [(path.name, size)]
    # It goes on recording there in the next file, and counts against the session's budget as if written there.
    peer.write("s", "r1.b", chunk_frames(90), chunk_index=2, restarted=None, fps=16)
    assert [f.name for f in peer.files("r1.b")] == ["part-0000.mp4", "part-0001.mp4"]
    refused = Recordings(tmp_path / "r2", session_bytes=size - 1, total_bytes=10**9, retention_s=3600.0, quality=80)
    assert refused.receive({path.name: size}) is None
    # An import that ends early leaves nothing behind and gives its reserved bytes back.
    spare = recorder(tmp_path / "r3", total_bytes=size)
    cut_short = spare.receive({path.name: size})
    assert cut_short is not None
    cut_short.write(path.name, 0, memoryview(b"half a file"))
    cut_short.discard()
    assert list((tmp_path / "r3").iterdir()) == []
    assert spare.receive({path.name: size}) is not None


def test_a_running_session_starts_and_stops_its_recording(server: LiveServer) -> None:
    async def scenario() -> tuple[str, list[list[Chunk]]]:
        async with await Session.connect(server.ws_url) as session:
            ready = await session.start(codec="raw", seed=7)
            assert ready.record is False and ready.share is not None
            spans: list[list[Chunk]] = []
            for action, ticks in ((None, 1), (True, 2), (False, 1), (True, 1)):
                if action is not None:
                    await session.record(on=action)
                for _ in range(ticks):
                    await session.tick(keys=["d"])
                spans.append([chunk async for chunk in session.chunks()])
                assert session.recording is (action is True)  # the answer came before the chunks after it
            assert await session.close() == "client"
            return ready.share.token, spans

    token, spans = asyncio.run(scenario())
    files = server.get("/v1/recordings", params={"share": token}).json()["recordings"]
    # Not recorded before `record`; stopping ends the file, and recording again begins the next one.
    assert [f["name"] for f in files] == ["part-0000.mp4", "part-0001.mp4"]
    for f, span in zip(files, (spans[1], spans[3]), strict=True):
        video = decoded(server.get(f"/v1/recordings/{f['name']}", params={"share": token}).content)
        assert len(video) == sum(len(chunk.frames) for chunk in span)


def test_record_on_a_server_that_does_not_record_is_refused_and_play_goes_on() -> None:
    from arstream.programs.client_lib import ServerError

    async def scenario(url: str) -> None:
        async with await Session.connect(url) as session:
            ready = await session.start(codec="raw")
            assert ready.record is None  # this server records nothing: ready does not say
            await session.record()
            with pytest.raises(ServerError, match="recording is off") as refused:
                await session.receive_chunk()
            assert refused.value.code == "invalid_message"
            await session.tick(keys=["d"])
            assert len([chunk async for chunk in session.chunks()]) == 1
            assert await session.close() == "client"

    with running_server(fake_settings()) as live:
        asyncio.run(scenario(live.ws_url))
