"""Saving and strictly loading tiny-world weights (safetensors) and their config (JSON).

Loading fails at start-up with :class:`WeightsError`, naming the file and
what was expected, when a file is missing, truncated or unreadable, or when
its tensors do not match the architecture the config describes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .model import TinyWorldConfig, TinyWorldDiT

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "tiny_world.safetensors"
CONFIG_NAME = "config.json"
FORMAT = "arstream-tiny-world-v1"


class WeightsError(ValueError):
    """The weights or config file is missing, truncated or does not match the model."""


def save_weights(model: TinyWorldDiT, weights_path: Path, config_path: Path, meta: dict[str, Any] | None = None) -> None:
    """Write the state dict as safetensors and the config (plus training metadata) as JSON."""
    weights_path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(tensors, str(weights_path), metadata={"format": FORMAT})
    payload = {"format": FORMAT, "model": model.cfg.to_dict(), "training": meta or {}}
    config_path.write_text(json.dumps(payload, indent=2) + "\n")


def load_config(config_path: Path) -> tuple[TinyWorldConfig, dict[str, Any]]:
    if not config_path.is_file():
        raise WeightsError(f"{config_path}: config file not found; expected the JSON written next to the weights")
    try:
        payload = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{config_path}: not valid JSON ({exc}); expected a tiny-world config") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or not isinstance(payload.get("model"), dict):
        raise WeightsError(f"{config_path}: expected a JSON object with format {FORMAT!r} and a 'model' section")
    try:
        cfg = TinyWorldConfig.from_dict(payload["model"])
        TinyWorldDiT(cfg)  # validates the shape arithmetic (heads, rotary split)
    except (TypeError, ValueError) as exc:
        raise WeightsError(f"{config_path}: invalid model config: {exc}") from None
    return cfg, payload.get("training", {})


def load_model(weights_path: Path, config_path: Path | None = None) -> tuple[TinyWorldDiT, dict[str, Any]]:
    """The model with its weights, in eval mode; ``config_path`` defaults to config.json beside the weights."""
    weights_path = Path(weights_path)
    config_path = Path(config_path) if config_path is not None else weights_path.parent / CONFIG_NAME
    cfg, training = load_config(config_path)
    if not weights_path.is_file():
        raise WeightsError(f"{weights_path}: weights file not found; expected a tiny-world safetensors file")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(
            f"{weights_path}: cannot read safetensors ({exc}); the file is truncated or not a safetensors file"
        ) from None
    model = TinyWorldDiT(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise WeightsError(
            f"{weights_path}: tensors do not match the config in {config_path}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in tensors.items():
        want = expected[name]
        if tensor.shape != want.shape or tensor.dtype != want.dtype:
            raise WeightsError(
                f"{weights_path}: tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {tuple(want.shape)} {want.dtype} for the config in {config_path}"
            )
        if not torch.isfinite(tensor).all():
            raise WeightsError(f"{weights_path}: tensor {name!r} holds non-finite values")
    model.load_state_dict(tensors)
    model.eval()
    model.requires_grad_(False)
    return model, training
