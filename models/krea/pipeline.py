"""KreaPipeline: Krea Realtime's chunk loop (a recomputed context, a blended prompt) behind the runner's contract.

Krea Realtime keeps no K/V from one chunk to the next. Before each chunk
(after the first) it recomputes the K/V of a 3-latent-frame context at t=0,
the frames seeing each other, under the conditioning the previous chunk ran
under; the chunk then sees that context and itself. Here that recompute is
the runner's history rewrite (:meth:`SessionKVState.begin_rewrite`, as
LongLive's re-cache): the rewritten frames replace the history only when the
chunk commits, so a failed forward leaves the session as it was, a rewind
point keeps its own, and a snapshot carries them. The context is the last
chunk's latents, except that from the third chunk on its first frame is the
9th-last decoded video frame encoded again by the VAE's encoder (a first
frame, as the model was trained to see a sequence start), not the latent
itself. Positions are the window's own (context 0..2, chunk 3..5), as Krea
rotates them, so a session never reaches the end of the rotary table.

A prompt change is blended, Krea's way: the umT5 outputs (padded to 512
tokens) are interpolated from what the last chunk ran under to the new
prompt's over ``prompt_blend_chunks`` chunks with weights
``linspace(0, 1, n)`` (the first blended chunk is still the old prompt's; a
change during a blend starts a new one from where it is). While a blend runs
the chunk's cross-attention K/V are computed from the blended outputs; once it
ends the prompt's shared K/V are used again (the same values).

Per session the pipeline owns the noise generator, the prompt it moves to
(one reference in the shared prompt cache), the blend's state, the last
chunk's latents, the re-encoded context frame and the VAE decoder's feature
cache; all of it changes only once a whole forward succeeded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import KreaConfig
from ..longlive.base import PromptedPipeline
from ..longlive.dit import LongLiveDiT, PromptKV, stack_prompt_kv
from ..longlive.kv import BoundRowsContext
from ..longlive.prompts import PromptEntry
from ..longlive.text import TextEncoder
from ..wan.geometry import backbone_kv_spec
from ..wan.parallel import HeadParallel
from ..wan.sampler import scheduler_sigma
from ..wan.vae import FeatureCache, StreamingVAE, export_feature_cache, import_feature_cache, to_uint8
from ...runner.kv_state import SessionKVState
from ...runner.spec import KVCacheSpec
from ...runner.types import TickRequest

# decoded video frames Krea keeps to re-encode the context's first frame from (``1 + (3 - 1) * 4``): the oldest
REENCODED_FRAME_FROM_END = 9


def denoising_schedule(steps: int, shift: float) -> tuple[list[float], list[float]]:
    """Krea's ``get_denoising_schedule`` at strength 1: ``steps`` timesteps from 1000 to 0 on the scheduler's shifted
    grid (0 appended), and the sigma each noises and denoises with (the grid's nearest: t=0 gets its last)."""
    grid = torch.linspace(1.0, 0.0, 1001)[:-1]
    timesteps = torch.cat([shift * grid / (1 + (shift - 1) * grid) * 1000, torch.zeros(1)])
    picked = timesteps[1000 - torch.linspace(1000, 0, steps).to(torch.long)]
    fed = [float(t) for t in picked]
    return fed, [scheduler_sigma(t, shift) for t in fed]


@dataclass(frozen=True)
class _KreaSession:
    """What carries over between a session's chunks besides the runner's KV (immutable: replaced on success)."""

    generator: torch.Generator
    prompt: str  # the cleaned prompt the session is under, or moves to in a blend (its entry referenced)
    blended: torch.Tensor | None = None  # umT5 outputs [text_len, text_dim] the last chunk ran under in a blend
    blend_from: torch.Tensor | None = None  # where the blend started
    blend_step: int = 0  # the blend's last chunk: weight linspace(0, 1, n)[blend_step]
    latents: torch.Tensor | None = None  # the last chunk's latents [16, F, h, w]
    first_context: torch.Tensor | None = None  # the re-encoded 9th-last video frame [16, 1, h, w]
    vae_cache: FeatureCache | None = None


class WindowContext(BoundRowsContext):
    """Self-attention over one forward's bound sessions at the window's own positions (context 0..C-1, then chunk)."""

    def __init__(self, states: Sequence[SessionKVState], keys: int, queries: int) -> None:
        self.states = list(states)
        device = states[0].device
        self.key_positions = torch.arange(keys, device=device)[None].expand(len(states), keys)
        self.query_positions = self.key_positions[:, keys - queries :]


class KreaPipeline(HeadParallel, PromptedPipeline[_KreaSession]):
    """Implements ``ARPipeline``, ``SupportsBatchedChunks``, ``SupportsWarmup`` and ``SupportsSessionTransfer``."""

    cfg: KreaConfig

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
        components: list[dict[str, Any]] | None = None,
    ) -> None:
        cfg: KreaConfig = model.cfg  # type: ignore[assignment]
        if cfg.context_frames != cfg.frames_per_chunk:
            raise ValueError("Krea's recomputed context is one chunk long here (its masks assume so)")
        super().__init__(model, vae, text, device=device, session_capacity=session_capacity, prompt_cache=prompt_cache,
                         default_prompt=default_prompt, components=components)  # fmt: skip
        self.timesteps, self.sigmas = denoising_schedule(cfg.denoising_steps, cfg.timestep_shift)
        elem = torch.empty((), dtype=self.dtype).element_size()
        latent_frame = 4 * cfg.out_dim * cfg.latent_height * cfg.latent_width
        # the last chunk, the re-encoded frame, and a blend's two umT5 outputs
        self.owned_bytes = (cfg.frames_per_chunk + 1) * latent_frame + 2 * cfg.text_len * cfg.text.dim * elem

    # ---- contract ------------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.cfg
        return backbone_kv_spec(
            cfg,
            self.kv_heads(cfg.num_heads),
            sink_frames=0,
            window_frames=cfg.window_frames,
            session_capacity=self.session_capacity,
            model_owned_bytes_per_session=self.vae_cache_bytes + self.owned_bytes + self.prompt_bytes,
            model_owned_bytes_fixed=self.prompts.spare * self.prompt_bytes,
            # per batch row: the prompt a changing row moves to, and a blended chunk's own cross-attention K/V
            model_owned_bytes_per_forward_row=2 * self.prompt_bytes,
            dtype=self.dtype,
            history_rewrites=True,
        )

    def model_card(self) -> dict[str, Any]:
        return {
            "name": self.cfg.model,
            "description": "Krea Realtime: Wan2.1-T2V distilled with Self-Forcing; prompt changes blend over chunks",
            **self._prompted_card(prompt_switch="blend"),
            "components": self.components,
            # seeded random weights (a test set-up): the picture is noise, and the page says why
            **({"weights": "random"} if self.random_weights else {}),
        }

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        return [TickRequest(session_id=session_id, request_id=i, controls={}) for i in range(3)]

    # ---- moving a session (SupportsSessionTransfer) -----------------------------------------

    def _export_session(self, session: _KreaSession, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        for name in ("blended", "blend_from", "latents", "first_context"):
            value = getattr(session, name)
            if value is not None:
                tensors[name] = value
        return {"prompt": session.prompt, "blend_step": session.blend_step,
                "vae": export_feature_cache(session.vae_cache, tensors)}  # fmt: skip

    def _import_session(self, generator: torch.Generator, prompt: str, values: dict[str, Any],
                        tensors: dict[str, torch.Tensor]) -> _KreaSession:  # fmt: skip
        t = tensors
        return _KreaSession(
            generator, prompt, t.get("blended"), t.get("blend_from"), int(values["blend_step"]),
            t.get("latents"), t.get("first_context"), import_feature_cache(values["vae"], t),
        )  # fmt: skip

    # ---- one chunk for a batch of sessions ----------------------------------------------------

    def _new_session(self, generator: torch.Generator, prompt: str) -> _KreaSession:
        return _KreaSession(generator=generator, prompt=prompt)

    def _padded(self, entry: PromptEntry) -> torch.Tensor:
        """A prompt's umT5 outputs padded with zeros to ``text_len`` (what Krea blends)."""
        padded = entry.tokens.new_zeros(self.cfg.text_len, self.cfg.text.dim)
        padded[: entry.tokens.shape[0]] = entry.tokens[: self.cfg.text_len]
        return padded

    def _conditioning(self, session: _KreaSession, entry: PromptEntry, first: bool) -> _KreaSession:
        """The session with this chunk's conditioning: the prompt's own, or the blend's next step."""
        n = self.cfg.prompt_blend_chunks
        if first or (entry.text == session.prompt and session.blend_from is None):
            return _KreaSession(session.generator, entry.text, latents=session.latents,
                                first_context=session.first_context, vae_cache=session.vae_cache)  # fmt: skip
        if entry.text != session.prompt:  # a new blend, from what the last chunk ran under
            start = session.blended if session.blended is not None else self._padded(self.prompts.get(session.prompt))
            step = 0
        else:
            assert session.blend_from is not None
            start, step = session.blend_from, session.blend_step + 1
        if step == n - 1:  # the blend's last chunk is the prompt's own outputs (lerp at weight 1 gives them)
            return _KreaSession(session.generator, entry.text, latents=session.latents,
                                first_context=session.first_context, vae_cache=session.vae_cache)  # fmt: skip
        weight = torch.linspace(0, 1, n)[step].to(start.dtype)
        blended = torch.lerp(start, self._padded(entry), weight)
        return _KreaSession(session.generator, entry.text, blended, start, step, session.latents,
                            session.first_context, session.vae_cache)  # fmt: skip

    def _cross_kv(self, session: _KreaSession, entry: PromptEntry) -> PromptKV:
        return entry.kv if session.blended is None else self._project(session.blended)

    def _recompute(self, state: SessionKVState, session: _KreaSession, kv: PromptKV) -> None:
        """Krea's ``recompute_kv_cache``: the context's K/V at t=0, rewritten into the session's history."""
        cfg = self.cfg
        latents = session.latents
        assert latents is not None
        rest = latents[:, -(cfg.context_frames - 1) :]
        first = latents[:, :1] if session.first_context is None else session.first_context
        context = torch.cat([first, rest], dim=1)[None]
        frames = context.shape[2]
        state.begin_rewrite(frames, keep_sink=True)  # no sink: the whole window is rewritten
        ctx = WindowContext([state], frames, frames)
        self.model(context.to(self.device), torch.zeros((1, frames), device=self.device), kv, ctx)
        state.end_pass()

    def _generate(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        cfg = self.cfg
        states = [self.bound_state(t.session_id) for t in ticks]
        before = [self._session(t, s.chunk_index) for t, s in zip(ticks, states)]
        generators = [s.generator for s in before]
        rewind = [g.get_state() for g in generators]
        fpc = cfg.frames_per_chunk
        shape = (cfg.out_dim, fpc, cfg.latent_height, cfg.latent_width)
        entries: list[PromptEntry] = []
        try:
            for t, s in zip(ticks, before):
                entries.append(self.prompts.acquire(t.prompt if t.prompt is not None else s.prompt))
            started = time.perf_counter()
            with torch.inference_mode():
                for state, session in zip(states, before):
                    if session.latents is not None:  # the context under what the last chunk ran under
                        previous = self.prompts.get(session.prompt)
                        self._recompute(state, session, self._cross_kv(session, previous))
                recomputed = time.perf_counter()
                sessions = [self._conditioning(s, e, s.latents is None) for s, e in zip(before, entries)]
                prompt_kv = stack_prompt_kv([self._cross_kv(s, e) for s, e in zip(sessions, entries)])
                keys = len(states[0].frame_positions())
                ctx = WindowContext(states, keys, fpc)

                def draw() -> torch.Tensor:
                    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(self.device)

                x = draw()
                clean = x
                last = len(self.timesteps) - 1
                for i, (fed, sigma) in enumerate(zip(self.timesteps, self.sigmas)):
                    ctx.begin_pass(commit=i == last)  # the t=0 pass's K/V stand until the next recompute
                    flow = self.model(x, torch.full((len(ticks), fpc), fed, device=self.device), prompt_kv, ctx)
                    ctx.end_pass()
                    clean = x - sigma * flow
                    if i < last:
                        following = self.sigmas[i + 1]
                        x = (1 - following) * clean + following * draw()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                decoded = time.perf_counter()
                videos, caches = self.vae.decode_rows(clean, [s.vae_cache for s in sessions])
                frames_out = [to_uint8(v) for v in videos]
                reencoded = [
                    self.vae.encode_step(v[:, :, -REENCODED_FRAME_FROM_END:][:, :, :1], None)[0]
                    if v.shape[2] >= REENCODED_FRAME_FROM_END + 3 else None  # from the second chunk on
                    for v in videos
                ]  # fmt: skip
            self.counters.recache_s = recomputed - started
            self.counters.dit_s = decoded - recomputed
            self.counters.vae_s = time.perf_counter() - decoded
        except BaseException:
            self._undo(generators, rewind, entries)
            raise
        for row, (tick, session) in enumerate(zip(ticks, sessions)):
            self._drop(tick.session_id)  # the old prompt's reference; the forward's becomes the session's
            self._sessions[tick.session_id] = _KreaSession(
                session.generator, session.prompt, session.blended, session.blend_from, session.blend_step,
                clean[row].clone(), reencoded[row], caches[row],
            )  # fmt: skip
            self.last_latents[tick.session_id] = clean[row]
        return frames_out
