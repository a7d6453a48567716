"""A dense reference of LongLive's interactive inference, written from the published pipeline, for one session.

What it follows (NVlabs/LongLive v1.0, ``pipeline/interactive_causal_inference.py`` and
``wan/modules/causal_model.py``, with ``configs/longlive_interactive_inference.yaml``): a KV
cache of at most ``local_attn_size`` frames per layer, the first ``sink_size`` frames kept
forever and the rest rolling; a chunk attends to the cache plus itself, at most
``local_attn_size`` frames; four denoising passes, then a commit pass at t=0 writes the
chunk. A prompt switch at frame ``s`` (``_recache_after_switch``, ``global_sink: true``) runs
the latents of frames ``[s - n, s)``, ``n = min(local_attn_size, s)``, once at t=0 under the
new prompt through the KV-cache path (no mask: every query sees every key); when
``s - n > 0`` it is a recompute, whose first ``sink_size`` frames are not written (the
sink keeps the old prompt) and whose other frames replace the rolling part; otherwise
every frame, sink included, is rewritten. The cache is a plain list of frames with
their absolute positions (not the runner's pages) and keeps every frame it holds.

Knobs for the negative controls: ``recache=False`` (a switch only changes the cross-attention),
``causal_recache`` (a block-causal mask inside the re-cache), ``reencode_sink`` (a recompute
rewrites the sink too), ``local_attn_size`` (another window) and ``warp`` (timesteps warped or not).

CausVid (tianweiy/CausVid, ``causvid/models/wan/causal_inference.py`` with
``configs/wan_causal_dmd.yaml``) is the same loop with no sink, a cache of all
21 frames of its rollout, and its timesteps fed unwarped (``warp_denoising_step``
false): the DiT sees 1000, 757, 522, and the flow-matching scheduler noises and
denoises with the sigma of its grid timestep nearest to each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arstream.models.longlive.dit import PromptKV
from arstream.models.longlive.pipeline import LongLivePipeline
from arstream.models.wan.sampler import shifted_sigma


@dataclass
class Frame:
    position: int
    k: list[torch.Tensor]  # per layer [tokens, heads, head_dim]
    v: list[torch.Tensor]


class DenseContext:
    """Everything visible: the input frames are all the keys."""

    self_mask = None

    def __init__(self, frames: int) -> None:
        self.query_positions = self.key_positions = torch.arange(frames)[None]

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class _Context:
    """The dense attention context of one forward: keys are ``visible`` (per layer) then the input frames."""

    def __init__(self, visible: list[Frame], positions: list[int], mask: torch.Tensor | None, tokens: int,
                 keys_of_input: bool = True) -> None:  # fmt: skip
        self.visible = visible
        self.positions = positions
        self.tokens = tokens
        self.keys_of_input = keys_of_input
        self.self_mask = mask
        keys = [f.position for f in visible] + (positions if keys_of_input else [])
        self.query_positions = torch.tensor([positions])
        self.key_positions = torch.tensor([keys])
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.new[layer] = (k[0], v[0])
        ks = [f.k[layer] for f in self.visible] + ([k[0]] if self.keys_of_input else [])
        vs = [f.v[layer] for f in self.visible] + ([v[0]] if self.keys_of_input else [])
        return torch.cat(ks)[None], torch.cat(vs)[None]

    def frames(self) -> list[Frame]:
        """The input frames' K/V (per frame), from the forward that just ran."""
        t = self.tokens
        layers = sorted(self.new)
        return [
            Frame(p, [self.new[n][0][i * t : (i + 1) * t] for n in layers], [self.new[n][1][i * t : (i + 1) * t] for n in layers])
            for i, p in enumerate(self.positions)
        ]


class DenseLongLive:
    def __init__(self, pipeline: LongLivePipeline, seed: int = 0, *, recache: bool = True, causal_recache: bool = False,
                 reencode_sink: bool = False, local_attn_size: int | None = None,
                 warp: bool | None = None) -> None:  # fmt: skip
        self.pipeline = pipeline
        self.model = pipeline.model
        self.cfg = pipeline.cfg
        self.local = self.cfg.local_attn_size if local_attn_size is None else local_attn_size
        self.recache_on, self.causal_recache, self.reencode_sink = recache, causal_recache, reencode_sink
        self.warp = self.cfg.warp_timesteps if warp is None else warp
        self.sink: list[Frame] = []
        self.rolling: list[Frame] = []
        self.latents: list[torch.Tensor] = []  # every frame's clean latent [16, h, w] ("output")
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt: str | None = None
        self.recaches = 0

    def _schedule(self) -> tuple[list[float], list[float]]:
        """What the DiT is fed at each denoising step, and the sigma each step noises and denoises with."""
        cfg, shift = self.cfg, self.cfg.timestep_shift
        if self.warp:  # ``timesteps[1000 - t]``: the scheduler's shifted grid at s = t / 1000, fed as 1000 * sigma
            sigmas = [shifted_sigma(t, shift) for t in cfg.denoise_timesteps]
            return [1000.0 * sigma for sigma in sigmas], sigmas
        # CausVid's warp_denoising_step false: t is fed as it is; the scheduler's sigma is that of its grid
        # timestep nearest to t (grid: the shifted sigmas of s = 1, 0.999, ..., 0.001)
        grid = [shift * s / (1 + (shift - 1) * s) for s in (1 - i / 1000 for i in range(1000))]
        sigmas = [min(grid, key=lambda sigma: abs(1000 * sigma - t)) for t in cfg.denoise_timesteps]
        return [float(t) for t in cfg.denoise_timesteps], sigmas

    def _prompt_kv(self, prompt: str) -> PromptKV:
        model = self.model
        return model.cross_kv(model.text_context(self.pipeline.text.encode(prompt)))

    def _forward(self, x: torch.Tensor, t: float, ctx: _Context, kv: PromptKV) -> torch.Tensor:
        return self.model(x, torch.full((1, x.shape[2]), t), kv, ctx)

    def _recache(self, kv: PromptKV) -> None:
        cfg, s = self.cfg, len(self.latents)
        n = min(self.local, s)
        start = s - n
        positions = list(range(start, s))
        recompute = start > 0
        old_sink = self.sink if recompute and not self.reencode_sink else []
        # a recompute's first sink_size frames are not written, so they are no keys either
        skipped = cfg.sink_size if recompute and not self.reencode_sink else 0
        tokens = cfg.tokens_per_frame
        mask = None
        if self.causal_recache:
            block = torch.arange(n).repeat_interleave(tokens) // cfg.frames_per_chunk
            new_keys = block[skipped * tokens :]
            mask = torch.cat([torch.ones(n * tokens, len(old_sink) * tokens, dtype=torch.bool),
                              new_keys[None, :] <= block[:, None]], dim=1)  # fmt: skip
        ctx = _RecacheContext(old_sink, positions, mask, tokens, skipped)
        x = torch.stack(self.latents[start:s], dim=1)[None]
        self._forward(x, 0.0, ctx, kv)
        new = ctx.frames()
        if recompute and not self.reencode_sink:
            self.rolling = new[cfg.sink_size :]
        else:
            self.sink, self.rolling = new[: cfg.sink_size], new[cfg.sink_size :]
        self.rolling = self.rolling[max(0, len(self.rolling) - (self.local - cfg.sink_size)) :]
        self.recaches += 1

    def step(self, prompt: str) -> torch.Tensor:
        """One chunk under ``prompt``; returns its clean latent ``[16, F, h, w]``."""
        cfg = self.cfg
        kv = self._prompt_kv(prompt)
        if self.prompt is not None and prompt != self.prompt and self.latents and self.recache_on:
            self._recache(kv)
        self.prompt = prompt
        s, fpc = len(self.latents), cfg.frames_per_chunk
        positions = list(range(s, s + fpc))
        history = self.local - cfg.sink_size - fpc  # rolling frames a chunk sees besides itself
        visible = self.sink + (self.rolling[max(0, len(self.rolling) - history) :] if history > 0 else [])
        shape = (1, cfg.out_dim, fpc, cfg.latent_height, cfg.latent_width)
        x = torch.randn(shape[1:], generator=self.generator)[None]
        fed, sigmas = self._schedule()
        clean = x
        with torch.inference_mode():
            for i, sigma in enumerate(sigmas):
                flow = self._forward(x, fed[i], _Context(visible, positions, None, cfg.tokens_per_frame), kv)
                clean = x - sigma * flow
                if i + 1 < len(sigmas):
                    x = (1 - sigmas[i + 1]) * clean + sigmas[i + 1] * torch.randn(shape[1:], generator=self.generator)[None]
            ctx = _Context(visible, positions, None, cfg.tokens_per_frame)
            self._forward(clean, 0.0, ctx, kv)
        for frame in ctx.frames():  # the cache fills the sink first, then rolls
            if len(self.sink) < cfg.sink_size:
                self.sink.append(frame)
            else:
                self.rolling.append(frame)
        self.rolling = self.rolling[max(0, len(self.rolling) - (self.local - cfg.sink_size)) :]
        self.latents.extend(clean[0].unbind(1))
        return clean[0]


class _RecacheContext(_Context):
    """The re-cache pass: keys are the kept sink and the input frames past the ``skipped`` first ones."""

    def __init__(self, sink: list[Frame], positions: list[int], mask: torch.Tensor | None, tokens: int,
                 skipped: int) -> None:  # fmt: skip
        super().__init__(sink, positions, mask, tokens)
        self.skipped = skipped
        self.key_positions = torch.tensor([[f.position for f in sink] + positions[skipped:]])

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.new[layer] = (k[0], v[0])
        cut = self.skipped * self.tokens
        ks = [f.k[layer] for f in self.visible] + [k[0, cut:]]
        vs = [f.v[layer] for f in self.visible] + [v[0, cut:]]
        return torch.cat(ks)[None], torch.cat(vs)[None]
