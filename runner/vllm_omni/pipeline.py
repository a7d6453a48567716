"""An ARStream pipeline as vLLM-Omni's ``SupportsARDiffusionPipeline``, and ticks as vLLM-Omni requests.

vLLM-Omni's ``ARDiffusionModelRunner`` loads a pipeline class, asks it for
``ar_diffusion_kv_cache_spec()``, binds a session's KV state with
``bind_ar_diffusion_state`` around each ``forward(batch)``, and tells it about
resets and closes. :class:`OmniPipelineAdapter` answers each of those with the
ARStream pipeline's own method (``kv_cache_spec`` converted by
:func:`~arstream.runner.vllm_omni.spec.to_omni_spec`, ``bind_session_state``
with an :class:`~arstream.runner.vllm_omni.state.OmniSessionKVState`,
``generate_chunk``, ``reset_session``, ``close_session``, ``warmup_requests``).

A tick travels in vLLM-Omni's own tick protocol (``ARDiffusionTickRequest``
under ``extra_args``): session, request id, chunk index, applied events,
prompt, reset and close; the controls ride as one control track and the seed
as the sampling seed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..contract import ARPipeline, SupportsWarmup
from ..chunks import check_frames, video_frames_of
from ..types import TickRequest
from .deprecations import importing_vllm
from .spec import to_omni_spec
from .state import OmniSessionKVState

with importing_vllm():
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.experimental.ar_diffusion.capability import ARDiffusionKVCacheSpec
    from vllm_omni.experimental.ar_diffusion.tick_protocol import ARDiffusionControlInput, ARDiffusionTickRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

CONTROLS_TRACK = "controls"
CONTROLS_SCHEMA = "arstream.controls"
# A prompt change's blend length has no field in vLLM-Omni's tick protocol: it rides beside the tick in extra_args.
PROMPT_TRANSITION_KEY = "arstream_prompt_transition_chunks"


def to_omni_request(tick: TickRequest, chunk_index: int) -> OmniDiffusionRequest:
    """One tick as a vLLM-Omni request (``chunk_index``: the session's chunk count before this tick).

    vLLM-Omni's tick protocol has no start image; the runtime's card offers none, so the transport
    refuses one before it gets here, and a tick that still carries one is refused rather than run without it.
    """
    if tick.start_image is not None:
        raise ValueError("the vllm-omni runtime takes no start image (vLLM-Omni's tick protocol has no field for it)")
    omni_tick = ARDiffusionTickRequest(
        session_id=tick.session_id,
        request_id=str(tick.request_id),
        chunk_index=chunk_index,
        applied_event_ids=tuple(tick.applied_event_ids),
        prompt=tick.prompt,
        controls=(ARDiffusionControlInput(CONTROLS_TRACK, CONTROLS_SCHEMA, tick.controls),),
        reset=tick.reset,
        close_session=tick.close,
    )
    extra_args = {**omni_tick.to_extra_args(), PROMPT_TRANSITION_KEY: tick.prompt_transition_chunks}
    params = OmniDiffusionSamplingParams(seed=tick.seed, extra_args=extra_args)
    # vLLM-Omni refuses a request without a prompt; a model that takes none ignores it.
    return OmniDiffusionRequest(
        prompt=tick.prompt or "", sampling_params=params, request_id=f"{tick.session_id}/{tick.request_id}"
    )


def tick_from_request(request: OmniDiffusionRequest) -> TickRequest:
    """The tick :func:`to_omni_request` encoded."""
    omni_tick = ARDiffusionTickRequest.from_extra_args(request.sampling_params.extra_args)
    if omni_tick is None:
        raise ValueError(f"request {request.request_id!r} carries no AR-Diffusion tick")
    controls = next((c.to_dict()["data"] for c in omni_tick.controls if c.track == CONTROLS_TRACK), {})
    return TickRequest(
        session_id=omni_tick.session_id,
        request_id=int(omni_tick.request_id),
        controls=controls,
        prompt=omni_tick.prompt,
        prompt_transition_chunks=int(request.sampling_params.extra_args.get(PROMPT_TRANSITION_KEY, 0)),
        seed=request.sampling_params.seed,
        reset=omni_tick.reset,
        close=omni_tick.close_session,
        applied_event_ids=omni_tick.applied_event_ids,
    )


class OmniPipelineAdapter(torch.nn.Module):
    """Implements ``SupportsARDiffusionPipeline`` and ``SupportsARDiffusionWarmup`` with an ARStream pipeline.

    vLLM-Omni builds the pipeline class itself (``cls(od_config=...)``), so
    :func:`adapter_class` binds an already loaded ARStream pipeline into a
    subclass. The wrapped pipeline is a plain attribute, not a submodule:
    it is already on its device and vLLM-Omni must not move or compile it.
    """

    def __init__(self, pipeline: ARPipeline, device: torch.device) -> None:
        super().__init__()
        self.arstream_pipeline = pipeline
        self.device = device
        self.spec = pipeline.kv_cache_spec()
        self._omni_spec = to_omni_spec(self.spec)
        # Video frames a chunk must return (the model card's count; the first chunk's may differ), as ARRunner checks.
        self._video_frames, self._first_chunk_frames = video_frames_of(pipeline.model_card(), self.spec)
        self._bound: dict[str, OmniSessionKVState] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM-Omni's loader step: the ARStream pipeline loaded its own weights, so there are none to take."""
        names = [name for name, _ in weights]
        if names:
            raise ValueError(f"the ARStream pipeline adapter takes no weights from vLLM-Omni, got {names[:3]}")
        return set()

    # ---- SupportsARDiffusionPipeline ------------------------------------------------

    def ar_diffusion_kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        return self._omni_spec

    @contextmanager
    def bind_ar_diffusion_state(self, session_id: str, state: Any) -> Iterator[None]:
        bound = OmniSessionKVState(state, self.spec, self.device)
        self._bound[session_id] = bound
        try:
            with self.arstream_pipeline.bind_session_state(session_id, bound):
                yield
        finally:
            self._bound.pop(session_id, None)

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        self.arstream_pipeline.reset_session(session_id)

    def close_ar_diffusion_session(self, session_id: str) -> None:
        self.arstream_pipeline.close_session(session_id)

    # ---- SupportsARDiffusionWarmup ------------------------------------------------

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterable[OmniDiffusionRequest]:
        if not isinstance(self.arstream_pipeline, SupportsWarmup):
            return []
        return [to_omni_request(tick, chunk_index=i) for i, tick in enumerate(self.arstream_pipeline.warmup_requests(session_id))]

    # ---- the forward ---------------------------------------------------------------

    def forward(self, batch: Any) -> DiffusionOutput:
        """One chunk of the (single) request's session, whose KV vLLM-Omni has bound."""
        (request,) = batch.requests
        tick = tick_from_request(request)
        first = self._bound[tick.session_id].chunk_index == 0
        frames = self.arstream_pipeline.generate_chunk(tick)
        # Inside the bound forward, so a bad chunk fails closed like any model error.
        check_frames(frames, self._first_chunk_frames if first else self._video_frames)
        return DiffusionOutput(output=torch.from_numpy(frames))


def adapter_class(pipeline: ARPipeline, device: torch.device) -> type[OmniPipelineAdapter]:
    """A pipeline class vLLM-Omni's loader can build (``cls(od_config=...)``) that wraps ``pipeline``."""

    class BoundOmniPipelineAdapter(OmniPipelineAdapter):
        def __init__(self, od_config: Any = None) -> None:
            super().__init__(pipeline, device)

    BoundOmniPipelineAdapter.__name__ = f"OmniPipelineAdapter[{type(pipeline).__name__}]"
    return BoundOmniPipelineAdapter
