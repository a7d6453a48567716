"""What a pipeline hands back for a chunk, checked: frames, undecoded latents, one commit per session.

Shared by every runtime (ARStream's runner and the vLLM-Omni adapter check the same shapes), so a model
that returns the wrong thing fails the same way on either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .kv_state import SessionKVState
from .spec import KVCacheSpec
from .types import PendingDecode, TickRequest, UnsupportedConfiguration

# the synthetic session warm-up runs its ticks as (never a client's id)
WARMUP_SESSION_ID = "__arstream_warmup__"


class ChunkShapeError(RuntimeError):
    """A pipeline returned frames that are not uint8 ``[F, H, W, 3]``."""


def video_frames_of(card: dict[str, Any], spec: KVCacheSpec) -> tuple[int, int]:
    """(frames per chunk, frames of a rollout's first chunk) the client gets, from the model card.

    The card's ``frames_per_chunk`` counts video frames, which a model with a
    temporally compressed latent (Wan VAE: 4 video frames per latent frame,
    fewer on the first chunk) produces from ``spec.frames_per_chunk`` latent
    frames; ``first_chunk_frames`` is optional and defaults to it.
    """
    per_chunk = card.get("frames_per_chunk", spec.frames_per_chunk) if isinstance(card, dict) else None
    first = card.get("first_chunk_frames", per_chunk) if isinstance(card, dict) else None
    return _frame_count("frames_per_chunk", per_chunk), _frame_count("first_chunk_frames", first)


def _frame_count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UnsupportedConfiguration(f"the model card's {name} must be an integer >= 1, got {value!r}")
    return value


def check_frames(frames: object, expected: int) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        got = f"{type(frames).__name__} {getattr(frames, 'dtype', '')} {getattr(frames, 'shape', '')}"
        raise ChunkShapeError(f"pipeline must return uint8 [F, H, W, 3] frames, got {got}")
    if frames.shape[0] != expected:
        raise ChunkShapeError(f"pipeline returned {frames.shape[0]} frames, the model card says {expected}")


def one_pending(chunks: object, tick: TickRequest) -> PendingDecode:
    check_pending(chunks, [tick])
    assert isinstance(chunks, list)
    return chunks[0]


def check_pending(chunks: object, ticks: Sequence[TickRequest]) -> None:
    if not isinstance(chunks, list) or len(chunks) != len(ticks):
        got = len(chunks) if isinstance(chunks, list) else type(chunks).__name__
        raise ChunkShapeError(f"generate_latents must return a list of {len(ticks)} PendingDecode, got {got}")
    for chunk, tick in zip(chunks, ticks):
        if not isinstance(chunk, PendingDecode) or chunk.session_id != tick.session_id:
            raise ChunkShapeError(f"generate_latents must return a PendingDecode for session {tick.session_id!r}")


def check_commits(states: Sequence[SessionKVState]) -> None:
    for state in states:
        if state.in_pass or not state.chunk_held:
            raise RuntimeError(f"pipeline did not commit exactly one chunk for session {state.session_id!r}")


def check_batch(frames: object, states: Sequence[SessionKVState], expected: Sequence[int]) -> None:
    if not isinstance(frames, list) or len(frames) != len(states):
        got = len(frames) if isinstance(frames, list) else type(frames).__name__
        raise ChunkShapeError(f"generate_chunks must return a list of {len(states)} frame arrays, got {got}")
    for chunk, count in zip(frames, expected):
        check_frames(chunk, count)
    check_commits(states)
