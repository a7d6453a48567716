"""``load_krea``: Krea Realtime from its published files, or with seeded random weights.

Layout, as krea-ai/realtime-video's README downloads it, all in one
directory: ``krea-realtime-video-14b.safetensors`` (the DiT, a flat state
dict whose keys carry the training wrapper's ``model.`` prefix:
``model.blocks.N.self_attn.q.weight``...), and Wan2.1's
``models_t5_umt5-xxl-enc-bf16.pth``, ``Wan2.1_VAE.pth`` and the tokenizer
directory ``google/umt5-xxl`` (Krea's server reads them from Wan2.1-T2V-1.3B's
folder: the same files). The load is exact (a missing, unexpected or misshapen
key fails naming the file and the keys); then each block's self-attention
q, k and v are fused into one projection, as Krea's loader does.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from .config import get_config
from .pipeline import KreaPipeline
from ..longlive.checkpoint import dit_key
from ..longlive.dit import LongLiveDiT
from ..longlive.loading import load_parts
from ..wan.checkpoint import find_file, load_into, read_state_dict
from ..wan.layers import WanAttentionBlock


def load_krea_dit(model: LongLiveDiT, path: Path) -> LongLiveDiT:
    """The published DiT file (``model.`` keys) into ``model``, exactly; then q/k/v fused."""
    state = read_state_dict(path)
    load_into(model, {dit_key(k): v for k, v in state.items()}, path)
    fuse_self_attention(model)
    return model


def fuse_self_attention(model: LongLiveDiT) -> None:
    for block in model.blocks:
        cast(WanAttentionBlock, block).self_attn.fuse_projections()


def load_krea(
    device: torch.device | str = "cpu",
    *,
    config: str = "14b",
    checkpoint: str | None = None,
    random_init: bool = False,
    seed: int = 0,
    dtype: str | None = None,
    dit_file: str | None = None,
    t5_file: str | None = None,
    vae_file: str | None = None,
    tokenizer: str | None = None,
    default_prompt: str | None = None,
    prompt_cache: int = 4,
    prompt_blend_chunks: int | None = None,
    session_capacity: int = 8,
    weights: str | None = None,
    text_encoder_device: str | None = None,
) -> KreaPipeline:
    """Build Krea Realtime from a directory in the published layout, or ``random_init`` (fused the same way);
    ``weights`` (int8, fp8, w8a8) and ``text_encoder_device`` as LongLive's (:func:`load_parts`), and on the meta device
    (``arstream plan``) its shapes and bytes only."""
    overrides = {} if prompt_blend_chunks is None else {"prompt_blend_chunks": int(prompt_blend_chunks)}
    cfg = get_config(config, **overrides)
    if cfg.prompt_blend_chunks < 2:
        raise ValueError(f"prompt_blend_chunks must be at least 2 (the first blended chunk is the old prompt's), "
                         f"got {cfg.prompt_blend_chunks}")  # fmt: skip

    def dit(model: LongLiveDiT, directory: Path) -> LongLiveDiT:
        return load_krea_dit(model, find_file(directory, dit_file, (cfg.dit_file,), "Krea Realtime DiT"))

    device = torch.device(device)
    parts = load_parts(cfg, device, family="krea-realtime", load_dit=dit, checkpoint=checkpoint,
                       random_init=random_init, seed=seed, dtype=dtype, t5_file=t5_file, vae_file=vae_file,
                       tokenizer=tokenizer, weights=weights, text_encoder_device=text_encoder_device,
                       prepare_dit=fuse_self_attention)  # fused before any quantization: one projection to quantize
    pipeline = KreaPipeline(parts.model, parts.vae, parts.text, device=device, session_capacity=session_capacity,
                            prompt_cache=prompt_cache, default_prompt=default_prompt,
                            components=parts.components)  # fmt: skip
    pipeline.random_weights = checkpoint is None
    return pipeline
