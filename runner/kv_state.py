"""One session's view of the paged pool, handed to a pipeline for one forward.

A chunk is produced by several forward *passes*: denoising passes write the
chunk's K/V to the pool's scratch (staging area) and leave the timeline alone;
the one committing pass also copies them into freshly allocated blocks and
advances it. The session's history is gathered from its blocks into the
staging area once per chunk, so every pass reads contiguous K/V. Frame
positions are absolute and keep counting after old frames leave the window,
so a pipeline can apply RoPE with :attr:`frame_start`.

Use from a pipeline, per chunk::

    for step in steps:
        state.begin_pass(commit=False)
        ... per layer: k_all, v_all = state.write_and_gather(layer, k, v)
        state.end_pass()
    state.begin_pass(commit=True)
    ...
    state.end_pass()
"""

from __future__ import annotations

import torch

from runner.pool import PagedKVPool


class PassStateError(RuntimeError):
    """A pass method was called out of order; the message names the expected call."""


class SessionKVState:
    """Block tables (per branch) and the frame counter of one session."""

    def __init__(self, pool: PagedKVPool, session_id: str) -> None:
        self.pool = pool
        self.spec = pool.spec
        self.session_id = session_id
        self.sink: dict[str, list[int]] = {b: [] for b in self.spec.branch_names}
        self.window: dict[str, list[int]] = {b: [] for b in self.spec.branch_names}
        self.pending: dict[str, list[int]] = {b: [] for b in self.spec.branch_names}
        self.frames_committed = 0
        self.chunks_committed = 0
        self.released = False
        self._in_pass = False
        self._commit = False
        # Bumped whenever the block tables change, so stale staging is regathered.
        self._history_version = 0
        self._history_tokens = 0
        self._chunk_tokens = self.spec.frames_per_chunk * self.spec.tokens_per_frame
        self._chunk_shape = (self.spec.frames_per_chunk, self.spec.tokens_per_frame)
        self.cross_slot: int | None = pool.allocate_slot() if self.spec.cross_attention_lengths else None
        self.cross_written: set[str] = set()

    # ---- what a pipeline reads -------------------------------------------------

    @property
    def frame_start(self) -> int:
        """Absolute index of the current chunk's first frame (for RoPE)."""
        return self.frames_committed

    @property
    def chunk_index(self) -> int:
        return self.chunks_committed

    def history_frames(self, branch: str = "main") -> int:
        """Frames of history visible to the current chunk."""
        return len(self.sink[branch]) + len(self.window[branch])

    # ---- passes -----------------------------------------------------------------

    def begin_pass(self, *, commit: bool) -> None:
        if self.released:
            raise PassStateError(f"session {self.session_id!r} was released; no pass can begin")
        if self._in_pass:
            raise PassStateError("begin_pass called twice; expected end_pass first")
        spec = self.spec
        if commit and spec.reset_at_boundary and self.history_frames(spec.branch_names[0]) + (
            spec.frames_per_chunk
        ) > spec.resident_frames:
            self._drop_history()
        owner = (id(self), self._history_version)
        if self.pool.staging_owner != owner:
            self._gather_history()
            self.pool.staging_owner = owner
        if commit:
            for branch in spec.branch_names:
                self.pending[branch] = self.pool.allocate(spec.frames_per_chunk)
        self._commit = commit
        self._in_pass = True

    def _gather_history(self) -> None:
        """Copy sink + window blocks (all layers, K and V) into the staging area."""
        spec = self.spec
        for branch in spec.branch_names:
            history = self.sink[branch] + self.window[branch]
            self._history_tokens = len(history) * spec.tokens_per_frame
            if history:
                index = torch.tensor(history, dtype=torch.long, device=self.pool.device)
                gathered = self.pool.kv.index_select(2, index)
                self.pool.staging[branch][:, :, : self._history_tokens] = gathered.flatten(2, 3)

    def write_and_gather(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, branch: str = "main"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's K/V for ``layer``; return history + chunk K/V.

        ``k`` and ``v`` are ``[frames_per_chunk * tokens_per_frame, kv_heads,
        head_size]``; the result is ``[visible_tokens, kv_heads, head_size]``
        in frame order (sink, window, current chunk). The results are views of
        the staging area: valid until the next write to the same layer.
        """
        if not self._in_pass:
            raise PassStateError("write_and_gather called outside a pass; expected begin_pass first")
        staging = self.pool.staging_layers[branch][layer]
        start = self._history_tokens
        end = start + self._chunk_tokens
        staging[0, start:end] = k
        staging[1, start:end] = v
        return staging[0, :end], staging[1, :end]

    def end_pass(self) -> None:
        if not self._in_pass:
            raise PassStateError("end_pass called without begin_pass")
        self._in_pass = False
        if not self._commit:
            return
        spec = self.spec
        start, end = self._history_tokens, self._history_tokens + self._chunk_tokens
        for branch in spec.branch_names:
            new = self.pending[branch]
            chunk = self.pool.staging[branch][:, :, start:end].unflatten(2, self._chunk_shape)
            self.pool.kv.index_copy_(2, torch.tensor(new, dtype=torch.long, device=self.pool.device), chunk)
            self.pending[branch] = []
            room_in_sink = spec.sink_frames - len(self.sink[branch])
            self.sink[branch].extend(new[:room_in_sink])
            self.window[branch].extend(new[max(room_in_sink, 0) :])
            overflow = len(self.window[branch]) - spec.window_frames
            if overflow > 0:
                evicted = self.window[branch][:overflow]
                del self.window[branch][:overflow]
                self.pool.free(evicted)
        self._history_version += 1
        self.frames_committed += spec.frames_per_chunk
        self.chunks_committed += 1

    # ---- cross attention ----------------------------------------------------------

    def cross_kv(self, name: str, layer: int, branch: str = "main") -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of a fixed-length cross-attention cache; see :attr:`cross_written`."""
        if self.cross_slot is None or name not in self.pool.cross_k:
            raise KeyError(f"no cross-attention cache named {name!r} in this spec")
        b = self.spec.branch_names.index(branch)
        return self.pool.cross_k[name][self.cross_slot, b, layer], self.pool.cross_v[name][self.cross_slot, b, layer]

    # ---- release ------------------------------------------------------------------

    def held_blocks(self) -> list[int]:
        return [i for b in self.spec.branch_names for i in self.sink[b] + self.window[b] + self.pending[b]]

    def _drop_history(self) -> None:
        for branch in self.spec.branch_names:
            self.pool.free(self.sink[branch] + self.window[branch])
            self.sink[branch] = []
            self.window[branch] = []
        self._history_version += 1

    def release(self) -> None:
        """Return every block and the cross slot to the pool; safe to call twice."""
        if self.released:
            return
        self.released = True
        self._in_pass = False
        if self.pool.staging_owner is not None and self.pool.staging_owner[0] == id(self):
            self.pool.staging_owner = None
        held = self.held_blocks()
        for branch in self.spec.branch_names:
            self.sink[branch], self.window[branch], self.pending[branch] = [], [], []
        try:
            self.pool.free(held)
        finally:
            if self.cross_slot is not None:
                slot, self.cross_slot = self.cross_slot, None
                self.pool.free_slot(slot)
