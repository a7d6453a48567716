"""The model worker on its own: one thread for every runner call, eviction reporting, bounded queue."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pytest

from arstream.app.protocol import InputMessage, TickMessage
from arstream.app.session import Session
from arstream.app.worker import ModelWorker, OutcomeKind, QueueBoundExceeded, TickOutcome
from arstream.models.fake import FakeKVPipeline
from arstream.runner.runner import ARRunner
from arstream.runner.types import TickRequest, TickResult
from servers import GatedFakePipeline, fake_settings, make_session, running_server, session_client, with_worker

WORKER_THREAD = "arstream-model-worker"


class ThreadRecordingFakePipeline(FakeKVPipeline):
    """FakeKVPipeline that notes which thread made each pipeline call."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.calls: list[tuple[str, str]] = []

    def _note(self, call: str) -> None:
        self.calls.append((call, threading.current_thread().name))

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        self._note("generate_chunk")
        return super().generate_chunk(tick)

    def reset_session(self, session_id: str) -> None:
        self._note("reset_session")
        super().reset_session(session_id)

    def close_session(self, session_id: str) -> None:
        self._note("close_session")
        super().close_session(session_id)

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        self._note("warmup_requests")
        return super().warmup_requests(session_id)


def test_every_pipeline_call_runs_on_the_worker_thread() -> None:
    pipeline = ThreadRecordingFakePipeline()
    with running_server(fake_settings(), pipeline) as server:
        start_free = server.stats()["kv"]["blocks_free"]

        async def scenario() -> None:
            async with session_client(server.ws_url, start={}) as client:
                for tick_id, reset in ((0, False), (1, True), (2, False)):
                    await client.send(type="tick", tick_id=tick_id, reset=reset)
                    await client.recv_chunk()
                client.abort()

        asyncio.run(scenario())
        server.wait_for_stats(lambda s: s["kv"]["blocks_free"] == start_free and s["kv"]["sessions_resident"] == 0)
    kinds = {call for call, _ in pipeline.calls}
    assert {"generate_chunk", "reset_session", "close_session", "warmup_requests"} <= kinds
    assert {thread for _, thread in pipeline.calls} == {WORKER_THREAD}


def test_a_session_whose_kv_was_evicted_reports_restarted_evicted() -> None:
    """Capacity 1 and sessions submitted straight to the worker (no admission) force an LRU eviction."""

    async def body(worker: ModelWorker, outcomes: asyncio.Queue[TickOutcome]) -> list[tuple[str, int, Any]]:
        a, b = make_session("s-a"), make_session("s-b")
        seen = []
        for session, tick_id in ((a, 0), (a, 1), (b, 0), (a, 2)):
            worker.submit(session.accept_tick(TickMessage(type="tick", tick_id=tick_id)))
            outcome = await asyncio.wait_for(outcomes.get(), 30)
            assert outcome.kind is OutcomeKind.CHUNK
            seen.append((outcome.job.session.id, outcome.chunk_index, outcome.restarted))
        assert worker.runner_stats is not None and worker.runner_stats.evictions_total == 2
        return seen

    seen = asyncio.run(with_worker(FakeKVPipeline(session_capacity=1), body))
    assert seen == [("s-a", 0, None), ("s-a", 1, None), ("s-b", 0, None), ("s-a", 0, "evicted")]


def test_session_position_says_where_a_rollout_continues_and_whether_it_was_evicted() -> None:
    """What a resume ticket is built from (app/resume.py): next chunk index, failed, evicted."""

    async def body(worker: ModelWorker, outcomes: asyncio.Queue[TickOutcome]) -> list[Any]:
        a, c, d = make_session("s-a"), make_session("s-c"), make_session("s-d")

        async def run(session: Session, tick_id: int, controls: dict[str, Any] | None = None) -> None:
            worker.submit(session.accept_tick(TickMessage(type="tick", tick_id=tick_id, controls=controls)))
            await asyncio.wait_for(outcomes.get(), 30)

        positions = [await worker.session_position("s-a")]  # never ran: a new rollout, nothing lost
        await run(a, 0)
        await run(a, 1)
        positions.append(await worker.session_position("s-a"))  # two chunks in
        await run(c, 0)  # capacity 2: a and c
        await run(d, 0, {"fail": True})  # d's slot came from a (least recently used); then d failed
        positions.append(await worker.session_position("s-d"))  # released by its failure, not evicted
        positions.append(await worker.session_position("s-a"))
        for session_id in ("s-a", "s-c", "s-d"):
            worker.drop_session(session_id)
        return positions

    positions = asyncio.run(with_worker(FakeKVPipeline(session_capacity=2), body))
    assert [(p.next_chunk_index, p.failed, p.evicted) for p in positions] == [
        (0, False, False),
        (2, False, False),
        (0, True, False),
        (0, False, True),
    ]


def test_drop_ticks_keeps_the_kv_and_returns_the_queued_ticks() -> None:
    pipeline = GatedFakePipeline()

    async def body(worker: ModelWorker, outcomes: asyncio.Queue[TickOutcome]) -> tuple[list[int], int, int]:
        session = make_session("s-a")
        for tick_id in range(3):
            worker.submit(session.accept_tick(TickMessage(type="tick", tick_id=tick_id)))
        await asyncio.to_thread(pipeline.waiting.wait, 30)  # tick 0 runs, 1 and 2 wait
        dropped = [job.tick_id for job in worker.drop_ticks("s-a")]
        depth = worker.queue_depth
        pipeline.gate.set()
        await asyncio.wait_for(outcomes.get(), 30)
        position = await worker.session_position("s-a")
        worker.drop_session("s-a")
        return dropped, depth, position.next_chunk_index

    assert asyncio.run(with_worker(pipeline, body)) == ([1, 2], 0, 1)


def test_queue_is_bounded_by_credits() -> None:
    pipeline = GatedFakePipeline()

    async def body(worker: ModelWorker, outcomes: asyncio.Queue[TickOutcome]) -> None:
        session = make_session("s-a")
        session.max_pending_ticks = 10  # a buggy caller that ignores the configured credits
        jobs = [session.accept_tick(TickMessage(type="tick", tick_id=i)) for i in range(6)]
        try:
            with pytest.raises(QueueBoundExceeded):
                for job in jobs:  # the gate holds the first forward, so at most one job leaves the queue
                    worker.submit(job)
        finally:
            worker.drop_session("s-a")
            pipeline.gate.set()

    asyncio.run(with_worker(pipeline, body))


class ExecuteRaisingFakeRunner(ARRunner):
    """A runner whose execute raises outside any forward, as a runner bug would."""

    def execute(self, ticks: Sequence[TickRequest]) -> list[TickResult]:
        raise RuntimeError("runner bug")


def test_a_runner_fault_outside_any_forward_still_answers_every_tick() -> None:
    async def body(worker: ModelWorker, outcomes: asyncio.Queue[TickOutcome]) -> list[tuple[OutcomeKind, str]]:
        worker.submit(make_session("s-a").accept_tick(TickMessage(type="tick", tick_id=0)))
        outcome = await asyncio.wait_for(outcomes.get(), 30)
        return [(outcome.kind, outcome.error)]

    seen = asyncio.run(with_worker(FakeKVPipeline(), body, runner_class=ExecuteRaisingFakeRunner))
    assert seen == [(OutcomeKind.INTERNAL, "runner failed: RuntimeError: runner bug")]


def test_a_session_runs_at_most_its_chunks_ahead_and_the_next_chunk_takes_the_newest_input() -> None:
    """Four ticks queued, two chunks made and not written: the third starts only when a credit comes back, with
    the input that arrived meanwhile (an input binds when its chunk starts, however many ticks were queued)."""

    async def body(worker: ModelWorker, outcomes: asyncio.Queue[TickOutcome]) -> tuple[int, list[list[int]]]:
        session = make_session("s-a")
        session.chunks_ahead_limit = 2
        for tick_id in range(4):
            worker.submit(session.accept_tick(TickMessage(type="tick", tick_id=tick_id)))
        made = [await asyncio.wait_for(outcomes.get(), 30) for _ in range(2)]
        held_back = worker.queue_depth  # nothing writes these two chunks, so no credit comes back
        session.accept_event(InputMessage(type="input", event_id=1, controls={"keys": ["w"]}))
        for _ in range(2):
            session.release_credit()  # as the writer does once a chunk is written
            made.append(await asyncio.wait_for(outcomes.get(), 30))
        worker.drop_session("s-a")
        return held_back, [outcome.applied_event_ids for outcome in made]

    held_back, applied = asyncio.run(with_worker(FakeKVPipeline(), body))
    assert held_back == 2
    assert applied == [[], [], [1], []]
