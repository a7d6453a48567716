"""LongLive's and Self-Forcing's umT5 on another device (``text_encoder_device``) gives the same chunks.

This machine has one device, the CPU, so "another device" is the device string
``cpu:0`` beside the model's ``cpu``: what is checked is the option's path (the
encoder built there, the card naming it, its outputs brought to the model's
device and dtype before the DiT reads them) and that a prompt switch encodes
there with the same result. A copy between two real devices (a GPU's DiT, the
CPU's encoder) is not exercised here; the GPU check's plan phase does that.
"""

from __future__ import annotations

import pytest
import torch

from arstream.models.longlive.loading import load_longlive
from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.runner.runner import runner_for_sessions
from arstream.runner.types import TickRequest

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["a red fox in the snow"] * 2 + ["a city street at night, rain"] * 2  # a switch (re-cache) at chunk 2


def rollout(pipeline: LongLivePipeline) -> list[torch.Tensor]:
    runner = runner_for_sessions(pipeline, 1)
    latents = []
    for i, prompt in enumerate(PROMPTS):
        runner.execute_tick(TickRequest(session_id="s", request_id=i, controls={}, prompt=prompt, seed=7))
        latents.append(pipeline.last_latents["s"].clone())
    return latents


@pytest.mark.parametrize("config", ["tiny", "tiny-self-forcing"])
def test_the_text_encoder_elsewhere_gives_the_same_chunks(config: str) -> None:
    here = load_longlive(config=config, random_init=True)
    elsewhere = load_longlive(config=config, random_init=True, text_encoder_device="cpu:0")
    placed = {c["name"]: c["device"] for c in elsewhere.model_card()["components"]}
    assert placed == {"dit": "cpu", "text_encoder": "cpu:0", "vae": "cpu"}
    assert {c["name"]: c["device"] for c in here.model_card()["components"]}["text_encoder"] == "cpu"
    encodes = elsewhere.prompts.encodes  # the default prompt's, at load
    ours, theirs = rollout(here), rollout(elsewhere)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert elsewhere.prompts.encodes - encodes == 2  # each of the two prompts encoded once, there


def test_a_bad_text_encoder_device_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match="text_encoder_device"):
        load_longlive(config="tiny", random_init=True, text_encoder_device="gpu-please")
