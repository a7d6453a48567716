"""The serving path's attention context: the runner's paged KV plus each session's action caches.

Self-attention K/V live in the runner's pool (one block per latent frame,
every layer) and are read through the bound :class:`SessionKVState` rows. The
action module's caches have other shapes (the mouse path keeps K/V per
spatial token and frame, the keyboard path one token per frame), so they
are model-owned state, kept per session in :class:`ActionHistory` with the
same window rule as the KV (the last ``local_attn_size`` frames including the
chunk; no sink, as in Matrix-Game). A pass only reads them; the committing
pass records the chunk's entries and :meth:`PagedChunkContext.updated_histories`
returns the new histories, which the pipeline stores only once the whole
forward succeeded, so a failed batch leaves every session's caches as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .config import MatrixGameConfig
from ...runner.kv_state import SessionKVState, write_and_gather_rows

# per action layer: mouse K, mouse V ([S, F, H, D]; empty without a mouse path), keyboard K, keyboard V ([F, H, D])
ActionKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ActionHistory:
    """One session's action caches: per action layer, K/V of its last history frames (immutable)."""

    frames: int = 0
    layers: dict[int, ActionKV] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers.values() for t in kv)


def action_history_bytes(cfg: MatrixGameConfig, dtype: torch.dtype) -> int:
    """Bytes of a full action history (the window's history frames, every action layer)."""
    a = cfg.action
    frames = cfg.local_attn_size - cfg.frames_per_chunk
    elem = torch.empty((), dtype=dtype).element_size()
    mouse = 2 * cfg.tokens_per_frame * frames * a.mouse_hidden_dim if a.enable_mouse else 0
    keyboard = 2 * frames * a.keyboard_hidden_dim
    return len(a.blocks) * (mouse + keyboard) * elem


class PagedChunkContext:
    """:class:`~arstream.models.matrix_game.dit.AttentionContext` for one chunk of a batch of sessions.

    Row ``i`` is ``states[i]`` (bound by the runner) with ``histories[i]``; the
    rows' histories are equally long (the runner batches only such sessions).
    """

    self_mask = None
    action_mask = None

    def __init__(
        self, states: Sequence[SessionKVState], histories: Sequence[ActionHistory], cfg: MatrixGameConfig
    ) -> None:
        self.states = list(states)
        self.histories = list(histories)
        self.cfg = cfg
        device = states[0].device
        fpc = cfg.frames_per_chunk
        positions = [s.frame_positions() for s in self.states]
        highest = max(max(p) for p in positions)
        if highest >= cfg.rope_frames:
            raise ValueError(f"frame position {highest} is outside the {cfg.rope_frames}-frame rotary table")
        self.key_positions = torch.tensor(positions, device=device)
        self.query_positions = self.key_positions[:, -fpc:]
        held = self.histories[0].frames
        if any(h.frames != held for h in self.histories):
            raise ValueError(f"batched rows need equally long action histories, got {[h.frames for h in self.histories]}")
        # The action window is contiguous and ends with the chunk.
        offsets = torch.arange(-held, fpc, device=device)
        self.action_key_positions = self.query_positions[:, :1] + offsets
        self._commit = False
        self._new: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def begin_pass(self, *, commit: bool) -> None:
        for state in self.states:
            state.begin_pass(commit=commit)
        self._commit = commit

    def end_pass(self) -> None:
        for state in self.states:
            state.end_pass()

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return write_and_gather_rows(self.states, layer, k, v)

    def _with_history(
        self, layer: int, kind: str, k: torch.Tensor, v: torch.Tensor, index: int, time_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._commit:
            self._new.setdefault(layer, {})[kind] = (k, v)
        if not self.histories[0].frames:
            return k, v
        past_k = torch.stack([h.layers[layer][index] for h in self.histories])
        past_v = torch.stack([h.layers[layer][index + 1] for h in self.histories])
        return torch.cat([past_k, k], dim=time_dim), torch.cat([past_v, v], dim=time_dim)

    def mouse_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._with_history(layer, "mouse", k, v, 0, time_dim=2)

    def keyboard_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._with_history(layer, "keyboard", k, v, 2, time_dim=1)

    def updated_histories(self) -> list[ActionHistory]:
        """Each row's action history after this chunk (call after the committing pass)."""
        keep = self.cfg.local_attn_size - self.cfg.frames_per_chunk
        frames = min(self.histories[0].frames + self.cfg.frames_per_chunk, keep)
        updated = []
        for row, old in enumerate(self.histories):
            layers: dict[int, ActionKV] = {}
            for layer, new in self._new.items():
                kk, kv = new["keyboard"][0][row], new["keyboard"][1][row]
                # without a mouse path the mouse entries stay empty ([S, 0, H, D])
                mk, mv = (new["mouse"][0][row], new["mouse"][1][row]) if "mouse" in new else (kk[None, :0], kv[None, :0])
                if old.frames:
                    pmk, pmv, pkk, pkv = old.layers[layer]
                    mk, mv = torch.cat([pmk, mk], dim=1), torch.cat([pmv, mv], dim=1)
                    kk, kv = torch.cat([pkk, kk], dim=0), torch.cat([pkv, kv], dim=0)
                # clone: a slice would pin the whole concatenation in memory
                layers[layer] = (
                    mk[:, mk.shape[1] - frames :].clone(),
                    mv[:, mv.shape[1] - frames :].clone(),
                    kk[kk.shape[0] - frames :].clone(),
                    kv[kv.shape[0] - frames :].clone(),
                )
            updated.append(ActionHistory(frames=frames if layers else 0, layers=layers))
        return updated
