"""docs/models.md's "What runs without a GPU or weights": every serve line it gives parses as `arstream serve`
flags and loads on the CPU, and a model built with random weights says so in its card (the page reads it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from arstream.app.settings import settings_from_argv
from arstream.models.registry import load_pipeline
from arstream.runner.contract import ARPipeline

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs/models.md").read_text()
SECTION = DOC[DOC.index("## What runs without a GPU or weights") :]
SECTION = SECTION[: SECTION.index("\n## ", 5)]
LINES = re.findall(r"^\| `arstream serve([^`]*)` \|", SECTION, re.M)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread


def test_the_section_gives_the_default_longlive_matrix_game_waypoint_and_the_fake() -> None:
    models = [settings_from_argv(shlex.split(line)).model for line in LINES]
    # Waypoint twice: its default tiny-1.5 (four frames a chunk) and tiny (Waypoint-1's decoder)
    assert models == ["tiny-world", "longlive", "matrix-game-2", "waypoint-1.5", "waypoint-1.5", "fake-kv"], LINES


@pytest.mark.parametrize("line", LINES)
def test_each_serve_line_loads_on_the_cpu_and_its_card_says_whether_the_weights_are_random(line: str) -> None:
    settings = settings_from_argv(shlex.split(line))
    pipeline = load_pipeline(settings.model, torch.device("cpu"), **settings.model_options)
    assert isinstance(pipeline, ARPipeline)
    random = bool(settings.model_options.get("random_init"))
    assert (pipeline.model_card().get("weights") == "random") == random, pipeline.model_card()
