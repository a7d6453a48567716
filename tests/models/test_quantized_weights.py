"""int8 weights (the ``weights`` model option) against full precision on the tiny configs, over 10 chunks.

The tolerance was fixed before anything was measured: int8 weight-only may
differ from fp32 by at most ``TOLERANCE`` times what bf16 (weights, compute and
KV) differs from fp32 on the same config, by the latents' largest difference
and by the frames' mean squared error (PSNR). The control rounds the same blocks'
weights to 3 bits per channel, a quantization known to be too coarse, and must
fail the same comparison: the check can fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from arstream.models.registry import load_pipeline
from arstream.runner.runner import runner_for_sessions
from arstream.runner.types import TickRequest

pytest.importorskip("torchao", reason="the quant extra (pip install 'arstream[quant]')")
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: torch on one thread

CHUNKS = 10
TOLERANCE = 4.0  # fixed before measuring: int8 may be at most 4x as far from fp32 as bf16 is
CONFIGS = [("matrix-game-2", "tiny"), ("longlive", "tiny"), ("longlive", "tiny-self-forcing")]


@dataclass
class Rollout:
    latents: list[torch.Tensor]
    frames: list[np.ndarray]


def controls(model: str, chunk: int) -> dict[str, Any]:
    return {"keys": [["w"], ["a"], [], ["d"]][chunk % 4]} if model == "matrix-game-2" else {}


def rollout(pipeline: Any, model: str) -> Rollout:
    runner = runner_for_sessions(pipeline, 1)
    latents, frames = [], []
    for chunk in range(CHUNKS):
        result = runner.execute_tick(TickRequest(session_id="s", request_id=chunk, controls=controls(model, chunk), seed=3))
        latents.append(pipeline.last_latents["s"].float().clone())
        frames.append(result.frames)
    runner.close_session("s")
    assert runner.pool.num_free == runner.blocks_free_at_start
    return Rollout(latents, frames)


def serve(model: str, config: str, **options: Any) -> Rollout:
    return rollout(load_pipeline(model, "cpu", config=config, random_init=True, **options), model)


def max_latent_difference(a: Rollout, b: Rollout) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.latents, b.latents, strict=True))


def frame_mse(a: Rollout, b: Rollout) -> float:
    squares = [((x.astype(np.float64) - y.astype(np.float64)) ** 2).ravel() for x, y in zip(a.frames, b.frames)]
    return float(np.concatenate(squares).mean())


def psnr(mse: float) -> float:
    return 10 * math.log10(255**2 / max(mse, 1e-12))


def within_tolerance(candidate: Rollout, bf16: Rollout, full: Rollout) -> tuple[bool, str]:
    """Whether ``candidate`` is at most TOLERANCE times as far from ``full`` as bf16 is, on latents and frames."""
    latent, latent_bf16 = max_latent_difference(candidate, full), max_latent_difference(bf16, full)
    mse, mse_bf16 = frame_mse(candidate, full), frame_mse(bf16, full)
    said = (
        f"latents: max diff {latent:.4g} vs bf16 {latent_bf16:.4g}; "
        f"frames: PSNR {psnr(mse):.2f} dB vs bf16 {psnr(mse_bf16):.2f} dB"
    )
    return latent <= TOLERANCE * latent_bf16 and mse <= TOLERANCE**2 * mse_bf16, said


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{m}-{c}" for m, c in CONFIGS])
def references(request: pytest.FixtureRequest) -> tuple[str, str, Rollout, Rollout]:
    model, config = request.param
    full = serve(model, config)
    bf16 = serve(model, config, dtype="bfloat16")
    assert 0 < max_latent_difference(bf16, full), "bf16 must differ from fp32 for the tolerance to mean anything"
    return model, config, full, bf16


def test_int8_weights_stay_within_the_tolerance_of_full_precision(
    references: tuple[str, str, Rollout, Rollout],
) -> None:
    model, config, full, bf16 = references
    pipeline: Any = load_pipeline(model, "cpu", config=config, random_init=True, weights="int8")
    dit = next(c for c in pipeline.model_card()["components"] if c["name"] == "dit")
    assert dit["weights"] == "int8 (float32 compute)"
    int8 = rollout(pipeline, model)
    assert max_latent_difference(int8, full) > 0, "the int8 weights must actually be used"
    ok, said = within_tolerance(int8, bf16, full)
    print(f"{model} {config}: int8 {said}")
    assert ok, said


def round_to_3_bits(module: nn.Module) -> None:
    """The control's quantization: each block linear's rows rounded to 7 levels (3 bits) of their largest weight."""
    with torch.no_grad():
        for name, layer in module.named_modules():
            if isinstance(layer, nn.Linear) and name.startswith("blocks."):
                scale = layer.weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 3
                layer.weight.copy_(torch.round(layer.weight / scale) * scale)


def test_the_control_a_too_coarse_quantization_fails_the_same_comparison(
    references: tuple[str, str, Rollout, Rollout],
) -> None:
    model, config, full, bf16 = references
    pipeline: Any = load_pipeline(model, "cpu", config=config, random_init=True)
    round_to_3_bits(pipeline.model)
    ok, said = within_tolerance(rollout(pipeline, model), bf16, full)
    print(f"{model} {config}: 3-bit control {said}")
    assert not ok, f"3-bit weights passed the int8 tolerance: {said}"


def test_building_the_wan_models_prints_none_of_torchaos_import_warnings() -> None:
    """torchao, imported by diffusers and transformers where it is installed, logged kernel libraries it skipped,
    enums torch calls deprecated, and a note on torchao checkpoints: noise before every plan and start. A fresh
    interpreter, as a user's: torchao logs only on its first import."""
    import subprocess
    import sys

    build = (
        "import logging; logging.basicConfig(); "  # as serve does: a library's logger with a NullHandler shows too
        "from arstream.models.registry import load_pipeline; "
        "load_pipeline('longlive', 'meta', config='tiny'); "
        "load_pipeline('matrix-game-2', 'meta', config='tiny', weights='int8')"
    )
    done = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "torchao" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr


def test_a_torchao_warning_not_known_to_be_harmless_still_shows(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from arstream.models.wan.quantize import quiet_torchao_import

    with quiet_torchao_import(), caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_cutlass_90a.abi3.so: Could not load this library")
        logging.getLogger("torchao").warning("something torchao's users should hear")
    assert [r.getMessage() for r in caplog.records] == ["something torchao's users should hear"]
