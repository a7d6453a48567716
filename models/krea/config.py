"""Sizes of Krea Realtime: the published 14B geometry, and a tiny one for CI.

``14b`` is Krea Realtime 14B as its server runs it (krea-ai/realtime-video,
``release_server.py`` with ``configs/self_forcing_server_14b.yaml``):
Wan2.1-T2V-14B (5120 wide, 40 layers, 40 heads) distilled with Self-Forcing;
3 latent frames a chunk; before each chunk the K/V of a 3-frame context
(``kv_cache_num_frames``) are recomputed from latents, so a chunk sees that
context and itself: a 6-frame window counting the chunk, no sink. Five passes
a chunk (``num_denoising_steps`` 5, the demo's default): 1000, 937.5, 833.3,
625 on the scheduler's shifted grid, then one at t=0 whose K/V the history
keeps until the next recompute. A prompt change is blended over 4 chunks
(the demo's ``interp_steps``). 480x832, umT5-XXL text and the Wan VAE.
``tiny`` keeps every structural feature at toy size (2 heads) for CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..longlive.config import TINY_FIELDS, LongLiveConfig


@dataclass(frozen=True, kw_only=True)
class KreaConfig(LongLiveConfig):
    """LongLive's text-to-video Wan fields, with Krea's defaults and its own: the context and the blend."""

    model: str = "krea-realtime"
    sink_size: int = 0
    local_attn_size: int = 6  # the recomputed context (3) and the chunk (3)
    context_frames: int = 3  # ``kv_cache_num_frames``: latent frames whose K/V are recomputed before each chunk
    denoising_steps: int = 5  # ``num_denoising_steps``: passes a chunk, the last at t=0
    prompt_blend_chunks: int = 4  # ``interp_steps``: chunks a prompt change is blended over, the first still the old
    dit_file: str = "krea-realtime-video-14b.safetensors"
    lora_file: str | None = None


_14B: dict[str, Any] = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)

CONFIGS: dict[str, KreaConfig] = {
    "14b": KreaConfig(name="14b", **_14B),
    "tiny": KreaConfig(name="tiny", **TINY_FIELDS),
}


def get_config(name: str, **overrides: Any) -> KreaConfig:
    try:
        config = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown krea-realtime config {name!r}; expected one of {sorted(CONFIGS)}") from None
    return replace(config, **overrides) if overrides else config
