"""A dense, frame-by-frame TAEHV decoder written from the published ``taehv.py`` (madebyollin/taehv), for tests.

Independent of :mod:`arstream.models.wan_decoders.taehv` in what matters: its
own module tree in the published layout (it loads the decoder's state dict
strictly, so the key names and shapes are checked too) and the published
sequential algorithm: a work queue over (frame, block) visited in causal
order, each memory block remembering its previous input, a grow block pushing
its output frames back onto the queue, and the first ``t_upscale - 1`` output
frames of the clip dropped. It decodes a whole clip in one call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class RefMem(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(_conv(2 * n, n), nn.ReLU(), _conv(n, n), nn.ReLU(), _conv(n, n))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, past], 1)) + x)


class RefGrow(nn.Module):
    def __init__(self, n: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n, n * stride, 1, bias=False)


class RefPool(nn.Module):
    def __init__(self, n: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n * stride, n, 1, bias=False)


class RefClamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 3 * torch.tanh(x / 3)


class RefHolder(nn.Module):
    """The published TAEHV's place for ``decoder`` (its state dict's ``decoder.*`` keys), with the patch size."""

    def __init__(self, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size


def reference_decoder(widths: tuple[int, int, int, int], latent_channels: int = 16, patch_size: int = 1) -> nn.Module:
    """``patch_size`` 2 is ``taehv1_5``'s (and ``taew2_2``'s): the last convolution makes a 2x2 patch of pixels."""
    a, b, c, d = widths
    holder = RefHolder(patch_size)
    holder.decoder = nn.Sequential(
        RefClamp(), _conv(latent_channels, a), nn.ReLU(),
        RefMem(a), RefMem(a), RefMem(a), nn.Upsample(scale_factor=2), RefGrow(a, 1), _conv(a, b, bias=False),
        RefMem(b), RefMem(b), RefMem(b), nn.Upsample(scale_factor=2), RefGrow(b, 2), _conv(b, c, bias=False),
        RefMem(c), RefMem(c), RefMem(c), nn.Upsample(scale_factor=2), RefGrow(c, 2), _conv(c, d, bias=False),
        nn.ReLU(), _conv(d, 3 * patch_size**2),
    )
    return holder


def reference_encoder(width: int, latent_channels: int, patch_size: int) -> nn.Module:
    """The published encoder (``encoder.*``): three stages of a time pool (2, 2, 1), a stride-2 convolution and
    three memory blocks, between an input and a latent convolution."""
    holder = RefHolder(patch_size)
    layers: list[nn.Module] = [_conv(3 * patch_size**2, width), nn.ReLU()]
    for stride in (2, 2, 1):
        layers += [RefPool(width, stride), nn.Conv2d(width, width, 3, stride=2, padding=1, bias=False)]
        layers += [RefMem(width), RefMem(width), RefMem(width)]
    holder.encoder = nn.Sequential(*layers, _conv(width, latent_channels))
    return holder


@torch.no_grad()
def encode_clip(holder: nn.Module, frames: torch.Tensor) -> torch.Tensor:
    """Frames ``[1, T, 3, H, W]`` in [0, 1] -> latents ``[1, T / 4, C, h, w]``: ``encode_video``'s patch unshuffle,
    then the published sequential walk, a pool block collecting ``stride`` frames before it runs."""
    patch = int(getattr(holder, "patch_size", 1))
    x = F.pixel_unshuffle(frames, patch) if patch > 1 else frames
    encoder = holder.encoder
    assert isinstance(encoder, nn.Sequential)
    blocks = list(encoder)
    memory: list[Any] = [None] * len(blocks)
    queue: list[tuple[torch.Tensor, int]] = [(x[:, t], 0) for t in range(x.shape[1])]
    out: list[torch.Tensor] = []
    while queue:
        xt, i = queue.pop(0)
        if i == len(blocks):
            out.append(xt)
            continue
        block = blocks[i]
        if isinstance(block, RefMem):
            past = memory[i]
            memory[i] = xt
            queue.insert(0, (block(xt, torch.zeros_like(xt) if past is None else past), i + 1))
        elif isinstance(block, RefPool):
            memory[i] = (memory[i] or []) + [xt]
            if len(memory[i]) == block.stride:
                pooled = block.conv(torch.cat(memory[i], 1))  # frame k's channels in group k
                memory[i] = []
                queue.insert(0, (pooled, i + 1))
        else:
            queue.insert(0, (block(xt), i + 1))
    return torch.stack(out, 1)


@torch.no_grad()
def decode_clip(holder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Latents ``[1, T, 16, h, w]`` -> frames ``[1, 4T - 3, 3, H, W]`` in [0, 1], one frame and one block at a time."""
    decoder = holder.decoder
    assert isinstance(decoder, nn.Sequential)
    blocks = list(decoder)
    memory: list[torch.Tensor | None] = [None] * len(blocks)
    queue: list[tuple[torch.Tensor, int]] = [(latents[:, t], 0) for t in range(latents.shape[1])]
    out: list[torch.Tensor] = []
    while queue:
        x, i = queue.pop(0)
        if i == len(blocks):
            out.append(x)
            continue
        block = blocks[i]
        if isinstance(block, RefMem):
            past = memory[i]
            memory[i] = x
            queue.insert(0, (block(x, torch.zeros_like(x) if past is None else past), i + 1))
        elif isinstance(block, RefGrow):
            grown = block.conv(x)
            pieces = grown.chunk(block.stride, 1)  # channel group k is output frame k
            for piece in reversed(pieces):
                queue.insert(0, (piece, i + 1))
        else:
            queue.insert(0, (block(x), i + 1))
    stride_total = 4
    video = torch.stack(out, 1).clamp(0, 1)
    patch = int(getattr(holder, "patch_size", 1))
    if patch > 1:  # the published decode_video: pixels out of each frame's channel patches
        frames = F.pixel_shuffle(video.flatten(0, 1), patch)
        video = frames.reshape(*video.shape[:2], *frames.shape[1:])
    return video[:, stride_total - 1 :]
