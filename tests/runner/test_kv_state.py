"""SessionKVState: block tables, sink-protected sliding window, scratch, release."""

import pytest
import torch

from arstream.runner.kv_state import PassStateError, SessionKVState, write_and_gather_rows
from arstream.runner.pool import PagedKVPool, plan_pool
from runner_fakes import tiny_spec


def make_pool(**overrides: object) -> PagedKVPool:
    spec = tiny_spec(**{"num_layers": 2, **overrides})
    return PagedKVPool(spec, plan_pool(spec, 1 << 14), torch.device("cpu"))


def chunk_kv(codes: list[float]) -> torch.Tensor:
    return torch.tensor(codes, dtype=torch.float32)[:, None, None].expand(-1, 1, 2).clone()


def commit_chunk(state: SessionKVState, codes: list[float]) -> list[float]:
    """Commit a chunk whose K (= V) rows carry ``codes``; return the keys layer 0 saw."""
    state.begin_pass(commit=True)
    seen: list[float] = []
    for layer in range(state.spec.num_layers):
        k_all, _ = state.write_and_gather(layer, chunk_kv(codes), chunk_kv(codes))
        if layer == 0:
            seen = k_all[:, 0, 0].tolist()
    state.end_pass()
    return seen


def test_sink_stays_and_window_slides_with_exact_block_ids() -> None:
    pool = make_pool()
    state = SessionKVState(pool, "a")
    commit_chunk(state, [0, 1])
    assert (state.sink["main"], state.window["main"]) == ([0], [1])
    commit_chunk(state, [2, 3])
    assert state.window["main"] == [1, 2, 3]
    commit_chunk(state, [4, 5])
    assert (state.sink["main"], state.window["main"]) == ([0], [2, 3, 4, 5])
    # block 1 went to the back of the free queue, so the next chunk gets 6 and 7
    commit_chunk(state, [6, 7])
    assert (state.sink["main"], state.window["main"]) == ([0], [4, 5, 6, 7])
    assert pool.num_used == 5
    assert (state.frame_start, state.chunk_index) == (8, 4)


def test_each_chunk_sees_sink_plus_window_plus_itself() -> None:
    state = SessionKVState(make_pool(), "a")
    seen = [commit_chunk(state, [2 * i, 2 * i + 1]) for i in range(5)]
    assert seen[0] == [0, 1]
    assert seen[2] == [0, 1, 2, 3, 4, 5]
    assert seen[4] == [0, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    ("sink", "window", "fpc", "span"),
    [
        (1, 6, 2, 7),  # sink + 4 history frames + the chunk
        (0, 6, 3, 6),  # Matrix-Game: local_attn_size 6 = 3 history frames + the chunk, no sink
        (0, 4, 3, 4),  # a history shorter than the chunk (1 frame)
        (1, 2, 2, 3),  # window = chunk: the sink and the chunk itself, no sliding history
    ],
)
def test_the_window_counts_the_current_chunk(sink: int, window: int, fpc: int, span: int) -> None:
    """A chunk attends to the sink plus the last ``window_frames`` frames including itself."""
    pool = make_pool(sink_frames=sink, window_frames=window, frames_per_chunk=fpc)
    assert pool.spec.history_window_frames == window - fpc
    assert pool.spec.resident_frames == sink + window - fpc
    state = SessionKVState(pool, "a")
    seen = [commit_chunk(state, [float(fpc * c + i) for i in range(fpc)]) for c in range(6)]
    last = 5 * fpc + fpc  # frames written after six chunks
    assert seen[-1] == [float(f) for f in range(sink)] + [float(f) for f in range(last - (span - sink), last)]
    assert max(len(s) for s in seen) == span
    assert state.history_frames() == sink + window - fpc
    state.release()
    assert pool.num_used == 0


def test_denoise_passes_use_scratch_and_do_not_advance() -> None:
    pool = make_pool()
    state = SessionKVState(pool, "a")
    commit_chunk(state, [0, 1])
    used = pool.num_used
    state.begin_pass(commit=False)
    k_all, _ = state.write_and_gather(0, chunk_kv([-5, -6]), chunk_kv([-5, -6]))
    state.end_pass()
    assert k_all[:, 0, 0].tolist() == [0, 1, -5, -6]
    assert (pool.num_used, state.frame_start) == (used, 2)
    # the poisoned scratch never reaches history
    assert commit_chunk(state, [2, 3]) == [0, 1, 2, 3]


def test_another_session_between_passes_does_not_corrupt_staging() -> None:
    pool = make_pool()
    a, b = SessionKVState(pool, "a"), SessionKVState(pool, "b")
    commit_chunk(a, [0, 1])
    commit_chunk(b, [100, 101])
    assert commit_chunk(a, [2, 3]) == [0, 1, 2, 3]
    assert commit_chunk(b, [102, 103]) == [100, 101, 102, 103]


def test_reset_at_boundary_keeps_only_the_sink_between_chunks() -> None:
    """vLLM-Omni's meaning: every chunk sees the sink and itself (2, 3, 3, 3 frames with sink 1 and 2 a chunk)."""
    pool = make_pool(reset_at_boundary=True)
    state = SessionKVState(pool, "a")
    assert commit_chunk(state, [0, 1]) == [0, 1]
    assert commit_chunk(state, [2, 3]) == [0, 2, 3]
    assert commit_chunk(state, [4, 5]) == [0, 4, 5]
    assert state.frame_positions() == [0, 6, 7]
    assert commit_chunk(state, [6, 7]) == [0, 6, 7]
    assert state.frame_start == 8
    assert pool.num_used == pool.spec.sink_frames


def test_release_returns_everything_even_mid_pass_and_twice() -> None:
    pool = make_pool()
    start = pool.num_free
    state = SessionKVState(pool, "a")
    commit_chunk(state, [0, 1])
    state.begin_pass(commit=True)
    state.release()
    state.release()
    assert pool.num_free == start
    with pytest.raises(PassStateError, match="released"):
        state.begin_pass(commit=False)


def test_out_of_order_calls_name_the_expected_call() -> None:
    state = SessionKVState(make_pool(), "a")
    with pytest.raises(PassStateError, match="expected begin_pass"):
        state.write_and_gather(0, chunk_kv([0, 1]), chunk_kv([0, 1]))
    with pytest.raises(PassStateError, match="without begin_pass"):
        state.end_pass()
    state.begin_pass(commit=False)
    with pytest.raises(PassStateError, match="expected end_pass"):
        state.begin_pass(commit=False)


def test_cross_attention_slot_is_held_and_returned() -> None:
    pool = make_pool(cross_attention_lengths={"text": 3})
    state = SessionKVState(pool, "a")
    k, v = state.cross_kv("text", layer=1)
    assert k.shape == (3, 1, 2)
    k.fill_(7.0)
    assert pool.cross_k["text"][state.cross_slot, 0, 1].eq(7.0).all()
    state.release()
    assert len(pool._free_slots) == pool.plan.session_capacity


def make_batch_pool(rows: int = 2, **overrides: object) -> PagedKVPool:
    """The pool of :func:`make_pool` with ``rows`` staging rows."""
    spec = make_pool(**overrides).spec
    return PagedKVPool(spec, plan_pool(spec, 1 << 14, max_batch_sessions=rows), torch.device("cpu"))


def tables(state: SessionKVState) -> tuple[list[int], list[int], int, int]:
    return state.sink["main"], state.window["main"], state.frame_start, state.chunk_index


def test_sessions_in_different_staging_rows_run_their_passes_interleaved() -> None:
    pool = make_batch_pool(rows=2)
    a, b = SessionKVState(pool, "a"), SessionKVState(pool, "b")
    commit_chunk(a, [0, 1])
    commit_chunk(b, [100, 101])
    a.prepare_forward(staging_row=0)
    b.prepare_forward(staging_row=1)
    a.begin_pass(commit=True)
    b.begin_pass(commit=True)
    seen_a, _ = a.write_and_gather(0, chunk_kv([2, 3]), chunk_kv([2, 3]))
    seen_b, _ = b.write_and_gather(0, chunk_kv([102, 103]), chunk_kv([102, 103]))
    assert seen_a[:, 0, 0].tolist() == [0, 1, 2, 3]
    assert seen_b[:, 0, 0].tolist() == [100, 101, 102, 103]


def test_held_chunk_joins_the_history_only_when_accepted() -> None:
    pool = make_batch_pool()
    state = SessionKVState(pool, "a")
    for i in range(3):
        commit_chunk(state, [2 * i, 2 * i + 1])
    before = tables(state)
    state.prepare_forward(staging_row=1, hold_commit=True)
    commit_chunk(state, [6, 7])
    assert state.chunk_held and tables(state) == before
    assert state.pending["main"] == [6, 7] and pool.num_used == 7
    with pytest.raises(PassStateError, match="one commit per forward"):
        state.begin_pass(commit=True)
    state.accept_chunk()
    assert tables(state) == ([0], [4, 5, 6, 7], 8, 4)
    assert pool.num_used == 5
    state.prepare_forward(staging_row=0)
    assert commit_chunk(state, [8, 9]) == [0, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("stage", ["open_pass", "held_chunk"])
def test_abort_forward_returns_the_chunk_blocks_and_keeps_the_history(stage: str) -> None:
    pool = make_batch_pool()
    state = SessionKVState(pool, "a")
    for i in range(3):
        commit_chunk(state, [2 * i, 2 * i + 1])
    before, free_before = tables(state), pool.num_free
    state.prepare_forward(staging_row=1, hold_commit=True)
    state.begin_pass(commit=True)
    for layer in range(2):
        state.write_and_gather(layer, chunk_kv([-9, -9]), chunk_kv([-9, -9]))
    if stage == "held_chunk":
        state.end_pass()
    state.abort_forward()
    assert tables(state) == before and pool.num_free == free_before
    assert not state.in_pass and not state.chunk_held
    # the retry, alone in row 0, sees the history as it was and nothing of the aborted chunk
    state.prepare_forward(staging_row=0)
    assert commit_chunk(state, [6, 7]) == [0, 2, 3, 4, 5, 6, 7]


def test_prepare_forward_refuses_a_missing_row_and_a_running_forward() -> None:
    state = SessionKVState(make_batch_pool(rows=2), "a")
    with pytest.raises(PassStateError, match="staging row 2 does not exist"):
        state.prepare_forward(staging_row=2)
    state.begin_pass(commit=False)
    with pytest.raises(PassStateError, match="inside a forward"):
        state.prepare_forward(staging_row=1)
    with pytest.raises(PassStateError, match="no held chunk"):
        state.accept_chunk()


def test_frame_positions_are_absolute_inside_the_rotary_table() -> None:
    state = SessionKVState(make_pool(), "a")
    for _ in range(4):
        commit_chunk(state, [0.0, 0.0])
    # sink frame 0, the window's 4 frames, the current chunk
    assert state.frame_positions() == [0, 4, 5, 6, 7, 8, 9]


def test_frame_positions_stay_inside_the_rotary_table_for_endless_sessions() -> None:
    """Past the table the window shifts down: distances inside it are kept, the sink stays put."""
    state = SessionKVState(make_pool(max_position_frames=10), "a")
    seen = []
    for _ in range(40):
        positions = state.frame_positions()
        seen.append(positions)
        commit_chunk(state, [0.0, 0.0])
    assert all(max(p) < 10 for p in seen)
    assert seen[-1] == [0, 4, 5, 6, 7, 8, 9]
    assert all(p[0] == 0 and p[1:] == list(range(p[1], p[1] + len(p) - 1)) for p in seen[1:])


def test_frame_positions_without_a_sink_keep_every_distance() -> None:
    state = SessionKVState(make_pool(sink_frames=0, max_position_frames=8), "a")
    for _ in range(30):
        positions = state.frame_positions()
        assert positions == list(range(positions[0], positions[0] + len(positions))) and positions[-1] < 8
        commit_chunk(state, [0.0, 0.0])
    assert state.frame_start == 60


def test_a_rotary_table_shorter_than_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="max_position_frames"):
        make_pool(max_position_frames=6)


STRIDED = {"strided_window_frames": 12, "frame_stride": 3}  # tiny_spec's 4 dense history frames, then every 3rd of 10


def strided_kept(committed: int) -> list[int]:
    """The frames a tiny_spec session with STRIDED keeps after its sink (frame 0), counted frame by frame."""
    return [f for f in range(1, committed) if f >= committed - 4 or (f >= committed - 10 and f % 3 == 0)]


def test_a_strided_tail_keeps_the_dense_window_and_the_strides_multiples_and_frees_the_rest() -> None:
    pool = make_pool(**STRIDED)
    state = SessionKVState(pool, "a")
    assert pool.spec.resident_frames == 1 + 4 + 2  # the sink, the dense window, the tail's worst phase
    held_most = 0
    for _ in range(12):
        start, visible = state.frame_start, state.history_frame_indexes()
        seen = commit_chunk(state, [float(start), float(start + 1)])  # each frame's K is its own index
        assert seen == list(map(float, visible))  # the chunk read the frames it was told it sees, in that order
        kept = strided_kept(state.frame_start)
        assert state.history_frame_indexes() == [0, *kept, state.frame_start, state.frame_start + 1]
        assert pool.num_used == 1 + len(kept)  # every other frame went back to the pool
        held_most = max(held_most, pool.num_used)
    assert held_most == pool.spec.resident_frames  # the plan's worst phase is reached, not just bounded
    state.release()
    assert pool.num_used == 0


def test_strided_frames_keep_their_distances_past_the_rotary_table() -> None:
    state = SessionKVState(make_pool(max_position_frames=13, **STRIDED), "a")
    for _ in range(30):
        indexes, positions = state.history_frame_indexes(), state.frame_positions()
        shift = indexes[-1] - positions[-1]
        assert positions[0] == 0 and positions[1:] == [i - shift for i in indexes[1:]]
        assert 0 < positions[1] and positions[-1] == min(indexes[-1], 12)
        commit_chunk(state, [0.0, 0.0])


@pytest.mark.parametrize("rows_in_order", [True, False])
def test_batched_rows_see_their_own_history_and_chunk(rows_in_order: bool) -> None:
    """write_and_gather_rows: rows in staging rows 0..n-1 (one write, views) or not (per row) give the same K/V."""
    pool = make_batch_pool(rows=3)
    states = [SessionKVState(pool, name) for name in "abc"]
    for i, state in enumerate(states):
        commit_chunk(state, [100 * i, 100 * i + 1])
    staging_rows = [0, 1, 2] if rows_in_order else [2, 0, 1]
    for state, row in zip(states, staging_rows):
        state.prepare_forward(staging_row=row)
        state.begin_pass(commit=False)
    chunk = torch.stack([chunk_kv([100 * i + 2, 100 * i + 3]) for i in range(3)])
    for layer in range(2):
        k_all, v_all = write_and_gather_rows(states, layer, chunk, chunk + 0.5)
        for i in range(3):
            assert k_all[i, :, 0, 0].tolist() == [100 * i, 100 * i + 1, 100 * i + 2, 100 * i + 3]
            assert v_all[i, :, 0, 0].tolist() == [100 * i, 100 * i + 1, 100 * i + 2.5, 100 * i + 3.5]
        # in order, the result is the staging area itself (no copy); otherwise rows are copied into place
        assert (k_all.data_ptr() == pool.staging["main"][:, layer, 0].data_ptr()) == rows_in_order
    for state in states:
        state.end_pass()


def test_shared_tables_keep_a_boundarys_blocks_after_the_window_slides_past_them() -> None:
    pool = make_pool()
    state = SessionKVState(pool, "a")
    commit_chunk(state, [0, 1])
    commit_chunk(state, [2, 3])
    boundary = state.share_tables()  # sink [0], window [1, 2, 3] at chunk 2
    assert (boundary.sink["main"], boundary.window["main"], boundary.chunks_committed) == ([0], [1, 2, 3], 2)
    assert pool.ref_counts() == {0: 2, 1: 2, 2: 2, 3: 2}
    commit_chunk(state, [4, 5])
    commit_chunk(state, [6, 7])  # the live window slid past blocks 1, 2 and 3; the boundary still holds them
    assert pool.ref_counts()[1] == 1 and pool.num_used == 8
    state.adopt_tables(boundary)  # back to chunk 2: the boundary's references become the live history's
    assert (state.sink["main"], state.window["main"], state.chunk_index, state.frame_start) == ([0], [1, 2, 3], 2, 4)
    assert pool.ref_counts() == {0: 1, 1: 1, 2: 1, 3: 1}
    assert commit_chunk(state, [8, 9]) == [0, 1, 2, 3, 8, 9]  # it reads the boundary's K/V
    state.begin_pass(commit=False)
    with pytest.raises(PassStateError, match="chunk boundary"):
        state.share_tables()
    state.end_pass()
    state.release()
    assert pool.ref_counts() == {}
