"""Waypoint's configuration: the keys of the published ``config.yaml`` this server reads, and the shapes it ships.

The published engine (Overworld's ``world_engine``, ``src/model/`` at commit
208c909824d906bf441122b7c40b9b4e1050d7c3) reads an OmegaConf ``config.yaml``
next to ``model.safetensors``. :func:`config_from_yaml` reads the keys that
shape the transformer and refuses, naming the file and the keys, a config this
server cannot serve exactly:

- ``prompt_conditioning`` set: the text path needs a UMT5-XL encoder this
  package does not load;
- a ``global_window`` that is not a multiple of ``global_pinned_dilation`` (the
  published cache asserts the same);
- of the later engine's (Waypoint-1.5's) keys, what is not built here
  (:func:`_temporal_keys`, :func:`_decoded_size`). Those that are: ``taehv_ae``
  and ``temporal_compression`` (four frames a latent frame from TAEHV),
  ``inference_fps`` (the frames' rate), ``auto_aspect_ratio`` (the 720p/360p
  resize) and ``max_frames`` (read as ``n_frames`` when that is absent).

Per-layer windows: every ``global_attn_period``-th layer (from
``global_attn_offset``) is a *global* layer that sees ``global_window`` frames,
of which only every ``global_pinned_dilation``-th (by absolute frame index) and
the current frame; the others are *local* layers that see the last
``local_window`` frames. The runner keeps one history per session for every
layer: the pipeline declares the local window dense and the global one as a
strided tail (:attr:`WaypointConfig.kept_windows`), and each layer masks what
it does not see (:meth:`WaypointConfig.layer_window`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml


class WaypointConfigError(ValueError):
    """A config file this server cannot serve; the message names the file and the keys."""


@dataclass(frozen=True)
class WaypointConfig:
    """The transformer's shape (token grid ``height`` x ``width`` after patching) and its sampler."""

    d_model: int = 2048
    n_heads: int = 16
    n_kv_heads: int = 16
    n_layers: int = 18
    mlp_ratio: int = 4
    channels: int = 16
    height: int = 16  # token rows per frame (latent rows / patch rows)
    width: int = 16
    patch: tuple[int, int] = (1, 1)
    n_buttons: int = 256
    n_frames: int = 512  # the rotary table's frames: the context the model was trained for
    local_window: int = 16
    global_window: int = 16
    global_pinned_dilation: int = 1
    global_attn_period: int = 1
    global_attn_offset: int = 0
    ctrl_conditioning_period: int = 1
    noise_conditioning: str = "wan"
    value_residual: bool = False
    gated_attn: bool = False
    scheduler_sigmas: tuple[float, ...] = (1.0, 0.8, 0.5, 0.0)
    fps: int = 60  # video frames a second (the published ``inference_fps``)
    # video frames per latent frame, so per chunk and per control input (Waypoint-1.5: 4)
    temporal_compression: int = 1
    # the picture size frames are served at (the Waypoint-1 decoder resizes to it; Waypoint-1.5's TAEHV output is
    # resized to it when it differs, as the published engine's ``auto_aspect_ratio`` does)
    image_height: int = 360
    image_width: int = 640
    # decoder: the Waypoint-1 autoencoder (``decoder_conf.yml``'s keys) or, with ``taehv_ae``, TAEHV's
    # ``widths``, ``latent_channels`` and ``patch_size``
    taehv_ae: bool = False
    ae: dict[str, Any] = field(default_factory=dict)

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads

    @property
    def tokens_per_frame(self) -> int:
        return self.height * self.width

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """One latent frame: channels, rows, columns."""
        return self.channels, self.height * self.patch[0], self.width * self.patch[1]

    def layer_window(self, layer: int) -> tuple[int, int]:
        """``(frames, dilation)`` of ``layer``: a global layer sees the current frame and, of the
        ``global_window - 1`` frames before it, those whose absolute index is a multiple of the dilation; a local
        layer the last ``local_window`` frames, itself included (the published ``StaticKVCache``'s rule)."""
        offset = self.global_attn_offset % self.global_attn_period
        if (layer - offset) % self.global_attn_period == 0:
            return self.global_window, self.global_pinned_dilation
        return self.local_window, 1

    @property
    def window_frames(self) -> int:
        """The widest layer's window."""
        return max(self.layer_window(layer)[0] for layer in range(self.n_layers))

    @property
    def kept_windows(self) -> tuple[int, int, int]:
        """``(dense, strided, stride)``: what a session keeps for every layer, as the runner's KV spec says it.

        The last ``dense`` frames (the widest undilated window), and of the last
        ``strided`` frames those whose index is a multiple of ``stride`` (the
        dilated global window, where it reaches further back); ``(widest, 0, 1)``
        when no dilated window reaches past the dense one, or dilations differ.
        """
        windows = {self.layer_window(layer) for layer in range(self.n_layers)}
        dense = max((frames for frames, dilation in windows if dilation == 1), default=1)
        beyond = {(frames, dilation) for frames, dilation in windows if dilation > 1 and frames > dense}
        if len(beyond) != 1 or len({dilation for _, dilation in windows if dilation > 1}) != 1:
            return self.window_frames, 0, 1
        ((strided, stride),) = beyond
        return dense, strided, stride

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# the autoencoder's decoder shape (decoder_conf.yml's ``model`` keys)
AE_WAYPOINT_1: dict[str, Any] = {
    "channels": 3,
    "latent_channels": 16,
    "ch_0": 64,
    "ch_max": 512,
    "decoder_blocks_per_stage": [1, 1, 1, 1, 1],
}
# TAEHV for HunyuanVideo 1.5 latents (``taehv1_5.pth``): 32 channels, a 2x2 patch, TAEHV's default widths
TAEHV_1_5: dict[str, Any] = {"widths": [256, 128, 64, 64], "latent_channels": 32, "patch_size": 2}
TAEHV_TINY: dict[str, Any] = {"widths": [8, 8, 4, 4], "latent_channels": 4, "patch_size": 2}
AE_TINY: dict[str, Any] = {
    "channels": 3,
    "latent_channels": 4,
    "ch_0": 8,
    "ch_max": 16,
    "decoder_blocks_per_stage": [1, 1],
}

# Waypoint-1.5-1B's transformer as its release is described (see docs/models.md for the sources): 24 layers of
# 2048 wide, 32 query and 16 K/V heads; 32 latent channels in 2x2 patches; every fourth layer (offset -1) global over
# 128 frames dilated by 8, the others local over 16; controls fused every third layer; 4 denoising steps; four
# 60 fps frames per latent frame from TAEHV. A loaded file's config.yaml decides the shapes; these size plans.
_RELEASE_1_5 = WaypointConfig(
    d_model=2048, n_heads=32, n_kv_heads=16, n_layers=24, mlp_ratio=4, channels=32, height=16, width=32,
    patch=(2, 2), n_buttons=256, n_frames=512, local_window=16, global_window=128, global_pinned_dilation=8,
    global_attn_period=4, global_attn_offset=-1, ctrl_conditioning_period=3, noise_conditioning="wan",
    value_residual=True, gated_attn=False, scheduler_sigmas=(1.0, 0.9, 0.75, 0.3, 0.0), fps=60,
    temporal_compression=4, image_height=720, image_width=1280, taehv_ae=True, ae=TAEHV_1_5,
)
# TAEHV decodes 16 pixels a latent cell; the published engine serves 16:8 pictures resized to 16:9 (encode sizes
# 512x1024 and 256x512 for 720p and 360p)
TAEHV_TIERS = {(512, 1024): (720, 1280), (256, 512): (360, 640)}

CONFIGS: dict[str, WaypointConfig] = {
    # Waypoint-1.5-1B (720p) and Waypoint-1.5-1B-360P: the 360p tier halves the token grid
    "1.5": _RELEASE_1_5,
    "1.5-360p": replace(_RELEASE_1_5, height=8, width=16, image_height=360, image_width=640),
    # CPU tests and ``arstream serve --model waypoint-1.5 --model-options '{"config": "tiny"}'``: random weights
    "tiny": WaypointConfig(
        d_model=32,
        n_heads=2,  # heads of 16 channels: the rotary split needs head_size a multiple of 16
        n_kv_heads=1,
        n_layers=3,
        mlp_ratio=2,
        channels=4,
        height=2,
        width=4,
        patch=(2, 2),
        n_buttons=256,  # as many as the published file: the page's keys all reach the model
        n_frames=24,
        local_window=4,
        global_window=4,
        ctrl_conditioning_period=2,
        value_residual=True,
        gated_attn=True,
        scheduler_sigmas=(1.0, 0.75, 0.4, 0.0),
        fps=16,
        image_height=24,
        image_width=40,
        ae=AE_TINY,
    ),
}
# CPU tests of Waypoint-1.5's own parts: the tiny transformer with four frames per latent frame from a tiny TAEHV
# (4x8 latent cells decode to 64x128, resized to 72x128 as the published 16:8 -> 16:9 resize does)
CONFIGS["tiny-1.5"] = replace(
    CONFIGS["tiny"], temporal_compression=4, fps=60, image_height=72, image_width=128, taehv_ae=True, ae=TAEHV_TINY
)


def get_config(name: str) -> WaypointConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown waypoint config {name!r}; expected one of {sorted(CONFIGS)}") from None


# config.yaml keys this server reads (besides those it refuses when set)
_REQUIRED = ("d_model", "n_heads", "n_layers", "mlp_ratio", "channels", "height", "width", "n_buttons", "n_frames",
             "local_window", "global_window", "global_attn_period", "ctrl_conditioning_period", "scheduler_sigmas")
# window keys: whole numbers of at least 1
_WINDOW_KEYS = ("local_window", "global_window", "global_pinned_dilation", "global_attn_period")


def config_from_yaml(path: Path, base: WaypointConfig) -> WaypointConfig:
    """The config ``path`` (the published ``config.yaml``) describes; ``base`` gives what it leaves out."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise WaypointConfigError(f"{path}: not a readable YAML config ({exc})") from None
    if not isinstance(raw, dict):
        raise WaypointConfigError(f"{path}: expected a mapping of config keys")
    if "n_frames" not in raw and "max_frames" in raw:  # the later engine's name for the trained context
        raw["n_frames"] = raw["max_frames"]
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise WaypointConfigError(f"{path}: missing keys {missing}")
    refused = []
    if raw.get("prompt_conditioning") is not None:
        refused.append("prompt_conditioning (a text encoder this server does not load)")
    windows = {key: raw.get(key, 1) for key in _WINDOW_KEYS}
    bad = [key for key, value in windows.items() if not isinstance(value, int) or isinstance(value, bool) or value < 1]
    if bad:
        refused.append(f"{', '.join(bad)} (a whole number of at least 1)")
    elif windows["global_window"] % windows["global_pinned_dilation"]:
        refused.append("global_window not a multiple of global_pinned_dilation")
    if raw.get("tokens_per_frame", raw["height"] * raw["width"]) != raw["height"] * raw["width"]:
        refused.append("tokens_per_frame != height * width")
    refused += _temporal_keys(raw)
    size = _decoded_size(raw, base) if raw.get("taehv_ae", False) else (base.image_height, base.image_width)
    if isinstance(size, str):
        refused.append(size)
    if refused:
        raise WaypointConfigError(f"{path}: cannot serve keys {refused}")
    patch = tuple(raw.get("patch", (1, 1)))
    values = {key: raw[key] for key in _REQUIRED}
    values["scheduler_sigmas"] = tuple(float(s) for s in raw["scheduler_sigmas"])
    values.update(temporal_compression=int(raw.get("temporal_compression", 1)), taehv_ae=bool(raw.get("taehv_ae", False)))
    if isinstance(raw.get("inference_fps"), int):
        values["fps"] = raw["inference_fps"]
    assert not isinstance(size, str)
    values["image_height"], values["image_width"] = size
    if values["taehv_ae"] != base.taehv_ae:  # the decoder's shape is the file's to say; start from the release's
        values["ae"] = dict(TAEHV_1_5 if values["taehv_ae"] else AE_WAYPOINT_1)
    return _merged(base, values, raw, patch)


def _temporal_keys(raw: dict[str, Any]) -> list[str]:
    """Refusals among the keys the engine's later (Waypoint-1.5) configs add.

    ``temporal_compression`` above 1 needs the TAEHV decoder (``taehv_ae``), which makes that many frames of each
    latent frame. The published engine steps the rotary time position by ``base_fps // (inference_fps //
    temporal_compression)`` a latent frame; this package steps it by 1, so any other step is refused.
    """
    refused = []
    model_type = raw.get("model_type", "waypoint-1")
    if model_type not in ("waypoint-1", "waypoint-1.5"):
        refused.append(f"model_type {model_type!r} (expected waypoint-1 or waypoint-1.5)")
    compression = raw.get("temporal_compression", 1)
    if not isinstance(compression, int) or isinstance(compression, bool) or compression < 1:
        refused.append("temporal_compression (a whole number of at least 1)")
        return refused
    if compression > 1 and not raw.get("taehv_ae", False):
        refused.append(f"temporal_compression {compression} without taehv_ae (no decoder here makes those frames)")
    fps, base_fps = raw.get("inference_fps"), raw.get("base_fps")
    if isinstance(fps, int) and isinstance(base_fps, int):
        if fps % compression or base_fps // max(1, fps // compression) != 1:
            refused.append(f"base_fps {base_fps}, inference_fps {fps}, temporal_compression {compression} (a rotary "
                           "time step other than 1 a latent frame)")
    return refused


def _decoded_size(raw: dict[str, Any], base: WaypointConfig) -> tuple[int, int] | str:
    """The picture size served for a TAEHV config: 16 pixels a latent cell, resized 16:8 -> 16:9 as published."""
    patch = raw.get("patch", (1, 1))
    decoded = (int(raw["height"]) * int(patch[0]) * 16, int(raw["width"]) * int(patch[1]) * 16)
    if not raw.get("auto_aspect_ratio", True):
        return decoded
    if decoded in TAEHV_TIERS:
        return TAEHV_TIERS[decoded]
    if base.taehv_ae and decoded[0] == base.latent_shape[1] * 16 and decoded[1] == base.latent_shape[2] * 16:
        return base.image_height, base.image_width  # a test config of this grid names its own size
    return f"auto_aspect_ratio for a {decoded[0]}x{decoded[1]} picture (the published sizes: {sorted(TAEHV_TIERS)})"


def _merged(
    base: WaypointConfig, values: dict[str, Any], raw: dict[str, Any], patch: tuple[Any, ...]
) -> WaypointConfig:
    merged = {**asdict(base), **values}
    merged.update(
        patch=(int(patch[0]), int(patch[1])),
        n_kv_heads=int(raw.get("n_kv_heads", raw["n_heads"])),
        global_pinned_dilation=int(raw.get("global_pinned_dilation", 1)),
        global_attn_offset=int(raw.get("global_attn_offset", 0)),
        noise_conditioning=str(raw.get("noise_conditioning", base.noise_conditioning)),
        value_residual=bool(raw.get("value_residual", False)),
        gated_attn=bool(raw.get("gated_attn", False)),
    )
    return WaypointConfig(**merged)


def config_to_yaml(cfg: WaypointConfig) -> str:
    """``cfg`` as the published ``config.yaml`` spells it (tests synthesise files in that layout)."""
    keys = dict(cfg.to_dict())
    for own in ("fps", "image_height", "image_width", "ae"):
        keys.pop(own)
    keys.update(
        model_type="waypoint-1.5" if cfg.taehv_ae else "waypoint-1",
        inference_fps=cfg.fps,
        base_fps=cfg.fps // cfg.temporal_compression,
    )
    keys.update(
        patch=list(cfg.patch),
        scheduler_sigmas=list(cfg.scheduler_sigmas),
        tokens_per_frame=cfg.tokens_per_frame,
        prompt_conditioning=None,
        ctrl_conditioning="mlp_fusion",
        ctrl_cond_dropout=0.0,
    )
    return yaml.safe_dump(keys)
