"""Sizes of the LongLive model: the published 1.3B geometry, Self-Forcing's and CausVid's, and tiny ones for CI.

``1.3b`` is LongLive v1.0 as shipped (``configs/longlive_interactive_inference.yaml``
on Wan2.1-T2V-1.3B): 3 latent frames a chunk, ``local_attn_size`` 12 counting
the 3 sink frames, so each chunk sees the sink, the 6 frames before it and
itself (a 9-frame window including the chunk, as :class:`KVCacheSpec` counts
it); four distilled steps (1000, 750, 500, 250) warped by shift 5; 480x832
video (60x104 latent, 1560 tokens a latent frame); umT5-XXL text, 512 tokens.

``self-forcing-1.3b`` is Self-Forcing's (``configs/self_forcing_dmd.yaml``):
no sink, and every frame of its 21-frame rollout sees every earlier one
(``local_attn_size`` -1 over a 21-frame cache); here a 21-frame window, which
is that exactly for the first 21 latent frames and then rolls as
Self-Forcing's own code does with ``local_attn_size`` 21. Its weights are the
EMA ones (``generator_ema``, as its README runs them). ``causvid-1.3b`` is
CausVid's published autoregressive checkpoint with ``configs/wan_causal_dmd.yaml``:
the same 21-frame attention, three steps (1000, 757, 522) *not* warped
(the DiT sees them as they are), shift 8. Beyond 21 latent frames CausVid's
code does not roll: it starts a new rollout from re-encoded frames, which a
stream cannot do (docs/models.md, "CausVid"); here the window rolls.
``causal-forcing-1.3b`` and ``causal-forcing-framewise-1.3b`` are Causal
Forcing's published weights (thu-ml/Causal-Forcing: a drop-in for
Self-Forcing's, run by the same inference pipeline): Self-Forcing's attention
and steps, 3 latent frames a chunk (``chunkwise/causal_forcing.pt``, read from
``generator`` as its README runs it) or one (``framewise/causal_forcing.pt``,
its EMA weights: ``generator_ema``, as its README runs that one); their card
names the model ``causal-forcing``.
``tiny`` keeps every structural feature at toy size for tests on a CPU;
``tiny-self-forcing``, ``tiny-causvid``, ``tiny-causal-forcing`` and
``tiny-causal-forcing-framewise`` are the other layouts at that size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..wan.geometry import WanGeometry
from ..wan.vae import VAEConfig


@dataclass(frozen=True)
class TextEncoderConfig:
    """umT5's encoder (Wan's ``umt5-xxl``): ``transformers.UMT5Config`` fields."""

    vocab_size: int = 256384
    dim: int = 4096
    ffn_dim: int = 10240
    num_heads: int = 64
    num_layers: int = 24
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


@dataclass(frozen=True, kw_only=True)
class LongLiveConfig(WanGeometry):
    """The backbone's fields are :class:`WanGeometry`'s (their defaults are LongLive's 1.3B)."""

    name: str
    model: str = "longlive"  # the name the model card gives (what ``GET /v1/models`` lists)
    text_len: int = 512  # umT5 tokens the DiT's cross-attention reads (real ones, then zeros)
    sink_size: int = 3
    local_attn_size: int = 12  # LongLive's count: the sink plus the window, the current chunk included
    denoise_timesteps: tuple[int, ...] = (1000, 750, 500, 250)
    warp_timesteps: bool = True  # the DiT sees 1000 * sigma (False: the timestep itself; CausVid's 3-step config)
    fps: int = 16  # Wan2.1's playback rate
    video_frames_per_latent: int = 4  # the VAE's time compression
    default_prompt: str = "A calm lake at sunrise, mist over the water, the camera drifting slowly forward."
    dit_file: str = "longlive_base.pt"
    dit_entry: str = "generator"  # the entry of the DiT file that holds the weights (files hold several)
    lora_file: str | None = "lora.pt"
    lora_rank: int = 256
    lora_alpha: int = 256
    text: TextEncoderConfig = field(default_factory=TextEncoderConfig)

    @property
    def window_frames(self) -> int:
        """The window as :class:`~arstream.runner.spec.KVCacheSpec` counts it (the chunk included, the sink not)."""
        return self.local_attn_size - self.sink_size


TINY_FIELDS: dict[str, Any] = dict(
    dim=32,
    ffn_dim=64,
    num_heads=2,
    # four layers: a re-cache's attention shapes the K/V of every layer past the first, so depth makes it show
    num_layers=4,
    text_len=24,
    latent_height=4,
    latent_width=6,
    lora_rank=4,
    lora_alpha=8,
    vae=VAEConfig(base_dim=8, num_res_blocks=1),
    text=TextEncoderConfig(vocab_size=260, dim=16, ffn_dim=32, num_heads=2, num_layers=2, num_buckets=8, max_distance=16),
)

# Self-Forcing and CausVid: no sink, every frame of a 21-frame rollout sees every earlier one, no LoRA
_SELF_FORCING: dict[str, Any] = dict(sink_size=0, local_attn_size=21, lora_file=None, dit_file="self_forcing_dmd.pt",
                                     dit_entry="generator_ema")  # fmt: skip
_CAUSVID: dict[str, Any] = dict(sink_size=0, local_attn_size=21, lora_file=None, dit_file="model.pt",
                                denoise_timesteps=(1000, 757, 522), warp_timesteps=False, timestep_shift=8.0)  # fmt: skip

# Causal Forcing: Self-Forcing's layout and steps with its own weights; frame-wise is one latent frame a chunk
_CAUSAL_FORCING: dict[str, Any] = dict(_SELF_FORCING, model="causal-forcing", dit_file="causal_forcing.pt",
                                       dit_entry="generator")  # fmt: skip
_CAUSAL_FORCING_FRAMEWISE: dict[str, Any] = dict(_CAUSAL_FORCING, frames_per_chunk=1, dit_entry="generator_ema")

CONFIGS: dict[str, LongLiveConfig] = {
    "1.3b": LongLiveConfig(name="1.3b"),
    "self-forcing-1.3b": LongLiveConfig(name="self-forcing-1.3b", **_SELF_FORCING),
    "causvid-1.3b": LongLiveConfig(name="causvid-1.3b", **_CAUSVID),
    "tiny": LongLiveConfig(name="tiny", **TINY_FIELDS),
    "tiny-self-forcing": LongLiveConfig(name="tiny-self-forcing", **_SELF_FORCING, **TINY_FIELDS),
    "tiny-causvid": LongLiveConfig(name="tiny-causvid", **_CAUSVID, **TINY_FIELDS),
    "causal-forcing-1.3b": LongLiveConfig(name="causal-forcing-1.3b", **_CAUSAL_FORCING),
    "causal-forcing-framewise-1.3b": LongLiveConfig(name="causal-forcing-framewise-1.3b", **_CAUSAL_FORCING_FRAMEWISE),
    "tiny-causal-forcing": LongLiveConfig(name="tiny-causal-forcing", **_CAUSAL_FORCING, **TINY_FIELDS),
    "tiny-causal-forcing-framewise": LongLiveConfig(name="tiny-causal-forcing-framewise", **_CAUSAL_FORCING_FRAMEWISE,
                                                    **TINY_FIELDS),  # fmt: skip
}


def get_config(name: str, **overrides: Any) -> LongLiveConfig:
    try:
        config = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown longlive config {name!r}; expected one of {sorted(CONFIGS)}") from None
    return replace(config, **overrides) if overrides else config
