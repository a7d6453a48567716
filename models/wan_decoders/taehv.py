"""TAEHV's decoder for Wan2.1 latents (``taew2_1``), streamed chunk by chunk with a state per session.

TAEHV (madebyollin/taehv) is a tiny causal video decoder: 2-D convolutions per
frame, and "memory blocks" that see their input frame beside the previous
frame's input at the same depth; two temporal-grow blocks turn each latent
frame into four video frames. The module tree below keeps the published
``nn.Sequential`` indices, so ``taew2_1.pth``'s ``decoder.*`` keys load as they are.

Streaming: the only thing that crosses a chunk boundary is, per memory block,
the last frame of its input. :meth:`TAEHVDecoder.decode` runs a whole chunk's
frames in parallel through each block (a memory block's "previous frame" is
the chunk's own frames shifted by one, the first taking the carried one) and
returns the new state, so decoding chunk by chunk gives the frames of
decoding the whole rollout at once. As the published decoder does, the first
``t_upscale - 1`` frames of a rollout are dropped (alignment with the Wan VAE:
a rollout's first latent frame becomes one video frame, every later one four).
The state given is never changed; the pipeline keeps the returned one only
once its forward succeeded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# The published decoder's widths (taew2_1.pth) and latent channels.
PUBLISHED_WIDTHS = (256, 128, 64, 64)
WAN_LATENT_CHANNELS = 16
# Temporal growth of the three stages as taew2_1 is published: none, then x2, x2 (4 frames per latent frame).
TIME_STRIDES = (1, 2, 2)

DecoderState = list[torch.Tensor]


@dataclass(frozen=True)
class TAEHVShape:
    """What a weight file's shapes fix: the four stage widths, the latent channels and the patch size.

    ``patch_size`` above 1 (``taehv1_5``, for HunyuanVideo 1.5 latents: 2) makes the last convolution emit
    ``3 * patch_size**2`` channels that a pixel shuffle turns into a ``patch_size`` times larger picture.
    """

    widths: tuple[int, int, int, int] = PUBLISHED_WIDTHS
    latent_channels: int = WAN_LATENT_CHANNELS
    patch_size: int = 1


def _conv(n_in: int, n_out: int, *, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class _SoftClamp(nn.Module):
    """Squash latents into (-3, 3) smoothly before the first convolution (the published ``Clamp``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class _MemoryBlock(nn.Module):
    """A residual block whose convolutions read the frame and the previous frame's input, stacked on channels."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            _conv(n_in * 2, n_out), nn.ReLU(), _conv(n_out, n_out), nn.ReLU(), _conv(n_out, n_out)
        )
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(torch.cat([x, past], 1)) + self.skip(x))


class _TimeGrow(nn.Module):
    """One frame in, ``stride`` frames out: a 1x1 convolution to ``stride`` times the channels, split in time."""

    def __init__(self, n_f: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n_f, n_f * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames, channels, height, width = x.shape
        # channel group k of frame t is output frame t * stride + k
        return self.conv(x).reshape(frames * self.stride, channels, height, width)


class TAEHVDecoder(nn.Module):
    """The decoder half of TAEHV; ``self.decoder`` holds the published layout's ``decoder.<i>`` modules."""

    def __init__(self, shape: TAEHVShape = TAEHVShape()) -> None:
        super().__init__()
        self.shape = shape
        w = shape.widths
        layers: list[nn.Module] = [_SoftClamp(), _conv(shape.latent_channels, w[0]), nn.ReLU()]
        for stage, stride in enumerate(TIME_STRIDES):
            n_f = w[stage]
            layers += [_MemoryBlock(n_f, n_f) for _ in range(3)]
            layers += [nn.Upsample(scale_factor=2), _TimeGrow(n_f, stride), _conv(n_f, w[stage + 1], bias=False)]
        layers += [nn.ReLU(), _conv(w[3], 3 * shape.patch_size**2)]
        self.decoder = nn.Sequential(*layers)
        self.t_upscale = 1
        for stride in TIME_STRIDES:
            self.t_upscale *= stride
        self.frames_to_trim = self.t_upscale - 1

    @property
    def memory_blocks(self) -> int:
        return sum(isinstance(m, _MemoryBlock) for m in self.decoder)

    def decode(self, latents: torch.Tensor, state: DecoderState | None) -> tuple[torch.Tensor, DecoderState]:
        """Latents ``[N, T, C, h, w]`` (the DiT's normalised Wan latents) -> frames ``[N, T', 3, H, W]`` in [0, 1].

        ``state`` None starts a rollout (memory of zeros; the first
        ``frames_to_trim`` output frames dropped). Returns the state after the
        chunk: per memory block, the last frame of its input.
        """
        if latents.ndim != 5 or latents.shape[2] != self.shape.latent_channels:
            raise ValueError(
                f"TAEHV decodes [N, T, {self.shape.latent_channels}, h, w] latents, got {list(latents.shape)}"
            )
        if state is not None and len(state) != self.memory_blocks:
            raise ValueError(f"TAEHV state has {len(state)} entries, the decoder {self.memory_blocks} memory blocks")
        n, frames = latents.shape[:2]
        x = latents.reshape(n * frames, *latents.shape[2:])
        new_state: DecoderState = []
        for block in self.decoder:
            if isinstance(block, _MemoryBlock):
                current = x.reshape(n, frames, *x.shape[1:])
                carried = current[:, :1] * 0 if state is None else state[len(new_state)][:, None]
                past = torch.cat([carried, current[:, :-1]], 1).reshape(x.shape)
                new_state.append(current[:, -1].clone())  # a clone: a view would keep the whole chunk alive
                x = block(x, past)
            else:
                x = block(x)
                if isinstance(block, _TimeGrow):
                    frames *= block.stride
        if self.shape.patch_size > 1:
            x = F.pixel_shuffle(x, self.shape.patch_size)
        video = x.reshape(n, frames, *x.shape[1:]).clamp(0, 1)
        if state is None:
            video = video[:, self.frames_to_trim :]
        return video, new_state


def shape_of(state: dict[str, torch.Tensor]) -> TAEHVShape:
    """The widths a ``decoder.*`` state dict was trained at, read from its convolutions (published indices)."""
    first = state.get("decoder.1.weight")
    stage_convs = [state.get(f"decoder.{i}.weight") for i in (8, 14, 20)]
    if first is None or any(t is None for t in stage_convs):
        raise KeyError("decoder.1.weight, decoder.8.weight, decoder.14.weight and decoder.20.weight")
    outs = [int(t.shape[0]) for t in stage_convs if t is not None]
    last = state.get("decoder.22.weight")  # the picture convolution: 3 channels per pixel of a patch
    patch_size = 1 if last is None else max(1, math.isqrt(int(last.shape[0]) // 3))
    return TAEHVShape(widths=(int(first.shape[0]), outs[0], outs[1], outs[2]), latent_channels=int(first.shape[1]),
                      patch_size=patch_size)


def fit_time_grow(module: TAEHVDecoder, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A grow layer saved with more output frames than this decoder makes keeps the last ones (as published)."""
    fitted = dict(state)
    for i, layer in enumerate(module.decoder):
        key = f"decoder.{i}.conv.weight"
        if isinstance(layer, _TimeGrow) and key in fitted:
            wanted = layer.conv.weight.shape[0]
            if fitted[key].shape[0] > wanted and fitted[key].shape[0] % wanted == 0:
                fitted[key] = fitted[key][-wanted:]
    return fitted


def decoder_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder half of a TAEHV file (the published files hold the encoder too)."""
    return {k: v for k, v in state.items() if k.startswith("decoder.")}


class StreamingTAEHV:
    """TAEHV behind the Wan VAE's streaming interface: ``[B, 16, F, h, w]`` in, ``[B, 3, F', H, W]`` in [-1, 1] out."""

    def __init__(self, decoder: TAEHVDecoder) -> None:
        self.module = decoder.eval()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Where it decodes (and keeps each session's state): the model's device, or another (``decode_device``)."""
        return next(self.module.parameters()).device

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, cache: DecoderState | None) -> tuple[torch.Tensor, DecoderState]:
        """One chunk of one or more rows sharing a state layout (all new rollouts, or none)."""
        video, state = self.module.decode(latents.permute(0, 2, 1, 3, 4).to(self.device, self.dtype), cache)
        return (video * 2 - 1).permute(0, 2, 1, 3, 4), state

    def decode_rows(
        self, latents: torch.Tensor, caches: Sequence[DecoderState | None]
    ) -> tuple[list[torch.Tensor], list[DecoderState]]:
        """Each row with its own state; rows all starting (or all continuing) a rollout decode as one batch."""
        rows = latents.shape[0]
        if all(c is None for c in caches):
            video, state = self.decode(latents, None)
        elif all(c is not None for c in caches):
            stacked = [torch.cat(entries) for entries in zip(*caches)]
            video, state = self.decode(latents, stacked)
        else:
            decoded = [self.decode(latents[row : row + 1], caches[row]) for row in range(rows)]
            return [v for v, _ in decoded], [s for _, s in decoded]
        return [video[row : row + 1] for row in range(rows)], [[e[row : row + 1].clone() for e in state] for row in range(rows)]
