"""The few-step sampler of the distilled causal Wan models (Self-Forcing, LongLive, CausVid, Matrix-Game 2.0).

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


def scheduler_sigma(timestep: float, shift: float) -> float:
    """The noise level the training scheduler gives an unwarped timestep: its grid's nearest entry.

    CausVid's scheduler (DiffSynth's flow matching, 1000 training steps,
    ``sigma_min`` 0, ``extra_one_step``) holds the shifted sigmas of
    ``s = 1, 0.999, ..., 0.001`` and their timesteps ``1000 * sigma``; a
    timestep that is not warped onto that grid (CausVid's published
    ``warp_denoising_step: false``) is fed to the DiT as it is, and noised and
    denoised with the sigma of the grid timestep nearest to it.
    """
    grid = torch.linspace(1.0, 0.0, 1001)[:-1]
    sigmas = shift * grid / (1 + (shift - 1) * grid)
    return float(sigmas[torch.argmin((sigmas * 1000.0 - timestep).abs())])


def sample_chunk(
    flow: Flow,
    ctx: ChunkContext,
    noise: torch.Tensor,
    draw_noise: Callable[[], torch.Tensor],
    timesteps: Sequence[float],
    shift: float,
    *,
    warp: bool = True,
) -> torch.Tensor:
    """Denoise ``noise`` ``[B, 16, F, h, w]`` into the chunk's clean latent and commit it; returns the latent.

    ``warp``: each distilled timestep is warped by the shift (Self-Forcing,
    LongLive, Matrix-Game 2.0: the DiT sees ``1000 * sigma``); without it the
    DiT sees the timestep itself, at the scheduler's sigma for it
    (:func:`scheduler_sigma`; CausVid's published 3-step config).
    """
    b, _, frames = noise.shape[:3]
    if warp:
        sigmas = [shifted_sigma(t, shift) for t in timesteps]
        fed = [1000.0 * sigma for sigma in sigmas]
    else:
        sigmas = [scheduler_sigma(t, shift) for t in timesteps]
        fed = [float(t) for t in timesteps]
    x = noise
    clean = noise
    for i, sigma in enumerate(sigmas):
        ctx.begin_pass(commit=False)
        predicted = flow(x, torch.full((b, frames), fed[i], device=noise.device))
        ctx.end_pass()
        clean = x - sigma * predicted
        if i + 1 < len(sigmas):
            x = (1 - sigmas[i + 1]) * clean + sigmas[i + 1] * draw_noise()
    ctx.begin_pass(commit=True)
    flow(clean, torch.zeros((b, frames), device=noise.device))
    ctx.end_pass()
    return clean
