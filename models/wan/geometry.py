"""The Wan2.1-1.3B backbone both causal Wan families share: its fields, and the sizes derived from them.

matrix-game-2's and LongLive's configs both inherit :class:`WanGeometry`, so
the backbone's published sizes (1536 wide, 30 layers, 12 heads, Wan's VAE)
and the arithmetic from latent sizes to tokens and pixels are written once.
Every field is keyword-only (the families' configs are too), so a family
adds its own fields (the attention window, the steps, its modules) and
declares a shared one again only where its published default differs
(matrix-game-2's image-conditioned input and 352x640 video).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .vae import VAEConfig
from ...runner.spec import KVCacheSpec

# The Wan VAE's spatial compression: one latent pixel is 8x8 video pixels.
VAE_SPATIAL_COMPRESSION = 8


@dataclass(frozen=True, kw_only=True)
class WanGeometry:
    """The backbone's fields (Wan2.1-T2V-1.3B's defaults) and the sizes derived from them."""

    dim: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_layers: int = 30
    freq_dim: int = 256
    eps: float = 1e-6
    patch_size: tuple[int, int, int] = (1, 2, 2)
    frames_per_chunk: int = 3  # latent frames
    rope_frames: int = 1024  # Wan's rotary table
    timestep_shift: float = 5.0
    in_dim: int = 16  # the noisy latent's channels (a text-to-video DiT reads nothing else)
    out_dim: int = 16  # latent channels the DiT predicts (the VAE's)
    latent_height: int = 60  # Wan2.1-T2V's 480x832 video
    latent_width: int = 104
    vae: VAEConfig = field(default_factory=VAEConfig)

    @property
    def video_frames_per_latent(self) -> int:
        """Video frames each latent frame after the first decodes to (the VAE's time compression)."""
        # LongLive's config has it as a field, matrix-game-2's derives it from its action module
        raise NotImplementedError(f"{type(self).__name__} must say how many video frames a latent frame decodes to")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def grid(self) -> tuple[int, int]:
        """Token rows and columns of one latent frame."""
        return self.latent_height // self.patch_size[1], self.latent_width // self.patch_size[2]

    @property
    def tokens_per_frame(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def height(self) -> int:
        return self.latent_height * VAE_SPATIAL_COMPRESSION

    @property
    def width(self) -> int:
        return self.latent_width * VAE_SPATIAL_COMPRESSION

    @property
    def video_frames_per_chunk(self) -> int:
        return self.frames_per_chunk * self.video_frames_per_latent

    @property
    def first_chunk_frames(self) -> int:
        """The causal VAE turns the first latent frame into one video frame, each later one into four."""
        return 1 + (self.frames_per_chunk - 1) * self.video_frames_per_latent


def backbone_kv_spec(geometry: WanGeometry, kv_heads: int | None = None, **family: Any) -> KVCacheSpec:
    """The runner's KV for the backbone's self-attention (every layer, one block per latent frame); the family adds
    its sink, window, capacity and what else it keeps (``family``: the other :class:`KVCacheSpec` fields).
    ``kv_heads``: the heads this device holds, over several devices (models/wan/parallel.py); default all."""
    return KVCacheSpec(
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_heads if kv_heads is None else kv_heads,
        head_size=geometry.head_dim,
        tokens_per_frame=geometry.tokens_per_frame,
        frames_per_chunk=geometry.frames_per_chunk,
        **family,
    )
