"""The serving path's attention context for LongLive: the runner's paged KV, for a chunk or a re-cache pass.

A chunk's passes read each bound session's sink + window + chunk
(:meth:`SessionKVState.frame_positions`); a re-cache pass (after a prompt
switch) reads the kept sink and the frames it recomputes
(:meth:`SessionKVState.rewrite_positions`), through the runner's history
rewrite (:meth:`SessionKVState.begin_rewrite`). In both, every query sees every
key: no mask inside a chunk, and none inside a re-cache either (LongLive
runs it through the KV-cache path, which has none).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...runner.kv_state import SessionKVState, write_and_gather_rows


class BoundRowsContext:
    """A :class:`~arstream.models.wan.layers.SelfAttentionContext`'s passes over bound sessions, row ``i`` =
    ``states[i]``, every query seeing every key; a subclass sets ``states`` and the positions."""

    self_mask = None
    states: list[SessionKVState]

    def begin_pass(self, *, commit: bool) -> None:
        for state in self.states:
            state.begin_pass(commit=commit)

    def end_pass(self) -> None:
        for state in self.states:
            state.end_pass()

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return write_and_gather_rows(self.states, layer, k, v)


class PagedContext(BoundRowsContext):
    """The runner's paged KV at the sessions' own frame positions (a chunk's, or a re-cache's)."""

    def __init__(self, states: Sequence[SessionKVState], positions: Sequence[list[int]], query_frames: int,
                 rope_frames: int) -> None:  # fmt: skip
        self.states = list(states)
        highest = max(max(p) for p in positions)
        if highest >= rope_frames:
            raise ValueError(f"frame position {highest} is outside the {rope_frames}-frame rotary table")
        self.key_positions = torch.tensor([list(p) for p in positions], device=states[0].device)
        self.query_positions = self.key_positions[:, -query_frames:]

    @classmethod
    def chunk(cls, states: Sequence[SessionKVState], frames_per_chunk: int, rope_frames: int) -> PagedContext:
        return cls(states, [s.frame_positions() for s in states], frames_per_chunk, rope_frames)

    @classmethod
    def recache(cls, state: SessionKVState, frames: int, keep_sink: bool, rope_frames: int) -> PagedContext:
        return cls([state], [state.rewrite_positions(frames, keep_sink=keep_sink)], frames, rope_frames)
