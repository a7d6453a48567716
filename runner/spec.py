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

    ``strided_window_frames`` (with ``frame_stride``) keeps a sparse tail
    behind the dense window: of the last ``strided_window_frames`` frames
    (counting the current chunk, as ``window_frames`` does) a session also
    keeps those whose *absolute* index is a multiple of ``frame_stride``; every
    other frame is freed when it leaves the dense window. A model whose layers
    see different windows (a few global layers over a long dilated window,
    local layers over a short dense one) keeps only what some layer reads and
    masks per layer (:meth:`SessionKVState.history_frame_indexes` says which
    frames it got). The kept set is a function of the frame counter alone
    (:func:`kept_history`), so snapshots, rewind points and parked sessions
    carry no more than before. 0 (the default): no strided tail.
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
    strided_window_frames: int = 0
    frame_stride: int = 1

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
        self._check_strided_tail()
        widest = max(self.window_frames, self.strided_window_frames)
        if self.max_position_frames is not None and self.max_position_frames < self.sink_frames + widest:
            raise SpecError(
                f"max_position_frames ({self.max_position_frames}) must hold the sink and the widest window "
                f"({self.sink_frames} + {widest} frames)"
            )
        if not self.dtype.is_floating_point:
            raise SpecError(f"dtype must be a floating point dtype, got {self.dtype}")

    def _check_strided_tail(self) -> None:
        _positive("frame_stride", self.frame_stride)
        strided = self.strided_window_frames
        if not isinstance(strided, int) or isinstance(strided, bool) or strided < 0:
            raise SpecError(f"strided_window_frames must be an integer >= 0, got {strided!r}")
        if not strided:
            if self.frame_stride != 1:
                raise SpecError(f"frame_stride ({self.frame_stride}) needs a strided_window_frames to apply to")
            return
        if self.frame_stride < 2:
            raise SpecError("a strided window needs frame_stride >= 2 (a stride of 1 is a wider dense window)")
        if strided % self.frame_stride:
            raise SpecError(
                f"strided_window_frames ({strided}) must be a multiple of frame_stride ({self.frame_stride})"
            )
        if strided <= self.window_frames:
            raise SpecError(
                f"strided_window_frames ({strided}) must be wider than the dense window_frames ({self.window_frames})"
            )
        if self.history_rewrites:
            raise SpecError(
                "a strided window cannot go with history_rewrites: a rewrite recomputes a contiguous window, "
                "and the frames a strided tail kept would no longer be the ones it saw"
            )
        if self.reset_at_boundary:
            raise SpecError("a strided window cannot go with reset_at_boundary: that keeps no window between chunks")

    @property
    def branch_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.kv_branches)

    @property
    def history_window_frames(self) -> int:
        """Non-sink frames a session keeps between chunks: the window minus the chunk itself."""
        return self.window_frames - self.frames_per_chunk

    @property
    def strided_history_frames(self) -> int:
        """Frames back (before the current chunk) the strided tail reaches; 0 without one."""
        return max(0, self.strided_window_frames - self.frames_per_chunk)

    @property
    def resident_frames(self) -> int:
        """The most frames a session keeps between chunks, per branch: the sink, the dense window and, in the
        strided tail's worst phase, its multiples of the stride beyond the dense window."""
        strided = -(-(self.strided_history_frames - self.history_window_frames) // self.frame_stride)
        return self.sink_frames + self.history_window_frames + (strided if self.strided_window_frames else 0)

    @property
    def kept_window_text(self) -> str:
        """The frames a session keeps between chunks, in words (the runner's log, `arstream plan`)."""
        kept = f"its first {self.sink_frames} and last {self.history_window_frames} frames"
        if self.strided_window_frames:
            kept += (f", and of the last {self.strided_history_frames} the frames whose index is a multiple of "
                     f"{self.frame_stride}")
        return kept

    def kept_history(self, first: int, committed: int) -> list[int]:
        """Absolute indexes of the non-sink frames kept between chunks once ``committed`` frames are (frames
        before ``first`` are the sink's): see :func:`kept_history`."""
        if self.reset_at_boundary:
            return []
        return kept_history(
            first, committed, self.history_window_frames, self.strided_history_frames, self.frame_stride
        )

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


def kept_history(first: int, committed: int, history: int, strided_history: int = 0, stride: int = 1) -> list[int]:
    """Absolute indexes, ascending, of the frames from ``first`` on a session keeps once ``committed`` frames are.

    The dense window's last ``history`` frames, and before them, within the last
    ``strided_history`` frames, those whose index is a multiple of ``stride``.
    """
    dense_start = max(first, committed - history)
    strided_start = max(first, committed - strided_history)
    strided_start += -strided_start % stride
    strided = range(strided_start, dense_start, stride) if strided_history > history else range(0)
    return [*strided, *range(dense_start, committed)]
