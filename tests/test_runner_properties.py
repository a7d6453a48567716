"""Random session operations never leak or double-free a KV block (hypothesis)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from models.fake import FakeForwardError, FakeKVPipeline
from runner.runner import ARRunner
from runner.types import TickRequest

SESSIONS = st.sampled_from(["a", "b", "c", "d", "e"])


class RunnerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pipeline = FakeKVPipeline(session_capacity=3, sink_frames=1, window_frames=4)
        self.runner = ARRunner(self.pipeline, kv_budget_bytes=1 << 20)
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
    def no_resident_session_means_start_up_free_count(self) -> None:
        if not self.runner.resident_sessions():
            assert self.runner.pool.num_free == self.runner.blocks_free_at_start

    @invariant()
    def never_over_capacity(self) -> None:
        assert len(self.runner.resident_sessions()) <= self.runner.session_capacity


RunnerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestRunnerMachine = RunnerMachine.TestCase
