"""A dense reference of Krea Realtime's streaming session, written from the published server, for one session.

What it follows, function by function (krea-ai/realtime-video at commit
acf4b7b4e1a3049a0e04782e751d12203334038d, ``release_server.py``'s
``GenerationSession`` with ``configs/self_forcing_server_14b.yaml``; the code
is CC-BY-NC-SA, so this is our own writing of what it does):

- ``__init__`` / ``init_models``: the denoising list from ``v2v.get_denoising_schedule``
  (``num_denoising_steps`` timesteps from 1000 to 0 on the zero-padded
  scheduler grid), a K/V buffer of ``kv_cache_num_frames + num_frame_per_block``
  frames per layer, a deque of the last ``1 + (kv_cache_num_frames - 1) * 4``
  decoded video frames;
- ``interpolate_prompt_embeds``: the umT5 outputs (padded to 512) lerped from
  the current ones to the new prompt's with weights ``linspace(0, 1, steps)``,
  one popped per block;
- ``recompute_kv_cache`` / ``get_clean_context_frames``: before every block
  after the first, the buffer is emptied and the context (the first latent
  frame and the last two while the second block runs; after that the deque's
  oldest video frame encoded again, and the last two latent frames) runs once
  at t=0 through the block-mask path (rotary positions from 0, one block: every
  context frame sees every other), under the conditioning the previous block
  ran under (``conditional_dict`` is updated inside the denoising loop, after
  this), its K/V written at the buffer's start;
- ``generate_block_internal``: the block at ``current_start = min(current_start_frame,
  kv_cache_num_frames)`` frames through the cache path (``local_attn_size`` -1:
  no rolling; the end indices' arithmetic), each step's x0 re-noised to the
  next (``FlowMatchScheduler.add_noise``), the last step at t=0, and no t=0
  pass after it (the next block recomputes the context anyway).

Where it departs, and why: noise is drawn block by block from one generator
in the order the stream draws it (the server draws a whole rollout's noise up
front; a stream has no length); frames are decoded by Wan's causal VAE as the
project does (the first latent frame is one video frame; Krea's decoder gives
four and drops three), so the deque's oldest frame is the same frame of the
previous block from the third block on, when it is read.

Knobs for the negative controls: ``recompute`` (False: the block's own t=0
K/V stay as the next context, as a plain KV cache would), ``reencode`` (False:
the context's first frame is the latent itself), ``blend`` (False: a prompt
change applies at once), ``recompute_under_new`` (the context recomputed
under this block's conditioning).
"""

from __future__ import annotations

from collections import deque

import torch

from arstream.models.krea.pipeline import KreaPipeline
from arstream.models.wan.vae import FeatureCache
from causal_forcing_reference import FlowMatchScheduler


class Buffer:
    """One layer's ``kv_cache``: K/V rows with each row's frame, and the two end indices."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.frames: torch.Tensor | None = None
        self.global_end = 0
        self.local_end = 0


class _Pass:
    """One forward's self-attention through the buffers, on the mask path (recompute) or the cache path."""

    self_mask = None

    def __init__(self, buffers: list[Buffer], start_frame: int, frames: int, tokens: int, recompute: bool) -> None:
        self.buffers, self.tokens, self.recompute = buffers, tokens, recompute
        self.start = start_frame * tokens
        self.end = self.start + frames * tokens
        positions = torch.arange(start_frame, start_frame + frames)
        self.query_positions = positions[None]
        if recompute:
            self.key_positions = positions[None]
        else:
            first = buffers[0]
            local_end = first.local_end + self.end - first.global_end
            held = 0 if first.frames is None else first.frames.shape[0]
            kept = first.frames[: min(held, local_end - frames * tokens)] if first.frames is not None else None
            frame_rows = torch.arange(self.start, self.end) // tokens
            rows = frame_rows if kept is None else torch.cat([kept, frame_rows])
            self.key_positions = rows[::tokens][None]

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = self.buffers[layer]
        frames = torch.arange(self.start, self.end) // self.tokens
        if self.recompute:  # the mask path: written at the buffer's start, the indices set to its length
            buffer.k, buffer.v, buffer.frames = k[0].clone(), v[0].clone(), frames
            buffer.global_end = buffer.local_end = k.shape[1]
            return k, v
        local_end = buffer.local_end + self.end - buffer.global_end
        local_start = local_end - k.shape[1]

        def placed(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
            kept = new[:0] if old is None else old[:local_start]
            return torch.cat([kept, new])

        buffer.k, buffer.v = placed(buffer.k, k[0]), placed(buffer.v, v[0])
        buffer.frames = placed(buffer.frames, frames)
        buffer.global_end, buffer.local_end = self.end, local_end
        return buffer.k[None], buffer.v[None]


class PublishedKrea:
    """``GenerationSession`` for one stream: :meth:`step` generates one block under the prompt given."""

    def __init__(self, pipeline: KreaPipeline, seed: int = 0, *, recompute: bool = True, reencode: bool = True,
                 blend: bool = True, recompute_under_new: bool = False) -> None:  # fmt: skip
        self.pipeline, self.model, self.cfg = pipeline, pipeline.model, pipeline.cfg
        cfg = self.cfg
        self.recompute_on, self.reencode, self.blend, self.under_new = recompute, reencode, blend, recompute_under_new
        self.scheduler = FlowMatchScheduler(cfg.timestep_shift)
        padded = torch.cat((self.scheduler.timesteps, torch.tensor([0.0])))
        strength = 1.0
        steps = torch.linspace(strength * 1000, 0, cfg.denoising_steps, dtype=torch.float32).to(torch.long)
        self.denoising_step_list = padded[1000 - steps]
        self.generator = torch.Generator().manual_seed(seed)
        self.all_latents: list[torch.Tensor] = []  # [16, h, w] per latent frame
        self.frame_context_cache: deque[torch.Tensor] = deque(maxlen=1 + (cfg.context_frames - 1) * 4)
        self.decode_cache: FeatureCache | None = None
        self.buffers = [Buffer() for _ in range(cfg.num_layers)]
        self.block_idx = 0
        self.current_start_frame = 0
        self.prompt: str | None = None
        self.current_prompt_embeds: torch.Tensor | None = None
        self.conditional_embeds: torch.Tensor | None = None  # ``conditional_dict['prompt_embeds']``
        self.interpolated_prompt_embeds: list[torch.Tensor] = []

    def _embeds(self, prompt: str) -> torch.Tensor:
        tokens = self.pipeline.text.encode(prompt)
        padded = tokens.new_zeros(self.cfg.text_len, self.cfg.text.dim)
        padded[: tokens.shape[0]] = tokens[: self.cfg.text_len]
        return padded

    def _kv(self, embeds: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.model.cross_kv(self.model.text_context(embeds))

    def interpolate_prompt_embeds(self, new_prompt: str, interpolation_steps: int) -> None:
        if self.current_prompt_embeds is None:
            return
        start, end = self.current_prompt_embeds, self._embeds(new_prompt)
        weights = torch.linspace(0, 1, steps=interpolation_steps).to(start)
        self.interpolated_prompt_embeds = [torch.lerp(start, end, w) for w in weights]

    def _clean_context_frames(self) -> torch.Tensor:
        frames = self.cfg.context_frames
        clean = self.all_latents[: self.current_start_frame]
        if (self.block_idx - 1) * self.cfg.frames_per_chunk < frames or not self.reencode:
            context = clean[:1] + clean[1:][-frames + 1 :]
        else:
            video = self.frame_context_cache[0]  # [1, 3, 1, H, W]
            first = self.pipeline.vae.encode_step(video, None)[0][:, 0]
            context = [first] + clean[1:][-frames + 1 :]
        return torch.stack(context, dim=1)[None]

    def _recompute_kv_cache(self) -> int:
        cfg = self.cfg
        if self.block_idx == 0:
            self.buffers = [Buffer() for _ in range(cfg.num_layers)]
            return self.current_start_frame
        start = min(self.current_start_frame, cfg.context_frames)
        if not self.recompute_on:
            return start  # the buffer as the last block left it (its t=0 pass), rolled to the window
        context = self._clean_context_frames()
        self.buffers = [Buffer() for _ in range(cfg.num_layers)]
        embeds = self.current_prompt_embeds if self.under_new else self.conditional_embeds
        assert embeds is not None
        ctx = _Pass(self.buffers, 0, context.shape[2], cfg.tokens_per_frame, recompute=True)
        self.model(context, torch.zeros((1, context.shape[2]), dtype=torch.int64), self._kv(embeds), ctx)
        return start

    @torch.inference_mode()
    def step(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One block under ``prompt`` (a change starts a blend); returns its latents ``[16, F, h, w]`` and video."""
        cfg = self.cfg
        if self.prompt is not None and prompt != self.prompt:
            if self.blend:
                self.interpolate_prompt_embeds(prompt, cfg.prompt_blend_chunks)
            else:
                self.current_prompt_embeds = self._embeds(prompt)
        self.prompt = prompt
        if self.current_prompt_embeds is None:
            self.current_prompt_embeds = self.conditional_embeds = self._embeds(prompt)
        if self.under_new and self.interpolated_prompt_embeds:
            self.current_prompt_embeds = self.interpolated_prompt_embeds.pop(0)
        if not self.recompute_on and self.block_idx > 0:
            self._roll()
        model_input_start_frame = self._recompute_kv_cache()
        if self.interpolated_prompt_embeds and not self.under_new:
            self.current_prompt_embeds = self.interpolated_prompt_embeds.pop(0)
        fpc = cfg.frames_per_chunk
        noisy = torch.randn((cfg.out_dim, fpc, cfg.latent_height, cfg.latent_width), generator=self.generator)[None]
        kv = self._kv(self.current_prompt_embeds)
        self.conditional_embeds = self.current_prompt_embeds
        denoised = noisy
        steps = self.denoising_step_list
        for index, current in enumerate(steps):
            timestep = torch.ones((1, fpc), dtype=torch.int64) * current
            ctx = _Pass(self.buffers, model_input_start_frame, fpc, cfg.tokens_per_frame, recompute=False)
            flow = self.model(noisy, timestep, kv, ctx)
            x0 = self.scheduler.flow_to_x0(flow[0].transpose(0, 1), noisy[0].transpose(0, 1), timestep[0])
            denoised = x0.transpose(0, 1)[None]
            if index < len(steps) - 1:
                following = steps[index + 1] * torch.ones(fpc, dtype=torch.long)
                noise = torch.randn((cfg.out_dim, fpc, cfg.latent_height, cfg.latent_width), generator=self.generator)
                renoised = self.scheduler.add_noise(denoised[0].transpose(0, 1), noise.transpose(0, 1), following)
                noisy = renoised.transpose(0, 1)[None]
        self.all_latents.extend(denoised[0].unbind(1))
        video, self.decode_cache = self.pipeline.vae.decode(denoised, self.decode_cache)
        self.frame_context_cache.extend(video[:, :, i : i + 1] for i in range(video.shape[2]))
        self.current_start_frame += fpc
        self.block_idx += 1
        return denoised[0], video

    def _roll(self) -> None:
        """Without a recompute: keep the last block's K/V (its t=0 pass) as the context, at positions 0..C-1."""
        tokens = self.cfg.context_frames * self.cfg.tokens_per_frame
        for buffer in self.buffers:
            assert buffer.k is not None and buffer.v is not None and buffer.frames is not None
            buffer.k, buffer.v = buffer.k[-tokens:], buffer.v[-tokens:]
            buffer.frames = torch.arange(tokens) // self.cfg.tokens_per_frame
            buffer.global_end = buffer.local_end = tokens
