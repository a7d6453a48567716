"""The pipeline contract, shaped like vLLM-Omni's ``SupportsARDiffusionPipeline``.

The runner owns KV memory and session lifetime; a pipeline owns its weights and
any small per-session state (RNG, last controls). The runner binds a session's
:class:`~runner.kv_state.SessionKVState` for exactly one forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from runner.spec import KVCacheSpec
from runner.types import TickRequest

if TYPE_CHECKING:
    from runner.kv_state import SessionKVState


@runtime_checkable
class ARPipeline(Protocol):
    """A model the runner can drive chunk by chunk."""

    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV shape; called once when the runner builds its pool."""

    def model_card(self) -> dict[str, Any]:
        """name, width, height, fps, frames_per_chunk and a JSON Schema for controls."""

    def bind_session_state(self, session_id: str, state: SessionKVState) -> AbstractContextManager[None]:
        """Make ``state`` the session's KV for the forward run inside the context."""

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        """Run one chunk for ``tick.session_id`` (bound) and return uint8 ``[F, H, W, 3]``."""

    def reset_session(self, session_id: str) -> None:
        """Drop model-owned state so the next chunk starts a new rollout."""

    def close_session(self, session_id: str) -> None:
        """Drop all model-owned state of a session that is gone."""


@runtime_checkable
class SupportsWarmup(Protocol):
    """Optional: ticks that exercise the real path (compiled shapes) at load time."""

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        """Ticks for a synthetic session; the runner releases it afterwards."""
