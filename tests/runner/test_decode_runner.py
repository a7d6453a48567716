"""The runner's split decode and the decoder-state bookkeeping, on the fake pipeline (no server, no threads but one)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from runner_fakes import FAKE_KV_BUDGET_BYTES, tick

from arstream.models.fake import FakeKVPipeline
from arstream.runner.decode_states import DecoderStateError, DecoderStates
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.types import NOT_DECODED, ChunkResult, TickFailure

# a hang guard for the one wait on another thread, not a speed check
GUARD_S = 30.0


def _runner(split: bool, batch: int = 4) -> tuple[ARRunner, FakeKVPipeline]:
    pipeline = FakeKVPipeline()
    return ARRunner(pipeline, kv_budget_bytes=FAKE_KV_BUDGET_BYTES, max_batch_sessions=batch, split_decode=split), pipeline


def _chunks(results: Sequence[object]) -> list[ChunkResult]:
    chunks = [r for r in results if isinstance(r, ChunkResult)]
    assert len(chunks) == len(results), results
    return chunks


def test_split_chunks_come_back_undecoded_and_decode_to_the_serial_frames() -> None:
    split, _ = _runner(split=True)
    serial, _ = _runner(split=False)
    for round_ in range(5):
        ticks = [tick(s, round_, controls={"keys": [k]}) for s, k in (("a", "w"), ("b", "d"), ("c", "s"))]
        pending = _chunks(split.execute(ticks))
        assert all(r.pending is not None and r.frames is NOT_DECODED for r in pending)
        decoded = _chunks(split.decode_chunks(pending))
        for got, want in zip(decoded, _chunks(serial.execute(ticks))):
            assert got.pending is None and got.chunk_index == want.chunk_index == round_
            np.testing.assert_array_equal(got.frames, want.frames)


def test_a_failed_decode_in_a_round_fails_only_its_session_and_fail_session_frees_its_blocks() -> None:
    runner, pipeline = _runner(split=True)
    free = runner.pool.num_free
    for round_ in range(2):
        results = _chunks(runner.execute([tick(s, round_) for s in "ab"]))
        if round_ == 1:
            results = [results[0], _chunks(runner.execute([tick("c", 0, controls={"fail_decode": True})]))[0], results[1]]
            decoded = runner.decode_chunks(results)
        else:
            decoded = runner.decode_chunks(results)
    assert isinstance(decoded[1], TickFailure) and "fail the decode of session(s) c" in str(decoded[1].error)
    assert [r.session_id for r in decoded if isinstance(r, ChunkResult)] == ["a", "b"]
    assert runner.is_resident("c")  # released by the runner's thread, not the decode's
    runner.fail_session("c")
    assert not runner.is_resident("c") and runner.stats().failures_total == 1
    # the others decode on from their own states; every block comes back
    _chunks(runner.decode_chunks(_chunks(runner.execute([tick(s, 2) for s in "ab"]))))
    for s in "ab":
        runner.close_session(s)
    assert runner.pool.num_free == free and pipeline.decoder_states.sessions() == []


def test_execute_tick_decodes_in_line_and_a_failed_decode_releases_the_session() -> None:
    runner, _ = _runner(split=True, batch=1)
    free = runner.pool.num_free
    assert runner.execute_tick(tick("a", 0)).frames.shape[0] == 2
    with pytest.raises(RuntimeError, match="fail the decode"):
        runner.execute_tick(tick("a", 1, controls={"fail_decode": True}))
    assert not runner.is_resident("a") and runner.pool.num_free == free


def test_a_decode_out_of_order_is_refused() -> None:
    states: DecoderStates[int] = DecoderStates()
    states.begin("s", 0)
    states.finish("s", 0, 10)
    states.begin("s", 1)
    states.begin("s", 2)
    with pytest.raises(DecoderStateError, match="chunk 2 decodes from the state after chunk 1, found the state after chunk 0"):
        states.before("s", 2)
    assert states.before("s", 1) == 10 and states.before("s", 0) is None


def test_a_reset_during_a_decode_keeps_it_from_storing_its_state() -> None:
    states: DecoderStates[int] = DecoderStates()
    states.begin("s", 0)
    states.finish("s", 0, 1)
    states.begin("s", 1)  # decoding...
    states.drop("s")  # ...when the session resets (or closes)
    states.finish("s", 1, 2)
    assert states.settled("s") is None and states.sessions() == []


def test_an_export_waits_for_the_decode_in_flight_and_sees_its_whole_chunk() -> None:
    states: DecoderStates[int] = DecoderStates()
    states.begin("s", 0)
    states.finish("s", 0, 1)
    states.begin("s", 1)
    seen: list[object] = []
    exporter = threading.Thread(target=lambda: seen.append(states.settled("s")))
    exporter.start()
    exporter.join(0.05)  # still waiting: the decode of chunk 1 has not finished
    assert exporter.is_alive() and seen == []
    states.finish("s", 1, 2)
    exporter.join(GUARD_S)
    assert seen == [(2, 2)]


def test_a_rewind_point_taken_while_the_chunk_before_it_decodes_gets_that_chunks_decoder_state() -> None:
    split = ARRunner(FakeKVPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES, rewind=RewindSchedule.last(4), split_decode=True)
    serial = ARRunner(FakeKVPipeline(), kv_budget_bytes=FAKE_KV_BUDGET_BYTES, rewind=RewindSchedule.last(4))
    first = _chunks(split.execute([tick("a", 0, controls={"keys": ["w"]})]))
    # chunk 1's forward runs while chunk 0 is still to decode (the worker's overlap): boundary 1 is taken then
    second = _chunks(split.execute([tick("a", 1, controls={"keys": ["d"]})]))
    _chunks(split.decode_chunks(first))
    split.complete_boundaries()
    _chunks(split.decode_chunks(second))
    for t in (tick("a", 0, controls={"keys": ["w"]}), tick("a", 1, controls={"keys": ["d"]})):
        serial.execute_tick(t)
    again = tick("a", 2, controls={"keys": ["s"]}, rewind_to=1)
    got, want = split.execute_tick(again), serial.execute_tick(again)
    assert got.chunk_index == want.chunk_index == 1
    np.testing.assert_array_equal(got.frames, want.frames)
    # the boundary carried the decoder state after chunk 0: the rewound chunk decoded from it, in order
    assert split.pipeline.decoder_states.settled("a") == (2, 2)  # type: ignore[attr-defined]


def test_a_session_evicted_while_its_chunk_decodes_keeps_no_decoder_state() -> None:
    pipeline = FakeKVPipeline()
    runner = runner_for_sessions(pipeline, 2, split_decode=True)
    free = runner.pool.num_free
    first = _chunks(runner.execute([tick("a", 0), tick("b", 0)]))
    _chunks(runner.decode_chunks(_chunks(runner.execute([tick("c", 0)]))))  # a third session: "a" is evicted...
    assert not runner.is_resident("a")
    decoded = _chunks(runner.decode_chunks(first))  # ...while its chunk 0 was still to decode
    assert [r.session_id for r in decoded] == ["a", "b"]  # the chunk it had made is still delivered
    assert pipeline.decoder_states.sessions() == ["b", "c"]  # but the evicted session's state is not kept
    for s in "bc":
        runner.close_session(s)
    assert runner.pool.num_free == free and pipeline.decoder_states.sessions() == []
