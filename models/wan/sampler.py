"""The few-step sampler of the distilled causal Wan models (Self-Forcing, LongLive, Matrix-Game 2.0).

Distilled timesteps with shift, fresh noise between steps, one commit pass.
Flow matching: ``x_t = (1 - sigma) * x0 + sigma * noise`` and the DiT predicts
the flow ``noise - x0``. Each denoising step is a non-committing pass (its K/V
go to the runner's scratch); then one committing pass runs the clean chunk at
timestep 0 (context noise 0) so the history holds the clean chunk's K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class ChunkContext(Protocol):
    def begin_pass(self, *, commit: bool) -> None: ...

    def end_pass(self) -> None: ...


# ``flow(x, timesteps)``: the DiT's flow for latents ``x`` ``[B, 16, F, h, w]`` at per-frame timesteps ``[B, F]``
Flow = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shifted_sigma(timestep: float, shift: float) -> float:
    """The flow-matching noise level of a distilled timestep (0..1000) under the scheduler's shift."""
    s = timestep / 1000.0
    return shift * s / (1 + (shift - 1) * s)


def sample_chunk(
    flow: Flow,
    ctx: ChunkContext,
    noise: torch.Tensor,
    draw_noise: Callable[[], torch.Tensor],
    timesteps: Sequence[float],
    shift: float,
) -> torch.Tensor:
    """Denoise ``noise`` ``[B, 16, F, h, w]`` into the chunk's clean latent and commit it; returns the latent."""
    b, _, frames = noise.shape[:3]
    sigmas = [shifted_sigma(t, shift) for t in timesteps]
    x = noise
    clean = noise
    for i, sigma in enumerate(sigmas):
        ctx.begin_pass(commit=False)
        predicted = flow(x, torch.full((b, frames), sigma * 1000.0, device=noise.device))
        ctx.end_pass()
        clean = x - sigma * predicted
        if i + 1 < len(sigmas):
            x = (1 - sigmas[i + 1]) * clean + sigmas[i + 1] * draw_noise()
    ctx.begin_pass(commit=True)
    flow(clean, torch.zeros((b, frames), device=noise.device))
    ctx.end_pass()
    return clean
