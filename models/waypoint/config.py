"""Waypoint's configuration: the keys of the published ``config.yaml`` this server reads, and the shapes it ships.

The published engine (Overworld's ``world_engine``, ``src/model/`` at commit
208c909824d906bf441122b7c40b9b4e1050d7c3) reads an OmegaConf ``config.yaml``
next to ``model.safetensors``. :func:`config_from_yaml` reads the keys that
shape the transformer and refuses, naming the file and the keys, a config this
server cannot serve exactly:

- ``prompt_conditioning`` set: the text path needs a UMT5-XL encoder this
  package does not load;
- a ``global_window`` that is not a multiple of ``global_pinned_dilation`` (the
  published cache asserts the same).

Per-layer windows: every ``global_attn_period``-th layer (from
``global_attn_offset``) is a *global* layer that sees ``global_window`` frames,
of which only every ``global_pinned_dilation``-th (by absolute frame index) and
the current frame; the others are *local* layers that see the last
``local_window`` frames. The runner keeps one window per session for every
layer, so the pipeline declares the widest and each layer masks its own
(:meth:`WaypointConfig.layer_window`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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
    fps: int = 60
    # the autoencoder's output size (the published decoder resizes to 360p)
    image_height: int = 360
    image_width: int = 640
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
        """The widest layer's window: what a session keeps for every layer."""
        return max(self.layer_window(layer)[0] for layer in range(self.n_layers))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# the autoencoder's decoder shape (decoder_conf.yml's ``model`` keys)
AE_1_5: dict[str, Any] = {
    "channels": 3,
    "latent_channels": 16,
    "ch_0": 64,
    "ch_max": 512,
    "decoder_blocks_per_stage": [1, 1, 1, 1, 1],
}
AE_TINY: dict[str, Any] = {
    "channels": 3,
    "latent_channels": 4,
    "ch_0": 8,
    "ch_max": 16,
    "decoder_blocks_per_stage": [1, 1],
}

CONFIGS: dict[str, WaypointConfig] = {
    # Waypoint-1.5's scale (1.2B parameters, a 512-frame context, 360p out). The real file's config.yaml
    # decides the shapes when one is loaded; this entry sizes plans and cost figures.
    "1.5": WaypointConfig(ae=AE_1_5),
    # CPU tests and ``arstream serve --model waypoint-1.5 --model-option config=tiny``: random weights
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
    refused += _later_engine_keys(raw)
    if refused:
        raise WaypointConfigError(f"{path}: cannot serve keys {refused}")
    patch = tuple(raw.get("patch", (1, 1)))
    values = {key: raw[key] for key in _REQUIRED}
    values["scheduler_sigmas"] = tuple(float(s) for s in raw["scheduler_sigmas"])
    return _merged(base, values, raw, patch)


def _later_engine_keys(raw: dict[str, Any]) -> list[str]:
    """Keys of the engine's later (Waypoint-1.5) configs whose meaning this package does not build.

    Served as if absent they would give wrong frames without an error: ``temporal_compression`` above 1 (or
    ``taehv_ae``, or ``model_type: waypoint-1.5``) means four video frames per latent frame from a streaming TAEHV
    decoder and rotary time positions in steps of the compression; an ``inference_fps`` below ``base_fps`` scales the
    time positions the same way. Both are refused until they are built.
    """
    refused = []
    compression = raw.get("temporal_compression", 1)
    if compression != 1 or raw.get("taehv_ae", False) or raw.get("model_type", "waypoint-1") != "waypoint-1":
        found = {key: raw[key] for key in ("model_type", "temporal_compression", "taehv_ae") if key in raw}
        refused.append(f"{found} (Waypoint-1.5: frames per latent frame and its TAEHV decoder are not built here)")
    fps, base_fps = raw.get("inference_fps"), raw.get("base_fps")
    if isinstance(fps, (int, float)) and isinstance(base_fps, (int, float)) and fps != base_fps:
        refused.append(f"inference_fps {fps} != base_fps {base_fps} (scaled time positions are not built here)")
    return refused


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
        patch=list(cfg.patch),
        scheduler_sigmas=list(cfg.scheduler_sigmas),
        tokens_per_frame=cfg.tokens_per_frame,
        prompt_conditioning=None,
        ctrl_conditioning="mlp_fusion",
        ctrl_cond_dropout=0.0,
    )
    return yaml.safe_dump(keys)
