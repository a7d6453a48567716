"""The served LongLive equals a dense reference written from the published pipeline (tiny config, CPU, fp32).

Ten chunks under three prompts: a switch at frame 12 (inside the first
``sink + window`` frames: the whole history, sink included, is re-encoded) and
one at frame 18 (the sink keeps the old prompt). Each negative control changes
one rule of the published pipeline and must differ from the served chunks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from longlive_reference import DenseLongLive

from arstream.models.longlive.loading import load_longlive
from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.runner.runner import runner_for_sessions
from arstream.runner.types import TickRequest

A, B, C = "a red fox in the snow", "a city street at night, rain", "an underwater reef, bright fish"
SCHEDULE = [A] * 4 + [B] * 2 + [C] * 4  # switches at chunks 4 and 6: frames 12 and 18


@pytest.fixture(scope="module")
def pipeline() -> LongLivePipeline:
    return load_longlive(config="tiny", random_init=True)


def serve(pipeline: LongLivePipeline, schedule: list[str], session: str = "s") -> Iterator[torch.Tensor]:
    runner = runner_for_sessions(pipeline, 1)
    for i, prompt in enumerate(schedule):
        runner.execute_tick(TickRequest(session_id=session, request_id=i, controls={}, prompt=prompt))
        yield pipeline.last_latents[session].clone()
    runner.close_session(session)
    assert runner.pool.num_free == runner.blocks_free_at_start


@pytest.fixture(scope="module")
def served(pipeline: LongLivePipeline) -> list[torch.Tensor]:
    before = pipeline.counters.recaches
    chunks = list(serve(pipeline, SCHEDULE))
    assert pipeline.counters.recaches - before == 2
    return chunks


def reference(pipeline: LongLivePipeline, **knobs: object) -> list[torch.Tensor]:
    dense = DenseLongLive(pipeline, **knobs)  # type: ignore[arg-type]
    return [dense.step(prompt) for prompt in SCHEDULE]


def differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [float((x - y).abs().max()) for x, y in zip(a, b, strict=True)]


def test_the_served_chunks_equal_the_dense_reference_through_two_switches(
    pipeline: LongLivePipeline, served: list[torch.Tensor]
) -> None:
    assert len(served) >= 8
    assert max(differences(served, reference(pipeline))) <= 1e-4


@pytest.mark.parametrize(
    ("control", "knobs", "first_changed"),
    [
        ("no re-cache", {"recache": False}, 4),
        ("a causal mask inside the re-cache", {"causal_recache": True}, 4),
        ("the sink re-encoded when it should not be", {"reencode_sink": True}, 6),
        ("a 12-frame window", {"local_attn_size": 15}, 4),
    ],
)
def test_each_negative_control_differs(
    pipeline: LongLivePipeline, served: list[torch.Tensor], control: str, knobs: dict[str, object], first_changed: int
) -> None:
    diffs = differences(served, reference(pipeline, **knobs))
    # equal before the rule it breaks comes into play, clearly different after
    assert max(diffs[:first_changed]) <= 1e-4, control
    assert max(diffs[first_changed:]) >= 1e-2, control


def test_a_second_session_with_the_same_prompt_encodes_nothing_and_resending_a_prompt_recaches_nothing(
    pipeline: LongLivePipeline,
) -> None:
    list(serve(pipeline, [A, A], session="first"))
    encodes, recaches = pipeline.prompts.encodes, pipeline.counters.recaches
    list(serve(pipeline, [A, A, A], session="second"))
    assert (pipeline.prompts.encodes, pipeline.counters.recaches) == (encodes, recaches)
    # the negative control: a new prompt does encode once, and switching to it re-caches once
    list(serve(pipeline, [A, "a desert at noon"], session="third"))
    assert (pipeline.prompts.encodes, pipeline.counters.recaches) == (encodes + 1, recaches + 1)




@pytest.mark.parametrize("config", ["tiny-self-forcing", "tiny-causvid"])
def test_self_forcings_and_causvids_layouts_equal_the_reference_past_their_21_frame_rollout(config: str) -> None:
    """No sink, a 21-frame window: the published rollout's attention for chunks 0-6, rolling from chunk 7 on;
    CausVid's timesteps fed unwarped (negative control: warped, as Self-Forcing's are, differs)."""
    pipeline = load_longlive(config=config, random_init=True)
    spec = pipeline.kv_cache_spec()
    assert (spec.sink_frames, spec.window_frames, spec.resident_frames) == (0, 21, 18)
    schedule = [A] * 8 + [B] * 2  # past 21 frames (chunk 7), then a switch at frame 24
    served = list(serve(pipeline, schedule))
    dense = DenseLongLive(pipeline)
    assert max(differences(served, [dense.step(p) for p in schedule])) <= 1e-4
    if config == "tiny-causvid":
        warped = DenseLongLive(pipeline, warp=True)
        assert min(differences(served, [warped.step(p) for p in schedule])) >= 1e-2
    # a window as long as LongLive's (9 frames) differs once a chunk would see past it (chunk 3)
    short = DenseLongLive(pipeline, local_attn_size=9)
    diffs = differences(served, [short.step(p) for p in schedule])
    assert max(diffs[:3]) <= 1e-4 and min(diffs[3:]) >= 1e-2
