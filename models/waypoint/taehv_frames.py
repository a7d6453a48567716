"""Waypoint-1.5's decoder: TAEHV (``taehv1_5``) turning each latent frame into ``temporal_compression`` frames.

The published engine (Overworld's ``world_engine``, its ``ChunkedStreamingTAEHV``) decodes one latent frame a
``gen_frame`` with a streaming TAEHV whose memory blocks carry the previous frame's input. Its first decode of a
session primes the stream: the first latent frame is decoded ``frames_to_trim`` times (three) and those frames
thrown away, then decoded once more for the four frames shown. A 16:8 picture is then resized (bilinear) to the
16:9 size served, and rounded to bytes.

Here the stream's state (per memory block, the last frame of its input) belongs to the session: the pipeline keeps
it beside the session's noise generator and exports it with a snapshot, rewind point or parked session, so a
session moved or rewound decodes on exactly as it would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..wan_decoders.taehv import DecoderState, TAEHVDecoder, TAEHVShape


def taehv_shape(ae: dict[str, object]) -> TAEHVShape:
    widths = tuple(int(w) for w in ae["widths"])  # type: ignore[attr-defined]
    if len(widths) != 4:
        raise ValueError(f"TAEHV takes four stage widths, got {list(widths)}")
    return TAEHVShape(
        widths=(widths[0], widths[1], widths[2], widths[3]),
        latent_channels=int(ae["latent_channels"]),  # type: ignore[call-overload]
        patch_size=int(ae["patch_size"]),  # type: ignore[call-overload]
    )


class FramesDecoder(TAEHVDecoder):
    """TAEHV's decoder (the published ``decoder.*`` keys) with the session-start priming and the served size."""

    def __init__(self, shape: TAEHVShape, size: tuple[int, int]) -> None:
        super().__init__(shape)
        self.size = size

    def decode_frames(
        self, latents: torch.Tensor, states: Sequence[DecoderState | None]
    ) -> tuple[torch.Tensor, list[DecoderState]]:
        """Latents ``[N, C, h, w]`` (one frame per row) and each row's state (None: the session's first) ->
        uint8 frames ``[N, t_upscale, H, W, 3]`` and each row's new state. The states given are not changed."""
        rows = latents.shape[0]
        if len(states) != rows:
            raise ValueError(f"{rows} latent rows but {len(states)} decoder states")
        carried: list[DecoderState] = []
        starting = [row for row in range(rows) if states[row] is None]
        primed: dict[int, DecoderState] = {}
        if starting:  # the published priming: the first latent frame decoded frames_to_trim times, output dropped
            first = latents[starting][:, None].expand(-1, self.frames_to_trim, -1, -1, -1)
            _, state = self.decode(first, None)
            primed = {row: [entry[i : i + 1] for entry in state] for i, row in enumerate(starting)}
        for row in range(rows):
            given = states[row]
            carried.append(primed[row] if given is None else given)
        stacked = [torch.cat(entries) for entries in zip(*carried)]
        video, new_state = self.decode(latents[:, None], stacked)
        frames = video.flatten(0, 1)
        if tuple(frames.shape[-2:]) != self.size:
            frames = F.interpolate(frames, size=self.size, mode="bilinear", align_corners=False)
        pixels = (frames.clamp(0, 1) * 255).round().to(torch.uint8)
        pixels = pixels.reshape(rows, -1, *pixels.shape[1:]).permute(0, 1, 3, 4, 2)
        return pixels, [[entry[row : row + 1].clone() for entry in new_state] for row in range(rows)]

    def state_bytes(self, latent_shape: tuple[int, int, int], dtype: torch.dtype) -> int:
        """What one session's stream state holds (counted in capacity like its KV)."""
        with torch.device("meta"):
            probe = FramesDecoder(self.shape, self.size).to(dtype)
            _, state = probe.decode(torch.zeros(1, 1, *latent_shape, dtype=dtype), None)
        return sum(entry.numel() * entry.element_size() for entry in state)

    def init_random(self, seed: int) -> None:
        """Seeded weights (tests and ``random_init``), unit variance per output so the memory blocks visibly matter."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) / max(1, param[0].numel()) ** 0.5)
