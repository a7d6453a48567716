"""A replica over two CPU devices (runner/distributed/): two gloo ranks, each holding half the heads of the KV.

One module-scoped two-rank runtime over tiny matrix-game-2 (two heads, seeded random weights) is compared with
a one-device runner over the same model: the ranks' pools hold one head each, the frames match the one-device
ones within fp32 tolerance over more than ten chunks (alone, two sessions batched, through a rewind and a park), a
session moves between the two (its snapshot has one format whatever the device count) and continues equal, only
rank 0 decodes (apart from the forward, as with --decode-overlap), and a killed rank ends every session with its
reason and frees the pool (last: it ends the runtime).
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from arstream.models.registry import load_pipeline
from arstream.runner.contract import ARPipeline
from arstream.runner.distributed import transfer
from arstream.runner.distributed.runtime import DistributedRuntime
from arstream.runner.distributed.transfer import is_kv
from arstream.runner.rewinds import rewind_for
from arstream.runner.runner import ARRunner
from arstream.runner.snapshot import SessionSnapshot
from arstream.runner.snapshot_import import SessionImport, TensorEntry, flat_bytes, import_session
from arstream.runner.snapshot_stream import parse_snapshot, plan_export
from arstream.runner.types import ChunkResult, ParkingPolicy, ReplicaLost, RuntimeOptions, TickFailure, TickRequest, UnsupportedConfiguration

MODEL = "matrix-game-2"
MODEL_OPTIONS: dict[str, Any] = {"config": "tiny", "random_init": True}
KEYS = [["d"], ["w"], [], ["a", "s"], ["d"], ["w", "d"], ["s"], ["a"], ["w"], [], ["d"], ["s"]]
OPTIONS = RuntimeOptions(
    kv_budget_bytes=32 * 2**20,
    max_batch_sessions=2,
    rewind_seconds=2.0,
    rewind_budget_bytes=8 * 2**20,
    parking=ParkingPolicy(budget_bytes=8 * 2**20),
    load_pipeline=functools.partial(load_pipeline, MODEL, **MODEL_OPTIONS),
)


def _pipeline() -> ARPipeline:
    pipeline = load_pipeline(MODEL, "cpu", **MODEL_OPTIONS)
    assert isinstance(pipeline, ARPipeline)
    return pipeline


def _recording_latents(pipeline: ARPipeline) -> ARPipeline:
    """The pipeline, keeping each chunk's latents as its decoder gets them (in ``pipeline.latents_seen``)."""
    decode = pipeline._decode  # type: ignore[attr-defined]
    seen: list[torch.Tensor] = []

    def recording(latents: torch.Tensor, caches: Any) -> Any:
        seen.extend(latents.clone())
        return decode(latents, caches)

    pipeline._decode = recording  # type: ignore[attr-defined]
    pipeline.latents_seen = seen  # type: ignore[attr-defined]
    return pipeline


def _assert_equal(two: DistributedRuntime, one: ARRunner, ticks: list[TickRequest]) -> None:
    """The round's latents equal within fp32 tolerance, its frames within one step of uint8 rounding."""
    seen_two, seen_one = two.local.pipeline.latents_seen, one.pipeline.latents_seen  # type: ignore[attr-defined]
    del seen_two[:], seen_one[:]
    for sharded, whole in zip(_frames(two, ticks), _frames(one, ticks), strict=True):
        assert np.abs(sharded.astype(np.int16) - whole.astype(np.int16)).max() <= 1
    assert len(seen_two) == len(seen_one) == len(ticks)
    for sharded_latents, whole_latents in zip(seen_two, seen_one):
        torch.testing.assert_close(sharded_latents, whole_latents, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[DistributedRuntime]:
    # rank 0 decodes apart from the forward, as the server's --decode-overlap has it (the others never decode)
    options = RuntimeOptions(**{**OPTIONS.__dict__, "devices": ("cpu", "cpu"), "split_decode": True})
    runtime = DistributedRuntime.for_pipeline(_recording_latents(_pipeline()), options)
    yield runtime
    runtime.shutdown()


@pytest.fixture(scope="module")
def one_rank() -> ARRunner:
    pipeline = _recording_latents(_pipeline())
    rewind = rewind_for(pipeline, seconds=OPTIONS.rewind_seconds, budget_bytes=OPTIONS.rewind_budget_bytes)
    return ARRunner(pipeline, rewind=rewind, parking=OPTIONS.parking, **OPTIONS.pool())


def _tick(session: str, index: int, **extra: object) -> TickRequest:
    return TickRequest(session_id=session, request_id=index, controls={"keys": KEYS[index % len(KEYS)]}, seed=7, **extra)  # type: ignore[arg-type]


def _frames(runtime: DistributedRuntime | ARRunner, ticks: list[TickRequest]) -> list[np.ndarray]:
    results = runtime.execute(ticks)
    if isinstance(runtime, DistributedRuntime):  # rank 0 decodes the round, then every rank hears it was joined
        results = runtime.decode_chunks([r for r in results if isinstance(r, ChunkResult)])
        runtime.complete_boundaries()
    for result in results:
        assert not isinstance(result, TickFailure), result.error
    return [r.frames for r in results]  # type: ignore[union-attr]


def test_each_rank_pool_holds_half_the_heads(two_ranks: DistributedRuntime, one_rank: ARRunner) -> None:
    whole = tuple(one_rank.pool.kv.shape)
    shapes = two_ranks.rank_pool_shapes()
    assert len(shapes) == 2 and shapes[0] == shapes[1]
    layers, kv, blocks, tokens, heads, size = shapes[0]
    assert (layers, kv, tokens, size) == (whole[0], whole[1], whole[3], whole[5])
    assert heads * 2 == whole[4] == 2
    assert two_ranks.local.plan.block_bytes * 2 == one_rank.plan.block_bytes


def test_two_ranks_equal_one_alone_and_batched(two_ranks: DistributedRuntime, one_rank: ARRunner) -> None:
    for index in range(12):
        _assert_equal(two_ranks, one_rank, [_tick("alone", index)])
    for index in range(10):  # two sessions in one forward
        _assert_equal(two_ranks, one_rank, [_tick("a", index), _tick("b", index + 3)])
    assert two_ranks.counters.batched_forwards_total >= 10
    assert two_ranks.next_chunk_index("a") == one_rank.next_chunk_index("a") == 10  # continued, never evicted
    for session in ("alone", "a", "b"):
        two_ranks.close_session(session)
        one_rank.close_session(session)
    assert two_ranks.local.pool.num_free == two_ranks.blocks_free_at_start


def test_two_ranks_equal_one_through_a_rewind_and_a_park(two_ranks: DistributedRuntime, one_rank: ARRunner) -> None:
    for runtime in (two_ranks, one_rank):
        for index in range(5):
            _frames(runtime, [_tick("r", index)])
    points = two_ranks.rewind_points("r")
    assert points is not None and points == one_rank.rewind_points("r") and points[0] < points[1]
    assert two_ranks.park_session("r") and one_rank.park_session("r")
    assert "r" in two_ranks.local.parking.sessions()
    for index in range(5, 11):
        held = two_ranks.rewind_points("r")
        assert held is not None and held == one_rank.rewind_points("r")
        rewind = {"rewind_to": held[0]} if index == 7 else {}
        _assert_equal(two_ranks, one_rank, [_tick("r", index, **rewind)])
    two_ranks.close_session("r")
    one_rank.close_session("r")


def _latents(runtime: DistributedRuntime | ARRunner, session: str, indices: range) -> list[torch.Tensor]:
    """Each chunk's latents as the session runs ``indices`` alone."""
    pipeline = runtime.local.pipeline if isinstance(runtime, DistributedRuntime) else runtime.pipeline
    seen = pipeline.latents_seen  # type: ignore[attr-defined]
    del seen[:]
    for index in indices:
        _frames(runtime, [_tick(session, index)])
    return list(seen)


def _exported(runtime: DistributedRuntime | ARRunner, session: str) -> SessionSnapshot:
    """The session's snapshot as a drain sends it: planned, streamed into bytes, parsed."""
    return parse_snapshot(b"".join(plan_export(runtime, session, protocol_version=1).chunks()))


def test_a_session_moves_from_two_ranks_to_one_and_back(two_ranks: DistributedRuntime, one_rank: ARRunner) -> None:
    for runtime in (two_ranks, one_rank):
        for index in range(3):
            _frames(runtime, [_tick("m", index)])
    assert two_ranks.park_session("m")  # exported from each rank's parked copy
    sharded, whole = _exported(two_ranks, "m"), _exported(one_rank, "m")
    for key in ("format_version", "model", "config_hash", "runtime", "protocol_version", "kv"):
        assert sharded.header[key] == whole.header[key], key
    assert sharded.tensors.keys() == whole.tensors.keys()
    for name, tensor in whole.tensors.items():  # every head, in the one-device layout
        torch.testing.assert_close(sharded.tensors[name], tensor, rtol=1e-4, atol=1e-5)
    reference = _latents(one_rank, "m", range(3, 6))  # the session uninterrupted on one device
    for runtime in (two_ranks, one_rank):
        runtime.close_session("m")
    import_session(one_rank, "m", sharded)
    import_session(two_ranks, "m", whole)
    assert two_ranks.next_chunk_index("m") == one_rank.next_chunk_index("m") == 3
    torch.testing.assert_close(_latents(one_rank, "m", range(3, 6)), reference, rtol=1e-4, atol=1e-5)  # 2 -> 1
    torch.testing.assert_close(_latents(two_ranks, "m", range(3, 6)), reference, rtol=1e-4, atol=1e-5)  # 1 -> 2
    for runtime in (two_ranks, one_rank):
        runtime.close_session("m")
    assert two_ranks.local.pool.num_free == two_ranks.blocks_free_at_start  # and the other rank's, in step


def test_a_streamed_export_holds_a_window_of_blocks_not_the_session(
    two_ranks: DistributedRuntime, one_rank: ARRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 joins the other rank's heads of each block a window at a time: the most it holds of them (the
    exporter's counter) is a few blocks, however long the session, and the bytes equal a single device's."""
    share = two_ranks.local.pool.kv[0, 0, 0]
    block_share_bytes = share.numel() * share.element_size()  # one block of one layer's K (or V), one rank's heads
    monkeypatch.setattr(transfer, "GATHER_WINDOW_BYTES", 2 * block_share_bytes)
    for runtime in (two_ranks, one_rank):
        for index in range(4):
            _frames(runtime, [_tick("w", index)])
    two_ranks.export_peak_held_bytes = 0
    sharded, whole = _exported(two_ranks, "w"), _exported(one_rank, "w")
    for name, tensor in whole.tensors.items():
        torch.testing.assert_close(sharded.tensors[name], tensor, rtol=1e-4, atol=1e-5)
    other_rank_bytes = sum(t.numel() * t.element_size() for n, t in whole.tensors.items() if is_kv(n)) // 2
    # the window, and the block being joined from it and rank 0's own share
    assert 0 < two_ranks.export_peak_held_bytes <= 5 * block_share_bytes < other_rank_bytes // 4
    for runtime in (two_ranks, one_rank):
        runtime.close_session("w")


def test_a_streamed_import_holds_a_window_of_blocks_not_the_session(
    two_ranks: DistributedRuntime, one_rank: ARRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session moved from one device to two arrives in pieces that cut its blocks anywhere: rank 0 splits each
    block by heads as it completes and sends the other rank its shares a window at a time, so the most it holds
    (the importer's counter) is the window and one block, however long the session; the session continues equal."""
    share = two_ranks.local.pool.kv[0, 0, 0]
    block_share_bytes = share.numel() * share.element_size()  # one block of one layer's K (or V), one rank's heads
    monkeypatch.setattr(transfer, "SCATTER_WINDOW_BYTES", 2 * block_share_bytes)
    for index in range(4):
        _frames(one_rank, [_tick("i", index)])
    whole = _exported(one_rank, "i")
    reference = _latents(one_rank, "i", range(4, 7))  # the session uninterrupted on one device
    job = SessionImport("i", whole.header, [TensorEntry.of(n, t) for n, t in whole.tensors.items()], protocol_version=1)
    two_ranks.import_peak_held_bytes = 0
    job.begin(two_ranks)
    piece = block_share_bytes * 3 // 2 + 1  # pieces that end mid-block, as a POST's do
    for index, tensor in enumerate(whole.tensors.values()):
        data = flat_bytes(tensor.contiguous())
        for offset in range(0, data.numel(), piece):
            job.write(two_ranks, index, offset, data[offset : offset + piece])
    job.finish(two_ranks)
    assert two_ranks.next_chunk_index("i") == 4
    torch.testing.assert_close(_latents(two_ranks, "i", range(4, 7)), reference, rtol=1e-4, atol=1e-5)
    kv_bytes = sum(t.numel() * t.element_size() for n, t in whole.tensors.items() if is_kv(n))
    # the window of the other rank's shares, and one whole block (two heads) not yet complete
    assert 0 < two_ranks.import_peak_held_bytes <= 4 * block_share_bytes < kv_bytes // 8
    for runtime in (two_ranks, one_rank):
        runtime.close_session("i")
    assert two_ranks.local.pool.num_free == two_ranks.blocks_free_at_start  # and the other rank's, in step


def test_only_rank_0_decodes_and_the_ranks_park_alike_until_it_joins(two_ranks: DistributedRuntime) -> None:
    """Rank 0 decodes every chunk; rank 1 decodes none and drops as many. A session whose decode rank 0 has not
    joined yet is parked on no rank (rank 1, which has no decode to wait for, refuses alike)."""
    before = two_ranks.rank_decode_counts()
    for index in range(3):
        _frames(two_ranks, [_tick("d", index)])
    (result,) = two_ranks.execute([_tick("d", 3)])
    assert isinstance(result, ChunkResult) and result.pending is not None
    assert not two_ranks.park_session("d")  # a disagreement between the ranks would lose the replica
    two_ranks.decode_chunks([result])
    two_ranks.complete_boundaries()
    assert two_ranks.park_session("d") and two_ranks.lost is None
    two_ranks.close_session("d")
    after = two_ranks.rank_decode_counts()
    assert [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)] == [(4, 0), (0, 4)]


def test_a_head_count_the_devices_do_not_divide_is_refused() -> None:
    options = RuntimeOptions(**{**OPTIONS.__dict__, "devices": ("cpu", "cpu", "cpu")})
    with pytest.raises(UnsupportedConfiguration, match="3 devices cannot share the model's 2 attention heads"):
        DistributedRuntime.for_pipeline(_pipeline(), options)


def test_a_killed_rank_ends_every_session_and_frees_the_pool(two_ranks: DistributedRuntime) -> None:
    """Last in the module: it ends the two-rank runtime."""
    _frames(two_ranks, [_tick("x", 0), _tick("y", 0)])
    two_ranks.park_session("y")
    assert two_ranks.local.pool.num_free < two_ranks.blocks_free_at_start
    (rank1,) = two_ranks.rank_processes()
    assert rank1.pid is not None
    os.kill(rank1.pid, signal.SIGKILL)
    results = two_ranks.execute([_tick("x", 1), _tick("y", 1)])
    for result in results:
        assert isinstance(result, TickFailure) and isinstance(result.error, ReplicaLost)
        assert "rank 1" in str(result.error)
    assert two_ranks.local.pool.num_free == two_ranks.blocks_free_at_start
    assert not two_ranks.is_resident("x") and not two_ranks.local.parking.sessions()
    later = two_ranks.execute([_tick("z", 0)])
    assert isinstance(later[0], TickFailure) and isinstance(later[0].error, ReplicaLost)
    assert two_ranks.rank_processes() == []
