"""What a pipeline declares about its KV cache; the pool is sized from this alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


class SpecError(ValueError):
    """A KV cache spec is inconsistent; the message says what was expected."""


@dataclass(frozen=True)
class KVBranch:
    """One independent KV history per session, e.g. CFG's ``cond`` and ``uncond``.

    ``local_index`` is the branch's position in the pipeline's batch, so a
    pipeline can map a batch row to the branch whose history it reads.
    """

    name: str
    local_index: int


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV shape a pipeline needs per session.

    One pool block holds one frame's tokens for every layer (a *latent*
    frame: the KV unit, which need not be what the client sees). A chunk
    attends to the ``sink_frames`` first frames plus the last
    ``window_frames`` frames *including itself*, as vLLM-Omni's runner and
    Matrix-Game's ``local_attn_size`` count it; so between chunks a session
    keeps ``sink_frames`` blocks forever plus the last
    :attr:`history_window_frames` (``window_frames - frames_per_chunk``)
    blocks, per branch. ``reset_at_boundary`` keeps only the sink between
    chunks: each chunk sees the sink and itself, the window is dropped at every
    chunk boundary (vLLM-Omni's meaning, ``chunk_window_skipped_tokens``; the
    conformance suite checks both runtimes agree).

    ``max_position_frames`` is the length (in frames) of the model's rotary
    table, when it has one: the positions :meth:`SessionKVState.frame_positions`
    hands out then stay below it however long a session runs (see there).
    ``model_owned_bytes_per_session`` is state the pipeline keeps per session
    besides the KV (e.g. a streaming VAE decoder's feature cache, action
    caches); it is counted in capacity like the KV. ``model_owned_bytes_fixed``
    is state the pipeline keeps once, however many sessions run, that the
    pool must leave room for (LongLive's cached prompts no session uses);
    ``model_owned_bytes_per_forward_row`` is state a forward holds per batch
    row while it runs, beyond the session's own (LongLive: the prompt a
    switching row moves to, held beside the old one until the chunk commits).
    Both are counted once in the plan's fixed bytes, the second per batch row. ``history_rewrites``
    declares that a forward may rewrite the committed history
    (:meth:`SessionKVState.begin_rewrite`, LongLive's re-cache): the pool then
    counts a rewrite's fresh blocks per batch row, and rewind points that may
    each hold a history of their own (see :func:`~arstream.runner.pool.session_frames`).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    tokens_per_frame: int
    frames_per_chunk: int
    sink_frames: int
    window_frames: int
    kv_branches: tuple[KVBranch, ...] = (KVBranch("main", 0),)
    session_capacity: int = 64
    cross_attention_lengths: Mapping[str, int] = field(default_factory=dict)
    model_owned_bytes_per_session: int = 0
    model_owned_bytes_fixed: int = 0
    model_owned_bytes_per_forward_row: int = 0
    reset_at_boundary: bool = False
    dtype: torch.dtype = torch.float32
    max_position_frames: int | None = None
    history_rewrites: bool = False

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_kv_heads",
            "head_size",
            "tokens_per_frame",
            "frames_per_chunk",
            "window_frames",
            "session_capacity",
        ):
            _positive(name, getattr(self, name))
        if not isinstance(self.sink_frames, int) or self.sink_frames < 0:
            raise SpecError(f"sink_frames must be an integer >= 0, got {self.sink_frames!r}")
        if self.window_frames < self.frames_per_chunk:
            raise SpecError(
                f"window_frames ({self.window_frames}) must hold at least one chunk "
                f"(frames_per_chunk={self.frames_per_chunk}): the window counts the current chunk"
            )
        if not self.kv_branches:
            raise SpecError("kv_branches must name at least one branch")
        names = [b.name for b in self.kv_branches]
        if len(set(names)) != len(names):
            raise SpecError(f"kv_branches names must be unique, got {names}")
        indices = sorted(b.local_index for b in self.kv_branches)
        if indices != list(range(len(indices))):
            raise SpecError(f"kv_branches local_index values must be 0..{len(indices) - 1}, got {indices}")
        for name, length in self.cross_attention_lengths.items():
            _positive(f"cross_attention_lengths[{name!r}]", length)
        for name in ("model_owned_bytes_per_session", "model_owned_bytes_fixed", "model_owned_bytes_per_forward_row"):
            if getattr(self, name) < 0:
                raise SpecError(f"{name} must be >= 0")
        if self.max_position_frames is not None and self.max_position_frames < self.sink_frames + self.window_frames:
            raise SpecError(
                f"max_position_frames ({self.max_position_frames}) must hold the sink and the window "
                f"({self.sink_frames} + {self.window_frames} frames)"
            )
        if not self.dtype.is_floating_point:
            raise SpecError(f"dtype must be a floating point dtype, got {self.dtype}")

    @property
    def branch_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.kv_branches)

    @property
    def history_window_frames(self) -> int:
        """Non-sink frames a session keeps between chunks: the window minus the chunk itself."""
        return self.window_frames - self.frames_per_chunk

    @property
    def resident_frames(self) -> int:
        """Frames a session keeps between chunks, per branch."""
        return self.sink_frames + self.history_window_frames

    @property
    def block_bytes(self) -> int:
        """K plus V for one frame's tokens across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.tokens_per_frame * self.num_kv_heads * self.head_size * elem

    @property
    def cross_attention_bytes_per_session(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_size * elem
        return sum(self.cross_attention_lengths.values()) * per_token * len(self.kv_branches)
