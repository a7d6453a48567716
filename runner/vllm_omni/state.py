"""ARStream's pass API over vLLM-Omni's session KV state, so a pipeline runs unchanged on either runtime.

An ARStream pipeline drives one chunk as passes (``begin_pass`` /
``write_and_gather`` per layer / ``end_pass``; see
:mod:`arstream.runner.kv_state`). vLLM-Omni's ``ARDiffusionKVState`` offers the
same steps in its own terms: ``get_kv_caches(branch, seq_len,
commit_current)`` opens a pass and returns per-layer paged contexts,
the layer's K/V go to the context's slots (managed blocks when the pass
commits, scratch blocks otherwise), attention reads the context's block table,
and ``commit_paged_context`` ends the pass and, for a committing one, advances
the session's timeline (evicting out-of-window blocks).

:class:`OmniSessionKVState` maps one onto the other without keeping any KV of
its own: every K/V it returns is gathered from vLLM-Omni's pools through the
block table vLLM-Omni built, so what a pass sees is what vLLM-Omni's own
attention would read.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kv_state import PassStateError
from ..spec import KVCacheSpec


class OmniSessionKVState:
    """The pipeline-facing part of :class:`~arstream.runner.kv_state.SessionKVState`, backed by vLLM-Omni."""

    def __init__(self, omni_state: Any, spec: KVCacheSpec, device: torch.device) -> None:
        self.omni_state = omni_state
        self.spec = spec
        self.device = device
        self.session_id: str = omni_state.session_id
        self._chunk_tokens = spec.frames_per_chunk * spec.tokens_per_frame
        self._in_pass = False
        # Per branch: the pass's paged contexts (one per layer) and the visible block ids.
        self._layers: dict[str, list[Any]] = {}
        self._visible: dict[str, torch.Tensor] = {}

    # ---- what a pipeline reads -------------------------------------------------

    @property
    def frame_start(self) -> int:
        """Absolute index of the current chunk's first frame (vLLM-Omni's committed timeline, in frames)."""
        adapter = self.omni_state.adapter(self.spec.branch_names[0])
        return adapter.absolute_num_computed_tokens // self.spec.tokens_per_frame

    @property
    def chunk_index(self) -> int:
        return self.frame_start // self.spec.frames_per_chunk

    def history_frames(self, branch: str = "main") -> int:
        """Frames of history the current chunk sees: sink plus the window's share left beside the chunk."""
        return min(self.frame_start, self.spec.resident_frames)

    def frame_positions(self, branch: str = "main") -> list[int]:
        """Rotary positions of the visible frames (sink, window, chunk), as ``SessionKVState.frame_positions``.

        Sliding windows only: the sink holds the rollout's first frames. Past
        ``spec.max_position_frames`` the window and chunk shift down so the
        chunk ends at the table's end.
        """
        spec = self.spec
        history = self.history_frames(branch)
        sink = min(spec.sink_frames, history)
        start = self.frame_start
        end = start + spec.frames_per_chunk
        shift = 0 if spec.max_position_frames is None else max(0, end - spec.max_position_frames)
        return list(range(sink)) + [p - shift for p in range(start - (history - sink), end)]

    @property
    def in_pass(self) -> bool:
        return self._in_pass

    # ---- passes -----------------------------------------------------------------

    def begin_pass(self, *, commit: bool) -> None:
        if self._in_pass:
            raise PassStateError("begin_pass called twice; expected end_pass first")
        for branch in self.spec.branch_names:
            layers = self.omni_state.get_kv_caches(branch, seq_len=self._chunk_tokens, commit_current=commit)
            forward = layers[0].forward_ctx
            # Allocates the chunk's slots (managed blocks for a commit, scratch otherwise) and builds the table.
            forward.prepare(torch.device(self.device), 0, self._chunk_tokens)
            self._layers[branch] = layers
            self._visible[branch] = forward.block_table[0, : forward.kv_len // forward.block_size].long()
        self._in_pass = True

    def write_and_gather(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, branch: str = "main"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's K/V for ``layer`` in vLLM-Omni's pool; return the visible K/V (history + chunk).

        ``k`` and ``v`` are ``[frames_per_chunk * tokens_per_frame, kv_heads, head_size]``; the result is
        ``[visible_tokens, kv_heads, head_size]`` in vLLM-Omni's block-table order (sink, window, chunk).
        """
        if not self._in_pass:
            raise PassStateError("write_and_gather called outside a pass; expected begin_pass first")
        inputs = self._layers[branch][layer].to_layer_inputs()
        key_pool, value_pool = inputs.key_pool, inputs.value_pool
        key_pool[inputs.video_slots] = k.to(key_pool.dtype)
        value_pool[inputs.video_slots] = v.to(value_pool.dtype)
        blocks = self._visible[branch]
        size = inputs.block_size
        k_all = key_pool.unflatten(0, (-1, size)).index_select(0, blocks).flatten(0, 1)
        v_all = value_pool.unflatten(0, (-1, size)).index_select(0, blocks).flatten(0, 1)
        return k_all, v_all

    def end_pass(self) -> None:
        """Close the pass; a committing one joins the history (vLLM-Omni advances and evicts)."""
        if not self._in_pass:
            raise PassStateError("end_pass called without begin_pass")
        self._in_pass = False
        for branch in self.spec.branch_names:
            self.omni_state.commit_paged_context(branch)
        self._layers.clear()
        self._visible.clear()
