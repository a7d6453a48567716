"""Pipelines selectable by name (``arstream serve --model NAME``).

Three kinds of names:

- the project's own pipelines (:data:`BUILTIN`);
- pipelines other packages register under the ``arstream.models`` entry-point
  group (``[project.entry-points."arstream.models"] NAME = "pkg.module:load"``;
  ``load(device, **options)`` returns an :class:`~arstream.runner.contract.ARPipeline`;
  docs/models.md, "Bring your own model"); a built-in name wins over a plugin's;
- ``vllm-omni:<architecture>``, a pipeline registered in vLLM-Omni itself, run
  only by the vllm-omni runtime (see :mod:`arstream.runner.vllm_omni.native`).

Importing this module is cheap (no torch): ``arstream serve --help`` and the
settings' validation use it before anything heavy loads.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from ..runner.vllm_omni.native import PREFIX as VLLM_OMNI_PREFIX
from ..runner.vllm_omni.native import (
    MissingWeights,
    NativePipeline,
    UnknownNativePipeline,
    check_weights,
    vllm_omni_available,
)

if TYPE_CHECKING:
    import torch

    from ..runner.contract import ARPipeline

log = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny-world"
ENTRY_POINT_GROUP = "arstream.models"


class UnknownModel(ValueError):
    """The requested model name is not registered (or its options cannot load it)."""


class UnsupportedModelRuntime(ValueError):
    """The model cannot run on the chosen runtime."""


def _fake_kv(device: torch.device, **options: Any) -> ARPipeline:
    from .fake import FakeKVPipeline

    return FakeKVPipeline(**options)


def _tiny_world(device: torch.device, **options: Any) -> ARPipeline:
    from .tiny_world.pipeline import load_tiny_world

    return load_tiny_world(device=device, **options)


def _toy_attention(device: torch.device, **options: Any) -> ARPipeline:
    from .toy_attention import ToyAttentionPipeline

    return ToyAttentionPipeline(device=device, **options)


def _matrix_game(device: torch.device, **options: Any) -> ARPipeline:
    from .matrix_game.pipeline import load_matrix_game

    return load_matrix_game(device=device, **options)


def _longlive(device: torch.device, **options: Any) -> ARPipeline:
    from .longlive.loading import load_longlive

    return load_longlive(device=device, **options)


def _causal_forcing(device: torch.device, **options: Any) -> ARPipeline:
    """Causal Forcing on LongLive's pipeline (the Self-Forcing path): its configs only, so the card names it."""
    from .longlive.config import CONFIGS
    from .longlive.loading import load_longlive

    config = options.pop("config", "causal-forcing-1.3b")
    allowed = sorted(name for name, cfg in CONFIGS.items() if cfg.model == "causal-forcing")
    if config not in allowed:
        raise ValueError(f"causal-forcing config {config!r} is not one of {allowed}")
    return load_longlive(device=device, config=config, **options)


def _waypoint(device: torch.device, **options: Any) -> ARPipeline:
    from .waypoint.loading import load_waypoint

    return load_waypoint(device=device, **options)


def _krea_realtime(device: torch.device, **options: Any) -> ARPipeline:
    from .krea.loading import load_krea

    return load_krea(device=device, **options)


# Models whose loaders build on the meta device (shapes and bytes, no file read): what ``arstream plan`` covers.
PLANNED_MODELS = ("matrix-game-2", "longlive", "krea-realtime", "waypoint-1.5")

# The project's own models; each factory takes (device, **options), as a plugin's does.
BUILTIN: dict[str, Callable[..., ARPipeline]] = {
    "tiny-world": _tiny_world,
    "fake-kv": _fake_kv,
    "toy-attention": _toy_attention,
    "matrix-game-2": _matrix_game,
    "longlive": _longlive,
    "causal-forcing": _causal_forcing,
    "krea-realtime": _krea_realtime,
    "waypoint-1.5": _waypoint,
}


def plugin_models() -> dict[str, str]:
    """Models other installed packages register (``arstream.models`` entry points): name -> "module:function"."""
    found = {entry.name: entry.value for entry in entry_points(group=ENTRY_POINT_GROUP)}
    for name in sorted(found.keys() & BUILTIN.keys()):
        log.warning("an installed package registers model %r, a built-in name; the built-in one is served", name)
    return {name: target for name, target in found.items() if name not in BUILTIN}


def model_names() -> list[str]:
    """Every name ``--model`` accepts besides ``vllm-omni:<pipeline>``."""
    return sorted(BUILTIN.keys() | plugin_models().keys())


def _factory(name: str) -> Callable[..., ARPipeline] | None:
    if name in BUILTIN:
        return BUILTIN[name]
    target = plugin_models().get(name)
    if target is None:
        return None
    module_name, _, attribute = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise UnknownModel(f"model {name!r} ({target}, an installed plugin) does not load: {exc}") from exc


def is_vllm_omni_model(name: str) -> bool:
    """Whether ``name`` names a pipeline registered in vLLM-Omni (``vllm-omni:<architecture>``)."""
    return name.startswith(VLLM_OMNI_PREFIX)


def check_model_name(name: str) -> str:
    """``name`` if it can name a model; ``vllm-omni:`` names are looked up in vLLM-Omni when it is installed.

    Looking one up imports vLLM (seconds), paid only by a ``vllm-omni:`` name,
    which only the vllm-omni runtime serves anyway.
    """
    if name in BUILTIN or name in plugin_models():
        return name
    if is_vllm_omni_model(name) and name != VLLM_OMNI_PREFIX:
        if vllm_omni_available():
            from ..runner.vllm_omni.native import registry_entry

            try:
                registry_entry(name.removeprefix(VLLM_OMNI_PREFIX))
            except UnknownNativePipeline as exc:
                raise UnknownModel(str(exc)) from None
        return name
    raise UnknownModel(f"unknown model {name!r}; expected one of {model_names()} or {VLLM_OMNI_PREFIX}<pipeline>")


def check_model_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` if they fit model ``name``: a ``vllm-omni:`` model needs an existing weights path."""
    if is_vllm_omni_model(name):
        check_weights(name, options)  # raises MissingWeights, a ValueError naming the path
    return options


def check_runtime(name: str, runtime: str) -> None:
    """Refuse a ``vllm-omni:`` model on any runtime but vllm-omni (only its runner can load one)."""
    if is_vllm_omni_model(name) and runtime != "vllm-omni":
        raise UnsupportedModelRuntime(
            f"model {name!r} is a pipeline registered in vLLM-Omni: serve it with --runtime vllm-omni"
        )


def load_pipeline(name: str, device: torch.device | str = "cpu", **options: Any) -> ARPipeline | NativePipeline:
    """The pipeline ``name`` names, or for ``vllm-omni:`` names the resolved registry entry its runtime loads."""
    if is_vllm_omni_model(name):
        if not vllm_omni_available():
            raise UnknownModel(f"{name} needs vLLM-Omni: pip install 'arstream[vllm-omni]', then --runtime vllm-omni")
        from ..runner.vllm_omni.native import resolve

        try:
            return resolve(name.removeprefix(VLLM_OMNI_PREFIX), options)
        except (UnknownNativePipeline, MissingWeights) as exc:
            raise UnknownModel(str(exc)) from None
    factory = _factory(name)
    if factory is None:
        raise UnknownModel(f"unknown model {name!r}; expected one of {model_names()}")
    import torch

    return factory(torch.device(device), **options)
