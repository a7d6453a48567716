"""ToyAttentionPipeline: random-weight chunk attention, the runner's benchmark and reference workload.

It runs the same math as a real AR diffusion transformer (per-layer Q/K/V,
bidirectional attention within a chunk, history from the KV cache, a few
non-committing denoise passes then one committing pass), with seeded random
weights. The KV source is pluggable, so the same model runs either through the
runner's paged :class:`SessionKVState` or through :class:`DenseKVCache`, a
direct contiguous cache with the same sink + window semantics. Tests compare
the two outputs; ``arstream bench runner`` compares their speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..runner.binding import SessionStateBinding
from ..runner.kv_state import SessionKVState
from ..runner.spec import KVCacheSpec
from ..runner.types import TickRequest

KVSource = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DenseKVCache:
    """A contiguous per-layer K/V buffer with sink + sliding-window semantics.

    Layout per layer: ``[sink frames | window frames | current chunk]`` in one
    preallocated tensor, so the visible K/V are a zero-copy slice. Sliding the
    window moves the window region left by the overflow.
    """

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        frames = spec.resident_frames + spec.frames_per_chunk
        shape = (spec.num_layers, frames * spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.frames_held = 0
        self.frames_committed = 0
        self._commit = False

    @property
    def frame_start(self) -> int:
        return self.frames_committed

    def begin_pass(self, *, commit: bool) -> None:
        self._commit = commit

    def write_and_gather(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.frames_held * self.spec.tokens_per_frame
        end = start + k.shape[0]
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def end_pass(self) -> None:
        if not self._commit:
            return
        spec = self.spec
        self.frames_held += spec.frames_per_chunk
        self.frames_committed += spec.frames_per_chunk
        overflow = self.frames_held - spec.resident_frames
        if overflow > 0:
            t = spec.tokens_per_frame
            keep_from = (spec.sink_frames + overflow) * t
            keep_to = self.frames_held * t
            dest = spec.sink_frames * t
            # clone: source and destination ranges overlap
            self.k[:, dest : dest + keep_to - keep_from] = self.k[:, keep_from:keep_to].clone()
            self.v[:, dest : dest + keep_to - keep_from] = self.v[:, keep_from:keep_to].clone()
            self.frames_held = spec.resident_frames


class ToyAttentionModel(torch.nn.Module):
    """A stack of pre-norm attention + MLP blocks over one chunk's tokens."""

    def __init__(self, spec: KVCacheSpec, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.spec = spec
        self.dim = spec.num_kv_heads * spec.head_size
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(self.dim, 3 * self.dim) for _ in range(spec.num_layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(self.dim, self.dim) for _ in range(spec.num_layers))
        self.mlp = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(self.dim, 2 * self.dim), torch.nn.GELU(), torch.nn.Linear(2 * self.dim, self.dim))
            for _ in range(spec.num_layers)
        )
        self.norm = torch.nn.LayerNorm(self.dim)
        self.position = torch.nn.Embedding(4096, self.dim)
        self.eval()

    @torch.inference_mode()
    def forward_chunk(self, x: torch.Tensor, frame_start: int, kv: KVSource) -> torch.Tensor:
        """``x``: ``[frames_per_chunk * tokens_per_frame, dim]``; returns the same shape."""
        spec = self.spec
        positions = torch.arange(frame_start, frame_start + spec.frames_per_chunk, device=x.device) % 4096
        h = x + self.position(positions).repeat_interleave(spec.tokens_per_frame, dim=0)
        heads, size = spec.num_kv_heads, spec.head_size
        for layer in range(spec.num_layers):
            q, k, v = self.qkv[layer](self.norm(h)).chunk(3, dim=-1)
            k_all, v_all = kv(layer, k.reshape(-1, heads, size), v.reshape(-1, heads, size))
            attended = F.scaled_dot_product_attention(
                q.reshape(-1, heads, size).transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1)
            )
            h = h + self.out[layer](attended.transpose(0, 1).reshape(-1, self.dim))
            h = h + self.mlp[layer](self.norm(h))
        return h


def toy_spec(**overrides: Any) -> KVCacheSpec:
    base: dict[str, Any] = dict(
        num_layers=4,
        num_kv_heads=4,
        head_size=16,
        tokens_per_frame=16,
        frames_per_chunk=2,
        sink_frames=1,
        window_frames=8,
        session_capacity=16,
    )
    base.update(overrides)
    return KVCacheSpec(**base)


def run_chunk(
    model: ToyAttentionModel, cache: SessionKVState | DenseKVCache, noise: torch.Tensor, steps: int
) -> torch.Tensor:
    """Denoise passes on scratch, then one committing pass; returns the chunk's latent."""
    x = noise
    for _ in range(steps):
        cache.begin_pass(commit=False)
        x = model.forward_chunk(x, cache.frame_start, cache.write_and_gather)
        cache.end_pass()
    cache.begin_pass(commit=True)
    model.forward_chunk(x, cache.frame_start, cache.write_and_gather)
    cache.end_pass()
    return x


def chunk_noise(spec: KVCacheSpec, dim: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(spec.frames_per_chunk * spec.tokens_per_frame, dim, generator=generator)


class ToyAttentionPipeline(SessionStateBinding):
    """ARPipeline over :class:`ToyAttentionModel`; frames are a grey-level view of the latent."""

    def __init__(
        self, *, steps: int = 3, seed: int = 0, device: torch.device | str = "cpu", **spec_overrides: Any
    ) -> None:
        super().__init__()
        self.spec = toy_spec(**spec_overrides)
        self.device = torch.device(device)
        self.model = ToyAttentionModel(self.spec, seed=seed).to(self.device)
        self.steps = steps
        self._generators: dict[str, torch.Generator] = {}
        self.last_latent: torch.Tensor | None = None
        self._side = int((self.spec.tokens_per_frame * self.model.dim) ** 0.5)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.spec

    def model_card(self) -> dict[str, Any]:
        side = self._side
        return {
            "name": "toy-attention",
            "width": side,
            "height": side,
            "fps": 16,
            "frames_per_chunk": self.spec.frames_per_chunk,
            "reads_prompt": False,
            "controls": {"type": "object", "additionalProperties": True},
        }

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        state = self.bound_state(tick.session_id)
        generator = self._generators.get(tick.session_id)
        if generator is None:
            generator = torch.Generator().manual_seed(tick.seed or 0)
            self._generators[tick.session_id] = generator
        noise = chunk_noise(self.spec, self.model.dim, generator).to(self.device)  # drawn on the CPU: same on any device
        latent = run_chunk(self.model, state, noise, self.steps)
        self.last_latent = latent
        return self.latent_to_frames(latent)

    def latent_to_frames(self, latent: torch.Tensor) -> np.ndarray:
        """uint8 ``[F, side, side, 3]`` grey frames from a chunk latent."""
        side = self._side
        pixels = latent.reshape(self.spec.frames_per_chunk, -1)[:, : side * side]
        grey = (torch.sigmoid(pixels) * 255).to(torch.uint8).reshape(-1, side, side, 1)
        return np.ascontiguousarray(grey.expand(-1, -1, -1, 3).cpu().numpy())

    def reset_session(self, session_id: str) -> None:
        self._generators.pop(session_id, None)

    def close_session(self, session_id: str) -> None:
        self._generators.pop(session_id, None)

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        return [TickRequest(session_id=session_id, request_id=i) for i in range(2)]
