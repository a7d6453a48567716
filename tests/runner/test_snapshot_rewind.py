"""Rewind points in a snapshot (runner/snapshot_rewind.py): carried with a move, kept within the peer's room.

A fake-kv session (CPU, a window of 2 chunks) plays past its window, so its
older points hold blocks the live history no longer lists. Streamed into a
second runner it holds the same points, and a rewind there gives the frames
the source's gives. A peer with too few free blocks keeps the newest points
and drops the oldest; one with rewind off keeps none; an import cut short in
the points' bytes leaves the pool as it was. No server.
"""

from __future__ import annotations

from typing import Any

import pytest

from arstream.models.fake import FakeKVPipeline
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import runner_for_sessions
from arstream.runner.snapshot import SnapshotError
from arstream.runner.snapshot_stream import import_pieces, parse_snapshot, plan_export, snapshot_bytes
from arstream.runner.types import TickRequest

SESSION = "s-00000000000000bb"
PLAYED = 7
SCHEDULE = RewindSchedule.last(8)


def runner(rewind: RewindSchedule | None = SCHEDULE) -> Any:
    return runner_for_sessions(FakeKVPipeline(window_frames=4), 2, rewind=rewind)


def played() -> Any:
    source = runner()
    for i in range(PLAYED):
        source.execute_tick(TickRequest(session_id=SESSION, request_id=i, controls={"keys": [("w", "a", "s", "d")[i % 4]]}))
    return source


def snapshot_of(source: Any) -> bytes:
    return b"".join(plan_export(source, SESSION, protocol_version=1).chunks())


def stream_into(target: Any, data: bytes, *, stop_after: int | None = None) -> Any:
    end = len(data) if stop_after is None else stop_after
    reads = (data[start : min(start + 50, end)] for start in range(0, end, 50))
    return import_pieces(target, SESSION, reads, max_bytes=len(data), protocol_version=1, finish=stop_after is None)


def rewind(at: Any, index: int) -> Any:
    return at.execute_tick(TickRequest(session_id=SESSION, request_id=100, rewind_to=index)).frames


def test_a_streamed_session_keeps_its_points_and_a_rewind_there_equals_the_source() -> None:
    source, target = played(), runner()
    free = target.stats().blocks_free
    held = source.sessions.rewind_held(SESSION)
    assert held[0] == 0 and len(held) == PLAYED + 1
    job = stream_into(target, snapshot_of(source))
    assert (job.rewind_carried, job.rewind_kept) == (PLAYED, PLAYED)
    assert target.sessions.rewind_held(SESSION) == held
    assert (rewind(target, 1) == rewind(source, 1)).all()  # boundary 1's window slid out of the live one
    target.close_session(SESSION)
    assert target.stats().blocks_free == free


def test_a_peer_without_room_for_every_point_keeps_the_newest() -> None:
    source, target = played(), runner()
    free = target.stats().blocks_free
    data = snapshot_of(source)
    live_frames = 4  # the live window (fake-kv has no sink)
    taken = target.pool.allocate(free - live_frames - 1)  # room for the live history and one more block
    job = stream_into(target, data)
    held = target.sessions.rewind_held(SESSION)
    assert 0 < job.rewind_kept < job.rewind_carried == PLAYED
    assert held == source.sessions.rewind_held(SESSION)[-len(held):]  # the oldest went first
    assert (rewind(target, held[0]) == rewind(source, held[0])).all()
    with pytest.raises(Exception, match="not held"):
        target.execute_tick(TickRequest(session_id=SESSION, request_id=101, rewind_to=0))
    target.close_session(SESSION)
    target.pool.free(taken)
    assert target.stats().blocks_free == free


def test_a_peer_with_rewind_off_takes_the_session_and_no_point() -> None:
    source, target = played(), runner(rewind=None)
    free = target.stats().blocks_free
    job = stream_into(target, snapshot_of(source))
    assert (job.rewind_carried, job.rewind_kept) == (PLAYED, 0)
    mine = target.execute_tick(TickRequest(session_id=SESSION, request_id=PLAYED)).frames
    assert (mine == source.execute_tick(TickRequest(session_id=SESSION, request_id=PLAYED)).frames).all()
    target.close_session(SESSION)
    assert target.stats().blocks_free == free


def test_an_import_cut_short_in_the_points_bytes_leaves_the_pool_as_it_was() -> None:
    source, target = played(), runner()
    free = target.stats().blocks_free
    data = snapshot_of(source)
    job = stream_into(target, data, stop_after=len(data) - 100)  # the points' tensors come last
    assert target.stats().blocks_free < free
    job.abort(target)
    assert target.stats().blocks_free == free and target.resident_sessions() == []


def test_a_point_whose_window_is_not_what_its_counter_keeps_is_refused_without_leaking() -> None:
    """A strided tail: each point's tables are sparse, and their frames a function of the point's counter; a point
    a frame short is refused before anything is placed."""
    def strided(rewind: RewindSchedule | None = SCHEDULE) -> Any:
        pipeline = FakeKVPipeline(window_frames=4, strided_window_frames=12, frame_stride=3)
        return runner_for_sessions(pipeline, 2, rewind=rewind)

    source = strided()
    for i in range(PLAYED):
        source.execute_tick(TickRequest(session_id=SESSION, request_id=i))
    snapshot = parse_snapshot(snapshot_of(source))
    snapshot.header["rewind"]["boundaries"][-2]["tables"]["window"]["main"].pop(0)
    target = strided()
    free = target.stats().blocks_free
    with pytest.raises(SnapshotError, match="rewind section is malformed.*window frames where the spec keeps"):
        stream_into(target, snapshot_bytes(snapshot))
    assert target.stats().blocks_free == free and not target.is_resident(SESSION)
