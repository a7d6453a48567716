"""A session as a portable object (runner/snapshot.py): export at chunk k, import elsewhere, continue bit-identically.

Each model runs one session uninterrupted, and the same session (same seed,
same controls) exported at chunk ``k`` into bytes, imported into a fresh
runner over a freshly loaded pipeline, and continued there: every chunk after
the move must equal the uninterrupted one exactly. Refusals (another model,
another config, no room, malformed bytes) leave the importing pool at its
start-up baseline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch

from arstream.models.fake import FakeKVPipeline
from arstream.models.registry import load_pipeline
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.runner.contract import ARPipeline
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.snapshot import (
    tensors_digest,
    FORMAT_VERSION,
    SessionSnapshot,
    SnapshotError,
    SnapshotRefused,
    export_session,
    transferable,
)
from arstream.runner.snapshot_import import import_session
from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes
from arstream.runner.types import TickRequest

KEYS = [["d"], ["d"], ["w"], [], ["a", "s"], ["d"], ["w", "d"], ["s"], ["s"], ["a"], ["w"], []]
SEED = 1234

PIPELINES: dict[str, Callable[[], ARPipeline]] = {
    # a short window, so the export happens after the window has slid (evicted blocks, sink kept)
    "fake-kv": lambda: FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2),
    # a strided tail behind a short dense window: the moved tables are sparse, rebuilt from the frame counter
    "fake-kv-strided": lambda: FakeKVPipeline(
        sink_frames=1, window_frames=4, frames_per_chunk=2, strided_window_frames=12, frame_stride=3
    ),
    "tiny-world": lambda: load_tiny_world(torch.device("cpu")),
    # tiny matrix-game-2 (random weights, seeded): KV, action caches, VAE feature cache, control history, noise
    "matrix-game-2": lambda: load_pipeline("matrix-game-2", "cpu", config="tiny", random_init=True),
    # the same with the TAEHV decoder: its per-memory-block state instead of the VAE cache
    "matrix-game-2-taehv": lambda: load_pipeline("matrix-game-2", "cpu", config="tiny", random_init=True, decoder="taehv"),
    # not Wan: one latent frame a chunk, no sink, K unrotated, a stateless decoder; its KV and noise carry the
    # continuation (it reads buttons and mouse, not these keys: tests/models/test_waypoint.py steers it)
    "waypoint-1.5": lambda: load_pipeline("waypoint-1.5", "cpu", config="tiny", random_init=True),
}


def _tick(session: str, index: int) -> TickRequest:
    return TickRequest(session_id=session, request_id=index, controls={"keys": KEYS[index]}, seed=SEED)


def _run(runner: ARRunner, session: str, indices: range) -> list[np.ndarray]:
    return [runner.execute_tick(_tick(session, i)).frames for i in indices]


@functools.cache
def _two_pipelines(model: str) -> tuple[ARPipeline, ARPipeline]:
    """Two separately loaded pipelines of ``model`` (source and target), loaded once per test run: a session's
    model state starts afresh at its chunk 0, so runs of earlier tests leave nothing that matters."""
    return PIPELINES[model](), PIPELINES[model]()


def _moved_run(model: str, move_at: int) -> tuple[list[np.ndarray], ARRunner, ARRunner]:
    source_pipeline, target_pipeline = _two_pipelines(model)
    source = runner_for_sessions(source_pipeline, 2)
    before = _run(source, "s", range(move_at))
    snapshot = parse_snapshot(snapshot_bytes(export_session(source, "s")))
    target = runner_for_sessions(target_pipeline, 2)
    import_session(target, "s", snapshot)
    after = _run(target, "s", range(move_at, len(KEYS)))
    return before + after, source, target


@pytest.mark.parametrize("model", sorted(PIPELINES))
@pytest.mark.parametrize("move_at", [1, 5])
def test_a_moved_session_continues_bit_identically(model: str, move_at: int) -> None:
    uninterrupted = _run(runner_for_sessions(_two_pipelines(model)[0], 2), "reference", range(len(KEYS)))
    moved, source, target = _moved_run(model, move_at)
    assert len(moved) == len(uninterrupted)
    for index, (got, want) in enumerate(zip(moved, uninterrupted)):
        assert np.array_equal(got, want), f"chunk {index} differs after a move at chunk {move_at}"
    assert target.next_chunk_index("s") == len(KEYS)
    # the source still holds its copy until the caller releases it; then it is back at baseline
    source.close_session("s")
    assert source.pool.num_free == source.blocks_free_at_start
    target.close_session("s")
    assert target.pool.num_free == target.blocks_free_at_start


def test_the_continuation_depends_on_the_moved_state() -> None:
    """The check above can fail: a snapshot whose KV is zeroed continues differently (fake-kv reads its KV)."""
    uninterrupted = _run(runner_for_sessions(PIPELINES["fake-kv"](), 2), "s", range(len(KEYS)))
    source = runner_for_sessions(PIPELINES["fake-kv"](), 2)
    _run(source, "s", range(5))
    snapshot = export_session(source, "s")
    snapshot.tensors = {name: torch.zeros_like(t) for name, t in snapshot.tensors.items()}
    target = runner_for_sessions(PIPELINES["fake-kv"](), 2)
    import_session(target, "s", snapshot)
    assert not np.array_equal(_run(target, "s", range(5, 6))[0], uninterrupted[5])


def test_tiny_world_model_state_travels() -> None:
    """A snapshot whose model-owned state lost the camera would show another view: the frames then differ."""
    uninterrupted = _run(runner_for_sessions(PIPELINES["tiny-world"](), 2), "s", range(len(KEYS)))
    source = runner_for_sessions(PIPELINES["tiny-world"](), 2)
    _run(source, "s", range(5))
    snapshot = export_session(source, "s")
    snapshot.header["model_state"]["session"]["camera"] = [0, 0]
    target = runner_for_sessions(PIPELINES["tiny-world"](), 2)
    import_session(target, "s", snapshot)
    assert not np.array_equal(_run(target, "s", range(5, 6))[0], uninterrupted[5])


def test_snapshot_header_names_model_config_and_versions() -> None:
    source = runner_for_sessions(PIPELINES["fake-kv"](), 2)
    _run(source, "s", range(3))
    snapshot = parse_snapshot(snapshot_bytes(export_session(source, "s", protocol_version=1)))
    header = snapshot.header
    assert header["format_version"] == FORMAT_VERSION
    assert header["model"] == "fake-kv"
    assert header["runtime"] == "arstream"
    assert header["protocol_version"] == 1
    assert len(header["config_hash"]) == 64
    assert header["kv"]["chunks_committed"] == 3 and snapshot.next_chunk_index == 3
    # sink 1 + window history (6 - 2) frames, each one block of [layers, 2, 1, tokens, heads, size]
    assert snapshot.tensors["kv/main"].shape == (2, 2, 5, 2, 1, 4)


def _refused(target: ARRunner, snapshot: SessionSnapshot, error: type[Exception], match: str) -> None:
    free = target.pool.num_free
    with pytest.raises(error, match=match):
        import_session(target, "moved", snapshot)
    assert target.pool.num_free == free
    assert not target.is_resident("moved")


def _fake_snapshot(**options: int) -> SessionSnapshot:
    source = runner_for_sessions(FakeKVPipeline(**options), 2)
    _run(source, "s", range(4))
    return parse_snapshot(snapshot_bytes(export_session(source, "s")))


def test_another_model_is_refused_and_the_pool_stays_at_baseline() -> None:
    target = runner_for_sessions(PIPELINES["tiny-world"](), 2)
    _refused(target, _fake_snapshot(), SnapshotRefused, "another model: 'fake-kv', this replica has 'tiny-world'")
    assert target.pool.num_free == target.blocks_free_at_start


def test_another_config_is_refused() -> None:
    target = runner_for_sessions(FakeKVPipeline(window_frames=8), 2)
    _refused(target, _fake_snapshot(window_frames=6), SnapshotRefused, "another model config")
    assert target.pool.num_free == target.blocks_free_at_start


def test_a_strided_session_is_refused_by_a_replica_whose_spec_keeps_no_strided_tail() -> None:
    target = runner_for_sessions(FakeKVPipeline(window_frames=4), 2)
    _refused(target, _fake_snapshot(window_frames=4, strided_window_frames=12, frame_stride=3), SnapshotRefused,
             "another model config")  # fmt: skip


def test_a_full_replica_refuses_and_evicts_nobody() -> None:
    target = runner_for_sessions(FakeKVPipeline(), 2)
    _run(target, "a", range(2))
    _run(target, "b", range(2))
    _refused(target, _fake_snapshot(), SnapshotRefused, "no room")
    assert target.resident_sessions() == ["a", "b"]


def test_a_snapshot_that_does_not_fit_the_spec_is_refused_without_leaking() -> None:
    snapshot = _fake_snapshot()
    snapshot.tensors["kv/main"] = snapshot.tensors["kv/main"][:, :, :, :1].contiguous()  # a token short per frame
    target = runner_for_sessions(FakeKVPipeline(), 2)
    _refused(target, snapshot, SnapshotError, "does not fit")
    assert target.pool.num_free == target.blocks_free_at_start


@pytest.mark.parametrize("model", ["fake-kv", "fake-kv-strided"])
def test_a_snapshot_whose_window_is_not_what_its_frame_counter_keeps_is_refused(model: str) -> None:
    """The kept frames are a function of the frame counter (a strided tail's too): a history a frame short would
    continue with every position after the gap wrong, so it is refused before a block is placed."""
    source = runner_for_sessions(PIPELINES[model](), 2)
    _run(source, "s", range(5))
    snapshot = parse_snapshot(snapshot_bytes(export_session(source, "s")))
    snapshot.tensors["kv/main"] = snapshot.tensors["kv/main"][:, :, :-1].contiguous()
    target = runner_for_sessions(PIPELINES[model](), 2)
    _refused(target, snapshot, SnapshotError, "window frames where this spec keeps")
    assert target.pool.num_free == target.blocks_free_at_start


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "shorter than"),
        (b"\xff" * 64, "does not fit"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", "no ARStream header"),
    ],
)
def test_bytes_that_are_not_a_snapshot_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(SnapshotError, match=match):
        parse_snapshot(data)


def test_another_format_version_is_refused() -> None:
    snapshot = _fake_snapshot()
    snapshot.header["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(SnapshotRefused, match="format version"):
        parse_snapshot(snapshot_bytes(snapshot))


def test_only_resident_sessions_export() -> None:
    runner = runner_for_sessions(FakeKVPipeline(), 2)
    with pytest.raises(SnapshotError, match="not resident"):
        export_session(runner, "nobody")


def test_a_runtime_other_than_arstreams_runner_cannot_move_sessions() -> None:
    """A drain on another runtime (vLLM-Omni's) got an AttributeError from deep inside the export."""

    class OtherRuntime:  # a fake: only its type matters here
        pass

    with pytest.raises(SnapshotRefused, match="OtherRuntime runtime cannot move sessions"):
        transferable(OtherRuntime())


def test_a_weights_digest_reads_scalar_parameters() -> None:
    """A 0-dim tensor (waypoint's value-residual weight) is hashed by its bytes like any other."""
    half, other = tensors_digest({"v_lamb": torch.tensor(0.5)}), tensors_digest({"v_lamb": torch.tensor(0.25)})
    assert half != other and half == tensors_digest({"v_lamb": torch.tensor([0.5]).reshape(())})
