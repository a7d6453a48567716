"""One session's view of the paged pool, handed to a pipeline for one forward.

A chunk is produced by several forward *passes*: denoising passes write the
chunk's K/V to shared scratch blocks and leave the timeline alone; the one
committing pass writes to freshly allocated blocks and advances it. Frame
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
        self._current: dict[str, list[int]] = {}
        self._gather_index: dict[str, torch.Tensor] = {}
        self._write_index: dict[str, torch.Tensor] = {}
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
        fpc = self.spec.frames_per_chunk
        if commit and self.spec.reset_at_boundary and self.history_frames(self.spec.branch_names[0]) + fpc > (
            self.spec.resident_frames
        ):
            self._drop_history()
        for branch in self.spec.branch_names:
            if commit:
                self.pending[branch] = self.pool.allocate(fpc)
                current = self.pending[branch]
            else:
                current = self.pool.scratch_ids[branch]
            self._current[branch] = current
            history = self.sink[branch] + self.window[branch]
            self._gather_index[branch] = torch.tensor(history + current, dtype=torch.long, device=self.pool.device)
            self._write_index[branch] = torch.tensor(current, dtype=torch.long, device=self.pool.device)
        self._commit = commit
        self._in_pass = True

    def write_and_gather(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, branch: str = "main"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's K/V for ``layer``; return history + chunk K/V.

        ``k`` and ``v`` are ``[frames_per_chunk * tokens_per_frame, kv_heads,
        head_size]``; the result is ``[visible_tokens, kv_heads, head_size]``
        in frame order (sink, window, current chunk).
        """
        if not self._in_pass:
            raise PassStateError("write_and_gather called outside a pass; expected begin_pass first")
        spec = self.spec
        blocks = k.reshape(spec.frames_per_chunk, spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
        index = self._write_index[branch]
        self.pool.k[layer].index_copy_(0, index, blocks)
        self.pool.v[layer].index_copy_(
            0, index, v.reshape(spec.frames_per_chunk, spec.tokens_per_frame, spec.num_kv_heads, spec.head_size)
        )
        gather = self._gather_index[branch]
        k_all = self.pool.k[layer].index_select(0, gather).flatten(0, 1)
        v_all = self.pool.v[layer].index_select(0, gather).flatten(0, 1)
        return k_all, v_all

    def end_pass(self) -> None:
        if not self._in_pass:
            raise PassStateError("end_pass called without begin_pass")
        self._in_pass = False
        if not self._commit:
            return
        for branch in self.spec.branch_names:
            new = self.pending[branch]
            self.pending[branch] = []
            room_in_sink = self.spec.sink_frames - len(self.sink[branch])
            self.sink[branch].extend(new[:room_in_sink])
            self.window[branch].extend(new[max(room_in_sink, 0) :])
            overflow = len(self.window[branch]) - self.spec.window_frames
            if overflow > 0:
                evicted = self.window[branch][:overflow]
                del self.window[branch][:overflow]
                self.pool.free(evicted)
        self.frames_committed += self.spec.frames_per_chunk
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

    def release(self) -> None:
        """Return every block and the cross slot to the pool; safe to call twice."""
        if self.released:
            return
        self.released = True
        self._in_pass = False
        held = self.held_blocks()
        for branch in self.spec.branch_names:
            self.sink[branch], self.window[branch], self.pending[branch] = [], [], []
        try:
            self.pool.free(held)
        finally:
            if self.cross_slot is not None:
                slot, self.cross_slot = self.cross_slot, None
                self.pool.free_slot(slot)
