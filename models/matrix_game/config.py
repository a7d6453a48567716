"""Sizes of the Matrix-Game-2.0-class causal Wan model: one code path, three sizes.

``1.3b`` is the published geometry (Wan2.1-1.3B backbone, 352x640 video,
44x80 latent, 880 tokens per latent frame, action module in blocks 0-14,
a 6-frame attention window including the current 3-frame chunk, no sink).
``1.3b-gta`` is the GTA driving variant (2 keys, a 4-frame window: one frame
of history); ``1.3b-templerun`` the Temple Run variant (7 keys, no mouse, 4
denoising steps). ``tiny`` keeps every structural feature at toy size so the
whole path runs on a 2-core CPU in tests and serves the demo; ``tiny-gta`` and
``tiny-templerun`` are the variants' layouts at that size (for tests).

Sizes and steps are the published ones (Matrix-Game-2 ``configs/distilled_model/*/config.json``
and ``configs/inference_yaml/*.yaml``), as are the key channels (``get_current_action``
in ``pipeline/causal_inference.py``) and the weights' file names (the model card).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..wan.geometry import WanGeometry
from ..wan.vae import VAEConfig


@dataclass(frozen=True)
class ActionConfig:
    """The keyboard + mouse module (``blocks.N.action_model.*`` in the published files)."""

    blocks: tuple[int, ...] = tuple(range(15))
    keyboard_dim_in: int = 4
    mouse_dim_in: int = 2
    # Temple Run's module has no mouse path (``enable_mouse: false``): no mouse_mlp/t_qkv/proj_mouse weights.
    enable_mouse: bool = True
    hidden_size: int = 128
    keyboard_hidden_dim: int = 1024
    mouse_hidden_dim: int = 1024
    heads_num: int = 16
    # Each latent frame reads the controls of the windows_size * vae_time_compression_ratio video frames before it.
    windows_size: int = 3
    vae_time_compression_ratio: int = 4
    # Only the time axis of the action rotary embedding turns (its height/width positions are always 0).
    rope_time_dim: int = 8
    rope_theta: float = 256.0
    qkv_bias: bool = False

    @property
    def condition_frames(self) -> int:
        return self.windows_size * self.vae_time_compression_ratio

    @property
    def mouse_dims(self) -> int:
        """Mouse channels per video frame the module reads (0 without a mouse path)."""
        return self.mouse_dim_in if self.enable_mouse else 0


@dataclass(frozen=True)
class ClipConfig:
    """The CLIP vision tower that encodes the start image (open-clip XLM-RoBERTa ViT-H/14)."""

    dim: int = 1280
    num_layers: int = 32
    num_heads: int = 16
    patch_size: int = 14
    image_size: int = 224
    mlp_ratio: int = 4
    out_dim: int = 1024
    eps: float = 1e-5

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


@dataclass(frozen=True, kw_only=True)
class MatrixGameConfig(WanGeometry):
    """The backbone's fields are :class:`WanGeometry`'s; those its published model sets otherwise are declared again."""

    name: str
    # noisy latent (16) + mask (4) + image-conditioning latent (16)
    in_dim: int = 36
    clip_dim: int = 1280
    clip_tokens: int = 257
    latent_height: int = 44  # 352x640 video
    latent_width: int = 80
    local_attn_size: int = 6  # latent frames a chunk attends to, itself included
    sink_size: int = 0
    denoise_timesteps: tuple[int, ...] = (1000, 666, 333)
    # Playback rate: the published code writes every mode's videos at 12 fps (utils/visualize.py,
    # process_video); the card's "25fps" is generation speed (docs/matrix-game.md, "Playback rate").
    fps: int = 12
    # Keyboard channels in the published order (``keys[i]`` sets channel i); ``idle_key``'s channel
    # is set when no key is held (Temple Run's "nomove" channel; the others send all zeros).
    keys: tuple[str, ...] = ("w", "s", "a", "d")
    idle_key: str | None = None
    # The DiT's file in the published checkpoint directory (Skywork/Matrix-Game-2.0).
    dit_file: str = "base_distilled_model/base_distill.safetensors"
    action: ActionConfig = field(default_factory=ActionConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)

    def __post_init__(self) -> None:
        if len(self.keys) != self.action.keyboard_dim_in:
            raise ValueError(f"{len(self.keys)} keys for {self.action.keyboard_dim_in} keyboard channels")
        if (self.clip.tokens, self.clip.dim) != (self.clip_tokens, self.clip_dim):
            raise ValueError(
                f"the CLIP tower gives {self.clip.tokens} tokens of {self.clip.dim}; "
                f"the DiT expects {self.clip_tokens} of {self.clip_dim}"
            )

    @property
    def video_frames_per_latent(self) -> int:
        return self.action.vae_time_compression_ratio


_TINY: dict[str, Any] = dict(
    dim=32,
    ffn_dim=64,
    num_heads=2,
    num_layers=2,
    clip_dim=16,
    clip_tokens=5,
    latent_height=4,
    latent_width=6,
    fps=16,
    vae=VAEConfig(base_dim=8, num_res_blocks=1),
    clip=ClipConfig(dim=16, num_layers=2, num_heads=2, image_size=28, mlp_ratio=2, out_dim=8),
)
_TINY_ACTION = ActionConfig(
    blocks=(0,), hidden_size=8, keyboard_hidden_dim=32, mouse_hidden_dim=32, heads_num=2, rope_time_dim=4
)
# GTA driving: forward/back keys; the published demo steers with the mouse (A/D send camera yaw -/+0.1).
_GTA: dict[str, Any] = dict(
    local_attn_size=4, keys=("w", "s"), dit_file="gta_distilled_model/gta_keyboard2dim.safetensors"
)
# Temple Run: channels nomove, jump, slide, turn left, turn right, left side, right side, bound to the
# published demo's keys Q, W, S, Z, C, A, D; four steps (1000, 750, 500, 250); no mouse.
_TEMPLE_RUN: dict[str, Any] = dict(
    keys=("q", "w", "s", "z", "c", "a", "d"),
    idle_key="q",
    denoise_timesteps=(1000, 750, 500, 250),
    dit_file="templerun_distilled_model/templerun_7dim_onlykey.safetensors",
)

CONFIGS: dict[str, MatrixGameConfig] = {
    "1.3b": MatrixGameConfig(name="1.3b"),
    # a window shorter than a chunk: one history frame
    "1.3b-gta": MatrixGameConfig(name="1.3b-gta", action=ActionConfig(keyboard_dim_in=2), **_GTA),
    "1.3b-templerun": MatrixGameConfig(
        name="1.3b-templerun", action=ActionConfig(keyboard_dim_in=7, enable_mouse=False), **_TEMPLE_RUN
    ),
    "tiny": MatrixGameConfig(name="tiny", action=_TINY_ACTION, **_TINY),
    "tiny-gta": MatrixGameConfig(name="tiny-gta", action=replace(_TINY_ACTION, keyboard_dim_in=2), **_TINY, **_GTA),
    "tiny-templerun": MatrixGameConfig(
        name="tiny-templerun",
        action=replace(_TINY_ACTION, keyboard_dim_in=7, enable_mouse=False),
        **_TINY,
        **_TEMPLE_RUN,
    ),
}


def get_config(name: str, **overrides: Any) -> MatrixGameConfig:
    try:
        config = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown matrix-game-2 config {name!r}; expected one of {sorted(CONFIGS)}") from None
    return replace(config, **overrides) if overrides else config
