"""Streaming Wan VAE decode through ``diffusers.AutoencoderKLWan``, with a feature cache per session.

The Wan2.1 VAE decoder is causal in time: decoding latent frame ``i`` needs
the last few frames of every causal convolution's input, which the decoder
keeps in a feature cache (a list with one entry per causal convolution).
``AutoencoderKLWan`` decodes frame by frame through that cache; here each
session owns its cache, so a chunk decodes on its own and the frames equal a
one-call decode of the whole latent. :meth:`StreamingVAE.decode` never
changes the cache it is given (the decoder replaces entries; it works on a
copy of the list) and returns the new one: the pipeline stores it only once
the whole forward succeeded.

The encoder is causal the same way: :meth:`StreamingVAE.encode_step` encodes
the first frame alone and then four frames at a time through its own feature
cache, exactly the steps of diffusers' one-call ``encode``, so the image
conditioning can be extended a latent frame at a time
(matrix-game's :class:`~arstream.models.matrix_game.images.ConditionStream`). The encoder and
decoder may hold different dtypes: Matrix-Game encodes in bf16 and decodes in fp16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..quantize import quiet_torchao_import

try:
    with quiet_torchao_import():  # diffusers imports torchao where it is installed
        from diffusers import AutoencoderKLWan
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
except ImportError as exc:  # pragma: no cover - the extra is part of the test install
    raise ImportError(
        "the Wan models need diffusers' AutoencoderKLWan: pip install 'arstream[wan]'"
    ) from exc

FeatureCache = list[Any]


@dataclass(frozen=True)
class VAEConfig:
    """``diffusers.AutoencoderKLWan`` arguments (Wan2.1 VAE: 8x spatial, 4x temporal, 16 channels)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2

    def kwargs(self) -> dict[str, Any]:
        return {
            "base_dim": self.base_dim,
            "z_dim": self.z_dim,
            "dim_mult": list(self.dim_mult),
            "num_res_blocks": self.num_res_blocks,
            "attn_scales": [],
            "temperal_downsample": [False, True, True],
        }


class HasVAE(Protocol):
    """A model config that names its VAE's geometry."""

    @property
    def vae(self) -> VAEConfig: ...


def build_vae(cfg: HasVAE) -> AutoencoderKLWan:
    return AutoencoderKLWan(**cfg.vae.kwargs())


class StreamingVAE:
    def __init__(self, vae: AutoencoderKLWan) -> None:
        self.vae = vae.eval()
        param = next(vae.parameters())
        shape = (1, -1, 1, 1, 1)
        self.mean = torch.tensor(vae.config.latents_mean, device=param.device).view(shape)
        self.std = torch.tensor(vae.config.latents_std, device=param.device).view(shape)
        self.cache_entries = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        vae.clear_cache()  # sizes diffusers' own encoder cache list: one entry per cached convolution
        self.encoder_cache_entries = len(vae._enc_feat_map)

    @property
    def dtype(self) -> torch.dtype:
        """The decoder's dtype."""
        return next(self.vae.decoder.parameters()).dtype

    @property
    def encoder_dtype(self) -> torch.dtype:
        return next(self.vae.encoder.parameters()).dtype

    @torch.inference_mode()
    def encode_step(self, video: torch.Tensor, cache: FeatureCache | None) -> tuple[torch.Tensor, FeatureCache]:
        """One step of the causal encoder: video ``[1, 3, T, H, W]`` in [-1, 1] -> normalised latents ``[16, 1, h, w]``.

        ``cache`` None starts a video (``T`` = 1, the first frame); later steps
        take 4 frames each. The latent is the posterior's mode (its mean), as
        Matrix-Game takes it. ``cache`` is not changed; the new one is returned.
        """
        work: FeatureCache = [None] * self.encoder_cache_entries if cache is None else list(cache)
        out = self.vae.encoder(video.to(self.encoder_dtype), feat_cache=work, feat_idx=[0])
        mean = self.vae.quant_conv(out)[:, : self.vae.config.z_dim]
        return ((mean.to(self.mean.dtype) - self.mean) / self.std)[0], work

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, cache: FeatureCache | None) -> tuple[torch.Tensor, FeatureCache]:
        """Normalised latents ``[1, 16, F, h, w]`` -> video ``[1, 3, F', H, W]`` in [-1, 1] and the new cache.

        ``cache`` None starts a rollout: its first latent frame becomes one video frame.
        """
        first = cache is None
        work: FeatureCache = [None] * self.cache_entries if cache is None else list(cache)
        z = (latents.to(self.mean.dtype) * self.std + self.mean).to(self.dtype)
        x = self.vae.post_quant_conv(z)
        frames = [
            self.vae.decoder(x[:, :, i : i + 1], feat_cache=work, feat_idx=[0], first_chunk=first and i == 0)
            for i in range(x.shape[2])
        ]
        return torch.cat(frames, dim=2).clamp(-1, 1), work

    def steady_cache_bytes(self, latent_shape: tuple[int, int, int, int]) -> int:
        """Bytes of a steady-state decoder cache (after a first and a later chunk of zeros ``[16, F, h, w]``)."""
        zeros = torch.zeros(1, *latent_shape, device=self.mean.device)
        _, cache = self.decode(zeros, None)
        _, cache = self.decode(zeros, cache)
        return cache_bytes(cache)

    def decode_rows(
        self, latents: torch.Tensor, caches: list[FeatureCache | None]
    ) -> tuple[list[torch.Tensor], list[FeatureCache]]:
        """Several sessions' chunks ``[B, 16, F, h, w]``, each with its own cache.

        Rows whose caches have the same structure (all new rollouts, or all
        past their first chunk) decode as one batch: the caches stack along
        the batch dimension and split again after. Otherwise row by row.
        """
        rows = latents.shape[0]
        if rows > 1 and _same_structure(caches):
            first = caches[0]
            stacked = None if first is None else [_stack(entries) for entries in zip(*caches)]  # type: ignore[arg-type]
            video, cache = self.decode(latents, stacked)
            split = [[_row(entry, row) for entry in cache] for row in range(rows)]
            return [video[row : row + 1] for row in range(rows)], split
        decoded = [self.decode(latents[row : row + 1], caches[row]) for row in range(rows)]
        return [video for video, _ in decoded], [cache for _, cache in decoded]


def _same_structure(caches: list[FeatureCache | None]) -> bool:
    if all(c is None for c in caches):
        return True
    if any(c is None for c in caches):
        return False

    def shape(entry: Any) -> Any:
        return tuple(entry.shape) if isinstance(entry, torch.Tensor) else entry

    signatures = {tuple(shape(e) for e in cache) for cache in caches}  # type: ignore[union-attr]
    return len(signatures) == 1


def _stack(entries: tuple[Any, ...]) -> Any:
    """One cache entry of every row, batched (entries are None, the string "Rep", or ``[1, ...]`` tensors)."""
    return torch.cat(entries) if isinstance(entries[0], torch.Tensor) else entries[0]


def _row(entry: Any, row: int) -> Any:
    # clone: a row's cache must not keep the whole batch's tensor alive after the batch changes
    return entry[row : row + 1].clone() if isinstance(entry, torch.Tensor) else entry


def cache_bytes(cache: FeatureCache) -> int:
    return sum(t.numel() * t.element_size() for t in cache if isinstance(t, torch.Tensor))


def export_feature_cache(cache: FeatureCache | None, tensors: dict[str, torch.Tensor]) -> list[Any] | None:
    """A session's decoder cache for a snapshot: its tensors into ``tensors`` (``vae/N``), the entries' kinds returned.

    Entries are tensors, None, or diffusers' "Rep" marker (repeat the first frame).
    """
    if cache is None:
        return None
    kinds: list[Any] = []
    for i, entry in enumerate(cache):
        if isinstance(entry, torch.Tensor):
            tensors[f"vae/{i}"] = entry
            kinds.append("tensor")
        else:
            kinds.append(entry)
    return kinds


def import_feature_cache(kinds: list[Any] | None, tensors: dict[str, torch.Tensor]) -> FeatureCache | None:
    """The inverse of :func:`export_feature_cache`."""
    if kinds is None:
        return None
    return [tensors[f"vae/{i}"] if kind == "tensor" else kind for i, kind in enumerate(kinds)]


def to_uint8(video: torch.Tensor) -> np.ndarray:
    """``[1, 3, F, H, W]`` in [-1, 1] -> uint8 ``[F, H, W, 3]``."""
    pixels = ((video[0].float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return np.ascontiguousarray(pixels.permute(1, 2, 3, 0).cpu().numpy())
