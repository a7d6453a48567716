"""LongLivePipeline: the causal Wan T2V DiT, umT5 text and the streaming Wan VAE behind the runner's contract.

The runner owns the self-attention KV (one pool block per latent frame: the
sink's 3, the window's 6 between chunks). The pipeline owns, per session, the
noise generator, the prompt its history is under, the last latent frames
(what a prompt switch re-caches from) and the VAE decoder's feature cache;
all of it changes only once a whole forward succeeded, so a failed batch
leaves every session as it was (generators rewound).

A prompt comes with every tick (``TickRequest.prompt``: the session's
latest; None keeps the one in use). A chunk whose prompt differs from the
session's (cleaned) is a *switch*, LongLive's re-cache: before the chunk,
the latent frames LongLive's cache holds are run once more at t=0 under the
new prompt, every frame seeing every other (no causal mask), and their K/V
replace the history's through the runner's copy-on-write rewrite
(:meth:`SessionKVState.begin_rewrite`). LongLive's cache holds the sink and
the last ``window`` frames (the window counts the chunk, so 9 frames: the
runner keeps only 6 of them between chunks, but all 9 are re-cached, as in
LongLive, and the first 3 shape the other 6 through attention). The sink
keeps the old prompt (LongLive's ``global_sink``), except in a switch within
the first ``sink + window`` frames, where LongLive's cache still starts at
frame 0 and the whole history, sink included, is re-encoded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .base import PromptedPipeline
from .dit import LongLiveDiT, stack_prompt_kv
from .kv import PagedContext
from .prompts import PromptEntry
from .text import TextEncoder
from ..wan.compile import compile_blocks
from ..wan.geometry import backbone_kv_spec
from ..wan.parallel import HeadParallel
from ..wan.sampler import sample_chunk
from ..wan.vae import (
    FeatureCache,
    StreamingVAE,
    export_feature_cache,
    import_feature_cache,
    to_uint8,
)
from ...runner.kv_state import SessionKVState
from ...runner.spec import KVCacheSpec
from ...runner.types import TickRequest

log = logging.getLogger("arstream.models.longlive")


@dataclass(frozen=True)
class _LongLiveSession:
    """What carries over between a session's chunks besides the runner's KV (immutable: replaced on success)."""

    generator: torch.Generator
    prompt: str  # the cleaned prompt the history is under
    latents: torch.Tensor | None = None  # [16, n, h, w]: the last sink + window latent frames, at most
    vae_cache: FeatureCache | None = None


class LongLivePipeline(HeadParallel, PromptedPipeline[_LongLiveSession]):
    """Implements ``ARPipeline``, ``SupportsBatchedChunks``, ``SupportsWarmup`` and ``SupportsSessionTransfer``."""

    def __init__(
        self,
        model: LongLiveDiT,
        vae: StreamingVAE,
        text: TextEncoder,
        *,
        device: torch.device,
        session_capacity: int = 8,
        prompt_cache: int = 4,
        default_prompt: str | None = None,
        kv_dtype: torch.dtype | None = None,
        components: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(model, vae, text, device=device, session_capacity=session_capacity, prompt_cache=prompt_cache,
                         default_prompt=default_prompt, components=components)  # fmt: skip
        self.kv_dtype = self.dtype if kv_dtype is None else kv_dtype
        cfg = self.cfg
        self.latent_bytes = 4 * cfg.out_dim * cfg.local_attn_size * cfg.latent_height * cfg.latent_width

    def compile_forward(self) -> None:
        """``--compile``: the DiT's blocks compiled on their first forward of each shape (the warm-up's)."""
        compile_blocks(self.model, self.device)

    # ---- contract ------------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.cfg
        return backbone_kv_spec(
            cfg,
            self.kv_heads(cfg.num_heads),
            sink_frames=cfg.sink_size,
            window_frames=cfg.window_frames,
            session_capacity=self.session_capacity,
            # the decoder cache, the latents a re-cache reads, and (worst case: its own) one prompt's K/V + tokens
            model_owned_bytes_per_session=self.vae_cache_bytes + self.latent_bytes + self.prompt_bytes,
            # the prompt cache's unreferenced entries (at most ``spare``), and per batch row the prompt a
            # switching row moves to while its old one is still held
            model_owned_bytes_fixed=self.prompts.spare * self.prompt_bytes,
            model_owned_bytes_per_forward_row=self.prompt_bytes,
            dtype=self.kv_dtype,
            max_position_frames=cfg.rope_frames,
            history_rewrites=True,
        )

    def model_card(self) -> dict[str, Any]:
        return {
            "name": self.cfg.model,
            # LongLive's own switch: the history re-cached under the new prompt
            **self._prompted_card(prompt_switch="recache"),
            # seeded random weights (a test set-up): the picture is noise, and the page says why
            **({"weights": "random"} if self.random_weights else {}),
            "components": self.components,
            "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
        }

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        return [TickRequest(session_id=session_id, request_id=i, controls={}) for i in range(2)]

    def session_prompt(self, session_id: str) -> str | None:
        """The cleaned prompt the session's history is under (None: no chunk yet)."""
        session = self._sessions.get(session_id)
        return None if session is None else session.prompt

    # ---- moving a session (SupportsSessionTransfer) -----------------------------------------

    def _export_session(self, session: _LongLiveSession, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        if session.latents is not None:
            tensors["latents"] = session.latents
        return {"prompt": session.prompt, "vae": export_feature_cache(session.vae_cache, tensors)}

    def _import_session(self, generator: torch.Generator, prompt: str, values: dict[str, Any],
                        tensors: dict[str, torch.Tensor]) -> _LongLiveSession:  # fmt: skip
        return _LongLiveSession(generator, prompt, tensors.get("latents"), import_feature_cache(values["vae"], tensors))

    # ---- one chunk for a batch of sessions ----------------------------------------------------

    def _new_session(self, generator: torch.Generator, prompt: str) -> _LongLiveSession:
        return _LongLiveSession(generator=generator, prompt=prompt)

    def _recache(self, state: SessionKVState, latents: torch.Tensor, entry: PromptEntry) -> None:
        """LongLive's re-cache of one session's history under ``entry``'s prompt (a rewrite of its committed KV)."""
        cfg = self.cfg
        committed = state.frame_start
        keep_sink = committed > cfg.local_attn_size  # LongLive's cache no longer starts at frame 0
        frames = cfg.window_frames if keep_sink else committed
        ctx = PagedContext.recache(state, frames, keep_sink, cfg.rope_frames)
        state.begin_rewrite(frames, keep_sink=keep_sink)
        self.model(latents[None, :, -frames:], torch.zeros((1, frames), device=self.device), entry.kv, ctx)
        state.end_pass()

    def _generate(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        cfg = self.cfg
        states = [self.bound_state(t.session_id) for t in ticks]
        sessions = [self._session(t, s.chunk_index) for t, s in zip(ticks, states)]
        generators = [s.generator for s in sessions]
        rewind = [g.get_state() for g in generators]
        fpc = cfg.frames_per_chunk
        shape = (cfg.out_dim, fpc, cfg.latent_height, cfg.latent_width)
        entries: list[PromptEntry] = []  # each row's prompt, referenced for the forward (the session's on success)
        try:
            for t, s in zip(ticks, sessions):
                entries.append(self.prompts.acquire(t.prompt if t.prompt is not None else s.prompt))

            def draw() -> torch.Tensor:
                return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(self.device)

            started = time.perf_counter()
            recaches = 0
            with torch.inference_mode():
                for state, session, entry in zip(states, sessions, entries):
                    if session.latents is not None and entry.text != session.prompt:
                        self._recache(state, session.latents, entry)
                        recaches += 1
                recached = time.perf_counter()
                ctx = PagedContext.chunk(states, fpc, cfg.rope_frames)
                prompt_kv = stack_prompt_kv([e.kv for e in entries])
                latents = sample_chunk(
                    lambda x, t: self.model(x, t, prompt_kv, ctx), ctx, draw(), draw,
                    cfg.denoise_timesteps, cfg.timestep_shift, warp=cfg.warp_timesteps,
                )  # fmt: skip
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                decoded = time.perf_counter()
                videos, caches = self.vae.decode_rows(latents, [s.vae_cache for s in sessions])
                frames_out = [to_uint8(v) for v in videos]
            self.counters.recaches += recaches
            self.counters.recache_s = recached - started
            self.counters.dit_s = decoded - recached
            self.counters.vae_s = time.perf_counter() - decoded
        except BaseException:
            self._undo(generators, rewind, entries)
            raise
        for row, (tick, session, entry) in enumerate(zip(ticks, sessions, entries)):
            history = latents[row] if session.latents is None else torch.cat([session.latents, latents[row]], dim=1)
            self._drop(tick.session_id)  # the old history's reference; the forward's becomes the session's
            self._sessions[tick.session_id] = _LongLiveSession(
                session.generator, entry.text, history[:, -cfg.local_attn_size :].clone(), caches[row]
            )
            self.last_latents[tick.session_id] = latents[row]
        return frames_out
