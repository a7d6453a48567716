"""The tiny-world network: a small causal diffusion transformer over world-aligned patch tokens.

A frame is represented by a *canvas*: the ``canvas_cells x canvas_cells`` grid
of 8x8 world cells that contains the 64x64 view. Cells are aligned to the
world (not the screen), and each token's rotary position is its world cell
coordinate, integrated from the controls (the camera position each session keeps in the pipeline).
So a cell that stays in view keeps its position from frame to frame, and the
network's job is to keep what it has shown consistent and to invent what
enters the view; the pipeline crops the view out of the canvas.

One *pass* runs the current chunk's tokens (``frames_per_chunk`` canvases)
through every block. At each layer the chunk's keys and values (keys already
rotated with their absolute frame index and world cell) go to a ``kv``
callback that stores them and returns everything the chunk may see: the
history the KV source keeps (sink + window frames) followed by the chunk
itself. Attention is therefore bidirectional within the chunk and causal
across chunks, and the same code runs against the runner's paged pool at
inference and a dense batched history in training
(:class:`arstream.models.tiny_world.sampling.DenseChunkKV`).

Each frame carries its own diffusion time and camera direction; both condition
the frame's tokens through adaLN modulation. The network predicts the clean
canvas (x0) in [-1, 1].

Output head: ``head="linear"`` maps each token to its 8x8 patch on its own,
so patch borders show (a mosaic of cells). ``head="conv"`` adds a small
convolutional refiner at pixel resolution over the whole canvas: it sees the
linear head's canvas, a few learned feature channels per pixel, the noisy
input canvas and the diffusion time, and adds a residual, so neighbouring
patches agree and the noisy input's own pixels sharpen the estimate (the
pixel-level skip a U-Net has). Its last layer starts at zero, so a conv model
initialised from linear-head weights starts out as that model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import NUM_CLASSES, ClassLogitsDecoder

KVCallback = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

NUM_DIRECTIONS = 9
TEMPORAL_ROPE_PAIRS = 4
TEMPORAL_ROPE_BASE = 10_000.0


@dataclass(frozen=True)
class TinyWorldConfig:
    """Architecture and sampling settings; saved next to the weights as config.json."""

    image_size: int = 64
    patch_size: int = 8
    # world cells per canvas side; the canvas must hold the view at any sub-cell offset
    canvas_cells: int = 9
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    mlp_ratio: int = 4
    frames_per_chunk: int = 2
    sink_frames: int = 1
    # frames of history a chunk attends to besides the sink, not counting itself (the runner's
    # KVCacheSpec.window_frames counts the chunk: history_frames + frames_per_chunk)
    history_frames: int = 4
    # diffusion times of the few-step sampler, highest first; the last x0 estimate is the output
    denoise_times: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)
    # noise level at which a finished chunk is re-encoded into the KV history
    context_noise: float = 0.1
    # "ddim": reuse the predicted noise between steps; "renoise": fresh noise each step
    sampler: str = "renoise"
    fps: int = 16
    # "linear": per-patch linear output; "conv": plus a pixel-level convolutional refiner
    head: str = "linear"
    head_channels: int = 16
    head_features: int = 8
    # channels of the frame decoder (decoder.py) turning x0 estimates into palette pictures; 0: none
    decoder_channels: int = 0
    # added to the logit of a pixel's previous class where the previous frame exists (decoder.decode_chunk)
    decoder_keep_logit: float = 0.0
    # per-class logit offsets where the previous frame does not reach (empty: none); see decoder.decode_chunk
    decoder_class_bias: tuple[float, ...] = ()
    # odd window (px) over which class probabilities are averaged where the previous frame does not reach; 0: off
    decoder_unseen_window: int = 0
    # strength of the pull of unseen content toward the map's class shares, given the view's (decoder.py); 0: off
    decoder_view_prior: float = 0.0

    def __post_init__(self) -> None:
        if self.canvas_size < self.image_size + self.patch_size - 1:
            raise ValueError(
                f"canvas of {self.canvas_cells} cells x {self.patch_size} px cannot hold a {self.image_size} px view "
                f"at every sub-cell offset"
            )
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of num_heads {self.num_heads}")
        times = list(self.denoise_times)
        if not times or any(not 0 < t <= 1 for t in times) or times != sorted(times, reverse=True):
            raise ValueError(f"denoise_times must be decreasing values in (0, 1], got {times}")
        if not 0 <= self.context_noise < 1:
            raise ValueError(f"context_noise must be in [0, 1), got {self.context_noise}")
        if self.sampler not in ("ddim", "renoise"):
            raise ValueError(f"sampler must be 'ddim' or 'renoise', got {self.sampler!r}")
        if self.head not in ("linear", "conv"):
            raise ValueError(f"head must be 'linear' or 'conv', got {self.head!r}")
        if self.decoder_channels < 0:
            raise ValueError(f"decoder_channels must be >= 0, got {self.decoder_channels}")
        if self.decoder_class_bias and len(self.decoder_class_bias) != NUM_CLASSES:
            raise ValueError(f"decoder_class_bias needs {NUM_CLASSES} values (one per class), got {self.decoder_class_bias}")
        if self.decoder_unseen_window < 0 or (self.decoder_unseen_window and self.decoder_unseen_window % 2 == 0):
            raise ValueError(f"decoder_unseen_window must be 0 or an odd number of pixels, got {self.decoder_unseen_window}")
        if self.decoder_view_prior < 0:
            raise ValueError(f"decoder_view_prior must be >= 0, got {self.decoder_view_prior}")
        if self.head_channels < 1 or self.head_features < 0:
            raise ValueError(
                f"head_channels must be >= 1 and head_features >= 0, got {self.head_channels}, {self.head_features}"
            )

    @property
    def grid(self) -> int:
        return self.canvas_cells

    @property
    def canvas_size(self) -> int:
        return self.canvas_cells * self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        return self.grid * self.grid

    @property
    def head_size(self) -> int:
        return self.d_model // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * 3

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["denoise_times"] = list(self.denoise_times)
        data["decoder_class_bias"] = list(self.decoder_class_bias)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TinyWorldConfig:
        known = {f.name for f in fields(cls)} | {"window_frames"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; expected a subset of {sorted(known)}")
        values = dict(data)
        if "window_frames" in values:  # configs saved before the field was named for what it counts
            values["history_frames"] = values.pop("window_frames")
        for name in ("denoise_times", "decoder_class_bias"):
            if name in values:
                values[name] = tuple(float(t) for t in values[name])
        return cls(**values)


def timestep_features(t: torch.Tensor, dim: int = 128) -> torch.Tensor:
    """Sinusoidal features of diffusion time ``t`` in [0, 1]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = (t.float() * 1000.0)[..., None] * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class RotaryPositions(nn.Module):
    """3-D rotary angles: absolute frame index, world cell row, world cell column.

    The head's rotation pairs are split into a temporal part (few, long
    wavelengths) and two spatial parts. Spatial positions are world cells, so
    attention sees where a token is in the world, not on the screen.
    """

    def __init__(self, head_size: int, grid: int) -> None:
        super().__init__()
        pairs = head_size // 2
        spatial = (pairs - TEMPORAL_ROPE_PAIRS) // 2
        if spatial < 1 or TEMPORAL_ROPE_PAIRS + 2 * spatial != pairs:
            raise ValueError(f"head_size {head_size} does not split into temporal + 2 equal spatial rotary parts")
        inv_t = TEMPORAL_ROPE_BASE ** (-torch.arange(TEMPORAL_ROPE_PAIRS, dtype=torch.float64) / TEMPORAL_ROPE_PAIRS)
        inv_s = 16.0 ** (-torch.arange(spatial, dtype=torch.float64) / max(spatial - 1, 1))
        self.register_buffer("inv_t", inv_t, persistent=False)
        self.register_buffer("inv_s", inv_s, persistent=False)
        self.register_buffer("local_rows", torch.arange(grid).repeat_interleave(grid), persistent=False)
        self.register_buffer("local_cols", torch.arange(grid).repeat(grid), persistent=False)

    def forward(self, frame_positions: torch.Tensor, cell_origins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, frames * tokens, pairs]``.

        ``frame_positions`` absolute frame indices, ``[F]`` shared by every
        row or ``[B, F]`` per row (batched sessions are at different points of
        their rollouts); ``cell_origins`` ``[B, F, 2]`` world cell ``(x, y)``
        of each canvas's top-left token. Angles are formed in float64 so
        far-travelled positions stay exact.
        """
        b, f = cell_origins.shape[:2]
        tokens = self.local_rows.shape[0]
        origins = cell_origins.to(torch.float64)
        rows = origins[:, :, 1:2] + self.local_rows.to(torch.float64)
        cols = origins[:, :, 0:1] + self.local_cols.to(torch.float64)
        positions = frame_positions.to(torch.float64).expand(b, f)
        temporal = (positions[:, :, None] * self.inv_t)[:, :, None, :].expand(b, f, tokens, -1)
        angles = torch.cat([temporal, rows[..., None] * self.inv_s, cols[..., None] * self.inv_s], dim=-1)
        angles = angles.reshape(b, f * tokens, -1)
        return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, N, heads, head_size]`` by angles ``[B, N, head_size / 2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos[:, :, None, :]
    sin = sin[:, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    """Pre-norm transformer block with per-frame adaLN-zero modulation."""

    def __init__(self, cfg: TinyWorldConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.head_size = cfg.head_size
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(approximate="tanh"), nn.Linear(cfg.mlp_ratio * d, d))
        self.ada = nn.Linear(d, 6 * d)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(
        self,
        x: torch.Tensor,
        cond: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        kv: KVCallback,
    ) -> torch.Tensor:
        b, frames, tokens, d = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(cond)[:, :, None, :].chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.qkv(h.reshape(b, frames * tokens, d)).view(b, frames * tokens, 3, self.num_heads, self.head_size).unbind(2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k_all, v_all = kv(layer, k, v)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2))
        attn = attn.transpose(1, 2).reshape(b, frames, tokens, d)
        x = x + gate1 * self.proj(attn)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class ConvHead(nn.Module):
    """Pixel-level refiner over whole canvases: three 3x3 convolutions adding a residual to the linear head.

    Inputs per pixel: the linear head's RGB, ``head_features`` learned
    channels, the noisy input's RGB and the diffusion time. The receptive
    field (7 px) spans patch borders, which the per-token head cannot see.
    """

    def __init__(self, cfg: TinyWorldConfig) -> None:
        super().__init__()
        c = cfg.head_channels
        self.conv1 = nn.Conv2d(3 + cfg.head_features + 3 + 1, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.conv3 = nn.Conv2d(c, 3, 3, padding=1)
        nn.init.zeros_(self.conv3.weight)
        nn.init.zeros_(self.conv3.bias)

    def forward(self, coarse: torch.Tensor, features: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``coarse``/``noisy`` ``[N, C, C, 3]``, ``features`` ``[N, C, C, k]``, ``t`` ``[N]`` -> ``[N, C, C, 3]``."""
        n, size = coarse.shape[0], coarse.shape[1]
        t_map = t.float()[:, None, None, None].expand(n, size, size, 1)
        x = torch.cat([coarse, features, noisy, t_map], dim=-1).permute(0, 3, 1, 2)
        x = F.gelu(self.conv1(x), approximate="tanh")
        x = F.gelu(self.conv2(x), approximate="tanh")
        return coarse + self.conv3(x).permute(0, 2, 3, 1)


class TinyWorldDiT(nn.Module):
    """Predicts clean frames for one chunk given its noisy frames, times, directions and the KV history."""

    def __init__(self, cfg: TinyWorldConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.patch_embed = nn.Linear(cfg.patch_dim, d)
        self.pos_embed = nn.Parameter(torch.randn(cfg.tokens_per_frame, d) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(128, d), nn.SiLU(), nn.Linear(d, d))
        self.direction_embed = nn.Embedding(NUM_DIRECTIONS, d)
        self.rotary = RotaryPositions(cfg.head_size, cfg.grid)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, cfg.patch_dim)
        nn.init.zeros_(self.final_ada.weight)
        nn.init.zeros_(self.final_ada.bias)
        if cfg.head == "conv":
            self.out_features = nn.Linear(d, cfg.patch_size * cfg.patch_size * cfg.head_features)
            self.conv_head = ConvHead(cfg)
        if cfg.decoder_channels:
            self.decoder = ClassLogitsDecoder(cfg.decoder_channels)

    def patchify(self, frames: torch.Tensor) -> torch.Tensor:
        """Canvases ``[B, F, C, C, 3]`` -> ``[B, F, tokens, patch_dim]``."""
        b, f = frames.shape[:2]
        g, p = self.cfg.grid, self.cfg.patch_size
        x = frames.reshape(b, f, g, p, g, p, 3).permute(0, 1, 2, 4, 3, 5, 6)
        return x.reshape(b, f, g * g, p * p * 3)

    def unpatchify(self, tokens: torch.Tensor, channels: int = 3) -> torch.Tensor:
        """``[B, F, tokens, p * p * channels]`` -> canvases ``[B, F, C, C, channels]``."""
        b, f = tokens.shape[:2]
        g, p = self.cfg.grid, self.cfg.patch_size
        x = tokens.reshape(b, f, g, g, p, p, channels).permute(0, 1, 2, 4, 3, 5, 6)
        return x.reshape(b, f, g * p, g * p, channels)

    def forward(
        self,
        noisy: torch.Tensor,
        t: torch.Tensor,
        direction: torch.Tensor,
        frame_positions: torch.Tensor,
        cell_origins: torch.Tensor,
        kv: KVCallback,
        output_rows: int | None = None,
    ) -> torch.Tensor:
        """One pass over a chunk.

        ``noisy`` canvases ``[B, F, C, C, 3]`` in [-1, 1]; ``t`` ``[B, F]``
        diffusion times; ``direction`` ``[B, F]`` indices 0..8;
        ``frame_positions`` ``[F]`` or ``[B, F]`` absolute frame indices; ``cell_origins``
        ``[B, F, 2]`` world cells of the canvases. Returns predicted clean canvases
        of the first ``output_rows`` rows (default all; 0 for a pass that only
        writes K/V, such as a commit, which then skips the output head).
        """
        x = self.patch_embed(self.patchify(noisy)) + self.pos_embed
        cond = F.silu(self.time_mlp(timestep_features(t)) + self.direction_embed(direction))
        cos, sin = self.rotary(frame_positions, cell_origins)
        for layer, block in enumerate(self.blocks):
            x = block(x, cond, cos, sin, layer, kv)
        rows = noisy.shape[0] if output_rows is None else output_rows
        if rows == 0:
            return noisy[:0]
        x, cond = x[:rows], cond[:rows]
        shift, scale = self.final_ada(cond)[:, :, None, :].chunk(2, dim=-1)
        h = self.final_norm(x) * (1 + scale) + shift
        coarse = self.unpatchify(self.out(h))
        if self.cfg.head == "linear":
            return coarse
        b, f = coarse.shape[:2]
        features = self.unpatchify(self.out_features(h), self.cfg.head_features)
        refined = self.conv_head(
            coarse.flatten(0, 1), features.flatten(0, 1), noisy[:rows].flatten(0, 1), t[:rows].flatten()
        )
        return refined.view(coarse.shape)
