"""Where a pipeline's components live and what they hold: the model card's ``components`` and the plan's weights.

A component is one module of a pipeline (the DiT, the VAE, a text or image
encoder, a separate decoder) with the device it runs on, how its weights are
held and their bytes. Bytes are what the tensors' storage holds (a quantized
tensor by its data and scales), so the same count on the meta device
(``arstream plan``) and on a loaded model agree by construction of the tensors,
not of a formula.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def storage_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s bytes: itself, or a quantized tensor's data and scales."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return [inner for name in names for inner in storage_tensors(getattr(tensor, name))]
    return [tensor]


def module_bytes(module: nn.Module) -> int:
    """Bytes a module's parameters and buffers hold (quantized ones by their data and scales); meta tensors count."""
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        for inner in storage_tensors(tensor):
            if id(inner) not in seen:
                seen.add(id(inner))
                total += inner.numel() * inner.element_size()
    return total


def held_as(compute: torch.dtype, weights: str | None = None) -> str:
    """How a component's weights are held: ``bfloat16``, or ``int8 (bfloat16 compute)``."""
    plain = str(compute).removeprefix("torch.")
    return plain if weights is None else f"{weights} ({plain} compute)"


def component(name: str, module: nn.Module, device: torch.device | str, held: str) -> dict[str, Any]:
    """One entry of the model card's ``components``: name, device, weights (how held) and bytes."""
    return {"name": name, "device": str(device), "weights": held, "bytes": module_bytes(module)}
