"""Pipelines selectable by name (``arstream serve --model NAME``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from arstream.runner.contract import ARPipeline

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
    """The requested model name is not registered."""


def load_pipeline(name: str, device: torch.device | str = "cpu", **options: Any) -> ARPipeline:
    try:
        factory = PIPELINES[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; expected one of {sorted(PIPELINES)}") from None
    return factory(torch.device(device), **options)
