"""A dense reference of Causal Forcing's inference, written from the published code, for one session.

What it follows, function by function (thu-ml/Causal-Forcing at commit
1fc7bbc19a503c1bce80ecef08158b20e702f386, the same inference pipeline as
Self-Forcing's):

- ``pipeline/causal_inference.py``, ``CausalInferencePipeline.__init__`` and
  ``inference``: the distilled steps warped onto the scheduler's grid
  (``timesteps[1000 - step]``), blocks of ``num_frame_per_block`` latent frames
  (3 chunk-wise, 1 frame-wise), each denoised step by step (the flow turned
  into x0, re-noised to the next step), then run once more at
  ``context_noise`` (0) to write the block's K/V into the cache;
- ``utils/scheduler.py``, ``FlowMatchScheduler`` as ``WanDiffusionWrapper``
  builds it (shift 5, ``sigma_min`` 0, ``extra_one_step``, 1000 steps) and its
  ``add_noise``; ``utils/wan_wrapper.py``, ``_convert_flow_pred_to_x0`` (in
  float64, the sigma of the grid timestep nearest);
- ``wan/modules/causal_model.py``, ``CausalWanSelfAttention.forward``'s cache
  path: a token buffer of ``kv_cache_size`` per layer with a global and a local
  end index; a block's first pass past the buffer's end evicts the oldest
  tokens after the sink (the rolling path, taken when ``local_attn_size`` is
  not -1), later passes of the same block overwrite its slots, and attention
  reads the last ``max_attention_size`` tokens up to the block's end.

Where it departs from the published script, and why: the noise is drawn
block by block from one generator in the order the stream draws it (the
script draws the whole rollout's noise up front and re-noises from the global
generator; a stream cannot know its length); and the published rollout is 21
latent frames with ``local_attn_size`` -1 (a 32760-token buffer: 21 frames),
whose buffer has no rolling path past 21 frames, so past them this follows
the rolling path of ``local_attn_size`` 21, which attends exactly as -1 does
within the first 21 frames. K is kept unrotated with its frame position and
rotated when read (the layers' convention), which equals rotating before
caching.

Knobs for the negative controls: ``frames_per_block`` (the other mode),
``local_attn_size`` (another window, in frames), ``warp`` (the steps fed
unwarped), ``commit`` (False: no t=0 pass, the last step's K/V stay cached).
"""

from __future__ import annotations

import torch

from arstream.models.longlive.dit import PromptKV
from arstream.models.longlive.pipeline import LongLivePipeline


class FlowMatchScheduler:
    """The training scheduler's grid: ``set_timesteps(1000)`` with ``sigma_min`` 0 and ``extra_one_step``."""

    def __init__(self, shift: float, steps: int = 1000) -> None:
        sigmas = torch.linspace(1.0, 0.0, steps + 1)[:-1]
        self.sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = self.sigmas * steps

    def sigma_of(self, timestep: torch.Tensor) -> torch.Tensor:
        index = torch.argmin((self.timesteps[None] - timestep.flatten()[:, None]).abs(), dim=1)
        return self.sigmas[index]

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        sigma = self.sigma_of(timestep).reshape(-1, 1, 1, 1)
        return ((1 - sigma) * x0 + sigma * noise).type_as(noise)

    def flow_to_x0(self, flow: torch.Tensor, xt: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        sigmas, timesteps = self.sigmas.double(), self.timesteps.double()
        index = torch.argmin((timesteps[None] - timestep.double().flatten()[:, None]).abs(), dim=1)
        sigma = sigmas[index].reshape(-1, 1, 1, 1)
        return (xt.double() - sigma * flow.double()).to(flow.dtype)


class LayerCache:
    """One layer's ``kv_cache`` dict: K/V token buffers (with each token's frame), and the two end indices."""

    def __init__(self, size: int, heads: int, head_dim: int) -> None:
        self.k = torch.zeros(size, heads, head_dim)
        self.v = torch.zeros(size, heads, head_dim)
        self.frame = torch.zeros(size, dtype=torch.long)
        self.global_end = 0
        self.local_end = 0


class CacheContext:
    """The self-attention of one forward through the caches (``CausalWanSelfAttention.forward``, cache path)."""

    self_mask = None

    def __init__(self, caches: list[LayerCache], start_frame: int, frames: int, tokens: int, sink_frames: int,
                 max_attention_frames: int, rolling: bool) -> None:  # fmt: skip
        self.caches, self.tokens = caches, tokens
        self.current_start = start_frame * tokens
        self.current_end = self.current_start + frames * tokens
        self.sink_tokens = sink_frames * tokens
        self.max_attention = max_attention_frames * tokens
        self.rolling = rolling
        self.query_positions = torch.arange(start_frame, start_frame + frames)[None]
        # every layer's buffer holds the same frames: the keys' positions are known before the first layer runs
        planned = caches[0].frame.clone()
        read = self._write(planned, caches[0], torch.arange(self.current_start, self.current_end) // tokens)
        self.key_positions = planned[read][::tokens][None]

    def _write(self, buffer: torch.Tensor, cache: LayerCache, new: torch.Tensor) -> slice:
        """Write ``new`` (rows for the block's tokens) into ``buffer``, rolling it first if it is full; the read."""
        count = new.shape[0]
        size = buffer.shape[0]
        if self.rolling and self.current_end > cache.global_end and count + cache.local_end > size:
            evicted = count + cache.local_end - size
            rolled = cache.local_end - evicted - self.sink_tokens
            kept = buffer[self.sink_tokens + evicted : self.sink_tokens + evicted + rolled].clone()
            buffer[self.sink_tokens : self.sink_tokens + rolled] = kept
            local_end = cache.local_end + self.current_end - cache.global_end - evicted
        else:
            local_end = cache.local_end + self.current_end - cache.global_end
        buffer[local_end - count : local_end] = new
        return slice(max(0, local_end - self.max_attention), local_end)

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.caches[layer]
        frames = torch.arange(self.current_start, self.current_end) // self.tokens
        self._write(cache.k, cache, k[0])
        self._write(cache.v, cache, v[0])
        read = self._write(cache.frame, cache, frames)
        cache.local_end = read.stop
        cache.global_end = self.current_end
        return cache.k[read][None], cache.v[read][None]


class PublishedCausalForcing:
    """``CausalInferencePipeline.inference`` for one prompt, a block at a time (:meth:`step`)."""

    def __init__(self, pipeline: LongLivePipeline, prompt: str, seed: int = 0, *, frames_per_block: int | None = None,
                 local_attn_size: int = 21, warp: bool = True, commit: bool = True) -> None:  # fmt: skip
        self.pipeline, self.model, self.cfg = pipeline, pipeline.model, pipeline.cfg
        cfg = self.cfg
        self.frames_per_block = cfg.frames_per_chunk if frames_per_block is None else frames_per_block
        self.local_attn_size, self.commit = local_attn_size, commit
        self.scheduler = FlowMatchScheduler(cfg.timestep_shift)
        steps = torch.tensor(cfg.denoise_timesteps, dtype=torch.long)
        if warp:
            self.steps = torch.cat((self.scheduler.timesteps, torch.tensor([0.0])))[1000 - steps]
        else:
            self.steps = steps
        tokens = cfg.tokens_per_frame
        self.caches = [LayerCache(local_attn_size * tokens, cfg.num_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        self.prompt_kv: PromptKV = self.model.cross_kv(self.model.text_context(pipeline.text.encode(prompt)))
        self.generator = torch.Generator().manual_seed(seed)
        self.current_start_frame = 0

    def _generator(self, x: torch.Tensor, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``WanDiffusionWrapper.forward`` on the cache: the flow and its x0, ``x`` ``[B, F, C, h, w]``."""
        cfg = self.cfg
        ctx = CacheContext(self.caches, self.current_start_frame, x.shape[1], cfg.tokens_per_frame, cfg.sink_size,
                           self.local_attn_size, rolling=True)  # fmt: skip
        flow = self.model(x.permute(0, 2, 1, 3, 4), timestep, self.prompt_kv, ctx).permute(0, 2, 1, 3, 4)
        x0 = self.scheduler.flow_to_x0(flow.flatten(0, 1), x.flatten(0, 1), timestep.flatten(0, 1))
        return flow, x0.reshape(flow.shape)

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """One block; returns its clean latent ``[16, F, h, w]`` (what ``output`` records)."""
        cfg, frames = self.cfg, self.frames_per_block
        shape = (frames, cfg.out_dim, cfg.latent_height, cfg.latent_width)
        noisy = torch.randn((cfg.out_dim, frames, cfg.latent_height, cfg.latent_width),
                            generator=self.generator).permute(1, 0, 2, 3)[None]  # fmt: skip
        denoised = noisy
        for index, current in enumerate(self.steps):
            timestep = torch.ones((1, frames), dtype=torch.int64) * current
            _, denoised = self._generator(noisy, timestep)
            if index < len(self.steps) - 1:
                following = self.steps[index + 1]
                noise = torch.randn((cfg.out_dim, frames, cfg.latent_height, cfg.latent_width),
                                    generator=self.generator).permute(1, 0, 2, 3)  # fmt: skip
                at = following * torch.ones(frames, dtype=torch.long)
                noisy = self.scheduler.add_noise(denoised.flatten(0, 1), noise, at)[None]
        assert denoised.shape[1:] == shape
        if self.commit:
            self._generator(denoised, torch.zeros((1, frames), dtype=torch.int64))
        self.current_start_frame += frames
        return denoised[0].permute(1, 0, 2, 3)
