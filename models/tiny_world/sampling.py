"""The few-step chunk sampler and the KV sources it runs against.

:func:`sample_chunk` is the whole generation recipe for one chunk: a few
non-committing denoising passes predicting the clean frames, then one
committing pass that writes the finished chunk, re-noised to the context noise
level, into the KV history. The pipeline runs it against the runner's paged
pool (:class:`PagedKV`); training runs it (and its own teacher-forced passes)
against :class:`DenseChunkKV`, a batched in-memory history with the same
sink + sliding-window rule, so what is trained is what is served. Batched
server sessions run against :class:`PagedKVRows`: one row per session, each
with its own history, frame positions and noise generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .decoder import decode_chunk
from .model import TinyWorldConfig, TinyWorldDiT
from ...runner.kv_state import SessionKVState, write_and_gather_rows

# One generator for the whole batch (training), one per row (batched server sessions, so a
# session's noise does not depend on who it shares a forward with), or None (global RNG).
Noise = torch.Generator | Sequence[torch.Generator] | None


class ChunkKV(Protocol):
    """What the sampler needs from a KV history."""

    def chunk_positions(self, frames_per_chunk: int) -> torch.Tensor:
        """Absolute frame indices of the chunk: ``[F]`` shared by every row, or ``[B, F]`` per row."""

    def begin_pass(self, *, commit: bool) -> None: ...

    def kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def end_pass(self) -> None: ...


class PagedKV:
    """Adapts the runner's :class:`SessionKVState` (one session, batch 1) to :class:`ChunkKV`."""

    def __init__(self, state: SessionKVState) -> None:
        self.state = state

    def chunk_positions(self, frames_per_chunk: int) -> torch.Tensor:
        return torch.arange(self.state.frame_start, self.state.frame_start + frames_per_chunk)

    def begin_pass(self, *, commit: bool) -> None:
        self.state.begin_pass(commit=commit)

    def kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_all, v_all = self.state.write_and_gather(layer, k[0], v[0])
        return k_all[None], v_all[None]

    def end_pass(self) -> None:
        self.state.end_pass()


class PagedKVRows:
    """Adapts several sessions' :class:`SessionKVState` (row ``i`` = ``states[i]``) to :class:`ChunkKV`.

    The sessions' histories must be equally long (the runner batches only
    such sessions); their frame positions may differ.
    """

    def __init__(self, states: Sequence[SessionKVState]) -> None:
        self.states = list(states)

    def chunk_positions(self, frames_per_chunk: int) -> torch.Tensor:
        return torch.stack([torch.arange(s.frame_start, s.frame_start + frames_per_chunk) for s in self.states])

    def begin_pass(self, *, commit: bool) -> None:
        for state in self.states:
            state.begin_pass(commit=commit)

    def kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return write_and_gather_rows(self.states, layer, k, v)

    def end_pass(self) -> None:
        for state in self.states:
            state.end_pass()


class DenseChunkKV:
    """Batched per-frame K/V history with the runner's sink + window rule, kept in autograd.

    A pass may run ``R = m * batch`` rows (e.g. a noisy query copy and a
    context copy of the same chunk); every row sees the same history, and on
    a committing pass only the rows in ``commit_rows`` become history.
    """

    def __init__(self, cfg: TinyWorldConfig, batch: int, frame_start: int = 0) -> None:
        self.cfg = cfg
        self.batch = batch
        self._frame_start = frame_start
        # each entry is one frame: per layer (k, v) with shape [batch, tokens, heads, head_size]
        self.sink: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.window: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._commit = False
        self._commit_rows: slice = slice(None)
        self._visible: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    @property
    def frame_start(self) -> int:
        return self._frame_start

    def chunk_positions(self, frames_per_chunk: int) -> torch.Tensor:
        return torch.arange(self._frame_start, self._frame_start + frames_per_chunk)

    def jump_to(self, frame_start: int) -> None:
        """Continue at a later absolute frame, dropping the window (as if it had slid past)."""
        self.window = []
        self._frame_start = frame_start

    def begin_pass(self, *, commit: bool, commit_rows: slice = slice(None)) -> None:
        self._commit = commit
        self._commit_rows = commit_rows
        self._pending = []
        frames = self.sink + self.window
        self._visible = []
        for layer in range(self.cfg.num_layers):
            if frames:
                k = torch.cat([f[layer][0] for f in frames], dim=1)
                v = torch.cat([f[layer][1] for f in frames], dim=1)
                self._visible.append((k, v))
            else:
                self._visible.append(None)

    def kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._commit:
            self._pending.append((k[self._commit_rows], v[self._commit_rows]))
        history = self._visible[layer]
        if history is None:
            return k, v
        hk, hv = history
        repeat = k.shape[0] // hk.shape[0]
        if repeat > 1:
            hk, hv = hk.repeat(repeat, 1, 1, 1), hv.repeat(repeat, 1, 1, 1)
        return torch.cat([hk, k], dim=1), torch.cat([hv, v], dim=1)

    def end_pass(self) -> None:
        self._visible = []
        if not self._commit:
            return
        tokens = self.cfg.tokens_per_frame
        for f in range(self.cfg.frames_per_chunk):
            frame = [(k[:, f * tokens : (f + 1) * tokens], v[:, f * tokens : (f + 1) * tokens]) for k, v in self._pending]
            if len(self.sink) < self.cfg.sink_frames:
                self.sink.append(frame)
            else:
                self.window.append(frame)
        del self.window[: max(len(self.window) - self.cfg.history_frames, 0)]
        self._pending = []
        self._frame_start += self.cfg.frames_per_chunk

    def detach(self) -> None:
        """Cut the history out of the autograd graph."""
        self.sink = [[(k.detach(), v.detach()) for k, v in f] for f in self.sink]
        self.window = [[(k.detach(), v.detach()) for k, v in f] for f in self.window]


def chunk_positions(kv: ChunkKV, cfg: TinyWorldConfig) -> torch.Tensor:
    return kv.chunk_positions(cfg.frames_per_chunk)


def noise_like(shape: tuple[int, ...], generator: Noise, device: torch.device) -> torch.Tensor:
    """Gaussian noise drawn on the CPU generator(s) (so a seed means the same frames on any device).

    With one generator per row, row ``i`` gets exactly the numbers a batch of
    one would draw from ``generator[i]``.
    """
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} generators for a batch of {shape[0]} rows")
    return torch.stack([torch.randn(shape[1:], generator=g) for g in generator]).to(device)


def canvas_origin(x: int, y: int, patch_size: int) -> tuple[int, int, int, int]:
    """For a camera at pixel ``(x, y)``: the world cell of the canvas's corner and the view's offset in it."""
    return x // patch_size, y // patch_size, x % patch_size, y % patch_size


def crop_view(canvas: torch.Tensor, offset_x: int, offset_y: int, view: int) -> torch.Tensor:
    """The ``view x view`` camera image inside a canvas ``[..., C, C, 3]``."""
    return canvas[..., offset_y : offset_y + view, offset_x : offset_x + view, :]


def commit_chunk(
    model: TinyWorldDiT,
    kv: ChunkKV,
    clean: torch.Tensor,
    direction: torch.Tensor,
    cell_origins: torch.Tensor,
    generator: Noise,
) -> None:
    """Write clean canvases ``[B, F, C, C, 3]`` into the history at the context noise level."""
    cfg = model.cfg
    level = cfg.context_noise
    noisy = (1 - level) * clean + level * noise_like(tuple(clean.shape), generator, clean.device)
    t = torch.full(direction.shape, level, device=clean.device)
    kv.begin_pass(commit=True)
    model(noisy, t, direction, chunk_positions(kv, cfg).to(clean.device), cell_origins, kv.kv, output_rows=0)
    kv.end_pass()


def estimate_chunk(
    model: TinyWorldDiT,
    kv: ChunkKV,
    direction: torch.Tensor,
    cell_origins: torch.Tensor,
    generator: Noise,
) -> torch.Tensor:
    """The few-step sampler's clean-canvas estimate ``[B, F, C, C, 3]`` of the next chunk; commits nothing.

    ``direction`` ``[B, F]`` holds each frame's camera direction index and
    ``cell_origins`` ``[B, F, 2]`` the world cell of each canvas's corner.
    """
    cfg = model.cfg
    shape = (direction.shape[0], cfg.frames_per_chunk, cfg.canvas_size, cfg.canvas_size, 3)
    device = direction.device
    positions = chunk_positions(kv, cfg).to(device)
    x = noise_like(shape, generator, device)
    times = cfg.denoise_times
    clean = x
    for i, t in enumerate(times):
        kv.begin_pass(commit=False)
        t_frames = torch.full(direction.shape, t, device=device)
        clean = model(x, t_frames, direction, positions, cell_origins, kv.kv).clamp(-1, 1)
        kv.end_pass()
        if i + 1 < len(times):
            t_next = times[i + 1]
            if cfg.sampler == "ddim":
                eps = (x - (1 - t) * clean) / t
            else:
                eps = noise_like(shape, generator, device)
            x = (1 - t_next) * clean + t_next * eps
    return clean


def sample_chunk(
    model: TinyWorldDiT,
    kv: ChunkKV,
    direction: torch.Tensor,
    cell_origins: torch.Tensor,
    generator: Noise,
    previous: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Generate and commit one chunk; returns its clean canvases ``[B, F, C, C, 3]`` in [-1, 1].

    The estimate of :func:`estimate_chunk`; a model with a frame decoder
    decodes it before it is returned and committed, and ``previous`` is then
    each row's last decoded canvas ``[B, C, C, 3]`` and its corner cell
    ``[B, 2]`` (None: every row starts a rollout).
    """
    cfg = model.cfg
    clean = estimate_chunk(model, kv, direction, cell_origins, generator)
    if cfg.decoder_channels:
        last, last_cells = previous if previous is not None else (None, None)
        clean = decode_chunk(
            model.decoder,
            clean,
            cell_origins,
            last,
            last_cells,
            cfg.patch_size,
            cfg.decoder_keep_logit,
            cfg.decoder_class_bias,
            cfg.decoder_unseen_window,
            cfg.decoder_view_prior,
        )
    commit_chunk(model, kv, clean, direction, cell_origins, generator)
    return clean


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    return ((frames.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def from_uint8(frames: torch.Tensor) -> torch.Tensor:
    return frames.float() / 127.5 - 1
