"""What both Wan loaders check the same way: the weights' source and the dtype names they accept."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_weights_source(family: str, checkpoint: str | None, random_init: bool) -> None:
    """Exactly one of a checkpoint directory and seeded random weights."""
    if (checkpoint is None) == (not random_init):
        raise ValueError(f"{family} needs either checkpoint=DIR or random_init=true (not both)")


def torch_dtype(name: str | None, default: str, option: str) -> torch.dtype:
    """The dtype ``name`` stands for (``default`` when None); ``option`` names the setting in the error."""
    name = default if name is None else name
    if name not in DTYPES:
        raise ValueError(f"{option} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
