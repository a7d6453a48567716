"""LongLive's causal Wan2.1 text-to-video DiT, with the published parameter names.

The Wan layers are :mod:`arstream.models.wan.layers`; a text-to-video Wan adds
``text_embedding`` (umT5's 4096-d tokens to the model width). As in Wan, the
prompt's real tokens are padded with zeros to ``text_len`` before the
embedding, so cross-attention always reads ``text_len`` tokens. The context's
cross-attention K/V depend on the prompt alone: :meth:`LongLiveDiT.cross_kv`
computes them once per prompt and every chunk of every session with that
prompt reads them (LongLive's ``crossattn_cache``, shared).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from .config import LongLiveConfig
from ..wan.layers import CrossKV, SelfAttentionContext, WanAttentionBlock, WanDiTBase

# per layer, the prompt's cross-attention K and V, [B, text_len, heads, head_dim] each
PromptKV = list[CrossKV]


class LongLiveDiT(WanDiTBase):
    def __init__(self, cfg: LongLiveConfig) -> None:
        super().__init__(in_dim=cfg.in_dim, dim=cfg.dim, out_dim=cfg.out_dim, freq_dim=cfg.freq_dim,
                         patch_size=cfg.patch_size)  # fmt: skip
        self.cfg = cfg
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text.dim, cfg.dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.dim, cfg.dim)
        )
        self.blocks = nn.ModuleList(
            WanAttentionBlock(cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.eps) for _ in range(cfg.num_layers)
        )
        self.add_head(cfg.eps, cfg.head_dim, cfg.rope_frames, cfg.grid)

    def text_context(self, tokens: torch.Tensor) -> torch.Tensor:
        """umT5 outputs of a prompt's real tokens ``[L, text_dim]`` -> the embedded context ``[1, text_len, dim]``."""
        cfg = self.cfg
        padded = tokens.new_zeros(cfg.text_len, cfg.text.dim)
        padded[: tokens.shape[0]] = tokens[: cfg.text_len]
        weight = next(self.text_embedding.parameters())
        return self.text_embedding(padded.to(weight.device, weight.dtype)[None])

    def cross_kv(self, context: torch.Tensor) -> PromptKV:
        """Every layer's cross-attention K/V of an embedded context (:meth:`text_context`)."""
        return [cast(WanAttentionBlock, block).cross_attn.project(context) for block in self.blocks]

    def forward(
        self, x: torch.Tensor, timesteps: torch.Tensor, prompt_kv: Sequence[CrossKV], ctx: SelfAttentionContext
    ) -> torch.Tensor:
        """The flow for latent frames ``x`` ``[B, 16, F, h, w]`` at per-frame ``timesteps`` ``[B, F]``, each row
        under its prompt's cross-attention K/V (``prompt_kv``: per layer, rows stacked)."""
        _, _, frames, h, w = x.shape
        tokens, e0, e = self.embed(x, timesteps)
        rotations = self.rotations(ctx)
        for layer, block in enumerate(self.blocks):
            tokens = block(tokens, e0, layer, ctx, prompt_kv[layer], rotations)
        return self.unpatchify(self.head(tokens, e), frames, h, w).float()


def stack_prompt_kv(rows: Sequence[PromptKV]) -> PromptKV:
    """Several rows' prompt K/V as one batch (per layer, rows stacked)."""
    if len(rows) == 1:
        return list(rows[0])
    return [(torch.cat([r[i][0] for r in rows]), torch.cat([r[i][1] for r in rows])) for i in range(len(rows[0]))]
