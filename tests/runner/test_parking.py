"""Parking (runner/parking.py): sessions moved to host memory and back continue bit-identically.

Each model plays one session uninterrupted in a runner of its own, and the
same session (same ticks, rewinds and branch) in a runner that parks it after
every chunk (or spills it to disk): every chunk must be equal. A restore that
fails ends only that session and leaves the pool at its baseline; a pool of N
slots serves 10N sessions taking turns without ending any.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from arstream.models.fake import FakeKVPipeline
from arstream.models.registry import load_pipeline
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.runner.contract import ARPipeline
from arstream.runner.parking import RestoreFailed
from arstream.runner.types import ParkingPolicy
from arstream.runner.rewind_schedule import RewindSchedule
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.types import ChunkResult, StartImage, TickFailure, TickRequest
from runner_fakes import FailingImportFakePipeline

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread

KEYS = [["d"], ["d"], ["w"], [], ["a", "s"], ["d"], ["w", "d"], ["s"], ["a"]]
SEED = 4321
K = 4
PLENTY = 2**34  # a park budget no test fills


def _loaded(name: str, **options: Any) -> ARPipeline:
    pipeline = load_pipeline(name, "cpu", **options)
    assert isinstance(pipeline, ARPipeline)
    return pipeline


PIPELINES: dict[str, Callable[[], ARPipeline]] = {
    # a short window, so parked boundaries hold blocks that slid out of the live window
    "fake-kv": lambda: FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2),
    # a strided tail behind a short dense window: the kept frames are sparse, their phase set by the frame counter
    "fake-kv-strided": lambda: FakeKVPipeline(
        sink_frames=1, window_frames=4, frames_per_chunk=2, strided_window_frames=12, frame_stride=3
    ),
    "tiny-world": lambda: load_tiny_world(torch.device("cpu")),
    # KV, action caches, VAE feature cache, control history, noise, and a start image
    "matrix-game-2": lambda: _loaded("matrix-game-2", config="tiny", random_init=True),
    # one latent frame a chunk: the runner's smallest chunks; noise, prompt, latents and the VAE cache
    "causal-forcing": lambda: _loaded("causal-forcing", config="tiny-causal-forcing-framewise", random_init=True),
    # a history rewritten every chunk, the re-encoded context frame, the prompt and the decoder cache
    "krea-realtime": lambda: _loaded("krea-realtime", config="tiny", random_init=True),
    # not Wan: one latent frame a chunk, no sink, K unrotated, a stateless decoder; its KV and noise carry the
    # continuation (it reads buttons and mouse, not these keys: tests/models/test_waypoint.py steers it)
    "waypoint-1.5": lambda: _loaded("waypoint-1.5", config="tiny", random_init=True),
}


@functools.cache
def _pipeline(model: str) -> ARPipeline:
    return PIPELINES[model]()


def _start_image(pipeline: ARPipeline) -> StartImage | None:
    names = pipeline.model_card().get("start_images") or []
    return StartImage(f"name:{names[-1]}", name=names[-1]) if names else None


def _script(pipeline: ARPipeline, session: str) -> list[TickRequest]:
    """Chunks, a rewind three boundaries back, more chunks: what both runners play."""
    image = _start_image(pipeline)
    ticks = [
        TickRequest(session_id=session, request_id=i, controls={"keys": keys}, seed=SEED, start_image=image)
        for i, keys in enumerate(KEYS)
    ]
    ticks[6] = TickRequest(
        session_id=session, request_id=6, controls={"keys": KEYS[6]}, seed=SEED, start_image=image, rewind_to=3
    )
    return ticks


def _play(runner: ARRunner, ticks: list[TickRequest], after_each: Callable[[], object] = lambda: None) -> list[np.ndarray]:
    frames = []
    for tick in ticks:
        frames.append(runner.execute_tick(tick).frames)
        after_each()
    return frames


def _runner(model: str, sessions: int, **options: Any) -> ARRunner:
    return runner_for_sessions(_pipeline(model), sessions, rewind=RewindSchedule.last(K), **options)


@functools.cache
def _reference(model: str) -> tuple[np.ndarray, ...]:
    return tuple(_play(_runner(model, 1), _script(_pipeline(model), "reference")))


def _same(a: list[np.ndarray] | tuple[np.ndarray, ...], b: list[np.ndarray] | tuple[np.ndarray, ...]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("model", sorted(PIPELINES))
@pytest.mark.parametrize("spill", [False, True])
def test_a_session_parked_after_every_chunk_continues_bit_identically(model: str, spill: bool, tmp_path: Path) -> None:
    policy = ParkingPolicy(spill_dir=str(tmp_path), spill_budget_bytes=PLENTY) if spill else ParkingPolicy(PLENTY)
    runner = _runner(model, 1, parking=policy)
    baseline = runner.pool.num_free
    parked_at: list[tuple[int, tuple[int, ...] | None]] = []

    def park() -> None:
        held = runner.sessions.rewind_held("s")
        assert runner.park_session("s") and runner.parking.sessions() == ["s"] and not runner.sessions.in_pool("s")
        assert runner.pool.num_free == baseline  # every block went back, the boundaries' too
        assert runner.sessions.rewind_held("s") == held  # answered from the parked copy, without a restore
        parked_at.append((runner.next_chunk_index("s"), held))
        if spill:
            assert runner.stats().sessions_spilled == 1 and list(tmp_path.iterdir())

    frames = _play(runner, _script(_pipeline(model), "s"), park)
    assert _same(frames, _reference(model))
    assert [index for index, _ in parked_at] == [1, 2, 3, 4, 5, 6, 4, 5, 6]  # the rewind went back to 3
    stats = runner.stats()
    assert (stats.parks_total, stats.restores_total, stats.restore_failures_total) == (len(KEYS), len(KEYS) - 1, 0)
    runner.close_session("s")
    assert runner.pool.num_free == baseline and not runner.parking.sessions() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("model", ["fake-kv", "tiny-world"])
def test_a_branch_from_a_parked_session_restores_it_and_both_continue(model: str) -> None:
    pipeline = _pipeline(model)
    ticks = _script(pipeline, "s")[:5]
    reference = _runner(model, 2)
    _play(reference, ticks)
    reference.branch_session("s", 2, "b")
    expected = _play(reference, [TickRequest(session_id="b", request_id=9, controls={"keys": ["a"]}, seed=SEED)])

    runner = _runner(model, 2, parking=ParkingPolicy(PLENTY))
    _play(runner, ticks)
    assert runner.park_session("s")
    assert runner.branch_session("s", 2, "b") == 2 and runner.sessions.in_pool("s")
    assert _same(_play(runner, [TickRequest(session_id="b", request_id=9, controls={"keys": ["a"]}, seed=SEED)]), expected)


def _fake_ticks(session: str, count: int) -> list[TickRequest]:
    return [TickRequest(session_id=session, request_id=i, controls={"keys": KEYS[i % len(KEYS)]}, seed=SEED) for i in range(count)]


def test_a_failed_restore_ends_only_that_session_and_leaves_the_pool_at_baseline() -> None:
    pipeline = FailingImportFakePipeline(sink_frames=1, window_frames=6, frames_per_chunk=2)
    runner = runner_for_sessions(pipeline, 2, rewind=RewindSchedule.last(K), parking=ParkingPolicy(PLENTY))
    baseline = runner.pool.num_free
    _play(runner, _fake_ticks("a", 5))
    _play(runner, _fake_ticks("b", 5))
    assert runner.park_session("a")
    with_b_only = runner.pool.num_free
    pipeline.fail_import = True
    (result,) = runner.execute([_fake_ticks("a", 6)[5]])
    assert isinstance(result, TickFailure) and isinstance(result.error, RestoreFailed)
    assert "could not be restored" in str(result.error)
    assert not runner.is_resident("a") and runner.pool.num_free == with_b_only
    assert runner.stats().restore_failures_total == 1
    pipeline.fail_import = False
    assert runner.next_chunk_index("b") == 5 and isinstance(runner.execute([_fake_ticks("b", 6)[5]])[0], ChunkResult)
    runner.close_session("b")
    assert runner.pool.num_free == baseline


def test_a_corrupt_spill_file_fails_the_restore_and_frees_everything(tmp_path: Path) -> None:
    runner = runner_for_sessions(
        FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2),
        1,
        rewind=RewindSchedule.last(K),
        parking=ParkingPolicy(spill_dir=str(tmp_path), spill_budget_bytes=PLENTY),
    )
    baseline = runner.pool.num_free
    _play(runner, _fake_ticks("a", 4))
    assert runner.park_session("a")
    (spilled,) = tmp_path.iterdir()
    spilled.write_bytes(b"not a safetensors file")
    with pytest.raises(RestoreFailed):
        runner.execute_tick(_fake_ticks("a", 5)[4])
    assert not runner.is_resident("a") and runner.pool.num_free == baseline and not list(tmp_path.iterdir())


@pytest.mark.parametrize("slots", [1, 3])
def test_a_pool_of_n_slots_serves_10n_sessions_taking_turns_and_none_ends(slots: int) -> None:
    pipeline = FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2)
    sessions = [f"s{k}" for k in range(10 * slots)]
    reference = runner_for_sessions(pipeline, 1, rewind=RewindSchedule.last(K))
    expected = _play(reference, _fake_ticks("r", 6))
    runner = runner_for_sessions(pipeline, slots, rewind=RewindSchedule.last(K), parking=ParkingPolicy(PLENTY))
    baseline = runner.pool.num_free
    played: dict[str, list[np.ndarray]] = {s: [] for s in sessions}
    for tick_index in range(6):
        for session in sessions:
            played[session].append(runner.execute_tick(_fake_ticks(session, 6)[tick_index]).frames)
            assert len(runner.resident_sessions()) <= slots
    stats = runner.stats()
    assert stats.evictions_total == 0 and stats.sessions_parked == 10 * slots - slots
    assert all(_same(played[s], expected) for s in sessions)
    for session in sessions:
        runner.close_session(session)
    assert runner.pool.num_free == baseline and runner.stats().parked_bytes == 0


def test_past_the_park_budget_the_lru_session_ends_as_before() -> None:
    pipeline = FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2)
    probe = runner_for_sessions(pipeline, 1, parking=ParkingPolicy(PLENTY))
    _play(probe, _fake_ticks("p", 3))
    assert probe.park_session("p")
    one = probe.stats().parked_bytes
    runner = runner_for_sessions(pipeline, 1, parking=ParkingPolicy(one))  # room for exactly one parked session
    evicted: list[str] = []
    runner.on_evict = evicted.append
    for session in ("a", "b", "c"):
        _play(runner, _fake_ticks(session, 3))
    assert runner.parking.sessions() == ["a"] and evicted == ["b"] and runner.resident_sessions() == ["c"]


def test_idle_sessions_are_parked_after_park_after_s() -> None:
    now = [0.0]
    runner = runner_for_sessions(
        FakeKVPipeline(), 3, parking=ParkingPolicy(PLENTY, after_s=10.0), clock=lambda: now[0]
    )
    _play(runner, _fake_ticks("idle", 2))
    now[0] = 5.0
    _play(runner, _fake_ticks("busy", 2))
    now[0] = 12.0
    assert runner.park_idle() == 1 and runner.parking.sessions() == ["idle"] and runner.sessions.in_pool("busy")
    stats = runner.stats()
    assert (stats.sessions_resident, stats.sessions_parked, stats.resident_capacity) == (1, 1, 3)
    assert stats.session_capacity == 3 + stats.park_capacity and stats.parked_bytes > 0


def test_an_import_parks_the_lru_session_to_make_room() -> None:
    from arstream.runner.snapshot import export_session
    from arstream.runner.snapshot_import import import_session
    from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes

    source = runner_for_sessions(FakeKVPipeline(), 1)
    _play(source, _fake_ticks("moved", 3))
    snapshot = parse_snapshot(snapshot_bytes(export_session(source, "moved")))
    target = runner_for_sessions(FakeKVPipeline(), 1, parking=ParkingPolicy(PLENTY))
    _play(target, _fake_ticks("here", 3))
    import_session(target, "moved", snapshot)
    assert target.resident_sessions() == ["moved"] and target.parking.sessions() == ["here"]


def test_an_exported_session_is_never_parked_until_its_next_chunk() -> None:
    runner = runner_for_sessions(FakeKVPipeline(), 1, parking=ParkingPolicy(PLENTY))
    _play(runner, _fake_ticks("a", 2))
    assert runner.park_session("a")
    assert runner.sessions.kv_state("a") is not None and runner.sessions.in_pool("a")  # a drain's export restores it
    assert not runner.park_session("a")
    runner.execute_tick(_fake_ticks("a", 3)[2])
    assert runner.park_session("a")


@pytest.mark.parametrize("model", ["fake-kv", "tiny-world"])
def test_a_parked_session_exports_the_same_snapshot_without_a_restore(model: str, tmp_path: Path) -> None:
    from arstream.runner.snapshot import SessionSnapshot, export_session
    from arstream.runner.snapshot_stream import parse_snapshot, plan_export, snapshot_bytes

    def same_snapshot(a: SessionSnapshot, b: SessionSnapshot) -> bool:
        return a.header == b.header and a.tensors.keys() == b.tensors.keys() and all(
            torch.equal(a.tensors[name], b.tensors[name]) for name in a.tensors
        )

    played_alike = _runner(model, 1)
    _play(played_alike, _script(_pipeline(model), "s")[:5])
    resident = parse_snapshot(snapshot_bytes(export_session(played_alike, "s")))
    runner = _runner(model, 1, parking=ParkingPolicy(spill_dir=str(tmp_path), spill_budget_bytes=PLENTY))
    _play(runner, _script(_pipeline(model), "s")[:5])
    runner.execute_tick(_script(_pipeline(model), "t")[0])  # "s" is parked to make room (and spilled)
    assert runner.parking.sessions() == ["s"] and runner.stats().sessions_spilled == 1
    assert same_snapshot(parse_snapshot(snapshot_bytes(export_session(runner, "s"))), resident)
    plan = plan_export(runner, "s")
    streamed = b"".join(plan.chunks())  # the sealed stream a drain sends
    assert same_snapshot(parse_snapshot(streamed), resident)
    assert runner.parking.sessions() == ["s"] and runner.stats().restores_total == 0


def test_a_parked_session_streams_out_of_its_host_copy_holding_no_second_copy() -> None:
    """A drain's plan of a parked session reads each KV block (the live ones and its rewind points') out of the
    parked host copy itself: the export holds no copy of the session beside the parked one."""
    from arstream.runner.snapshot_stream import plan_export

    runner = _runner("fake-kv", 1, parking=ParkingPolicy(budget_bytes=PLENTY))
    _play(runner, _script(_pipeline("fake-kv"), "s")[:5])
    runner.execute_tick(_script(_pipeline("fake-kv"), "t")[0])  # "s" is parked to make room, in host memory
    held = runner.sessions.lot.peek("s")
    assert held is not None and runner.parking.sessions() == ["s"]
    copy = held[1]["blocks"].untyped_storage().data_ptr()
    kv = [t for t in plan_export(runner, "s").tensors if t.name.startswith("kv/") or t.name == "rewind/kv"]
    assert {t.name for t in kv} == {"kv/main", "rewind/kv"}
    assert all(part().untyped_storage().data_ptr() == copy for tensor in kv for part in tensor.parts)


def test_a_spill_budget_without_a_directory_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a spill directory"):
        ParkingPolicy(spill_budget_bytes=1)
    with pytest.raises(ValueError, match=">= 0"):
        ParkingPolicy(after_s=-1.0)


@pytest.mark.parametrize("where", ["host", "spill", "both"])
def test_with_every_slot_and_park_place_held_a_restore_swaps_and_none_ends(where: str, tmp_path: Path) -> None:
    """One slot, a lot with room for exactly two: three sessions take turns. Each restore parks the resident
    session in the place it leaves (before, the lot still counted it, so making room evicted the resident one).
    ``both``: a session and a half of host memory and of disk hold two, not three (a session is kept whole)."""
    pipeline = FakeKVPipeline(sink_frames=1, window_frames=6, frames_per_chunk=2)
    per_session = runner_for_sessions(pipeline, 1, rewind=RewindSchedule.last(K)).plan.per_session_bytes
    host, disk = {"host": (2 * per_session, 0), "spill": (0, 2 * per_session)}.get(where, (per_session * 3 // 2,) * 2)
    policy = ParkingPolicy(host, spill_dir=str(tmp_path) if disk else None, spill_budget_bytes=disk)
    runner = runner_for_sessions(pipeline, 1, rewind=RewindSchedule.last(K), parking=policy)
    assert runner.parking.capacity == 2
    expected = _play(runner_for_sessions(pipeline, 1, rewind=RewindSchedule.last(K)), _fake_ticks("r", 6))
    sessions = ["a", "b", "c"]
    played: dict[str, list[np.ndarray]] = {s: [] for s in sessions}
    for tick_index in range(6):
        for session in sessions:
            played[session].append(runner.execute_tick(_fake_ticks(session, 6)[tick_index]).frames)
    assert runner.stats().evictions_total == 0 and len(runner.parking.sessions()) == 2
    assert all(_same(played[s], expected) for s in sessions)
