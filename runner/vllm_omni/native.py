"""Pipelines registered in vLLM-Omni itself, named ``vllm-omni:<architecture>`` (docs/vllm-omni.md).

The name after the prefix is a key of vLLM-Omni's own diffusion registry
(``vllm_omni.diffusion.registry.DiffusionModelRegistry``), the same string its
configs give as ``model_class_name`` (``LingBotWorldCausalDMDPipeline``,
``DreamZeroPipeline``). Resolution reads that registry's entry (module and
class) without importing the pipeline module: those modules pull heavy
dependencies (LingBot-World and DreamZero import torchvision). The class is
imported only when the vllm-omni runtime is built.

Importing this module is cheap (it never imports vLLM at module level), so the
runtime seam can recognise a :class:`NativePipeline` without the extra.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arstream.runner.types import UnsupportedConfiguration

PREFIX = "vllm-omni:"
WEIGHTS_OPTION = "model"  # vLLM-Omni's own name for the weights path (OmniDiffusionConfig.model)
# What vLLM-Omni's ARDiffusionModelRunner requires of a pipeline (SupportsARDiffusionPipeline).
AR_DIFFUSION_METHODS = (
    "ar_diffusion_kv_cache_spec",
    "bind_ar_diffusion_state",
    "reset_ar_diffusion_session",
    "close_ar_diffusion_session",
)


def vllm_omni_available() -> bool:
    """Whether the vllm-omni extra is installed (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm_omni") is not None


class UnknownNativePipeline(ValueError):
    """The name is not a key of vLLM-Omni's diffusion registry."""


class MissingWeights(ValueError):
    """The weights path in the model options is absent or does not exist."""


@dataclass(frozen=True)
class NativePipeline:
    """A vLLM-Omni pipeline resolved from its registry entry, to be loaded by vLLM-Omni's own loader."""

    arch: str
    module_name: str
    class_name: str
    weights: Path
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.arch}"


def check_weights(name: str, options: dict[str, Any]) -> Path:
    """The existing weights directory or file ``options["model"]`` names; raises :class:`MissingWeights`."""
    given = options.get(WEIGHTS_OPTION)
    if not isinstance(given, str) or not given:
        raise MissingWeights(
            f"{name} loads its weights from a path: give it as --model-options '{{\"{WEIGHTS_OPTION}\": \"/path\"}}'"
        )
    path = Path(given).expanduser()
    if not path.exists():
        raise MissingWeights(f"{name}: the weights path {str(path)!r} does not exist")
    return path


def _registry() -> Any:
    from arstream.runner.vllm_omni.deprecations import importing_vllm

    with importing_vllm():
        from vllm_omni.diffusion.registry import DiffusionModelRegistry
    return DiffusionModelRegistry


def registered_archs() -> list[str]:
    """Every architecture name vLLM-Omni's diffusion registry holds (built-in and plugin-registered)."""
    return sorted(_registry().get_supported_archs())


def registry_entry(arch: str) -> Any:
    """vLLM-Omni's registry entry for ``arch``; one line listing every registered name if there is none."""
    entry = _registry().models.get(arch)
    if entry is None:
        raise UnknownNativePipeline(
            f"unknown vLLM-Omni pipeline {arch!r}; vLLM-Omni registers {', '.join(registered_archs())}"
        )
    return entry


def resolve(arch: str, options: dict[str, Any]) -> NativePipeline:
    """The registry entry for ``arch``, with its weights path checked; nothing is imported or loaded."""
    entry = registry_entry(arch)
    weights = check_weights(f"{PREFIX}{arch}", options)
    if hasattr(entry, "module_name"):  # registered by name, imported lazily (every built-in entry)
        module_name, class_name = entry.module_name, entry.class_name
    else:  # registered as a class by a plugin
        module_name, class_name = entry.model_cls.__module__, entry.model_cls.__qualname__
    extra = {key: value for key, value in options.items() if key != WEIGHTS_OPTION}
    return NativePipeline(arch, module_name, class_name, weights, extra)


def load_class(native: NativePipeline) -> type:
    """Import the registered class and check it is an AR-Diffusion pipeline; clear errors otherwise."""
    from arstream.runner.vllm_omni.workarounds import stub_torchvision_if_missing

    stub_torchvision_if_missing()
    try:
        module = importlib.import_module(native.module_name)
    except ImportError as exc:
        raise UnsupportedConfiguration(
            f"{native.name} ({native.module_name}.{native.class_name}) does not import here: {exc}"
        ) from exc
    cls: type = getattr(module, native.class_name)
    missing = [method for method in AR_DIFFUSION_METHODS if not hasattr(cls, method)]
    if missing:
        raise UnsupportedConfiguration(
            f"{native.name} is not an AR-Diffusion pipeline: "
            f"it lacks {', '.join(missing)} (SupportsARDiffusionPipeline)"
        )
    return cls
