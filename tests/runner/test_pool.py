"""PagedKVPool and plan_pool as plain data structures, with exact block ids."""

from typing import Any

import pytest
import torch

from arstream.runner.pool import (
    BlockStateError,
    PagedKVPool,
    PoolBudgetError,
    PoolExhausted,
    budget_for_sessions,
    plan_pool,
)
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.spec import KVBranch, SpecError
from runner_fakes import tiny_spec


def test_block_bytes_counts_k_and_v_across_layers() -> None:
    spec = tiny_spec(num_layers=3, num_kv_heads=2, head_size=4, tokens_per_frame=5)
    assert spec.block_bytes == 2 * 3 * 5 * 2 * 4 * 4


def test_plan_fits_largest_session_count() -> None:
    spec = tiny_spec()  # 16-byte blocks, 5 resident frames, chunk of 2, staging of 7
    per_session = 5 * 16
    fixed = (2 + 7) * 16
    plan = plan_pool(spec, fixed + 3 * per_session + per_session - 1)
    assert plan.session_capacity == 3
    assert plan.num_blocks == 3 * 5 + 2
    assert plan.scratch_blocks == 7
    assert plan.pool_bytes == (plan.num_blocks + plan.scratch_blocks) * 16


@pytest.mark.parametrize("max_batch_sessions", [1, 3])
@pytest.mark.parametrize("sessions", [1, 2, 7])
def test_budget_for_sessions_is_the_smallest_with_room_for_exactly_that_many(
    sessions: int, max_batch_sessions: int
) -> None:
    spec = tiny_spec(kv_branches=(KVBranch("cond", 0), KVBranch("uncond", 1)), model_owned_bytes_per_session=24)
    budget = budget_for_sessions(spec, sessions, max_batch_sessions=max_batch_sessions)
    assert plan_pool(spec, budget, max_batch_sessions=max_batch_sessions).session_capacity == sessions
    if sessions == 1:
        with pytest.raises(PoolBudgetError):
            plan_pool(spec, budget - 1, max_batch_sessions=max_batch_sessions)
    else:
        assert plan_pool(spec, budget - 1, max_batch_sessions=max_batch_sessions).session_capacity == sessions - 1
    with pytest.raises(PoolBudgetError, match="at least one session"):
        budget_for_sessions(spec, 0)


def test_plan_is_capped_by_spec_session_capacity() -> None:
    plan = plan_pool(tiny_spec(session_capacity=2), 1 << 20)
    assert plan.session_capacity == 2
    assert plan.num_blocks == 2 * 5 + 2


def test_plan_counts_every_branch_and_model_owned_bytes() -> None:
    spec = tiny_spec(kv_branches=(KVBranch("cond", 0), KVBranch("uncond", 1)), model_owned_bytes_per_session=100)
    plan = plan_pool(spec, 1 << 16)
    assert plan.per_session_bytes == 5 * 2 * 16 + 100
    assert plan.num_blocks == plan.session_capacity * 10 + 4


def test_budget_below_one_session_fails_with_the_numbers() -> None:
    with pytest.raises(PoolBudgetError, match="cannot hold one session.*224 bytes"):
        plan_pool(tiny_spec(), 223)


def test_allocation_is_lowest_first_and_freed_ids_go_to_the_back() -> None:
    pool = PagedKVPool(tiny_spec(), plan_pool(tiny_spec(), 1 << 12), torch.device("cpu"))
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free([1, 0])
    assert pool.num_used == 3
    rest = pool.allocate(pool.num_free)
    assert rest[-2:] == [1, 0]
    assert pool.num_free == 0


def test_double_free_and_foreign_ids_are_refused() -> None:
    pool = PagedKVPool(tiny_spec(), plan_pool(tiny_spec(), 1 << 12), torch.device("cpu"))
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(BlockStateError):
        pool.free(ids)
    with pytest.raises(BlockStateError):
        pool.free([10_000])


def test_over_allocation_says_how_many_are_free() -> None:
    pool = PagedKVPool(tiny_spec(), plan_pool(tiny_spec(), 1 << 12), torch.device("cpu"))
    with pytest.raises(PoolExhausted, match=f"{pool.num_free} free"):
        pool.allocate(pool.num_free + 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_layers": 0}, "num_layers must be an integer >= 1"),
        ({"window_frames": 1}, "must hold at least one chunk"),
        ({"sink_frames": -1}, "sink_frames"),
        ({"kv_branches": ()}, "at least one branch"),
        ({"kv_branches": (KVBranch("a", 0), KVBranch("a", 1))}, "unique"),
        ({"kv_branches": (KVBranch("a", 1),)}, "local_index"),
        ({"dtype": torch.int32}, "floating point"),
        ({"cross_attention_lengths": {"text": 0}}, "cross_attention_lengths"),
        ({"strided_window_frames": 12, "frame_stride": 5}, r"multiple of frame_stride \(5\)"),
        ({"strided_window_frames": 6, "frame_stride": 3}, "wider than the dense window_frames"),
        ({"strided_window_frames": 12, "frame_stride": 1}, "frame_stride >= 2"),
        ({"frame_stride": 3}, "needs a strided_window_frames"),
        ({"strided_window_frames": 12, "frame_stride": 3, "history_rewrites": True}, "cannot go with history_rewrites"),
        ({"strided_window_frames": 12, "frame_stride": 3, "reset_at_boundary": True}, "cannot go with reset_at_boundary"),
        ({"strided_window_frames": 12, "frame_stride": 3, "max_position_frames": 12}, "the widest window"),
    ],
)
def test_inconsistent_specs_say_what_was_expected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        tiny_spec(**overrides)


def test_plan_counts_an_in_flight_chunk_and_a_staging_row_per_batched_session() -> None:
    spec = tiny_spec()  # 16-byte blocks, 5 resident frames, chunk of 2, staging of 7
    per_session = 5 * 16
    fixed = 3 * (2 + 7) * 16
    plan = plan_pool(spec, fixed + 4 * per_session + per_session - 1, max_batch_sessions=3)
    assert plan.session_capacity == 4
    assert plan.num_blocks == 4 * 5 + 3 * 2
    assert (plan.scratch_blocks, plan.staging_rows) == (3 * 7, 3)
    assert plan.pool_bytes == (plan.num_blocks + plan.scratch_blocks) * 16
    with pytest.raises(PoolBudgetError, match="3 in-flight chunk"):
        plan_pool(spec, fixed + per_session - 1, max_batch_sessions=3)
    with pytest.raises(PoolBudgetError, match="max_batch_sessions must be an integer >= 1"):
        plan_pool(spec, 1 << 20, max_batch_sessions=0)


def test_pool_has_one_staging_row_per_batched_session() -> None:
    spec = tiny_spec(num_layers=2)
    pool = PagedKVPool(spec, plan_pool(spec, 1 << 12, max_batch_sessions=3), torch.device("cpu"))
    assert pool.staging["main"].shape == (3, 2, 2, 7, 1, 2)
    assert len(pool.staging_layers) == 3 and len(pool.staging_layers[2]["main"]) == 2
    assert pool.staging_owners == [None, None, None]


def test_a_shared_block_returns_to_the_free_queue_with_its_last_reference() -> None:
    pool = PagedKVPool(tiny_spec(), plan_pool(tiny_spec(), 1 << 12), torch.device("cpu"))
    free_at_start = pool.num_free
    ids = pool.allocate(3)
    pool.share([ids[0], ids[1], ids[1]])
    assert pool.ref_counts() == {ids[0]: 2, ids[1]: 3, ids[2]: 1}
    pool.free(ids)
    assert pool.ref_counts() == {ids[0]: 1, ids[1]: 2} and pool.num_free == free_at_start - 2
    pool.free([ids[1], ids[1], ids[0]])
    assert pool.ref_counts() == {} and pool.num_free == free_at_start


def test_freeing_more_references_than_a_block_has_is_refused_and_changes_nothing() -> None:
    pool = PagedKVPool(tiny_spec(), plan_pool(tiny_spec(), 1 << 12), torch.device("cpu"))
    ids = pool.allocate(2)
    pool.share([ids[0]])
    with pytest.raises(BlockStateError, match=str(ids[1])):
        pool.free([ids[0], ids[1], ids[1]])
    assert pool.ref_counts() == {ids[0]: 2, ids[1]: 1}
    with pytest.raises(BlockStateError, match="not allocated"):
        pool.share([10_000])


def test_rewind_points_add_their_chunks_and_model_state_copies_to_each_session() -> None:
    spec = tiny_spec(kv_branches=(KVBranch("cond", 0), KVBranch("uncond", 1)), model_owned_bytes_per_session=24)
    # 16-byte blocks, 5 resident frames, chunk of 2: K rewind points add K chunks of blocks per branch
    # and K copies of the model-owned state, never K copies of the window.
    plain = plan_pool(spec, 1 << 16)
    kept = plan_pool(spec, 1 << 16, rewind=RewindSchedule.last(3))
    assert plain.per_session_bytes == 5 * 2 * 16 + 24
    assert kept.per_session_bytes == (5 + 3 * 2) * 2 * 16 + 4 * 24
    assert kept.num_blocks == kept.session_capacity * (5 + 3 * 2) * 2 + 4
    assert plan_pool(spec, 1 << 16, rewind=None) == plain
    budget = budget_for_sessions(spec, 4, rewind=RewindSchedule.last(3))
    assert plan_pool(spec, budget, rewind=RewindSchedule.last(3)).session_capacity == 4
    assert plan_pool(spec, budget - 1, rewind=RewindSchedule.last(3)).session_capacity == 3
