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
        ("a 12-frame window", {"local_attn_size": 15}, 3),
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


def test_self_forcings_layout_without_a_sink_equals_the_reference_too() -> None:
    pipeline = load_longlive(config="tiny-self-forcing", random_init=True)
    assert pipeline.kv_cache_spec().sink_frames == 0
    served = list(serve(pipeline, SCHEDULE))
    assert max(differences(served, reference(pipeline))) <= 1e-4
