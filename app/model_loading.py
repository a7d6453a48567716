"""Loading the model for the hub: the runtime built on the worker thread, and the card read once it is warm.

:func:`load_runtime` runs on the worker's thread (:class:`~arstream.app.worker.ModelWorker` calls it once);
:func:`read_card` runs on the event loop when the worker says the model is ready, and says what the server
offers (the controls schema, the start images) or why it cannot serve.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema
import torch

from .plan import check_plan_fits
from .settings import Settings
from .start_image import offered_start_images
from .transfers import park_idle
from ..models.registry import load_pipeline
from ..runner.contract import ARPipeline, SupportsCompile
from ..runner.runtimes import Runtime, build_runtime
from ..runner.types import ParkingPolicy, UnsupportedConfiguration
from ..runner.vllm_omni.native import NativePipeline

if TYPE_CHECKING:
    from .worker import ModelWorker

log = logging.getLogger("arstream.hub")


class CardRefused(ValueError):
    """The loaded model cannot be served; the message says why (the server's not-ready reason)."""


@dataclass(frozen=True)
class CardOffer:
    """What a model card offers the sessions: its controls' validator and its start images (first: default)."""

    card: dict[str, Any]
    controls_validator: jsonschema.protocols.Validator
    start_image_names: tuple[str, ...]


def compile_forward(pipeline: ARPipeline | NativePipeline) -> None:
    """``--compile``: the pipeline's forward wrapped for compilation, or a refusal naming the models that have one."""
    if not isinstance(pipeline, SupportsCompile):
        name = pipeline.model_card().get("name") if isinstance(pipeline, ARPipeline) else pipeline.name
        raise UnsupportedConfiguration(f"--compile: model {name!r} has no compiled forward (matrix-game-2, longlive do)")
    pipeline.compile_forward()


def load_runtime(settings: Settings, pipeline: ARPipeline | None, compiling: Callable[[], None]) -> Runtime:
    """On the worker thread: load the pipeline (unless given), build the runtime and its pool, warm up
    (``compiling`` is told when ``--compile`` makes the warm-up a compile)."""
    torch.set_num_threads(settings.resolved_torch_threads())
    loaded: ARPipeline | NativePipeline
    if pipeline is not None:
        loaded = pipeline
    else:
        check_plan_fits(settings)
        loaded = load_pipeline(settings.model, settings.replica_devices()[0], **settings.model_options)
    devices = settings.replica_devices()
    runtime = build_runtime(
        settings.runtime,
        loaded,
        device=devices[0],
        # several devices: the other ranks load the same model themselves (runner/distributed/)
        devices=devices if len(devices) > 1 else (),
        collective_timeout_s=settings.collective_timeout_s,
        load_pipeline=functools.partial(load_pipeline, settings.model, **settings.model_options),
        kv_budget_bytes=settings.resolved_kv_budget_bytes(),
        memory_fraction=settings.memory_fraction,
        max_batch_sessions=settings.resolved_max_batch_sessions(),
        rewind_seconds=settings.rewind_seconds,
        rewind_budget_bytes=settings.rewind_budget_bytes(),
        split_decode=settings.resolved_decode_overlap(),
        parking=ParkingPolicy(  # parking (runner/parking.py)
            settings.park_budget_bytes, settings.park_after_s, settings.park_spill_dir, settings.park_spill_budget_bytes
        ),
    )
    if settings.compile:
        compile_forward(loaded)
        compiling()
    warmed = runtime.warmup()
    log.info("model %s warmed up with %d chunk(s)", runtime.model_card().get("name"), warmed)
    return runtime


async def park_idle_sessions(worker: ModelWorker, after_s: float) -> None:
    """The worker parks idle sessions after each job; this asks it to on a quiet server too (no ticks at all)."""
    while True:
        await asyncio.sleep(max(0.25, after_s / 4))
        park_idle(worker)


def load_failure(settings: Settings, error: BaseException) -> str:
    """Why the server is not ready when the model failed to load."""
    # A TypeError from the loader is a keyword it does not take: an option the user gave.
    options = f" with --model-options {json.dumps(settings.model_options)}" if isinstance(error, TypeError) else ""
    return f"the model failed to load{options}: {error}"


def read_card(card: dict[str, Any]) -> CardOffer:
    """What ``card`` offers; raises :class:`CardRefused` (its controls schema or start images are invalid)."""
    try:
        schema = card.get("controls", {})
        validator_class = jsonschema.validators.validator_for(schema)
        validator_class.check_schema(schema)
        return CardOffer(card, validator_class(schema), offered_start_images(card))
    except jsonschema.SchemaError as exc:
        raise CardRefused(f"the model card's controls schema is invalid: {exc.message}") from exc
    except ValueError as exc:
        raise CardRefused(str(exc)) from exc
