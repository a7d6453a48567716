"""Reading Wan checkpoint files, as published: state dicts, exact-fit loading, the Wan VAE.

Files are read with safetensors or ``torch.load(weights_only=True)`` (never
unpickling code), unwrapped from a training wrapper (``generator``,
``state_dict``...). Every name must match the module exactly: any missing
key, unexpected key or wrong shape fails with :class:`CheckpointError`
naming the file and the keys. The VAE comes in the original Wan layout
(``Wan2.1_VAE.pth``), converted with diffusers' own converter, or already in
diffusers' layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

# wrappers training scripts put around a state dict
WRAPPER_KEYS = ("state_dict", "model", "generator_ema", "generator")
LISTED = 8


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or does not fit the model; the message names it."""


def find_file(directory: Path, explicit: str | None, candidates: Sequence[str], what: str) -> Path:
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    names = [explicit] if explicit else list(candidates)
    for name in names:
        path = directory / name
        if path.is_file():
            return path
    raise CheckpointError(f"no {what} file in {directory}: looked for {', '.join(names)}")


def read_state_dict(path: Path, entry: str | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` or ``.pth``/``.pt`` file (``weights_only``), unwrapped from a training wrapper.

    ``entry`` picks one of several top-level entries (a training checkpoint's
    ``generator``, ``generator_ema``, ``critic``...); a bare state dict is
    read as it is.
    """
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded: object = load_file(str(path))
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any reader error becomes one message naming the file
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    if entry is not None and isinstance(loaded, dict) and not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        if entry not in loaded:
            raise CheckpointError(f"{path} has no {entry!r} entry (its entries: {_listed([str(k) for k in loaded])})")
        loaded = loaded[entry]
    while isinstance(loaded, dict) and len(loaded) == 1 and next(iter(loaded)) in WRAPPER_KEYS:
        loaded = next(iter(loaded.values()))
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return loaded


def _listed(keys: Sequence[str]) -> str:
    more = f" (+{len(keys) - LISTED} more)" if len(keys) > LISTED else ""
    return ", ".join(keys[:LISTED]) + more


def load_into(module: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Copy ``state`` into ``module``; every key must be present, expected and of the right shape."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [
        f"{k} {tuple(state[k].shape)} (model {tuple(expected[k].shape)})"
        for k in expected
        if k in state and state[k].shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listed(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {_listed(wrong)}")
    if problems:
        raise CheckpointError(f"{path} does not fit the model: " + "; ".join(problems))
    module.load_state_dict(state, strict=True)


def load_vae(module: nn.Module, path: Path) -> None:
    """Diffusers-layout keys load as they are; the original Wan layout goes through diffusers' converter."""
    state = read_state_dict(path)
    if not all(k in state for k in module.state_dict()):
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

        # diffusers leaves it unannotated: a state dict in, a state dict out
        convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = convert_wan_vae_to_diffusers
        try:
            state = convert(state)
        except Exception as exc:  # noqa: BLE001 - a layout we cannot convert: say which file
            raise CheckpointError(f"{path} is neither a diffusers nor an original Wan VAE state dict: {exc}") from exc
    load_into(module, state, path)
