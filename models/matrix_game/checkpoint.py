"""Reading a Matrix-Game 2.0 checkpoint directory: the DiT, CLIP and the Wan VAE, as published.

The readers are :mod:`arstream.models.wan.checkpoint`'s. The DiT's keys carry
a ``model.`` prefix (a training wrapper's name), which is stripped; every
other name must match :class:`~arstream.models.matrix_game.dit.CausalWanDiT`
exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from arstream.models.wan.checkpoint import CheckpointError, find_file, load_into, load_vae, read_state_dict

__all__ = ["CheckpointError", "find_file", "load_into", "load_vae", "read_state_dict", "load_dit", "load_clip_visual"]

# Where the published repository (Skywork/Matrix-Game-2.0) keeps each part; first match wins. The DiT's
# published file depends on the config (``MatrixGameConfig.dit_file``); these generic names come after it.
GENERIC_DIT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")
VAE_FILES = ("Wan2.1_VAE.pth", "vae.safetensors", "vae.pth")
CLIP_FILES = ("models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth", "clip.safetensors", "clip.pth")
CLIP_PREFIX = "visual."
DIT_PREFIX = "model."


def dit_files(dit_file: str) -> tuple[str, ...]:
    """A config's DiT file candidates: its published file, then the generic names."""
    return (dit_file, *GENERIC_DIT_FILES)


def load_dit(module: nn.Module, path: Path, fitting: Callable[[dict[str, torch.Size]], list[str]] | None = None) -> None:
    """Load the DiT; a file that does not fit says which configs it fits (``fitting``: shapes -> config names)."""
    state = read_state_dict(path)
    state = {k.removeprefix(DIT_PREFIX): v for k, v in state.items()}
    try:
        load_into(module, state, path)
    except CheckpointError as exc:
        names = fitting({k: v.shape for k, v in state.items()}) if fitting is not None else []
        if not names:
            raise
        raise CheckpointError(f"{exc}; it fits config {' or '.join(repr(n) for n in names)}") from None


def load_clip_visual(module: nn.Module, path: Path) -> None:
    """The vision tower's ``visual.*`` keys of a CLIP file (its text tower is not needed)."""
    state = {k: v for k, v in read_state_dict(path).items() if k.startswith(CLIP_PREFIX)}
    load_into(module, state, path)
