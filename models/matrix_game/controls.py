"""Controls -> Matrix-Game's per-video-frame keyboard and mouse conditions, and each latent frame's window.

A tick's controls hold for every video frame of its chunk. Latent frame
``p`` reads the conditions of the ``condition_frames`` (12) video frames
``4p - 12 .. 4p - 1``; frames before the first count as the first frame's
conditions (Matrix-Game pads with a copy of frame 0). A session keeps only
frame 0's conditions and the last ``condition_frames`` frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config import MatrixGameConfig

CAMERA_AXES = ("pitch", "yaw")


def controls_schema(cfg: MatrixGameConfig) -> dict[str, Any]:
    """The config's keys (its keyboard channels); ``camera`` only where the model has a mouse path."""
    keys = list(cfg.keys)
    properties: dict[str, Any] = {
        "keys": {"type": "array", "items": {"enum": keys}, "uniqueItems": True, "maxItems": len(keys)},
    }
    if cfg.action.enable_mouse:
        properties["camera"] = {
            "type": "object",
            "description": "camera rotation per video frame (the mouse), in Matrix-Game's units",
            "properties": {axis: {"type": "number", "minimum": -1, "maximum": 1} for axis in CAMERA_AXES},
            "additionalProperties": False,
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }


def condition_vectors(controls: dict[str, Any], cfg: MatrixGameConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(keyboard ``[keyboard_dim]``, mouse ``[mouse_dim]``) for one video frame under ``controls``."""
    keyboard = torch.zeros(cfg.action.keyboard_dim_in)
    held = [key for key in controls.get("keys", []) if key in cfg.keys]
    for key in held or ([cfg.idle_key] if cfg.idle_key else []):
        keyboard[cfg.keys.index(key)] = 1.0
    camera = controls.get("camera") or {}
    mouse = torch.tensor([float(camera.get(axis, 0.0)) for axis in CAMERA_AXES][: cfg.action.mouse_dims])
    return keyboard, mouse


@dataclass(frozen=True)
class ControlHistory:
    """Frame 0's conditions and those of the last video frames (immutable)."""

    first_keyboard: torch.Tensor  # [keyboard_dim]
    first_mouse: torch.Tensor  # [mouse_dim]
    keyboard: torch.Tensor  # [V, keyboard_dim], video frames start .. start + V - 1
    mouse: torch.Tensor  # [V, mouse_dim]
    start: int

    @property
    def end(self) -> int:
        return self.start + self.keyboard.shape[0]


def extend(
    history: ControlHistory | None, controls: dict[str, Any], frames: int, cfg: MatrixGameConfig
) -> ControlHistory:
    """The history with ``frames`` more video frames under ``controls``."""
    keyboard, mouse = condition_vectors(controls, cfg)
    new_kb, new_mouse = keyboard.expand(frames, -1), mouse.expand(frames, -1)
    if history is None:
        return ControlHistory(keyboard, mouse, new_kb.clone(), new_mouse.clone(), 0)
    return ControlHistory(
        history.first_keyboard,
        history.first_mouse,
        torch.cat([history.keyboard, new_kb]),
        torch.cat([history.mouse, new_mouse]),
        history.start,
    )


def trimmed(history: ControlHistory, cfg: MatrixGameConfig) -> ControlHistory:
    """Only what later latent frames can still read: the last ``condition_frames`` video frames."""
    keep = cfg.action.condition_frames
    drop = max(history.keyboard.shape[0] - keep, 0)
    return ControlHistory(
        history.first_keyboard, history.first_mouse, history.keyboard[drop:], history.mouse[drop:], history.start + drop
    )


def windows(history: ControlHistory, latent_frames: range, cfg: MatrixGameConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(mouse ``[F, condition_frames * mouse_dim]``, keyboard ``[F, condition_frames, keyboard_dim]``)."""
    ratio, span = cfg.video_frames_per_latent, cfg.action.condition_frames
    mouse_rows, keyboard_rows = [], []
    for p in latent_frames:
        video = range(ratio * p - span, ratio * p)
        if video.stop > history.end or any(0 <= v < history.start for v in video):
            raise ValueError(f"latent frame {p} needs video frames {video.start}..{video.stop - 1}, "
                             f"the history holds {history.start}..{history.end - 1}")
        kb = [history.first_keyboard if v < 0 else history.keyboard[v - history.start] for v in video]
        ms = [history.first_mouse if v < 0 else history.mouse[v - history.start] for v in video]
        keyboard_rows.append(torch.stack(kb))
        mouse_rows.append(torch.stack(ms).flatten())
    return torch.stack(mouse_rows), torch.stack(keyboard_rows)
