"""The training script: runs both step kinds, checkpoints, resumes, exports loadable weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from arstream.models.tiny_world import train
from arstream.models.tiny_world.model import TinyWorldConfig
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.models.tiny_world.world import CAMERA_SPEED

SMALL = {"d_model": 32, "num_layers": 1, "num_heads": 2}


def run(tmp_path: Path, steps: int, *extra: str) -> int:
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL))
    argv = [
        "--steps", str(steps), "--batch-size", "2", "--self-forcing-batch-size", "1", "--chunks", "2",
        "--rollout-chunks", "3", "--self-forcing-from", "1", "--self-forcing-share", "1.0", "--worlds", "1",
        "--warmup", "1", "--log-every", "1", "--threads", "1", "--config", str(config), "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    return train.main(argv + list(extra))


def test_train_checkpoints_resumes_and_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tmp_path, 3, "--stop-at", "2") == 0
    first = capsys.readouterr().out
    assert "step 1/3 loss" in first and "diffusion-forcing" in first and "ETA" in first
    assert "step 2/3 loss" in first and "self-forcing" in first
    assert "step 3/3" not in first
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 2

    assert run(tmp_path, 3, "--resume", "auto") == 0
    second = capsys.readouterr().out
    assert "resumed from" in second and "at step 2" in second
    assert "step 3/3 loss" in second
    assert "step 1/" not in second

    pipeline = load_tiny_world(torch.device("cpu"), str(tmp_path / "run" / "tiny_world.safetensors"))
    assert pipeline.cfg == TinyWorldConfig(**SMALL)


def test_resume_refuses_a_different_config(tmp_path: Path) -> None:
    assert run(tmp_path, 1) == 0
    (tmp_path / "small.json").write_text(json.dumps({**SMALL, "d_model": 64}))
    with pytest.raises(SystemExit, match="differs"):
        train.main(["--steps", "2", "--config", str(tmp_path / "small.json"), "--out", str(tmp_path / "run"),
                    "--resume", "auto", "--worlds", "1", "--threads", "1"])  # fmt: skip


def test_visibility_mask_follows_the_camera() -> None:
    origins = np.array([[[10, 10], [10 + CAMERA_SPEED, 10], [10 + 2 * CAMERA_SPEED, 10 - CAMERA_SPEED]]])
    mask = train.visibility_mask(origins, origins[:, :1], 64).numpy()
    assert mask[0, 0].all()
    # after moving right the rightmost columns show world the reference crop never saw
    assert mask[0, 1][:, : 64 - CAMERA_SPEED].all() and not mask[0, 1][:, 64 - CAMERA_SPEED :].any()
    # after moving up as well, the top rows are new too
    assert not mask[0, 2][:CAMERA_SPEED].any() and mask[0, 2][CAMERA_SPEED:, : 64 - 2 * CAMERA_SPEED].all()
