"""Waypoint's autoencoder decoder, written from ``world_engine``'s ``src/ae_nn.py`` and ``src/ae.py``
(commit 208c909824d906bf441122b7c40b9b4e1050d7c3).

A frame decodes alone: the published decoder keeps no state between frames
(no temporal convolution, no cache), so a session's decoder state is empty and
a snapshot, rewind point or parked session carries none for it. Its shape:
a channel duplication up to ``ch_max`` channels, one up-stage per entry of
``decoder_blocks_per_stage`` (a bicubic 2x upsample and residual blocks, plus a
pixel-shuffle shortcut), SiLU, and a last convolution resized to the output
size (360p in the published file). The published file stores weight-normed
convolutions (``parametrizations.weight.original0/1``); the loader bakes them
into plain weights, as the published engine does before inference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def conv(ch_in: int, ch_out: int, kernel: int, *, groups: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(ch_in, ch_out, kernel, 1, kernel // 2, groups=groups, bias=bias)


class ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        hidden = 2 * ch
        self.conv1 = conv(ch, hidden, 1)
        self.conv2 = conv(hidden, hidden, 3, groups=max(1, hidden // 16))
        self.conv3 = conv(hidden, ch, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.conv1(x))
        h = F.leaky_relu(self.conv2(h))
        return x + self.conv3(h)


class Upsample(nn.Module):
    def __init__(self, ch_in: int, ch_out: int) -> None:
        super().__init__()
        self.proj: nn.Module = nn.Identity() if ch_in == ch_out else conv(ch_in, ch_out, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.proj(x), scale_factor=2.0, mode="bicubic")


class UpBlock(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, blocks: int) -> None:
        super().__init__()
        self.up = Upsample(ch_in, ch_out)
        self.blocks = nn.ModuleList(ResBlock(ch_out) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        for block in self.blocks:
            x = block(x)
        return x


class ChannelToSpace(nn.Module):
    def __init__(self, ch_in: int, ch_out: int) -> None:
        super().__init__()
        self.proj = conv(ch_in, ch_out * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pixel_shuffle(self.proj(x), 2)


class ChannelDuplication(nn.Module):
    """A convolution plus the input with each channel repeated ``ch_out / ch_in`` times (scaled to unit variance)."""

    def __init__(self, ch_in: int, ch_out: int) -> None:
        super().__init__()
        self.proj = conv(ch_in, ch_out, 3)
        self.reps = ch_out // ch_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(self.reps, dim=1) * self.reps**-0.5 + self.proj(x)


class ToImage(nn.Module):
    """The last convolution, then a bicubic resize to the output size (the published SquareToLandscape)."""

    def __init__(self, ch_in: int, ch_out: int, size: tuple[int, int]) -> None:
        super().__init__()
        self.proj = conv(ch_in, ch_out, 3)
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.proj(x), self.size, mode="bicubic")


class Decoder(nn.Module):
    """Latent ``[B, latent_channels, h, w]`` -> image ``[B, channels, H, W]`` in [-1, 1] (roughly)."""

    def __init__(self, conf: dict[str, Any], size: tuple[int, int]) -> None:
        super().__init__()
        ch0, ch_max = int(conf["ch_0"]), int(conf["ch_max"])
        self.conv_in = ChannelDuplication(int(conf["latent_channels"]), ch_max)
        blocks, shortcuts = [], []
        ch = ch0
        for count in reversed(list(conf["decoder_blocks_per_stage"])):
            wider = min(ch * 2, ch_max)
            blocks.append(UpBlock(wider, ch, int(count)))
            shortcuts.append(ChannelToSpace(wider, ch))
            ch = wider
        self.blocks = nn.ModuleList(reversed(blocks))
        self.residuals = nn.ModuleList(reversed(shortcuts))
        self.conv_out = ToImage(ch0, int(conf["channels"]), size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block, shortcut in zip(self.blocks, self.residuals, strict=True):
            x = block(x) + shortcut(x)
        return self.conv_out(F.silu(x))

    def init_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                fan_in = param[0].numel() if param.dim() > 1 else 1
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Decoder output ``[B, C, H, W]`` -> uint8 ``[B, H, W, 3]`` (the first three channels), as the published engine."""
    pixels = ((images / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1)[..., :3]


def bake_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight-normed entries (``X.parametrizations.weight.original0`` = g, ``original1`` = v) as ``X.weight``."""
    baked: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(".parametrizations.weight.original1"):
            continue
        if key.endswith(".parametrizations.weight.original0"):
            stem = key.removesuffix(".parametrizations.weight.original0")
            direction = state[f"{stem}.parametrizations.weight.original1"]
            norm = direction.flatten(1).norm(dim=1).view(-1, *([1] * (direction.dim() - 1)))
            baked[f"{stem}.weight"] = value * direction / norm
        else:
            baked[key] = value
    return baked
