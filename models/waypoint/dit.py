"""Waypoint's transformer, written from ``world_engine``'s ``src/model/`` (commit 208c909824d906bf441122b7c40b9b4e1050d7c3).

One latent frame is one chunk: patchified into ``height * width`` tokens, each
block conditions on the noise level (AdaLN-style scale, shift and gate from a
per-layer head), attends causally over frames through an
:class:`AttentionContext` (the runner's pages when serving, a dense cache in the
reference), fuses the controller embedding into its tokens every
``ctrl_conditioning_period`` layers, then runs its MLP. The module and
parameter names are the published file's, so ``model.safetensors`` loads
without renaming.

Rotary positions: the published model rotates Q and K with a table over
``n_frames`` frames (time, rows and columns on orthogonal parts of each head)
and stores K rotated. Here K is stored unrotated and the gathered K rotated
with the runner's frame positions, which stay inside the table however long a
session runs (:meth:`~arstream.runner.kv_state.SessionKVState.frame_positions`),
where the published cache would index past its table.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import WaypointConfig


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


class MLP(nn.Module):
    def __init__(self, dim_in: int, dim_middle: int, dim_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim_in, dim_middle, bias=False)
        self.fc2 = nn.Linear(dim_middle, dim_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)))


class NoiseConditioner(nn.Module):
    """A noise level -> Fourier features (fp32) -> an MLP to ``d_model``."""

    freq: torch.Tensor

    def __init__(self, dim: int, fourier_dim: int = 512, base: float = 10_000.0) -> None:
        super().__init__()
        self.register_buffer(
            "freq", torch.logspace(0, -1, steps=fourier_dim // 2, base=base, dtype=torch.float32), persistent=False
        )
        self.mlp = MLP(fourier_dim, dim * 4, dim)

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        """``sigma`` ``[B]`` -> ``[B, 1, d_model]``."""
        phase = sigma.reshape(-1).float().mul(1000)[:, None] * self.freq[None, :]
        features = torch.cat((torch.sin(phase), torch.cos(phase)), dim=-1) * 2**0.5
        return self.mlp(features.to(self.mlp.fc1.weight.dtype))[:, None, :]


class ControllerEmbedding(nn.Module):
    """Mouse velocity (2), pressed buttons (``n_buttons``) and scroll sign (1) -> ``d_model``."""

    def __init__(self, cfg: WaypointConfig) -> None:
        super().__init__()
        self.mlp = MLP(cfg.n_buttons + 3, cfg.d_model * cfg.mlp_ratio, cfg.d_model)

    def forward(self, controls: torch.Tensor) -> torch.Tensor:
        return self.mlp(controls)


class NullEmbedding(nn.Module):
    """The published classifier-free-guidance null embedding: in the file, unused by inference."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.null_emb = nn.Parameter(torch.zeros(1, 1, dim))


class CondHead(nn.Module):
    """Per-layer (s0, b0, g0, s1, b1, g1) from the noise embedding."""

    def __init__(self, cfg: WaypointConfig) -> None:
        super().__init__()
        self.bias_in = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.noise_conditioning == "wan" else None
        self.cond_proj = nn.ModuleList(nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(6))

    def forward(self, cond: torch.Tensor) -> list[torch.Tensor]:
        h = F.silu(cond + self.bias_in if self.bias_in is not None else cond)
        return [proj(h) for proj in self.cond_proj]


class ControlFusion(nn.Module):
    """``MLP(cat(x, control))`` with the control broadcast over a frame's tokens (the published MLPFusion)."""

    def __init__(self, cfg: WaypointConfig) -> None:
        super().__init__()
        self.mlp = MLP(2 * cfg.d_model, cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, control: torch.Tensor) -> torch.Tensor:
        w_x, w_c = self.mlp.fc1.weight.chunk(2, dim=1)
        return self.mlp.fc2(F.silu(F.linear(x, w_x) + F.linear(control, w_c)))


class AdaNorm(nn.Module):
    """The output norm: ``rms_norm(x) * (1 + a) + b`` with (a, b) from the noise embedding."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        a, b = self.fc(F.silu(cond)).chunk(2, dim=-1)
        return rms_norm(x) * (1 + a) + b


def rope_tables(cfg: WaypointConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[n_frames * tokens_per_frame, head_size / 2]``: columns, rows, then time frequencies.

    Columns and rows take a linear ("pixel") spectrum over positions in (-1, 1),
    each on an eighth of the head; time a geometric ("lang", base 10000)
    spectrum on a quarter; each frequency serves two neighbouring channels.
    """
    rows, cols, frames = cfg.height, cfg.width, cfg.n_frames
    head = cfg.head_size
    xy_dim, t_dim = head // 8, head // 4
    max_freq = min(rows, cols) * 0.8
    xy_freqs = torch.linspace(1.0, max_freq / 2, xy_dim // 2) * math.pi
    t_freqs = 1.0 / (10_000 ** (torch.arange(0, t_dim, 2)[: t_dim // 2].float() / t_dim))

    def angles(pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return (pos[:, None] * freqs[None, :]).repeat_interleave(2, dim=-1)

    ax = angles(torch.linspace(-1 + 1 / cols, 1 - 1 / cols, cols), xy_freqs)  # [W, xy]
    ay = angles(torch.linspace(-1 + 1 / rows, 1 - 1 / rows, rows), xy_freqs)  # [H, xy]
    at = angles(torch.arange(frames).float(), t_freqs)  # [T, t]
    per_frame = torch.cat(
        [ax[None, :, :].expand(rows, cols, -1), ay[:, None, :].expand(rows, cols, -1)], dim=-1
    ).reshape(rows * cols, -1)
    table = torch.cat(
        [per_frame[None].expand(frames, -1, -1), at[:, None, :].expand(frames, rows * cols, -1)], dim=-1
    ).reshape(frames * rows * cols, -1)
    return table.cos().contiguous(), table.sin().contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (even, odd) of ``x`` ``[..., T, D]``; the result is (rotated evens, rotated odds)."""
    x0, x1 = x.float().unfold(-1, 2, 2).unbind(-1)
    return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).type_as(x)


class AttentionContext(Protocol):
    """Where a pass's self-attention K/V come from and go to."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[B, heads, T, D]``, ``k``/``v`` ``[B, kv_heads, T, D]`` of this frame (normed, unrotated)
        -> attention output ``[B, heads, T, D]`` over the visible frames and this one."""


class Attention(nn.Module):
    def __init__(self, cfg: WaypointConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv_heads, self.head_size = layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_size
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_size, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_size, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_size, bias=False)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_lamb = nn.Parameter(torch.tensor(0.5)) if cfg.value_residual else None
        self.gate_proj = nn.Linear(cfg.n_heads, cfg.n_heads, bias=False) if cfg.gated_attn else None

    def forward(
        self, x: torch.Tensor, first_v: torch.Tensor | None, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, tokens, _ = x.shape

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(batch, tokens, n, self.head_size).transpose(1, 2)

        q = heads(self.q_proj(x), self.n_heads)
        k = heads(self.k_proj(x), self.n_kv_heads)
        v = heads(self.v_proj(x), self.n_kv_heads)
        if self.v_lamb is not None:  # value residual: every layer's V leans towards the first layer's
            first_v = v if first_v is None else first_v
            v = torch.lerp(v, first_v.view_as(v), self.v_lamb)
        y = ctx.attend(self.layer, rms_norm(q), rms_norm(k), v)
        if self.gate_proj is not None:
            gates = torch.sigmoid(self.gate_proj(x[..., : self.n_heads]))  # [B, T, heads]
            y = y * gates.transpose(1, 2).unsqueeze(-1)
        return self.out_proj(y.transpose(1, 2).reshape(batch, tokens, -1)), first_v


class Block(nn.Module):
    def __init__(self, cfg: WaypointConfig, layer: int) -> None:
        super().__init__()
        self.attn = Attention(cfg, layer)
        self.mlp = MLP(cfg.d_model, cfg.d_model * cfg.mlp_ratio, cfg.d_model)
        self.cond_head = CondHead(cfg)
        self.ctrl_mlpfusion = ControlFusion(cfg) if layer % cfg.ctrl_conditioning_period == 0 else None

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor, control: torch.Tensor, first_v: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        s0, b0, g0, s1, b1, g1 = self.cond_head(cond)
        attended, first_v = self.attn(rms_norm(x) * (1 + s0) + b0, first_v, ctx)
        x = x + attended * g0
        if self.ctrl_mlpfusion is not None:
            x = x + self.ctrl_mlpfusion(rms_norm(x), rms_norm(control))
        x = x + self.mlp(rms_norm(x) * (1 + s1) + b1) * g1
        return x, first_v


class Transformer(nn.Module):
    def __init__(self, cfg: WaypointConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))


class WaypointDiT(nn.Module):
    """The published ``WorldModel`` without its text path: one frame's velocity from its noisy latent."""

    def __init__(self, cfg: WaypointConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.denoise_step_emb = NoiseConditioner(cfg.d_model)
        self.ctrl_emb = ControllerEmbedding(cfg)
        self.ctrl_cfg = NullEmbedding(cfg.d_model)
        self.transformer = Transformer(cfg)
        if cfg.noise_conditioning in ("dit_air", "wan"):
            # one set of noise projections for every layer, as published (the file names each layer's copy)
            heads = [block.cond_head for block in self.transformer.blocks if isinstance(block, Block)]
            for head in heads[1:]:
                for mine, first in zip(head.cond_proj, heads[0].cond_proj, strict=True):
                    mine.weight = first.weight
        self.patchify = nn.Conv2d(cfg.channels, cfg.d_model, kernel_size=cfg.patch, stride=cfg.patch, bias=False)
        self.unpatchify = nn.Linear(cfg.d_model, cfg.channels * math.prod(cfg.patch), bias=True)
        self.out_norm = AdaNorm(cfg.d_model)

    def forward(
        self, x: torch.Tensor, sigma: torch.Tensor, controls: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """``x`` ``[B, C, h, w]`` (one latent frame per row), ``sigma`` ``[B]``, ``controls`` ``[B, n_buttons + 3]``."""
        cfg = self.cfg
        batch = x.shape[0]
        ph, pw = cfg.patch
        cond = self.denoise_step_emb(sigma)
        control = self.ctrl_emb(controls)[:, None, :]
        h = self.patchify(x).flatten(2).transpose(1, 2)  # [B, rows * cols, d], row-major
        first_v = None
        for block in self.transformer.blocks:
            h, first_v = block(h, cond, control, first_v, ctx)
        out = self.unpatchify(F.silu(self.out_norm(h, cond)))  # [B, tokens, C * ph * pw]
        out = out.view(batch, cfg.height, cfg.width, cfg.channels, ph, pw)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(batch, cfg.channels, cfg.height * ph, cfg.width * pw)

    def init_random(self, seed: int) -> None:
        """Random weights for tests and the tiny config (every parameter drawn, so nothing is a no-op)."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                fan_in = param.shape[-1] if param.dim() > 1 else 1
                scale = 0.5 if param.dim() <= 1 else 1.0 / math.sqrt(fan_in)
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
