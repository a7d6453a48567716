"""The causal Wan DiT of Matrix-Game 2.0, with the published parameter names.

The Wan layers are :mod:`arstream.models.wan.layers`; this module adds what
Matrix-Game has besides them: the image context (``img_emb.proj``) and the
action module (``blocks.N.action_model.*``). A published state dict loads
without conversion (after its ``model.`` prefix is stripped).

Attention never owns a cache. Every forward gets an :class:`AttentionContext`
that says where each query frame sits, what it may see and where the keys
come from: the serving path hands the runner's paged KV plus the session's
action caches (:mod:`arstream.models.matrix_game.kv`); a dense reference
hands the whole sequence and a block-causal mask. So the block math is one
implementation whichever way the history is kept.

K is stored *without* rotary embedding and rotated when read, with the
positions the context gives (the runner's :meth:`frame_positions`, which stay
inside the rotary table for endless sessions). For a session shorter than the
table this is exactly the published scheme (rotate, then cache).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .config import ActionConfig, MatrixGameConfig
from ..wan.layers import (
    Rotation,
    SelfAttentionContext,
    WanAttentionBlock,
    WanDiTBase,
    WanRMSNorm,
    attend,
    rotate_pairs,
    rotation,
)


class AttentionContext(SelfAttentionContext, Protocol):
    """Where a forward's keys come from (the action module's too); see the module docstring."""

    action_key_positions: torch.Tensor  # [B, Fa] positions of the frames the action module sees
    action_mask: torch.Tensor | None  # [Fq, Fa] bool or None

    def mouse_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, S, Fq, H, D]`` per spatial token -> ``[B, S, Fa, H, D]``."""

    def keyboard_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, Fq, H, D]`` (one keyboard token per frame) -> ``[B, Fa, H, D]``."""


# ---- Matrix-Game's own layers ---------------------------------------------------------


class UnweightedRMSNorm(WanRMSNorm):
    """The action module's q/k norm: it has a ``weight`` in the published files but never applies it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


class ActionModule(nn.Module):
    """Keyboard and mouse conditioning: attention over time, per spatial token.

    Mouse: each spatial token's hidden state, concatenated with the mouse
    deltas of the video frames before its latent frame, goes through an MLP
    and attends over time to the same token in earlier frames (its own K/V
    cache, one entry per spatial token and frame). Keyboard: each spatial
    token's query attends over time to one keyboard token per latent frame
    (its own, much smaller cache). Without a mouse path (Temple Run,
    ``enable_mouse: false``) the keyboard path reads the block's hidden state directly.
    """

    def __init__(self, cfg: ActionConfig, img_hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        frames = cfg.condition_frames
        c = cfg.mouse_hidden_dim
        self.keyboard_embed = nn.Sequential(
            nn.Linear(cfg.keyboard_dim_in, cfg.hidden_size), nn.SiLU(), nn.Linear(cfg.hidden_size, cfg.hidden_size)
        )
        if cfg.enable_mouse:  # Temple Run's module has no mouse path (and none of its weights)
            self.mouse_mlp = nn.Sequential(
                nn.Linear(cfg.mouse_dim_in * frames + img_hidden_size, c),
                nn.GELU(approximate="tanh"),
                nn.Linear(c, c),
                nn.LayerNorm(c),
            )
            self.t_qkv = nn.Linear(c, 3 * c, bias=cfg.qkv_bias)
            self.img_attn_q_norm = UnweightedRMSNorm(c // cfg.heads_num, eps=1e-6)
            self.img_attn_k_norm = UnweightedRMSNorm(c // cfg.heads_num, eps=1e-6)
            self.proj_mouse = nn.Linear(c, img_hidden_size, bias=cfg.qkv_bias)
        kd = cfg.keyboard_hidden_dim
        self.key_attn_q_norm = UnweightedRMSNorm(kd // cfg.heads_num, eps=1e-6)
        self.key_attn_k_norm = UnweightedRMSNorm(kd // cfg.heads_num, eps=1e-6)
        self.mouse_attn_q = nn.Linear(img_hidden_size, kd, bias=cfg.qkv_bias)
        self.keyboard_attn_kv = nn.Linear(cfg.hidden_size * frames, 2 * kd, bias=cfg.qkv_bias)
        self.proj_keyboard = nn.Linear(kd, img_hidden_size, bias=cfg.qkv_bias)

    def _angles(self, positions: torch.Tensor) -> Rotation:
        """``[B, F]`` -> ``[B, 1, F, 1, pairs]`` cos/sin: the time rotation, broadcast over tokens and heads."""
        inv = 1.0 / torch.pow(
            self.cfg.rope_theta,
            torch.arange(0, self.cfg.rope_time_dim, 2, dtype=torch.float64, device=positions.device)
            / self.cfg.rope_time_dim,
        )
        return rotation((positions.to(torch.float64)[..., None] * inv)[:, None, :, None, :])

    def _mouse(
        self,
        x: torch.Tensor,
        layer: int,
        ctx: AttentionContext,
        frames: int,
        mouse: torch.Tensor,
        q_rot: Rotation,
        k_rot: Rotation,
    ) -> torch.Tensor:
        """The mouse path: each spatial token attends over time to the same token in earlier frames."""
        b, length, c = x.shape
        s = length // frames
        tokens = x.view(b, frames, s, c).transpose(1, 2)  # [B, S, F, C]
        mouse_in = torch.cat([tokens, mouse[:, None].expand(b, s, frames, mouse.shape[-1]).to(x.dtype)], dim=-1)
        q, k, v = self.t_qkv(self.mouse_mlp(mouse_in)).unflatten(-1, (3, self.cfg.heads_num, -1)).unbind(-3)
        q, k = self.img_attn_q_norm(q), self.img_attn_k_norm(k)  # [B, S, F, H, D]
        k_all, v_all = ctx.mouse_kv(layer, k, v)
        q, k_all = rotate_pairs(q, q_rot), rotate_pairs(k_all, k_rot)
        out = attend(q.flatten(0, 1), k_all.flatten(0, 1), v_all.flatten(0, 1), ctx.action_mask)
        out = out.reshape(b, s, frames, -1).transpose(1, 2).reshape(b, length, -1)
        return x + self.proj_mouse(out)

    def forward(
        self,
        x: torch.Tensor,
        layer: int,
        ctx: AttentionContext,
        frames: int,
        mouse: torch.Tensor,
        keyboard: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``[B, F * S, C]``; ``mouse`` ``[B, F, condition_frames * mouse_dim]``,
        ``keyboard`` ``[B, F, condition_frames, keyboard_dim]`` (each latent frame's control window)."""
        cfg = self.cfg
        b, length, c = x.shape
        s = length // frames
        heads = cfg.heads_num
        q_rot = self._angles(ctx.query_positions)
        k_rot = self._angles(ctx.action_key_positions)

        if cfg.enable_mouse:
            x = self._mouse(x, layer, ctx, frames, mouse, q_rot, k_rot)

        # keyboard: one token per latent frame, attended by every spatial token
        keys = self.keyboard_embed(keyboard.to(x.dtype)).flatten(2)  # [B, F, frames * hidden]
        k, v = self.keyboard_attn_kv(keys).unflatten(-1, (2, heads, -1)).unbind(-3)  # [B, F, H, D]
        k = self.key_attn_k_norm(k)
        q = self.key_attn_q_norm(self.mouse_attn_q(x).view(b, frames, s, heads, -1).transpose(1, 2))  # [B, S, F, H, D]
        k_all, v_all = ctx.keyboard_kv(layer, k, v)
        q = rotate_pairs(q, q_rot)
        k_all = rotate_pairs(k_all[:, None], k_rot)
        fa = k_all.shape[2]
        k_all = k_all.expand(b, s, fa, heads, -1).flatten(0, 1)
        v_all = v_all[:, None].expand(b, s, fa, heads, -1).flatten(0, 1)
        out = attend(q.flatten(0, 1), k_all, v_all, ctx.action_mask)
        out = out.reshape(b, s, frames, -1).transpose(1, 2).reshape(b, length, -1)
        return x + self.proj_keyboard(out)


class MLPProj(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(
            nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim), nn.GELU(), nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class CausalWanDiT(WanDiTBase):
    """Matrix-Game 2.0's action-conditioned, chunk-causal Wan DiT."""

    def __init__(self, cfg: MatrixGameConfig) -> None:
        super().__init__(
            in_dim=cfg.in_dim, dim=cfg.dim, out_dim=cfg.out_dim, freq_dim=cfg.freq_dim, patch_size=cfg.patch_size
        )
        self.cfg = cfg
        self.img_emb = MLPProj(cfg.clip_dim, cfg.dim)
        self.blocks = nn.ModuleList(
            WanAttentionBlock(
                cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.eps,
                ActionModule(cfg.action, cfg.dim) if i in cfg.action.blocks else None,
            )
            for i in range(cfg.num_layers)
        )
        self.add_head(cfg.eps, cfg.head_dim, cfg.rope_frames, cfg.grid)

    def image_context(self, clip_features: torch.Tensor) -> torch.Tensor:
        """``[B, clip_tokens, clip_dim]`` CLIP image tokens -> the cross-attention context."""
        return self.img_emb(clip_features)

    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        cond: torch.Tensor,
        context: torch.Tensor,
        mouse: torch.Tensor,
        keyboard: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """Predict the flow for latent frames ``x`` ``[B, 16, F, h, w]`` at per-frame ``timesteps`` ``[B, F]``.

        ``cond`` ``[B, 20, F, h, w]`` is the mask + image-conditioning latent,
        ``context`` the image context (:meth:`image_context`), ``mouse`` and
        ``keyboard`` each latent frame's control window (see :class:`ActionModule`).
        """
        _, _, frames, h, w = x.shape
        tokens, e0, e = self.embed(torch.cat([x, cond], dim=1), timesteps)
        rotations = self.rotations(ctx)
        for layer, block in enumerate(self.blocks):
            tokens = block(tokens, e0, layer, ctx, context, rotations, mouse, keyboard)
        return self.unpatchify(self.head(tokens, e), frames, h, w).float()
