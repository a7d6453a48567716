"""Quantized DiT weights (the ``weights`` model option), through torchao, for every model that offers it.

``int8``: weight-only, one scale per output channel; the matmul runs in the
model's dtype. ``fp8``: weight-only float8 (e4m3), one scale per output channel;
on CUDA only where the GPU has float8 units (compute capability 8.9 or later:
Ada, Hopper, Blackwell); torchao dequantizes it on the CPU, which is where the
tests run it. ``w8a8``: int8 weights (one scale per output channel) and int8
activations quantized on the fly (one scale per token), so the matmul itself
runs in int8 with int32 sums (``torch._int_mm``: cuBLAS's int8 GEMM on CUDA);
the mode Overworld publishes Waypoint's speed with. It runs on CUDA and the CPU
only.

Only the linear layers of the transformer blocks are quantized (nearly all of a
DiT's bytes); the embeddings, the head, the decoders and the encoders stay in
the dtype the model computes in. A weight the model ties across blocks (one
tensor several layers share) is quantized once and stays shared. The loaders
quantize after the published files are read, so no other checkpoint is needed;
on the meta device (``arstream plan``) the same call gives the quantized
tensors' shapes and bytes.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

WEIGHTS = ("int8", "fp8", "w8a8")
FP8_MIN_CAPABILITY = (8, 9)
W8A8_DEVICES = ("cpu", "cuda", "meta")  # torchao's int8 matmul runs on these (meta: shapes only, for the plan)


# What torchao, and diffusers (which imports it where it is installed), log once on import that is no news to a user
# of these models: kernel libraries built for another Python or GPU that torchao goes on without, its Triton kernels
# missing where there is no Triton (a CPU install; int8, fp8 and w8a8 run without them), torchao's enums
# registered in a way torch now calls deprecated, and diffusers' note on torchao-serialized checkpoints (none is
# loaded here). Each is matched by its logger and its own words, so any other warning still shows.
def _skipped_kernel_library(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("Failed to load ") and "Could not load this library" in str(record.msg)


def _no_triton(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("Warning: Detected no triton")


def _torchao_enum_registered(record: logging.LogRecord) -> bool:
    registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
    module = str(getattr(registered, "__module__", ""))
    return str(record.msg).startswith("%s is an Enum subclass") and module.startswith("torchao")


def _serialized_checkpoints_note(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("Unable to import `torchao` Tensor objects")


HARMLESS_IMPORT_LOGS: dict[str, Callable[[logging.LogRecord], bool]] = {
    "torchao": _skipped_kernel_library,
    "torchao.kernel.intmm": _no_triton,
    "torch.utils._pytree": _torchao_enum_registered,
    "diffusers.quantizers.torchao.torchao_quantizer": _serialized_checkpoints_note,
}


@contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Import torchao, or a library that imports it, without its known harmless warnings (the rest still show)."""
    loggers = [logging.getLogger(name) for name in HARMLESS_IMPORT_LOGS]

    def keep(record: logging.LogRecord) -> bool:  # a logger's filters see only its own records
        return not HARMLESS_IMPORT_LOGS[record.name](record)

    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)


class QuantizationUnavailable(ValueError):
    """The ``weights`` option cannot be served here: torchao is missing, or the device cannot run it."""


def check_weights_option(weights: str | None, device: torch.device | str) -> None:
    """Refuse an unknown ``weights`` name, a missing torchao, ``fp8`` on a GPU without float8 units, or ``w8a8``
    on a device torchao's int8 matmul does not run on."""
    if weights is None:
        return
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {list(WEIGHTS)} (or left out for the model's dtype), got {weights!r}")
    if importlib.util.find_spec("torchao") is None:
        raise QuantizationUnavailable(
            f"weights {weights!r} needs torchao: pip install 'arstream[quant]' (README.md names the extras)"
        )
    device = torch.device(device)
    if weights == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise QuantizationUnavailable(
                f"weights 'fp8' needs a GPU with float8 units (compute capability 8.9 or later: Ada, Hopper, "
                f"Blackwell); {name} is {capability[0]}.{capability[1]}: use weights 'int8' or 'w8a8'"
            )
    if weights == "w8a8" and device.type not in W8A8_DEVICES:
        raise QuantizationUnavailable(
            f"weights 'w8a8' runs its int8 matmul on CUDA or the CPU only, not {device.type}: use weights 'int8'"
        )


def _config(weights: str) -> Any:
    with quiet_torchao_import():
        from torchao.quantization import (
            Float8WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
        )

    if weights == "int8":
        return Int8WeightOnlyConfig()
    if weights == "fp8":
        return Float8WeightOnlyConfig()
    return Int8DynamicActivationInt8WeightConfig()  # symmetric, per token (activations) and per channel (weights)


def quantize_blocks(
    model: nn.Module, weights: str | None, blocks: str = "blocks.", keep: tuple[str, ...] = ()
) -> None:
    """Quantize the linear weights of ``model``'s modules under ``blocks`` (a name prefix) to ``weights``, in place.

    None leaves them as they are. Linears whose names end with one of ``keep``
    stay as they are (a model that slices a weight rather than calling the
    layer: torchao's tensors take no slicing by input column). A weight tensor
    several linears share is quantized with the first of them and given back to
    the others, so it is held once, quantized, as it was held once before.
    """
    if weights is None:
        return
    with quiet_torchao_import():
        from torchao.quantization import quantize_

    first_holder: dict[int, nn.Linear] = {}
    sharers: list[tuple[nn.Linear, nn.Linear]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith(blocks) and not name.endswith(keep):
            first = first_holder.setdefault(id(module.weight), module)
            if first is not module:
                sharers.append((module, first))
    chosen = {id(module) for module in first_holder.values()}

    def is_chosen(module: nn.Module, fqn: str) -> bool:
        return id(module) in chosen

    quantize_(model, _config(weights), filter_fn=is_chosen)
    for module, first in sharers:
        module.weight = first.weight
