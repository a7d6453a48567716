"""The training script: runs both step kinds, checkpoints, resumes, exports loadable weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from arstream.programs.tiny_world import train
from arstream.models.tiny_world.model import TinyWorldConfig, TinyWorldDiT
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.models.tiny_world.sampling import DenseChunkKV, from_uint8
from arstream.models.tiny_world.weights import save_weights
from arstream.models.tiny_world.world import CAMERA_SPEED, PALETTE

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
    assert "step 2/3 loss" in first and "mixed" in first
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


def test_resume_refuses_a_different_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tmp_path, 1) == 0
    (tmp_path / "small.json").write_text(json.dumps({**SMALL, "d_model": 64}))
    exit_code = train.main(["--steps", "2", "--config", str(tmp_path / "small.json"), "--out", str(tmp_path / "run"),
                            "--resume", "auto", "--worlds", "1", "--threads", "1"])  # fmt: skip
    assert exit_code == 1
    assert "differs" in capsys.readouterr().err


def test_visibility_mask_follows_the_camera() -> None:
    origins = np.array([[[10, 10], [10 + CAMERA_SPEED, 10], [10 + 2 * CAMERA_SPEED, 10 - CAMERA_SPEED]]])
    mask = train.visibility_mask(origins, origins[:, :1], 64).numpy()
    assert mask[0, 0].all()
    # after moving right the rightmost columns show world the reference crop never saw
    assert mask[0, 1][:, : 64 - CAMERA_SPEED].all() and not mask[0, 1][:, 64 - CAMERA_SPEED :].any()
    # after moving up as well, the top rows are new too
    assert not mask[0, 2][:CAMERA_SPEED].any() and mask[0, 2][CAMERA_SPEED:, : 64 - 2 * CAMERA_SPEED].all()


def test_init_from_adds_a_conv_head_that_starts_as_the_source_model(tmp_path: Path) -> None:
    source = TinyWorldDiT(TinyWorldConfig(**SMALL))
    with torch.no_grad():
        for p in source.parameters():  # adaLN starts at zero: give every layer a say
            p.normal_(0, 0.05)
    save_weights(source, tmp_path / "src" / "tiny_world.safetensors", tmp_path / "src" / "config.json")
    conv = TinyWorldDiT(TinyWorldConfig(**SMALL, head="conv"))
    fresh = train.init_from(conv, tmp_path / "src" / "tiny_world.safetensors")
    assert fresh and all(n.startswith(("conv_head.", "out_features.")) for n in fresh)

    cfg = source.cfg
    gen = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, cfg.frames_per_chunk, cfg.canvas_size, cfg.canvas_size, 3, generator=gen)
    t = torch.rand(2, cfg.frames_per_chunk, generator=gen)
    direction = torch.randint(0, 9, (2, cfg.frames_per_chunk), generator=gen)
    cells = torch.randint(-50, 50, (2, cfg.frames_per_chunk, 2), generator=gen)
    outputs = []
    for model in (source, conv):
        kv = DenseChunkKV(cfg, 2)
        kv.begin_pass(commit=False)
        outputs.append(model(noisy, t, direction, torch.arange(cfg.frames_per_chunk), cells, kv.kv))
        kv.end_pass()
    torch.testing.assert_close(outputs[1], outputs[0])
    # once the refiner's last layer has weights, it changes the picture across patch borders
    with torch.no_grad():
        conv.conv_head.conv3.weight.normal_(0, 0.1)
    kv = DenseChunkKV(cfg, 2)
    kv.begin_pass(commit=False)
    assert not torch.allclose(conv(noisy, t, direction, torch.arange(cfg.frames_per_chunk), cells, kv.kv), outputs[0])


def test_init_from_refuses_weights_of_another_shape(tmp_path: Path) -> None:
    source = TinyWorldDiT(TinyWorldConfig(**{**SMALL, "d_model": 64}))
    save_weights(source, tmp_path / "tiny_world.safetensors", tmp_path / "config.json")
    with pytest.raises(SystemExit, match="do not fit"):
        train.init_from(TinyWorldDiT(TinyWorldConfig(**SMALL, head="conv")), tmp_path / "tiny_world.safetensors")


def test_fine_tune_with_a_conv_head_class_loss_and_snapshots(tmp_path: Path) -> None:
    assert run(tmp_path, 2) == 0
    conv_config = tmp_path / "conv.json"
    conv_config.write_text(json.dumps({**SMALL, "head": "conv"}))
    argv = [
        "--steps", "2", "--batch-size", "2", "--self-forcing-batch-size", "1", "--chunks", "2", "--rollout-chunks", "3",
        "--self-forcing-from", "1", "--self-forcing-share", "1.0", "--worlds", "1", "--warmup", "1", "--threads", "1",
        "--config", str(conv_config), "--out", str(tmp_path / "conv"), "--init-from",
        str(tmp_path / "run" / "tiny_world.safetensors"), "--head-lr", "1e-3", "--class-loss", "0.05",
        "--still-share", "0.5", "--snapshot-every", "1",
    ]  # fmt: skip
    assert train.main(argv) == 0
    for step in (1, 2):
        snapshot = tmp_path / "conv" / "snapshots" / f"step-{step}" / "tiny_world.safetensors"
        pipeline = load_tiny_world("cpu", str(snapshot))
        assert pipeline.cfg.head == "conv"


def test_class_loss_is_small_on_the_palette_and_large_between_colours() -> None:
    clean = from_uint8(torch.from_numpy(PALETTE[None, None, :, None, :].repeat(4, axis=3)))
    assert train.class_loss(clean, clean).item() < 0.02
    halfway = (clean + clean.roll(1, dims=2)) / 2
    assert train.class_loss(halfway, clean).item() > 0.5
    mask = torch.zeros(clean.shape[:-1] + (1,))
    assert train.class_loss(halfway, clean, mask).item() == 0.0
