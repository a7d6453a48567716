"""A pipeline registered in vLLM-Omni itself (``vllm-omni:<name>``), loaded and served by vLLM-Omni's runner.

vLLM-Omni builds the pipeline from its registry and loads its weights with
its own loader (``load_model``), sizes the KV pool from the pipeline's own
spec (its real KV size and its own session limit), and runs one
``execute_model`` per tick; :class:`NativeOmniRunner` is
:class:`~arstream.runner.vllm_omni.runtime.VllmOmniRunner` with the tick
translation of the model (:mod:`~arstream.runner.vllm_omni.lingbot` for
LingBot-World, the one AR world model vLLM-Omni 0.30.0 registers).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ..chunks import WARMUP_SESSION_ID
from ..types import TickRequest, UnsupportedConfiguration
from .deprecations import ignoring_their_deprecations, importing_vllm
from .native import NativePipeline, load_class
from .runtime import RUNTIME, VllmOmniRunner, budgeted_runner_class, kv_config
from .spec import from_omni_spec
from .workarounds import fix_host_rotary

with importing_vllm():
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.registry import get_diffusion_pre_process_func
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    from . import lingbot
    from .distributed import ensure_single_rank, worker_context

log = logging.getLogger("arstream.runner.vllm_omni")

# Registered AR-Diffusion pipelines that are not world models, with why they cannot be served as a frame stream.
NOT_WORLD_MODELS = {
    "DreamZeroPipeline": "a robot policy: its ticks carry robot_obs and return actions, not video frames",
}


class NativeOmniRunner(VllmOmniRunner):
    """vLLM-Omni's runner over one of its own registered pipelines; see the module docstring."""

    def __init__(
        self,
        native: NativePipeline,
        *,
        device: torch.device | str = "cpu",
        kv_budget_bytes: int | None = None,
        memory_fraction: float | None = None,
        max_batch_sessions: int = 1,
    ) -> None:
        load_class(native)
        if native.arch in NOT_WORLD_MODELS:
            raise UnsupportedConfiguration(f"{native.name} is {NOT_WORLD_MODELS[native.arch]}")
        if native.arch != lingbot.ARCH:
            raise UnsupportedConfiguration(f"{native.name}: serving it is not wired (only {lingbot.ARCH} is)")
        if max_batch_sessions != 1:
            log.info("vllm-omni runs one session per forward; max_batch_sessions=%d is not used", max_batch_sessions)
        self.native = native
        device = torch.device(device)
        options = dict(native.options)
        height = int(options.pop("height", lingbot.DEFAULT_HEIGHT))
        width = int(options.pop("width", lingbot.DEFAULT_WIDTH))
        prompt = options.pop("prompt", None)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        budget, fraction = kv_config(device, kv_budget_bytes, memory_fraction)
        od_config = OmniDiffusionConfig(
            model=str(native.weights),
            model_class_name=native.arch,
            dtype=dtype,
            enforce_eager=True,  # no torch.compile / CUDA-graph capture (see docs/vllm-omni.md)
            model_config={
                "ar_diffusion_kv_config": fraction,
                "ar_diffusion_height": height,
                "ar_diffusion_width": width,
                **options,  # vLLM-Omni's own model_config keys (e.g. lingbot_vae_decode_fast_path)
            },
        )
        with ignoring_their_deprecations():
            vllm_config = create_diffusion_vllm_config(device, od_config)
            ensure_single_rank(vllm_config, od_config)
            model_runner = budgeted_runner_class(budget)(vllm_config, od_config, device)
            with worker_context(vllm_config, od_config):
                model_runner.load_model()
        if model_runner.kv_cache is None:
            raise UnsupportedConfiguration(f"{native.name}: vLLM-Omni built no AR-Diffusion KV cache for it")
        pipeline = model_runner.pipeline
        if device.type == "cpu":
            fix_host_rotary(pipeline)
        self.ticks = lingbot.LingBotTicks(
            pipeline, get_diffusion_pre_process_func(od_config), height=height, width=width, prompt=prompt
        )
        self._attach(model_runner, from_omni_spec(pipeline.ar_diffusion_kv_cache_spec(), dtype), device)

    def _request(self, tick: TickRequest, chunk_index: int) -> Any:
        return self.ticks.request(tick, chunk_index)

    def _frames(self, output: Any, tick: TickRequest) -> np.ndarray:
        """Decode the chunk; a failed decode closes the session (its decoder state is half-advanced)."""
        try:
            frames = self.ticks.frames(output, tick.session_id)
            first = self.frames_committed(tick.session_id) == self.spec.frames_per_chunk
            expected = self.ticks.first_chunk_frames if first else self.ticks.frames_per_chunk
            if frames.shape[0] != expected:
                got = frames.shape[0]
                raise RuntimeError(f"{self.native.name} decoded {got} frames, the model card says {expected}")
        except Exception:
            self.close_session(tick.session_id)
            raise
        if tick.close:
            self.close_session(tick.session_id)
        return frames

    def _warmup_ticks(self) -> list[TickRequest]:
        """One chunk of the default picture with a key held: loads every stage and times a step for admission."""
        return [TickRequest(session_id=WARMUP_SESSION_ID, request_id=0, controls={"keys": ["w"]}, seed=0)]

    def model_card(self) -> dict[str, Any]:
        return {**self.ticks.model_card(self.native.name), "runtime": RUNTIME}
