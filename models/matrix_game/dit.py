"""The causal Wan DiT of Matrix-Game 2.0, with the published parameter names.

Module and parameter names follow the original Wan / Matrix-Game code, so a
published state dict loads without conversion (after its ``model.`` prefix
is stripped): ``patch_embedding``, ``time_embedding``, ``time_projection``,
``img_emb.proj``, ``blocks.N.{norm3, self_attn, cross_attn, ffn, modulation}``,
``blocks.N.action_model.*`` and ``head.{head, modulation}``.

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

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from arstream.models.matrix_game.config import ActionConfig, MatrixGameConfig


class AttentionContext(Protocol):
    """Where a forward's keys come from; see the module docstring."""

    query_positions: torch.Tensor  # [B, Fq] rotary frame positions of the input frames
    key_positions: torch.Tensor  # [B, Fk] positions of every frame self-attention sees
    self_mask: torch.Tensor | None  # [Lq, Lk] bool (True attends) or None: everything visible
    action_key_positions: torch.Tensor  # [B, Fa] positions of the frames the action module sees
    action_mask: torch.Tensor | None  # [Fq, Fa] bool or None

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, Lq, H, D]`` for the input frames -> ``[B, Lk, H, D]`` visible K/V (unrotated)."""

    def mouse_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, S, Fq, H, D]`` per spatial token -> ``[B, S, Fa, H, D]``."""

    def keyboard_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, Fq, H, D]`` (one keyboard token per frame) -> ``[B, Fa, H, D]``."""


# ---- small pieces ------------------------------------------------------------------


def sinusoidal_embedding(dim: int, timesteps: torch.Tensor) -> torch.Tensor:
    """Wan's timestep embedding: ``[cos | sin]`` of ``t * 10000^(-i/half)``, computed in float64."""
    half = dim // 2
    t = timesteps.to(torch.float64).flatten()
    angles = torch.outer(t, torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half))
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


def rope_angles(length: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """``[length, dim // 2]`` rotation angles, one per interleaved pair of channels."""
    # explicit device: the model may be built on the meta device, the tables are not parameters
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    return torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"), inv)


Rotation = tuple[torch.Tensor, torch.Tensor]


def rotation(angles: torch.Tensor) -> Rotation:
    """``(cos, sin)`` of ``angles`` in float32, computed once and applied by every layer's :func:`rotate_pairs`."""
    return torch.cos(angles).float(), torch.sin(angles).float()


def rotate_pairs(x: torch.Tensor, rot: Rotation) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x`` ``[..., D]`` by ``rot`` (``[..., P]`` each; the first ``2P`` channels)."""
    cos, sin = rot
    pairs = cos.shape[-1]
    head, tail = x[..., : 2 * pairs], x[..., 2 * pairs :]
    a, b = head.float().unflatten(-1, (pairs, 2)).unbind(-1)
    rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([rotated, tail], dim=-1) if tail.shape[-1] else rotated


class WanRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class UnweightedRMSNorm(WanRMSNorm):
    """The action module's q/k norm: it has a ``weight`` in the published files but never applies it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


class WanLayerNorm(nn.LayerNorm):
    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False) -> None:
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 whatever the weights' dtype (bf16 serving), as the published model normalises
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).type_as(x)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``[N, Lq, H, D]`` queries over ``[N, Lk, H, D]`` keys; returns ``[N, Lq, H, D]``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


# ---- rotary positions ------------------------------------------------------------------


class WanRope:
    """Wan's 3-D rotary embedding: channel pairs split over (frame, row, column)."""

    def __init__(self, head_dim: int, frames: int, grid: tuple[int, int]) -> None:
        pairs = head_dim // 2
        self.split = (pairs - 2 * (pairs // 3), pairs // 3, pairs // 3)
        self.frames = frames
        self.grid = grid
        self.frame_angles = rope_angles(frames, head_dim - 4 * (head_dim // 6))
        self.row_angles = rope_angles(max(grid), 2 * (head_dim // 6))
        self.col_angles = rope_angles(max(grid), 2 * (head_dim // 6))

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """``[B, F]`` frame positions -> ``[B, F * rows * cols, 1, pairs]`` angles, tokens in (frame, row, col) order.

        Positions must be below ``frames`` (the caller checks on the host: no device sync here).
        """
        rows, cols = self.grid
        b, f = positions.shape
        if self.frame_angles.device != positions.device:  # moved once, on the first forward
            self.frame_angles, self.row_angles, self.col_angles = (
                t.to(positions.device) for t in (self.frame_angles, self.row_angles, self.col_angles)
            )
        frame = self.frame_angles[positions][:, :, None, None].expand(b, f, rows, cols, -1)
        row = self.row_angles[:rows][None, None, :, None].expand(b, f, rows, cols, -1)
        col = self.col_angles[:cols][None, None, None, :].expand(b, f, rows, cols, -1)
        return torch.cat([frame, row, col], dim=-1).reshape(b, f * rows * cols, 1, -1)


# ---- attention layers ---------------------------------------------------------------------


class WanAttention(nn.Module):
    """The q/k/v/o projections and q/k RMS norms that self- and cross-attention share (same checkpoint keys)."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps)
        self.norm_k = WanRMSNorm(dim, eps=eps)


class WanSelfAttention(WanAttention):
    def forward(
        self, x: torch.Tensor, layer: int, ctx: AttentionContext, q_rot: Rotation, k_rot: Rotation
    ) -> torch.Tensor:
        b, length, _ = x.shape
        shape = (b, length, self.num_heads, self.head_dim)
        q = self.norm_q(self.q(x)).view(shape)
        k = self.norm_k(self.k(x)).view(shape)
        v = self.v(x).view(shape)
        k_all, v_all = ctx.self_kv(layer, k, v)
        out = attend(rotate_pairs(q, q_rot), rotate_pairs(k_all, k_rot), v_all, ctx.self_mask)
        return self.o(out.flatten(2))


class WanCrossAttention(WanAttention):
    """Cross-attention to the image context (Matrix-Game has no text)."""

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.norm_q(self.q(x)).view(b, -1, self.num_heads, self.head_dim)
        k = self.norm_k(self.k(context)).view(b, -1, self.num_heads, self.head_dim)
        v = self.v(context).view(b, -1, self.num_heads, self.head_dim)
        return self.o(attend(q, k, v, None).flatten(2))


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


class WanAttentionBlock(nn.Module):
    def __init__(self, cfg: MatrixGameConfig, with_action: bool) -> None:
        super().__init__()
        dim = cfg.dim
        self.norm1 = WanLayerNorm(dim, cfg.eps)
        self.self_attn = WanSelfAttention(dim, cfg.num_heads, cfg.eps)
        self.norm3 = WanLayerNorm(dim, cfg.eps, elementwise_affine=True)
        self.cross_attn = WanCrossAttention(dim, cfg.num_heads, cfg.eps)
        self.norm2 = WanLayerNorm(dim, cfg.eps)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.action_model = ActionModule(cfg.action, dim) if with_action else None

    def forward(
        self,
        x: torch.Tensor,
        e: torch.Tensor,
        layer: int,
        ctx: AttentionContext,
        context: torch.Tensor,
        rotations: tuple[Rotation, Rotation],
        mouse: torch.Tensor,
        keyboard: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``[B, F * S, C]``; ``e`` ``[B, F, 6, C]`` (each frame's own timestep modulation)."""
        b, frames = e.shape[:2]
        mod = (self.modulation[None] + e).unbind(2)  # six [B, F, C]
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (m[:, :, None] for m in mod)

        def per_frame(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, frames, -1, t.shape[-1])

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, t.shape[-1])

        y = self.self_attn(flat(per_frame(self.norm1(x)) * (1 + scale_sa) + shift_sa), layer, ctx, *rotations)
        x = flat(per_frame(x) + per_frame(y) * gate_sa)
        x = x + self.cross_attn(self.norm3(x), context)
        if self.action_model is not None:
            x = self.action_model(x, layer, ctx, frames, mouse, keyboard)
        y = self.ffn(flat(per_frame(self.norm2(x)) * (1 + scale_ff) + shift_ff))
        return flat(per_frame(x) + per_frame(y) * gate_ff)


class Head(nn.Module):
    def __init__(self, dim: int, out_dim: int, patch_size: tuple[int, int, int], eps: float) -> None:
        super().__init__()
        self.norm = WanLayerNorm(dim, eps)
        self.head = nn.Linear(dim, math.prod(patch_size) * out_dim)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """``e`` ``[B, F, C]``: each frame's timestep embedding."""
        b, frames = e.shape[:2]
        shift, scale = (self.modulation[None] + e[:, :, None]).unbind(2)
        normed = self.norm(x).view(b, frames, -1, x.shape[-1])
        return self.head((normed * (1 + scale[:, :, None]) + shift[:, :, None]).view(b, -1, x.shape[-1]))


class MLPProj(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(
            nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim), nn.GELU(), nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class CausalWanDiT(nn.Module):
    """Matrix-Game 2.0's action-conditioned, chunk-causal Wan DiT."""

    def __init__(self, cfg: MatrixGameConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv3d(cfg.in_dim, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
        self.img_emb = MLPProj(cfg.clip_dim, cfg.dim)
        self.blocks = nn.ModuleList(WanAttentionBlock(cfg, i in cfg.action.blocks) for i in range(cfg.num_layers))
        self.head = Head(cfg.dim, cfg.out_dim, cfg.patch_size, cfg.eps)
        self.rope = WanRope(cfg.head_dim, cfg.rope_frames, cfg.grid)

    def init_random(self, seed: int) -> None:
        """Seeded random weights (``random_init``) for every parameter: Xavier matrices, small biases, unit norms.

        Unlike training's init, the output head and the action projections
        are not zeroed, so every path shows in the output (tests compare it).
        Numbers are drawn on the CPU, so a seed means the same weights on any device.
        """
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.dim() >= 2:
                    fan_in, fan_out = param.shape[1] * math.prod(param.shape[2:]), param.shape[0]
                    bound = math.sqrt(6.0 / (fan_in + fan_out))
                    values = (torch.rand(param.shape, generator=generator) * 2 - 1) * bound
                elif name.endswith("bias"):
                    values = torch.randn(param.shape, generator=generator) * 0.02
                else:
                    values = torch.ones(param.shape)
                param.copy_(values)

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
        cfg = self.cfg
        b, _, frames, h, w = x.shape
        tokens = self.patch_embedding(torch.cat([x, cond], dim=1).to(self.patch_embedding.weight.dtype))
        tokens = tokens.flatten(2).transpose(1, 2)
        dtype = tokens.dtype
        e = self.time_embedding(sinusoidal_embedding(cfg.freq_dim, timesteps).to(dtype))  # [B*F, C]
        e0 = self.time_projection(e).view(b, frames, 6, cfg.dim)
        e = e.view(b, frames, cfg.dim)
        # cos/sin once per forward, not once per layer
        rotations = (rotation(self.rope.angles(ctx.query_positions)), rotation(self.rope.angles(ctx.key_positions)))
        for layer, block in enumerate(self.blocks):
            tokens = block(tokens, e0, layer, ctx, context, rotations, mouse, keyboard)
        out = self.head(tokens, e)
        return self.unpatchify(out, frames, h, w).float()

    def unpatchify(self, x: torch.Tensor, frames: int, h: int, w: int) -> torch.Tensor:
        pt, ph, pw = self.cfg.patch_size
        c = self.cfg.out_dim
        b = x.shape[0]
        x = x.view(b, frames // pt, h // ph, w // pw, pt, ph, pw, c)
        x = torch.einsum("bfhwpqrc->bcfphqwr", x)
        return x.reshape(b, c, frames, h, w)
