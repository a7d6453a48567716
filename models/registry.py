"""Pipelines selectable by name (``arstream serve --model NAME``).

Two kinds of names: the project's own pipelines (:data:`PIPELINES`), and
``vllm-omni:<architecture>``, a pipeline registered in vLLM-Omni itself, run
only by the vllm-omni runtime (see :mod:`arstream.runner.vllm_omni.native`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from arstream.runner.contract import ARPipeline
from arstream.runner.runtimes import vllm_omni_available
from arstream.runner.vllm_omni.native import PREFIX as VLLM_OMNI_PREFIX
from arstream.runner.vllm_omni.native import MissingWeights, NativePipeline, UnknownNativePipeline, check_weights

DEFAULT_MODEL = "tiny-world"


def _fake_kv(device: torch.device, **options: Any) -> ARPipeline:
    from arstream.models.fake import FakeKVPipeline

    return FakeKVPipeline(**options)


def _tiny_world(device: torch.device, **options: Any) -> ARPipeline:
    from arstream.models.tiny_world.pipeline import load_tiny_world

    return load_tiny_world(device=device, **options)


def _toy_attention(device: torch.device, **options: Any) -> ARPipeline:
    from arstream.models.toy_attention import ToyAttentionPipeline

    return ToyAttentionPipeline(device=device, **options)


def _matrix_game(device: torch.device, **options: Any) -> ARPipeline:
    from arstream.models.matrix_game.pipeline import load_matrix_game

    return load_matrix_game(device=device, **options)


PIPELINES: dict[str, Callable[..., ARPipeline]] = {
    "tiny-world": _tiny_world,
    "fake-kv": _fake_kv,
    "toy-attention": _toy_attention,
    "matrix-game-2": _matrix_game,
}


class UnknownModel(ValueError):
    """The requested model name is not registered (or its options cannot load it)."""


class UnsupportedModelRuntime(ValueError):
    """The model cannot run on the chosen runtime."""


def is_vllm_omni_model(name: str) -> bool:
    """Whether ``name`` names a pipeline registered in vLLM-Omni (``vllm-omni:<architecture>``)."""
    return name.startswith(VLLM_OMNI_PREFIX)


def check_model_name(name: str) -> str:
    """``name`` if it can name a model; ``vllm-omni:`` names are looked up in vLLM-Omni when it is installed.

    Looking one up imports vLLM (seconds), paid only by a ``vllm-omni:`` name,
    which only the vllm-omni runtime serves anyway.
    """
    if name in PIPELINES:
        return name
    if is_vllm_omni_model(name) and name != VLLM_OMNI_PREFIX:
        if vllm_omni_available():
            from arstream.runner.vllm_omni.native import registry_entry

            try:
                registry_entry(name.removeprefix(VLLM_OMNI_PREFIX))
            except UnknownNativePipeline as exc:
                raise UnknownModel(str(exc)) from None
        return name
    raise UnknownModel(f"unknown model {name!r}; expected one of {sorted(PIPELINES)} or {VLLM_OMNI_PREFIX}<pipeline>")


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
        from arstream.runner.vllm_omni.native import resolve

        try:
            return resolve(name.removeprefix(VLLM_OMNI_PREFIX), options)
        except (UnknownNativePipeline, MissingWeights) as exc:
            raise UnknownModel(str(exc)) from None
    try:
        factory = PIPELINES[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; expected one of {sorted(PIPELINES)}") from None
    return factory(torch.device(device), **options)
