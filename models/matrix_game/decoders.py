"""Which decoder turns matrix-game-2's latents into frames: the Wan VAE (default) or TAEHV (``decoder: taehv``).

TAEHV (:mod:`arstream.models.wan_decoders.taehv`) decodes the same normalised
Wan2.1 latents at a fraction of the Wan VAE's cost and per-session state
(per memory block one frame of activations, against the VAE's feature cache of
about 1 GB at 352x640). The image conditioning is still encoded by the Wan VAE's
encoder: TAEHV replaces only the decode. Its weights come from the published
``taew2_1.pth`` (or ``.safetensors``) in the checkpoint directory, or are
seeded random at the config's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol

import torch

from . import checkpoint as ckpt
from .config import MatrixGameConfig
from ..wan.vae import FeatureCache, StreamingVAE
from ...runner.snapshot import weights_digest
from ..wan_decoders.taehv import (
    StreamingTAEHV,
    TAEHVDecoder,
    TAEHVShape,
    decoder_keys,
    fit_time_grow,
    shape_of,
)

DecoderName = Literal["wan-vae", "taehv"]
DECODERS: tuple[DecoderName, ...] = ("wan-vae", "taehv")
TAEHV_FILES = ("taew2_1.pth", "taew2_1.safetensors")
# toy widths for the tiny configs' random decoder (the published ones are 256, 128, 64, 64)
TINY_WIDTHS = (16, 8, 8, 8)


class LatentDecoder(Protocol):
    """What the pipeline asks of a decoder: a chunk of several rows, each with its own streaming state."""

    @property
    def dtype(self) -> torch.dtype: ...

    def decode_rows(
        self, latents: torch.Tensor, caches: list[FeatureCache | None]
    ) -> tuple[list[torch.Tensor], list[FeatureCache]]: ...


def load_taehv(path: Path) -> TAEHVDecoder:
    """The decoder half of a TAEHV file in the published layout; its widths are read from its shapes."""
    state = decoder_keys(ckpt.read_state_dict(path))
    try:
        shape = shape_of(state)
    except KeyError as exc:
        raise ckpt.CheckpointError(f"{path} is not a TAEHV decoder: missing keys: {exc.args[0]}") from None
    if shape.latent_channels != 16:
        raise ckpt.CheckpointError(
            f"{path} decodes {shape.latent_channels}-channel latents; Wan2.1's have 16 (is it taew2_2 or taehv?)"
        )
    module = TAEHVDecoder(shape)
    ckpt.load_into(module, fit_time_grow(module, state), path)
    return module


def build_decoder(
    name: str,
    vae: StreamingVAE,
    cfg: MatrixGameConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    checkpoint: Path | None,
    decoder_file: str | None,
    seed: int,
    decode_device: str | None = None,
) -> LatentDecoder:
    """The decoder the ``decoder`` option names, on ``device`` (or ``decode_device``) in ``dtype``.

    The Wan VAE is returned as it is: its decoder shares a module with the encoder the image conditioning needs.
    """
    if name not in DECODERS:
        raise ValueError(f"decoder must be one of {list(DECODERS)}, got {name!r}")
    if name == "wan-vae":
        if decoder_file is not None:
            raise ValueError("decoder_file is for decoder 'taehv'; the Wan VAE's file is vae_file")
        if decode_device is not None:
            raise ValueError("decode_device needs decoder 'taehv' (the Wan VAE decodes where it encodes)")
        return vae
    if device.type == "meta":  # a plan (arstream plan): shapes and bytes, no file read
        with torch.device("meta"):
            module = TAEHVDecoder(TAEHVShape(widths=TINY_WIDTHS) if cfg.name.startswith("tiny") else TAEHVShape())
        return StreamingTAEHV(module.to(dtype=dtype))
    if decode_device is not None:
        try:
            device = torch.device(decode_device)
        except RuntimeError as exc:
            raise ValueError(f"decode_device: {exc}") from None
    if checkpoint is not None:
        module = load_taehv(ckpt.find_file(checkpoint, decoder_file, TAEHV_FILES, "TAEHV decoder"))
    else:
        torch.manual_seed(seed + 2)
        module = TAEHVDecoder(TAEHVShape(widths=TINY_WIDTHS) if cfg.name.startswith("tiny") else TAEHVShape())
    return StreamingTAEHV(module.to(device=device, dtype=dtype))


def decoder_device(decoder: LatentDecoder, default: torch.device) -> torch.device:
    """Where a decoder keeps its sessions' states (TAEHV may sit on its own device; the VAE on the model's)."""
    return decoder.device if isinstance(decoder, StreamingTAEHV) else default


def decoder_digest(decoder: LatentDecoder) -> str | None:
    """The weights digest of a decoder other than the VAE (whose weights the fingerprint covers already)."""
    return weights_digest(decoder.module) if isinstance(decoder, StreamingTAEHV) else None
