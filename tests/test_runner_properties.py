"""Random session operations never leak or double-free a KV block (hypothesis).

The runner batches up to three sessions per forward, so rounds of ticks run
through the batched path too, including batches that fail before and after
their rows committed.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from arstream.models.fake import FakeForwardError
from arstream.runner.runner import ARRunner
from arstream.runner.types import ChunkResult, TickFailure, TickRequest
from runner_fakes import RaisingAfterCommitFakePipeline

SESSIONS = st.sampled_from(["a", "b", "c", "d", "e"])
# (session, fail, reset, close) per tick of a round
ROUND_TICKS = st.lists(st.tuples(SESSIONS, st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=6)


class RunnerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pipeline = RaisingAfterCommitFakePipeline(session_capacity=3, sink_frames=1, window_frames=6)
        self.runner = ARRunner(self.pipeline, kv_budget_bytes=1 << 20, max_batch_sessions=3)
        self.request_id = 0

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

    @rule(session=SESSIONS)
    def close(self, session: str) -> None:
        self.runner.close_session(session)

    @rule(session=SESSIONS)
    def reset(self, session: str) -> None:
        self.runner.reset_session(session)

    @invariant()
    def blocks_are_owned_exactly_once(self) -> None:
        pool = self.runner.pool
        held = [b for sid in self.runner.resident_sessions() for b in self.runner._sessions[sid].held_blocks()]
        assert len(held) == len(set(held))
        assert sorted(held) == sorted(pool._allocated)
        assert pool.num_free + len(held) == pool.num_blocks
        assert len(set(pool._free)) == pool.num_free

    @invariant()
    def no_forward_is_left_open_between_calls(self) -> None:
        for state in self.runner._sessions.values():
            assert not state.in_pass and not state.chunk_held
            assert all(not state.pending[b] for b in state.spec.branch_names)

    @invariant()
    def no_resident_session_means_start_up_free_count(self) -> None:
        if not self.runner.resident_sessions():
            assert self.runner.pool.num_free == self.runner.blocks_free_at_start

    @invariant()
    def never_over_capacity(self) -> None:
        assert len(self.runner.resident_sessions()) <= self.runner.session_capacity


RunnerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestRunnerMachine = RunnerMachine.TestCase
