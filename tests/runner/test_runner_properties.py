"""Random session operations never leak or double-free a KV block (hypothesis).

The runner batches up to three sessions per forward, so rounds of ticks run
through the batched path too, including batches that fail before and after
their rows committed. Sessions keep rewind points, so blocks are shared
between live histories, kept boundaries and branches: every reference the
sessions hold is one the pool counts, and none is left when no session is.
Sessions are also parked (runner/parking.py: explicitly, when idle, and as
the LRU victim of a full pool, within a park budget of about two sessions)
and restored, and some restores fail: a parked session holds no block, and
the parked bytes are what the lot holds, within its budget.
"""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from arstream.models.fake import FakeForwardError
from arstream.runner.parking import RestoreFailed
from arstream.runner.types import ParkingPolicy
from arstream.runner.pool import session_frames
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import ARRunner
from arstream.runner.types import ChunkResult, RewindUnavailable, TickFailure, TickRequest
from runner_fakes import FailingImportFakePipeline, RaisingAfterCommitFakePipeline

SESSIONS = st.sampled_from(["a", "b", "c", "d", "e"])
# (session, fail, reset, close) per tick of a round
ROUND_TICKS = st.lists(st.tuples(SESSIONS, st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=6)
# how far back a rewind or branch goes from where the session is (beyond the 3 kept boundaries: refused)
BACK = st.integers(min_value=-1, max_value=5)


class ImportFailingFakePipeline(FailingImportFakePipeline, RaisingAfterCommitFakePipeline):
    """The fake that fails after a commit when asked, whose import of a model state (a restore) raises while
    ``fail_import`` is set."""


class RunnerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pipeline = ImportFailingFakePipeline(session_capacity=3, sink_frames=1, window_frames=6)
        self.now = 0.0
        self.runner = self._runner(park_budget_bytes=0)
        # room for about two parked sessions: some LRU victims park, the others end as before
        self.runner = self._runner(park_budget_bytes=2 * self.runner.plan.per_session_bytes)
        self.request_id = 0

    def _runner(self, park_budget_bytes: int) -> ARRunner:
        return ARRunner(
            self.pipeline,
            kv_budget_bytes=1 << 20,
            max_batch_sessions=3,
            rewind=RewindSchedule.last(3),
            parking=ParkingPolicy(park_budget_bytes, after_s=5.0),
            clock=lambda: self.now,
        )

    def _tick(self, session: str, **fields: object) -> None:
        self.request_id += 1
        self.runner.execute_tick(TickRequest(session_id=session, request_id=self.request_id, **fields))

    @rule(session=SESSIONS, reset=st.booleans(), close=st.booleans())
    def tick(self, session: str, reset: bool, close: bool) -> None:
        self._tick(session, reset=reset, close=close)
        assert self.runner.is_resident(session) != close

    @rule(session=SESSIONS)
    def fail(self, session: str) -> None:
        try:
            self._tick(session, controls={"fail": True})
        except FakeForwardError:
            pass
        else:
            raise AssertionError("the fake was asked to fail")
        assert not self.runner.is_resident(session)

    @rule(round_ticks=ROUND_TICKS, fault_after_commit=st.booleans())
    def execute_round(self, round_ticks: list[tuple[str, bool, bool, bool]], fault_after_commit: bool) -> None:
        ticks = []
        for session, fail, reset, close in round_ticks:
            self.request_id += 1
            controls = {"fail": True} if fail else {}
            ticks.append(TickRequest(session, self.request_id, controls=controls, reset=reset, close=close))
        self.pipeline.raise_next_batch = fault_after_commit
        try:
            results = self.runner.execute(ticks)
        finally:
            self.pipeline.raise_next_batch = False
        assert [(r.session_id, r.request_id) for r in results] == [(t.session_id, t.request_id) for t in ticks]
        for t, result in zip(ticks, results):
            assert isinstance(result, TickFailure if t.controls else ChunkResult), (t, result)
        last_of_session = {t.session_id: t for t in ticks}
        for session, t in last_of_session.items():
            if t.controls or t.close:
                assert not self.runner.is_resident(session)

    @rule(session=SESSIONS, chunks=st.integers(min_value=2, max_value=6))
    def advance(self, session: str, chunks: int) -> None:
        """Several chunks in a row: sessions get old enough for rewinds past kept boundaries and slid windows."""
        for _ in range(chunks):
            self._tick(session)

    @rule(session=SESSIONS, back=BACK, fail=st.booleans())
    def rewind(self, session: str, back: int, fail: bool) -> None:
        now = self.runner.next_chunk_index(session)
        held = self.runner.sessions.rewind_held(session) or ()
        target = now - back
        before = (self.runner.pool.ref_counts(), now, self.runner.is_resident(session))
        controls = {"fail": True} if fail else {}
        self.request_id += 1
        ticks = [TickRequest(session, self.request_id, controls=controls, rewind_to=target)]
        [result] = self.runner.execute(ticks)
        if target != now and target not in held:
            assert isinstance(result, TickFailure) and isinstance(result.error, RewindUnavailable)
            assert (self.runner.pool.ref_counts(), now, self.runner.is_resident(session)) == before
        elif fail:
            assert isinstance(result, TickFailure) and not self.runner.is_resident(session)
        else:
            # rewind_to where the session already is, is a plain tick (PROTOCOL.md): no "rewind" label
            restarted = None if target == now else "rewind"
            assert isinstance(result, ChunkResult) and result.chunk_index == target and result.restarted == restarted

    @rule(source=SESSIONS, back=BACK, new=SESSIONS)
    def branch(self, source: str, back: int, new: str) -> None:
        boundary = self.runner.next_chunk_index(source) - back
        held = self.runner.rewind_points(source) if self.runner.is_resident(source) else None
        if self.runner.is_resident(new):
            with pytest.raises(ValueError):
                self.runner.branch_session(source, boundary, new)
        elif held is None or not held[0] <= boundary <= held[1]:
            with pytest.raises(RewindUnavailable):
                self.runner.branch_session(source, boundary, new)
            assert not self.runner.is_resident(new)
        else:
            self.runner.branch_session(source, boundary, new)
            assert self.runner.next_chunk_index(new) == boundary

    @rule(session=SESSIONS)
    def close(self, session: str) -> None:
        self.runner.close_session(session)

    @rule(session=SESSIONS)
    def park(self, session: str) -> None:
        before = (self.runner.next_chunk_index(session), self.runner.sessions.rewind_held(session))
        was_held = self.runner.is_resident(session)
        parked = self.runner.park_session(session)
        assert self.runner.is_resident(session) == was_held
        assert parked == (session in self.runner.parking.sessions() and not self.runner.sessions.in_pool(session)) or not parked
        assert (self.runner.next_chunk_index(session), self.runner.sessions.rewind_held(session)) == before

    @rule(seconds=st.sampled_from([1.0, 6.0]))
    def idle(self, seconds: float) -> None:
        self.now += seconds
        self.runner.park_idle()

    @rule(session=SESSIONS)
    def restore_fails(self, session: str) -> None:
        parked = session in self.runner.parking.sessions()
        self.pipeline.fail_import = True
        try:
            self.request_id += 1
            [result] = self.runner.execute([TickRequest(session, self.request_id)])
        finally:
            self.pipeline.fail_import = False
        if parked:
            assert isinstance(result, TickFailure) and isinstance(result.error, RestoreFailed)
            assert not self.runner.is_resident(session)
        else:
            assert isinstance(result, ChunkResult)

    @rule(session=SESSIONS)
    def reset(self, session: str) -> None:
        self.runner.reset_session(session)

    @invariant()
    def every_reference_is_counted_once_by_the_pool(self) -> None:
        pool = self.runner.pool
        held: Counter[int] = Counter()
        for sid in self.runner.resident_sessions():
            state = self.runner.sessions.state(sid)
            assert state is not None
            live = state.held_blocks()
            assert len(live) == len(set(live))  # a session's live history lists a block once
            held.update(live)
            held.update(self.runner.rewinds.blocks(sid))
        assert dict(held) == pool.ref_counts()
        assert pool.num_free + len(held) == pool.num_blocks
        assert len(set(pool._free)) == pool.num_free
        assert not set(pool._free) & set(held)

    @invariant()
    def kept_boundaries_stay_within_the_plan(self) -> None:
        # shared or not, the resident sessions' blocks never exceed what the plan counts per session
        per_session = session_frames(self.runner.spec, self.runner.rewind)
        assert self.runner.pool.num_used <= len(self.runner.resident_sessions()) * per_session

    @invariant()
    def no_forward_is_left_open_between_calls(self) -> None:
        for sid in self.runner.resident_sessions():
            state = self.runner.sessions.state(sid)
            assert state is not None and not state.in_pass and not state.chunk_held
            assert all(not state.pending[b] for b in state.spec.branch_names)

    @invariant()
    def no_resident_session_means_start_up_free_count(self) -> None:
        if not self.runner.resident_sessions():
            assert self.runner.pool.num_free == self.runner.blocks_free_at_start

    @invariant()
    def never_over_capacity(self) -> None:
        assert len(self.runner.resident_sessions()) <= self.runner.session_capacity

    @invariant()
    def parked_sessions_hold_no_blocks_and_their_bytes_are_counted(self) -> None:
        runner = self.runner
        parked = runner.parking.sessions()
        assert not set(parked) & set(runner.resident_sessions())
        lot = [runner.sessions.lot.get(s) for s in parked]
        stats = runner.stats()
        assert stats.parked_bytes == sum(p.nbytes for p in lot if p is not None) <= runner.sessions.lot.budget_bytes
        assert stats.sessions_parked == len(parked) <= runner.parking.capacity
        assert (stats.blocks_used, stats.blocks_free) == (runner.pool.num_used, runner.pool.num_free)


RunnerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestRunnerMachine = RunnerMachine.TestCase
