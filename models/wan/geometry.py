"""The sizes every causal Wan2.1 config derives from its fields: heads, token grid, pixels, video frames a chunk.

matrix-game-2's and LongLive's configs both inherit :class:`WanGeometry`, so
the arithmetic from latent sizes to tokens and pixels is written once. It is
a plain mixin, not a dataclass: each family's frozen dataclass declares the
fields (with its own defaults) and this class only reads them.
"""

from __future__ import annotations

# The Wan VAE's spatial compression: one latent pixel is 8x8 video pixels.
VAE_SPATIAL_COMPRESSION = 8


class WanGeometry:
    """Derived sizes; the inheriting dataclass supplies the fields named below."""

    dim: int
    num_heads: int
    patch_size: tuple[int, int, int]
    latent_height: int
    latent_width: int
    frames_per_chunk: int  # latent frames

    @property
    def video_frames_per_latent(self) -> int:
        """Video frames each latent frame after the first decodes to (the VAE's time compression)."""
        raise NotImplementedError  # a field in one family, derived from the action module in the other

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
