"""Wan2.1 DiT layers, with the published parameter names, shared by matrix-game-2 and LongLive.

Module and parameter names follow the original Wan code (``patch_embedding``,
``time_embedding``, ``time_projection``, ``blocks.N.{norm3, self_attn,
cross_attn, ffn, modulation}``, ``head.{head, modulation}``), so published
state dicts load without conversion.

Attention never owns a cache. Every forward gets a context that says where
each query frame sits, what it may see and where the keys come from
(:class:`SelfAttentionContext`): the serving path hands the runner's paged KV,
a dense reference the whole sequence and a mask. K is stored *without* rotary
embedding and rotated when read, with the positions the context gives; for a
session shorter than the rotary table this is exactly the published scheme
(rotate, then cache).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ...runner.distributed.sequence_parallel import SequenceParallel

CrossKV = tuple[torch.Tensor, torch.Tensor]


class SelfAttentionContext(Protocol):
    """Where a forward's self-attention keys come from; see the module docstring."""

    query_positions: torch.Tensor  # [B, Fq] rotary frame positions of the input frames
    key_positions: torch.Tensor  # [B, Fk] positions of every frame self-attention sees
    self_mask: torch.Tensor | None  # [Lq, Lk] bool (True attends) or None: everything visible

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, Lq, H, D]`` for the input frames -> ``[B, Lk, H, D]`` visible K/V (unrotated)."""


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
    a, b = torch.unflatten(head.float(), -1, (pairs, 2)).unbind(-1)
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
    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__(dim, num_heads, eps)
        self.qkv: nn.Linear | None = None  # q, k and v fused (:meth:`fuse_projections`)
        # a replica over several devices: this rank's share of the heads (runner/distributed/sequence_parallel.py)
        self.parallel: SequenceParallel | None = None

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """q, k and v as one projection ``qkv`` (one matmul a pass instead of three), from the loaded weights.

        Checkpoints keep the three (the published names); a model fuses them
        once loaded. The fused layer computes the same rows, so only the
        matmul's summation order can differ.
        """
        if self.qkv is not None:
            return
        parts = (self.q, self.k, self.v)
        fused = nn.Linear(self.q.in_features, 3 * self.q.out_features, device=self.q.weight.device,
                          dtype=self.q.weight.dtype)  # fmt: skip
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        fused.bias.copy_(torch.cat([p.bias for p in parts]))
        del self.q, self.k, self.v
        self.qkv = fused

    def forward(
        self, x: torch.Tensor, layer: int, ctx: SelfAttentionContext, q_rot: Rotation, k_rot: Rotation
    ) -> torch.Tensor:
        sp = self.parallel
        length = x.shape[1]
        # Over several devices this rank projects its slice of the tokens, then holds every token of its heads.
        q, k, v = self._project(x if sp is None else sp.my_tokens(x))
        if sp is not None:
            q, k, v = sp.to_heads(torch.stack([q, k, v]), length).unbind(0)
        k_all, v_all = ctx.self_kv(layer, k, v)
        if k_all.dtype != q.dtype:  # a KV pool in another dtype (the kv_dtype option): attention runs in the model's
            k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)
        out = attend(rotate_pairs(q, q_rot), rotate_pairs(k_all, k_rot), v_all, ctx.self_mask)
        if sp is None:
            return self.o(out.flatten(2))
        return sp.gather_tokens(self.o(sp.to_tokens(out).flatten(2)), length)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed q, k and raw v of ``x`` ``[B, L, C]``, each ``[B, L, heads, head_dim]``."""
        b, length, _ = x.shape
        shape = (b, length, self.num_heads, self.head_dim)
        if self.qkv is not None:
            q_raw, k_raw, v_raw = self.qkv(x).chunk(3, dim=-1)
        else:
            q_raw, k_raw, v_raw = self.q(x), self.k(x), self.v(x)
        return self.norm_q(q_raw).view(shape), self.norm_k(k_raw).view(shape), v_raw.view(shape)


class WanCrossAttention(WanAttention):
    """Cross-attention to a context: Matrix-Game's image tokens, or LongLive's text tokens.

    :meth:`project` gives the context's K/V, which depend on the context alone:
    a model whose context is fixed per session (a prompt) computes them once
    and shares them (LongLive's per-prompt cache); ``forward`` takes either.
    """

    def project(self, context: torch.Tensor) -> CrossKV:
        b = context.shape[0]
        k = self.norm_k(self.k(context)).view(b, -1, self.num_heads, self.head_dim)
        v = self.v(context).view(b, -1, self.num_heads, self.head_dim)
        return k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | CrossKV) -> torch.Tensor:
        b = x.shape[0]
        q = self.norm_q(self.q(x)).view(b, -1, self.num_heads, self.head_dim)
        k, v = self.project(context) if isinstance(context, torch.Tensor) else context
        return self.o(attend(q, k, v, None).flatten(2))


class WanAttentionBlock(nn.Module):
    """One Wan block: modulated self-attention, cross-attention, an optional extra module (Matrix-Game's
    actions, ``action_model``), modulated FFN."""

    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float, action_model: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = WanLayerNorm(dim, eps)
        self.self_attn = WanSelfAttention(dim, num_heads, eps)
        self.norm3 = WanLayerNorm(dim, eps, elementwise_affine=True)
        self.cross_attn = WanCrossAttention(dim, num_heads, eps)
        self.norm2 = WanLayerNorm(dim, eps)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.action_model = action_model

    def forward(
        self,
        x: torch.Tensor,
        e: torch.Tensor,
        layer: int,
        ctx: SelfAttentionContext,
        context: torch.Tensor | CrossKV,
        rotations: tuple[Rotation, Rotation],
        *action: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` ``[B, F * S, C]``; ``e`` ``[B, F, 6, C]`` (each frame's own timestep modulation);
        ``action``: what ``action_model`` reads besides ``x``, ``layer``, ``ctx`` and the frame count."""
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
            x = self.action_model(x, layer, ctx, frames, *action)
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


class WanDiTBase(nn.Module):
    """What every causal Wan DiT here shares: patch and time embeddings, blocks, head, seeded random weights.

    Subclasses build their own modules and ``blocks``, then call
    :meth:`add_head` (registration order is the order :meth:`init_random`
    draws in, so a seed keeps meaning the same weights), and say what the
    blocks read besides the tokens.
    """

    patch_size: tuple[int, int, int]
    out_dim: int
    freq_dim: int
    dim: int

    def __init__(self, *, in_dim: int, dim: int, out_dim: int, freq_dim: int, patch_size: tuple[int, int, int]) -> None:
        super().__init__()
        self.patch_size, self.out_dim, self.freq_dim, self.dim = patch_size, out_dim, freq_dim, dim
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def add_head(self, eps: float, head_dim: int, rope_frames: int, grid: tuple[int, int]) -> None:
        """The output head and the rotary table, after the subclass's blocks."""
        self.head = Head(self.dim, self.out_dim, self.patch_size, eps)
        self.rope = WanRope(head_dim, rope_frames, grid)

    def init_random(self, seed: int) -> None:
        """Seeded random weights (``random_init``) for every parameter: Xavier matrices, small biases, unit norms.

        Unlike training's init, the output head and the action projections
        are not zeroed, so every path shows in the output (tests compare it).
        Numbers are drawn on the CPU in float32, a parameter at a time, and copied into the parameter where it
        lives, in its dtype: a seed means the same weights on any device (rounded to the dtype, as a cast of the
        float32 weights would round them), and the host holds one parameter's draw, not the model.
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

    def embed(self, x: torch.Tensor, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Patchified tokens ``[B, L, C]`` of ``x`` ``[B, in_dim, F, h, w]``, and the per-frame modulation
        ``e0`` ``[B, F, 6, C]`` and head embedding ``e`` ``[B, F, C]`` of ``timesteps`` ``[B, F]``."""
        b, frames = x.shape[0], x.shape[2]
        tokens = self.patch_embedding(x.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding(self.freq_dim, timesteps).to(tokens.dtype))  # [B*F, C]
        e0 = self.time_projection(e).view(b, frames, 6, self.dim)
        return tokens, e0, e.view(b, frames, self.dim)

    def rotations(self, ctx: SelfAttentionContext) -> tuple[Rotation, Rotation]:
        """cos/sin of the queries' and keys' positions, once per forward (not once per layer)."""
        return rotation(self.rope.angles(ctx.query_positions)), rotation(self.rope.angles(ctx.key_positions))

    def unpatchify(self, x: torch.Tensor, frames: int, h: int, w: int) -> torch.Tensor:
        pt, ph, pw = self.patch_size
        c = self.out_dim
        b = x.shape[0]
        x = x.view(b, frames // pt, h // ph, w // pw, pt, ph, pw, c)
        x = torch.einsum("bfhwpqrc->bcfphqwr", x)
        return x.reshape(b, c, frames, h, w)
