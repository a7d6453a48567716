"""Matrix-Game's few-step sampler: distilled timesteps with shift, fresh noise between steps, one commit pass.

Flow matching: ``x_t = (1 - sigma) * x0 + sigma * noise`` and the DiT predicts
the flow ``noise - x0``. Each denoising step is a non-committing pass (its K/V
go to the runner's scratch); then one committing pass runs the clean chunk at
timestep 0 (context noise 0) so the history holds the clean chunk's K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from arstream.models.matrix_game.config import MatrixGameConfig
from arstream.models.matrix_game.dit import AttentionContext, CausalWanDiT


class ChunkContext(AttentionContext, Protocol):
    def begin_pass(self, *, commit: bool) -> None: ...

    def end_pass(self) -> None: ...


def shifted_sigma(timestep: float, shift: float) -> float:
    """The flow-matching noise level of a distilled timestep (0..1000) under the scheduler's shift."""
    s = timestep / 1000.0
    return shift * s / (1 + (shift - 1) * s)


def sample_chunk(
    model: CausalWanDiT,
    ctx: ChunkContext,
    noise: torch.Tensor,
    draw_noise: Callable[[], torch.Tensor],
    cond: torch.Tensor,
    context: torch.Tensor,
    mouse: torch.Tensor,
    keyboard: torch.Tensor,
) -> torch.Tensor:
    """Denoise ``noise`` ``[B, 16, F, h, w]`` into the chunk's clean latent and commit it; returns the latent."""
    cfg: MatrixGameConfig = model.cfg
    b, _, frames = noise.shape[:3]
    sigmas = [shifted_sigma(t, cfg.timestep_shift) for t in cfg.denoise_timesteps]
    x = noise
    clean = noise
    for i, sigma in enumerate(sigmas):
        ctx.begin_pass(commit=False)
        t = torch.full((b, frames), sigma * 1000.0, device=noise.device)
        flow = model(x, t, cond, context, mouse, keyboard, ctx)
        ctx.end_pass()
        clean = x - sigma * flow
        if i + 1 < len(sigmas):
            x = (1 - sigmas[i + 1]) * clean + sigmas[i + 1] * draw_noise()
    ctx.begin_pass(commit=True)
    model(clean, torch.zeros((b, frames), device=noise.device), cond, context, mouse, keyboard, ctx)
    ctx.end_pass()
    return clean
