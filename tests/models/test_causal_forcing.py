"""Causal Forcing on the Self-Forcing path equals a dense reference written from its published code (tiny, CPU, fp32).

Chunk-wise (3 latent frames a chunk) over 10 chunks and frame-wise (one latent
frame a chunk, the runner's smallest) over 24: both past the published
21-frame rollout, latents and decoded frames. Each negative control changes
one rule of the published pipeline and must differ from the served chunks
once the rule comes into play. Then what serving adds and must not change:
batched sessions equal their alone runs, and a session exported mid-stream
(a drain's snapshot) continues bit-identically on another pipeline.
Parking is covered by ``tests/runner/test_parking.py`` (its ``causal-forcing`` row).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from causal_forcing_reference import PublishedCausalForcing

from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.models.registry import load_pipeline
from arstream.models.wan.vae import to_uint8
from arstream.runner.runner import runner_for_sessions
from arstream.runner.snapshot import export_session
from arstream.runner.snapshot_import import import_session
from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes
from arstream.runner.types import ChunkResult, TickRequest

PROMPT = "a red fox running through deep snow"
SEED = 7
CHUNKS = {"tiny-causal-forcing": 10, "tiny-causal-forcing-framewise": 24}  # 30 and 24 latent frames: past 21


@functools.cache
def pipeline(config: str) -> LongLivePipeline:
    loaded = load_pipeline("causal-forcing", "cpu", config=config, random_init=True)
    assert isinstance(loaded, LongLivePipeline)
    return loaded


def tick(session: str, index: int, seed: int = SEED) -> TickRequest:
    return TickRequest(session_id=session, request_id=index, controls={}, prompt=PROMPT, seed=seed)


@functools.cache
def served(config: str) -> tuple[list[torch.Tensor], np.ndarray]:
    """The served chunks' latents, and every frame the session sent."""
    model = pipeline(config)
    runner = runner_for_sessions(model, 1)
    latents, frames = [], []
    for i in range(CHUNKS[config]):
        result = runner.execute_tick(tick("s", i))
        assert isinstance(result, ChunkResult)
        latents.append(model.last_latents["s"].clone())
        frames.append(result.frames)
    runner.close_session("s")
    assert runner.pool.num_free == runner.blocks_free_at_start
    return latents, np.concatenate(frames)


def reference(config: str, **knobs: object) -> list[torch.Tensor]:
    dense = PublishedCausalForcing(pipeline(config), PROMPT, SEED, **knobs)  # type: ignore[arg-type]
    return [dense.step() for _ in range(CHUNKS[config])]


def differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [float((x - y).abs().max()) for x, y in zip(a, b, strict=True)]


def decoded(config: str, latents: list[torch.Tensor]) -> np.ndarray:
    """The published decode: the whole rollout's latents in one call."""
    video, _ = pipeline(config).vae.decode(torch.cat(latents, dim=1)[None], None)
    return to_uint8(video)


def gap(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@pytest.mark.parametrize("config", sorted(CHUNKS))
def test_the_served_latents_and_frames_equal_the_published_pipeline(config: str) -> None:
    model = pipeline(config)
    frames_per_chunk = {"tiny-causal-forcing": 3, "tiny-causal-forcing-framewise": 1}[config]
    spec = model.kv_cache_spec()
    assert (spec.frames_per_chunk, spec.sink_frames, spec.window_frames) == (frames_per_chunk, 0, 21)
    assert model.model_card()["name"] == "causal-forcing"
    latents, frames = served(config)
    want = reference(config)
    assert max(differences(latents, want)) <= 1e-5
    assert frames.shape[0] == 1 + 4 * (CHUNKS[config] * frames_per_chunk - 1)  # the causal VAE's first frame is one
    assert gap(frames, decoded(config, want)) <= 1


@pytest.mark.parametrize("config", sorted(CHUNKS))
@pytest.mark.parametrize(
    ("control", "knobs", "first_changed"),
    [
        ("the steps fed unwarped", {"warp": False}, {"tiny-causal-forcing": 0, "tiny-causal-forcing-framewise": 0}),
        ("no t=0 pass: the last step's K/V cached", {"commit": False},
         {"tiny-causal-forcing": 1, "tiny-causal-forcing-framewise": 1}),
        # a 9-frame window: seen first by the chunk whose frames reach past 9 (frame 9, in chunk 3 or chunk 9)
        ("a 9-frame window", {"local_attn_size": 9}, {"tiny-causal-forcing": 3, "tiny-causal-forcing-framewise": 9}),
    ],
)  # fmt: skip
def test_each_negative_control_differs(config: str, control: str, knobs: dict[str, object],
                                       first_changed: dict[str, int]) -> None:  # fmt: skip
    latents, frames = served(config)
    want = reference(config, **knobs)
    diffs = differences(latents, want)
    first = first_changed[config]
    assert max(diffs[:first], default=0.0) <= 1e-5, control
    assert min(diffs[first:]) >= 1e-2, (control, diffs)
    assert gap(frames, decoded(config, want)) >= 8, control


def test_frame_wise_batched_sessions_equal_their_alone_runs() -> None:
    config = "tiny-causal-forcing-framewise"
    model = pipeline(config)
    seeds = {"x": 1, "y": 2}
    alone = {}
    for session, seed in seeds.items():
        runner = runner_for_sessions(model, 1)
        results = [runner.execute_tick(tick(session, i, seed)) for i in range(5)]
        alone[session] = [r.frames for r in results if isinstance(r, ChunkResult)]
        runner.close_session(session)
    runner = runner_for_sessions(model, 2, max_batch_sessions=2)
    batched: dict[str, list[np.ndarray]] = {"x": [], "y": []}
    for i in range(5):
        round_results = runner.execute([tick(s, i, seed) for s, seed in seeds.items()])
        for s, result in zip(seeds, round_results):
            assert isinstance(result, ChunkResult)
            batched[s].append(result.frames)
    assert runner.counters.batched_forwards_total == 5
    for s in seeds:
        assert max(gap(a, b) for a, b in zip(batched[s], alone[s], strict=True)) <= 1
    assert gap(batched["x"][2], batched["y"][2]) >= 8  # the seeds make different streams: the comparison can fail


@pytest.mark.parametrize("config", sorted(CHUNKS))
def test_an_exported_session_continues_bit_identically_on_another_pipeline(config: str) -> None:
    here = runner_for_sessions(pipeline(config), 1)
    for i in range(4):
        here.execute_tick(tick("s", i))
    snapshot = parse_snapshot(snapshot_bytes(export_session(here, "s")))
    expected = [here.execute_tick(tick("s", i)).frames for i in range(4, 8)]
    here.close_session("s")
    fresh = load_pipeline("causal-forcing", "cpu", config=config, random_init=True)
    assert isinstance(fresh, LongLivePipeline)
    there = runner_for_sessions(fresh, 1)
    import_session(there, "s", snapshot)
    got = [there.execute_tick(tick("s", i)).frames for i in range(4, 8)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    there.close_session("s")
    assert there.pool.num_free == there.blocks_free_at_start


def test_the_registry_serves_only_causal_forcings_configs() -> None:
    with pytest.raises(ValueError, match=r"causal-forcing config 'tiny' is not one of \['causal-forcing-1.3b'"):
        load_pipeline("causal-forcing", "cpu", config="tiny", random_init=True)
