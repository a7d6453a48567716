"""A dense, full-sequence reference for matrix-game-2: no cache, a block-causal mask instead.

Every chunk re-runs the whole sequence so far (the clean latents of earlier
chunks at timestep 0, then the chunk being denoised) through the same DiT
weights with a mask that lets a frame see the sink frames plus the last
``local_attn_size`` frames up to the end of its own chunk (the action module:
no sink), with absolute rotary positions. Its noise comes from the same
seeded generator in the same order as the pipeline's. Its image conditioning
is Matrix-Game's: the start image followed by black frames for the whole
rollout, encoded in one call (diffusers' ``encode``), latent frame ``k``
reading latent ``k``. What it shares with the serving path is the block math;
what it replaces is everything the runner and the caches do.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from arstream.models.matrix_game.config import MatrixGameConfig
from arstream.models.matrix_game.controls import extend, windows
from arstream.models.matrix_game.dit import CausalWanDiT
from arstream.models.wan.layers import WanRope
from arstream.models.matrix_game.images import default_image
from arstream.models.matrix_game.pipeline import MatrixGamePipeline
from arstream.models.wan.sampler import shifted_sigma
from arstream.models.wan.vae import StreamingVAE


def whole_rollout_condition(vae: StreamingVAE, image: torch.Tensor, latent_frames: int) -> torch.Tensor:
    """Matrix-Game's ``cond_concat`` ``[20, F, h, w]``: mask (ones on frame 0) + the one-call encoding of
    the start image followed by ``4 * (F - 1)`` black frames."""
    black = torch.zeros(3, 4 * (latent_frames - 1), *image.shape[1:])
    video = torch.cat([image[:, None], black], dim=1)[None].to(vae.encoder_dtype)
    with torch.inference_mode():
        latents = vae.vae.encode(video).latent_dist.mode()
    normalised = ((latents.float() - vae.mean) / vae.std)[0]
    mask = torch.zeros(4, *normalised.shape[1:])
    mask[:, 0] = 1.0
    return torch.cat([mask, normalised])


class DenseContext:
    def __init__(self, frames: int, cfg: MatrixGameConfig) -> None:
        positions = torch.arange(frames)[None]
        self.query_positions = self.key_positions = self.action_key_positions = positions
        index = torch.arange(frames)
        chunk = index // cfg.frames_per_chunk
        chunk_end = (chunk + 1) * cfg.frames_per_chunk
        causal = chunk[None, :] <= chunk[:, None]
        recent = index[None, :] >= chunk_end[:, None] - cfg.local_attn_size
        sink = index[None, :] < cfg.sink_size
        frame_mask = causal & (recent | sink)
        s = cfg.tokens_per_frame
        self.self_mask = frame_mask.repeat_interleave(s, 0).repeat_interleave(s, 1)
        self.action_mask = causal & recent

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    mouse_kv = self_kv
    keyboard_kv = self_kv


def dense_rollout(
    pipeline: MatrixGamePipeline, controls: list[dict[str, Any]], seed: int, *, window: int | None = None
) -> list[torch.Tensor]:
    """The clean latent ``[16, F, h, w]`` of each chunk, one chunk per entry of ``controls``.

    ``window`` overrides the attention window (a negative control: a wrong one must diverge).
    """
    cfg = pipeline.cfg if window is None else replace(pipeline.cfg, local_attn_size=window)
    model = pipeline.model
    table = model.rope
    # The same weights with a rotary table long enough for absolute positions.
    model.rope = WanRope(cfg.head_dim, 4096, cfg.grid)
    try:
        return _rollout(pipeline, cfg, model, controls, seed)
    finally:
        model.rope = table


def _rollout(
    pipeline: MatrixGamePipeline,
    cfg: MatrixGameConfig,
    model: CausalWanDiT,
    controls: list[dict[str, Any]],
    seed: int,
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (1, cfg.out_dim, cfg.frames_per_chunk, cfg.latent_height, cfg.latent_width)
    sigmas = [shifted_sigma(t, cfg.timestep_shift) for t in cfg.denoise_timesteps]
    fpc = cfg.frames_per_chunk
    history = None
    clean: list[torch.Tensor] = []
    condition = whole_rollout_condition(pipeline.vae, default_image(cfg), len(controls) * fpc)
    with torch.inference_mode():
        for c, chunk_controls in enumerate(controls):
            frames = cfg.first_chunk_frames if c == 0 else cfg.video_frames_per_chunk
            history = extend(history, chunk_controls, frames, cfg)
            total = (c + 1) * fpc
            mouse, keyboard = windows(history, range(total), cfg)
            cond = condition[None, :, :total]
            ctx = DenseContext(total, cfg)
            context = pipeline.context
            x = torch.randn(shape, generator=generator)
            for i, sigma in enumerate(sigmas):
                past = torch.cat(clean, dim=2) if clean else x[:, :, :0]
                t = torch.cat([torch.zeros(1, past.shape[2]), torch.full((1, fpc), sigma * 1000.0)], dim=1)
                flow = model(torch.cat([past, x], dim=2), t, cond, context, mouse[None], keyboard[None], ctx)
                x0 = x - sigma * flow[:, :, -fpc:]
                if i + 1 < len(sigmas):
                    x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * torch.randn(shape, generator=generator)
            clean.append(x0)
    return [latent[0] for latent in clean]
