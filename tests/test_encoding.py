"""The encoder pool: ordered lanes, per-session encoders, and a worker that forwards while frames encode."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from arstream.app import encoding
from arstream.app.codecs import FrameEncoder
from arstream.app.encoding import EncoderPool, OrderedLanes
from arstream.app.protocol import TickMessage
from arstream.app.worker import ModelWorker, OutcomeKind, TickOutcome
from arstream.models.fake import FakeKVPipeline
from servers import fake_settings, make_session, running_server, session_client, with_worker

GUARD_S = 30.0  # hang guard only


# ---- ordered lanes ------------------------------------------------------------------------------


def test_a_lane_runs_its_tasks_one_at_a_time_in_order() -> None:
    lanes = OrderedLanes(4, name="test-lanes")
    seen: list[int] = []
    running = 0
    overlap = False
    lock = threading.Lock()
    done = threading.Event()

    def task(index: int) -> Callable[[], None]:
        def run() -> None:
            nonlocal running, overlap
            with lock:
                running += 1
                overlap = overlap or running > 1
            time.sleep(0.001)
            with lock:
                running -= 1
                seen.append(index)
            if index == 49:
                done.set()

        return run

    for index in range(50):
        lanes.submit("a", task(index))
    assert done.wait(GUARD_S)
    lanes.shutdown(wait=True)
    assert seen == list(range(50))
    assert not overlap


def test_lanes_of_different_sessions_run_side_by_side() -> None:
    lanes = OrderedLanes(2, name="test-lanes")
    a_started, b_ran = threading.Event(), threading.Event()
    release_a = threading.Event()

    def slow_a() -> None:
        a_started.set()
        release_a.wait(GUARD_S)

    lanes.submit("a", slow_a)
    assert a_started.wait(GUARD_S)
    lanes.submit("b", b_ran.set)
    # b runs while a's task still holds its thread: lanes do not wait for each other.
    assert b_ran.wait(GUARD_S)
    release_a.set()
    lanes.shutdown(wait=True)


def test_a_failing_task_does_not_stall_its_lane(caplog: pytest.LogCaptureFixture) -> None:
    lanes = OrderedLanes(1, name="test-lanes")
    after = threading.Event()

    def fail() -> None:
        raise RuntimeError("encoder bug")

    lanes.submit("a", fail)
    lanes.submit("a", after.set)
    assert after.wait(GUARD_S)
    lanes.shutdown(wait=True)
    assert "encoder bug" in caplog.text
    assert lanes.busy_lanes() == 0


def test_nothing_runs_after_shutdown() -> None:
    lanes = OrderedLanes(1, name="test-lanes")
    ran = threading.Event()
    lanes.shutdown(wait=True)
    lanes.submit("a", ran.set)
    assert not ran.is_set() and lanes.busy_lanes() == 0
    with pytest.raises(ValueError, match="at least 1 thread"):
        OrderedLanes(0, name="test-lanes")


def test_lane_threads_run_at_the_given_niceness_and_the_caller_keeps_its_own() -> None:
    import os

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []
    lanes = OrderedLanes(2, name="test-lanes", nice=5)
    done = threading.Event()
    lanes.submit("a", lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    def note_priority_and_finish() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        done.set()

    lanes.submit("b", note_priority_and_finish)
    assert done.wait(GUARD_S)
    lanes.shutdown(wait=True)
    assert seen and all(nice == min(own + 5, 19) for nice in seen), (own, seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


# ---- per-session encoders ------------------------------------------------------------------------


class CountingEncoder(FrameEncoder):
    """A JPEG/raw encoder that notes which instance encoded what, and when it was closed."""

    made: list[CountingEncoder] = []

    def __init__(self, codec: str, quality: int) -> None:
        super().__init__(codec, quality)
        self.chunks: list[int] = []
        self.closed = False
        CountingEncoder.made.append(self)

    def encode(self, frames: np.ndarray, *, chunk_index: int, tick_id: int) -> list[bytes]:
        self.chunks.append(chunk_index)
        return super().encode(frames, chunk_index=chunk_index, tick_id=tick_id)

    def close(self) -> None:
        self.closed = True


def test_a_new_stream_starts_at_rollout_start_codec_change_and_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    CountingEncoder.made = []
    monkeypatch.setattr(encoding, "new_encoder", CountingEncoder)
    pool = EncoderPool(2)
    frames = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    done = threading.Event()

    def encode(chunk_index: int, codec: str = "raw") -> Callable[[], None]:
        def step() -> None:
            pool.encode("s", frames, codec=codec, quality=80, chunk_index=chunk_index, tick_id=chunk_index)

        return step

    for step in (encode(0), encode(1), encode(2), encode(0), encode(1), encode(2, "jpeg")):
        pool.submit("s", step)
    pool.restart_stream("s")
    pool.submit("s", encode(3, "jpeg"))
    pool.submit("s", done.set)
    assert done.wait(GUARD_S)
    assert [e.chunks for e in CountingEncoder.made] == [[0, 1, 2], [0, 1], [2], [3]]
    assert [e.closed for e in CountingEncoder.made] == [True, True, True, False]
    pool.shutdown(wait=True)
    assert CountingEncoder.made[-1].closed and pool.sessions_with_encoders() == 0


# ---- the worker forwards while the encoder pool encodes ------------------------------------------


class GatedEncoder(FrameEncoder):
    """Blocks session ``s-slow``'s encoding until :attr:`gate` opens; notes the encoding threads."""

    gate = threading.Event()
    threads: set[str] = set()

    def encode(self, frames: np.ndarray, *, chunk_index: int, tick_id: int) -> list[bytes]:
        GatedEncoder.threads.add(threading.current_thread().name)
        if frames[0, 0, 0, 2] == 1:  # the fake's blue channel: the "w" key held
            assert GatedEncoder.gate.wait(GUARD_S)
        return super().encode(frames, chunk_index=chunk_index, tick_id=tick_id)


class CountingFakePipeline(FakeKVPipeline):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.forwards = 0

    def generate_chunk(self, tick: Any) -> np.ndarray:
        self.forwards += 1
        return super().generate_chunk(tick)


def test_the_worker_runs_the_next_forward_while_a_chunk_encodes(monkeypatch: pytest.MonkeyPatch) -> None:
    GatedEncoder.gate = threading.Event()
    GatedEncoder.threads = set()
    monkeypatch.setattr(encoding, "new_encoder", GatedEncoder)
    pipeline = CountingFakePipeline()

    async def body(worker: ModelWorker, outcomes: asyncio.Queue[TickOutcome]) -> list[tuple[str, int]]:
        slow, fast = make_session("s-slow"), make_session("s-fast")
        warm = pipeline.forwards
        for tick_id in range(3):
            worker.submit(slow.accept_tick(TickMessage(type="tick", tick_id=tick_id, controls={"keys": ["w"]})))
        worker.submit(fast.accept_tick(TickMessage(type="tick", tick_id=0)))
        # The fast session's chunk arrives while the slow session's first chunk is still encoding...
        first = await asyncio.wait_for(outcomes.get(), GUARD_S)
        assert first.job.session.id == "s-fast"
        # ...and the worker has run every forward meanwhile: encoding is not on its thread.
        while pipeline.forwards < warm + 4:
            await asyncio.sleep(0.01)
        GatedEncoder.gate.set()
        rest = [await asyncio.wait_for(outcomes.get(), GUARD_S) for _ in range(3)]
        assert all(o.kind is OutcomeKind.CHUNK for o in [first, *rest])
        return [(o.job.session.id, o.chunk_index) for o in rest]

    order = asyncio.run(with_worker(pipeline, body, encode_threads=2))
    assert order == [("s-slow", 0), ("s-slow", 1), ("s-slow", 2)]  # in order per session
    assert GatedEncoder.threads and all(name.startswith("arstream-encoder") for name in GatedEncoder.threads)


def test_many_batched_sessions_each_receive_their_chunks_in_order() -> None:
    settings = fake_settings(max_batch_sessions=8, encode_threads=3, max_sessions_per_client=None)
    with running_server(settings, FakeKVPipeline(width=64, height=48)) as server:

        async def one_session(ticks: int) -> list[tuple[int, int, int]]:
            seen: list[tuple[int, int, int]] = []
            async with session_client(server.ws_url, start={"codec": "jpeg"}) as client:
                for tick_id in range(4):
                    await client.send(type="tick", tick_id=tick_id)
                for tick_id in range(4, ticks + 4):
                    chunk, frames = await client.recv_chunk()
                    seen.extend((chunk["tick_id"], chunk["chunk_index"], h.frame_index) for h, _ in frames)
                    if tick_id < ticks:
                        await client.send(type="tick", tick_id=tick_id)
            return seen

        async def scenario() -> list[list[tuple[int, int, int]]]:
            return list(await asyncio.gather(*(one_session(12) for _ in range(8))))

        for seen in asyncio.run(scenario()):
            assert seen == [(i, i, f) for i in range(12) for f in range(2)]
