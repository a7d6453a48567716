"""LingBot-World (vLLM-Omni's ``LingBotWorldCausalDMDPipeline``) as an ARStream model: ticks, frames, card.

vLLM-Omni's own pipeline does the work; this module only translates:

- a tick becomes the request LingBot's realtime tick path takes: a prompt
  mapping with the conditioning picture in ``multi_modal_data.image`` (the
  session's start image), one ``camera`` control track in LingBot's
  ``lingbot.camera_actions.v1`` schema (the held keys, one action list per
  latent frame of the chunk), the fixed cache resolution, one block of
  ``num_frames`` video frames, and ``output_type='latent'`` (its realtime
  ticks return latents only). vLLM-Omni's registered pre-processing for the
  pipeline then runs on it, as its diffusion engine runs it before a worker;
- the latents a tick returns become frames through the pipeline's
  per-session streaming VAE decoder (9 video frames for a rollout's first
  chunk, 12 after: the causal decoder expands the opening latent frame to one
  frame and every later one to four);
- the card says so: resolution, fps, frame counts, keys, prompt, start images.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from arstream.runner.types import StartImage, TickRequest
from arstream.runner.vllm_omni.deprecations import importing_vllm
from arstream.runner.vllm_omni.workarounds import stub_torchvision_if_missing

with importing_vllm():
    stub_torchvision_if_missing()  # LingBot's package imports its wan2_2 sibling, which imports torchvision
    import PIL.Image
    from vllm_omni.diffusion.models.lingbot_world.actions import LINGBOT_CAMERA_ACTION_SCHEMA
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.experimental.ar_diffusion.tick_protocol import ARDiffusionControlInput, ARDiffusionTickRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

ARCH = "LingBotWorldCausalDMDPipeline"
CAMERA_TRACK = "camera"  # the one control track LingBot's pre-processing reads
FPS = 16  # Wan 2.x video, which LingBot-World is trained on
DEFAULT_HEIGHT, DEFAULT_WIDTH = 480, 832  # vLLM-Omni's default cache geometry (model_config ar_diffusion_*)
DEFAULT_PROMPT = "a first-person walk through a detailed world"
DEFAULT_IMAGE = "horizon"
# LingBot's camera-action keys (vLLM-Omni's actions.py): translation, then rotation of the camera.
KEYS = {
    "w": "move forward",
    "a": "move left",
    "s": "move back",
    "d": "move right",
    "i": "look up",
    "j": "look left",
    "k": "look down",
    "l": "look right",
}
CONTROLS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "keys": {
            "type": "array",
            "items": {"enum": list(KEYS)},
            "uniqueItems": True,
            "maxItems": len(KEYS),
            "description": "held keys, LingBot's camera actions: " + ", ".join(f"{k} {v}" for k, v in KEYS.items()),
        }
    },
    "additionalProperties": False,
}


def horizon_image(height: int, width: int) -> np.ndarray:
    """The default start picture: sky over ground, so a session without its own picture still has a scene."""
    rows = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    sky = np.array([120, 170, 230], dtype=np.float32)
    ground = np.array([90, 120, 60], dtype=np.float32)
    above = (rows < 0.55)[..., None]
    colour = np.where(above, sky * (0.7 + 0.3 * rows[..., None]), ground * (1.2 - 0.4 * rows[..., None]))
    return np.broadcast_to(colour, (height, width, 3)).clip(0, 255).astype(np.uint8)


class LingBotTicks:
    """Ticks to LingBot requests and its latents to frames, for one loaded ``LingBotWorldCausalDMDPipeline``."""

    def __init__(self, pipeline: Any, pre_process: Any, *, height: int, width: int, prompt: str | None = None) -> None:
        self.pipeline = pipeline
        self.pre_process = pre_process
        self.height, self.width = height, width
        self.prompt = prompt or DEFAULT_PROMPT
        self.latent_frames = int(pipeline.transformer.config.num_frames_per_block)
        temporal = int(pipeline.vae_scale_factor_temporal)
        # One block of latent frames per tick: the request's video length (the causal VAE's first-chunk count).
        self.request_frames = (self.latent_frames - 1) * temporal + 1
        self.first_chunk_frames = self.request_frames
        self.frames_per_chunk = self.latent_frames * temporal
        self._default_image = PIL.Image.fromarray(horizon_image(height, width))

    def model_card(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "width": self.width,
            "height": self.height,
            "fps": FPS,
            "frames_per_chunk": self.frames_per_chunk,
            "first_chunk_frames": self.first_chunk_frames,
            "reads_prompt": True,
            # Each tick's prompt is encoded (cached by text) and the cross-attention K/V rebuilt when it changes.
            "prompt_switch": "at_once",
            "default_prompt": self.prompt,
            "description": "LingBot-World: a world from a start picture, walked through with the camera keys",
            "controls": CONTROLS_SCHEMA,
            # The conditioning picture LingBot needs: a session's own, or this default.
            "start_images": [DEFAULT_IMAGE],
        }

    def image(self, start: StartImage | None) -> PIL.Image.Image:
        if start is None or start.pixels is None:
            if start is not None and start.name not in (None, DEFAULT_IMAGE):
                raise ValueError(f"LingBot-World offers the start image {DEFAULT_IMAGE!r}, not {start.name!r}")
            return self._default_image
        return PIL.Image.fromarray(np.ascontiguousarray(start.pixels))

    def request(self, tick: TickRequest, chunk_index: int) -> OmniDiffusionRequest:
        """The tick as LingBot's realtime request, after vLLM-Omni's pre-processing for the pipeline.

        ``close`` is not sent: the runtime closes the session itself after
        decoding the chunk, which needs the session's decoder state.
        """
        held = [key for key in tick.controls.get("keys", []) if key in KEYS]
        camera = {"mode": "frames", "frames": [held] * self.latent_frames}
        text = tick.prompt or self.prompt
        omni_tick = ARDiffusionTickRequest(
            session_id=tick.session_id,
            request_id=str(tick.request_id),
            chunk_index=chunk_index,
            applied_event_ids=tuple(tick.applied_event_ids),
            prompt=text,
            controls=(ARDiffusionControlInput(CAMERA_TRACK, LINGBOT_CAMERA_ACTION_SCHEMA, camera),),
            reset=tick.reset,
        )
        params = OmniDiffusionSamplingParams(
            # LingBot needs the runner's generator, which the runner makes from a seed; the session keeps its state.
            seed=tick.seed if tick.seed is not None else random.randrange(2**31),
            height=self.height,
            width=self.width,
            num_frames=self.request_frames,
            output_type="latent",
            extra_args=omni_tick.to_extra_args(),
        )
        prompt = {"prompt": text, "multi_modal_data": {"image": self.image(tick.start_image)}}
        request = OmniDiffusionRequest(
            prompt=prompt, sampling_params=params, request_id=f"{tick.session_id}/{tick.request_id}"
        )
        return self.pre_process(request)

    def frames(self, output: Any, session_id: str) -> np.ndarray:
        """The chunk's video frames, uint8 ``[F, H, W, 3]``, from the latents one tick returned."""
        latents = output.output["payload"]["latents"]
        if not isinstance(latents, torch.Tensor):
            raise TypeError(f"LingBot returned {type(latents).__name__} latents, expected a tensor")
        return decode_chunk(self.pipeline, latents, session_id)


def decode_chunk(pipeline: Any, latents: torch.Tensor, session_id: str) -> np.ndarray:
    """The pipeline's per-session streaming decode of one chunk's latents.

    WORKAROUND (vLLM-Omni 0.30.0): LingBot's request-mode ticks stop at
    latents ("stateful streaming VAE decode is a separate integration step"),
    and the decode its step-execution path uses, ``_decode_chunk_to_pixels``
    with the session id, is private. It is the only way to decode a session's
    chunks with the session's own temporal cache (chunk N+1 continuing chunk
    N), which ``reset_ar_diffusion_session`` / ``close_ar_diffusion_session``
    release with the session. ``tests/test_vllm_omni_lingbot.py`` checks
    request-mode ticks still refuse pixel output and this method still exists:
    when LingBot decodes in request mode, this call goes.
    """
    return pipeline._decode_chunk_to_pixels(latents, session_id=session_id)
