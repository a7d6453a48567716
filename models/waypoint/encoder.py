"""Waypoint's picture encoders: what turns a start image into the clean latent frame a session begins from.

Two, one per autoencoder (written from ``world_engine``'s ``src/ae_nn.py`` and
``src/ae.py``, commit 208c909824d906bf441122b7c40b9b4e1050d7c3, and the later
``src/ae.py`` whose ``ChunkedStreamingTAEHV`` serves Waypoint-1.5):

- :class:`AEEncoder`, Waypoint-1's autoencoder encoder (``encoder.safetensors``
  beside the decoder, weight-normed convolutions like it): the picture scaled
  to [-1, 1], its channels padded with zeros to the encoder's (the published
  file reads RGB plus a depth channel it is given as zeros), resized (bicubic)
  to the size whose down-stages give the model's latent grid (512x512 in the
  published file, whose code fixes that size), then per stage residual blocks
  and a bicubic half-size step beside a space-to-channel shortcut, and a last
  convolution beside a channel average. The file's ``conv_out_logvar`` is
  read and checked but never used, as published.
- :class:`TAEHVEncoder`, the encoder half of TAEHV (``taehv1_5.pth``'s
  ``encoder.*``): a start picture is repeated to ``t_downscale`` (four)
  frames, as the published engine is handed it, scaled to [0, 1], resized
  (bilinear) to the latent grid's size (the published 16:9 -> 16:8 resize:
  720x1280 -> 512x1024), unshuffled into 2x2 patches, then convolutions,
  memory blocks (each frame beside the previous frame's input; zeros before
  the first: a fresh stream) and two time pools that fold each four frames
  into one latent frame.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .decoder import ResBlock, conv
from ..wan_decoders.taehv import _MemoryBlock

TAEHV_WIDTH = 64  # the published encoder's width at every stage
TAEHV_TIME_POOLS = (2, 2, 1)  # frames folded together per stage: four frames a latent frame


def _resize(x: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    if tuple(x.shape[-2:]) == size:
        return x
    return F.interpolate(x, size=size, mode=mode, align_corners=False)


class _Downsample(nn.Module):
    def __init__(self, ch_in: int, ch_out: int) -> None:
        super().__init__()
        self.proj = conv(ch_in, ch_out, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.interpolate(x, scale_factor=0.5, mode="bicubic"))


class _DownBlock(nn.Module):
    def __init__(self, ch_in: int, ch_out: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(ch_in) for _ in range(blocks))
        self.down = _Downsample(ch_in, ch_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.down(x)


class _SpaceToChannel(nn.Module):
    def __init__(self, ch_in: int, ch_out: int) -> None:
        super().__init__()
        self.proj = conv(ch_in, ch_out // 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pixel_unshuffle(self.proj(x), 2)


class _ChannelAverage(nn.Module):
    """A convolution plus the input's channel groups averaged down to ``ch_out`` (scaled to unit variance)."""

    def __init__(self, ch_in: int, ch_out: int) -> None:
        super().__init__()
        self.proj = conv(ch_in, ch_out, 3)
        self.groups = ch_in // ch_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        average = x.reshape(b, self.groups, c // self.groups, h, w).mean(1) * self.groups**0.5
        return average + self.proj(x)


class _InputConv(nn.Module):
    def __init__(self, ch_in: int, ch_out: int) -> None:
        super().__init__()
        self.proj = conv(ch_in, ch_out, 3)


class AEEncoder(nn.Module):
    """Waypoint-1's encoder (``encoder_conf.yml``'s ``model`` keys); :meth:`encode` takes uint8 pixels."""

    def __init__(self, conf: dict[str, Any], latent_grid: tuple[int, int]) -> None:
        super().__init__()
        self.in_channels = int(conf["channels"])
        ch, ch_max = int(conf["ch_0"]), int(conf["ch_max"])
        self.conv_in = _InputConv(self.in_channels, ch)
        blocks, shortcuts = [], []
        for count in conf["encoder_blocks_per_stage"]:
            wider = min(ch * 2, ch_max)
            blocks.append(_DownBlock(ch, wider, int(count)))
            shortcuts.append(_SpaceToChannel(ch, wider))
            ch = wider
        self.blocks = nn.ModuleList(blocks)
        self.residuals = nn.ModuleList(shortcuts)
        self.conv_out = _ChannelAverage(ch, int(conf["latent_channels"]))
        if not conf.get("skip_logvar", False):
            self.conv_out_logvar = conv(ch, 1, 3)  # in the file; the published encode never reads it
        scale = 2 ** len(blocks)
        self.size = (latent_grid[0] * scale, latent_grid[1] * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in.proj(F.interpolate(x, self.size, mode="bicubic"))
        for block, shortcut in zip(self.blocks, self.residuals, strict=True):
            x = block(x) + shortcut(x)
        return self.conv_out(x)

    def encode(self, pixels: np.ndarray) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` -> the latent frame ``[C, h, w]`` (the published ``InferenceAE.encode``)."""
        weight = self.conv_in.proj.weight
        # a copy: the pixels may be read-only
        rgb = torch.from_numpy(np.array(pixels, dtype=np.uint8)).to(weight.device, weight.dtype)
        x = (rgb.permute(2, 0, 1)[None] / 255 * 2 - 1)[:, : self.in_channels]
        if x.shape[1] < self.in_channels:
            x = torch.cat([x, x.new_zeros(1, self.in_channels - x.shape[1], *x.shape[2:])], 1)
        return self(x)[0]

    def init_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                fan_in = param[0].numel() if param.dim() > 1 else 1
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)


class _TimePool(nn.Module):
    """``stride`` consecutive frames in, one out: their channels side by side through a 1x1 convolution."""

    def __init__(self, width: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(width * stride, width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames, channels, height, width = x.shape
        return self.conv(x.reshape(frames // self.stride, self.stride * channels, height, width))


class TAEHVEncoder(nn.Module):
    """TAEHV's encoder; ``self.encoder`` holds the published layout's ``encoder.<i>`` modules."""

    def __init__(self, latent_channels: int, patch_size: int, latent_grid: tuple[int, int],
                 width: int = TAEHV_WIDTH) -> None:
        super().__init__()
        self.patch_size = patch_size
        layers: list[nn.Module] = [nn.Conv2d(3 * patch_size**2, width, 3, padding=1), nn.ReLU()]
        for stride in TAEHV_TIME_POOLS:
            layers += [_TimePool(width, stride), nn.Conv2d(width, width, 3, stride=2, padding=1, bias=False)]
            layers += [_MemoryBlock(width, width) for _ in range(3)]
        layers.append(nn.Conv2d(width, latent_channels, 3, padding=1))
        self.encoder = nn.Sequential(*layers)
        self.t_downscale = 1
        for stride in TAEHV_TIME_POOLS:
            self.t_downscale *= stride
        scale = 2 ** len(TAEHV_TIME_POOLS) * patch_size
        self.size = (latent_grid[0] * scale, latent_grid[1] * scale)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """Frames ``[T, 3, H, W]`` in [0, 1] (T a multiple of ``t_downscale``; a fresh stream) -> latents
        ``[T / 4, C, h, w]``."""
        x = F.pixel_unshuffle(frames, self.patch_size) if self.patch_size > 1 else frames
        for block in self.encoder:
            if isinstance(block, _MemoryBlock):
                past = torch.cat([torch.zeros_like(x[:1]), x[:-1]])
                x = block(x, past)
            else:
                x = block(x)
        return x

    def encode(self, pixels: np.ndarray) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` -> the latent frame ``[C, h, w]`` of the picture held for four frames."""
        first = self.encoder[0]
        assert isinstance(first, nn.Conv2d)
        weight = first.weight
        # a copy: the pixels may be read-only
        rgb = torch.from_numpy(np.array(pixels, dtype=np.uint8)).to(weight.device, weight.dtype)
        frame = _resize(rgb.permute(2, 0, 1)[None] / 255, self.size, "bilinear")
        return self(frame.expand(self.t_downscale, -1, -1, -1))[0]

    def init_random(self, seed: int) -> None:
        """Seeded weights (tests and ``random_init``); biases zero, so that the
        picture, not the biases, makes the latent (pictures must give visibly different seeds)."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) / param[0].numel() ** 0.5)


PictureEncoder = AEEncoder | TAEHVEncoder


def taehv_encoder_width(state: dict[str, torch.Tensor]) -> int:
    """The encoder's width, read from its first convolution (``encoder.0.weight``); KeyError when absent."""
    return int(state["encoder.0.weight"].shape[0])
