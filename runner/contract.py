"""The pipeline contract, shaped like vLLM-Omni's ``SupportsARDiffusionPipeline``.

The runner owns KV memory and session lifetime; a pipeline owns its weights and
any small per-session state (RNG, last controls). The runner binds a session's
:class:`~arstream.runner.kv_state.SessionKVState` for exactly one forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from .spec import KVCacheSpec
from .types import PendingDecode, TickRequest

if TYPE_CHECKING:
    from .kv_state import SessionKVState


# ---- what a model card says beyond its frame geometry (docs/models.md, PROTOCOL.md's card fields) ----

# A video a request that names no length gets: vLLM-Omni's and Wan's default clip, 81 frames (5 s at 16 fps,
# plus the first). A card's ``default_num_frames`` overrides it for its model.
DEFAULT_NUM_FRAMES = 81

# How a model takes a prompt that changes mid-session (the card's ``prompt_switch``, read only when
# ``reads_prompt`` is true): "blend" interpolates the prompt embedding over ``transition_chunks`` chunks
# (vLLM-Omni's prompt interaction, :mod:`arstream.runner.prompt_blend`), "recache" switches at the next chunk and
# re-caches the history under the new prompt (LongLive), "at_once" switches at the next chunk (a model that
# encodes the prompt every chunk). A model that reads no prompt cannot take a change.
PromptSwitch = Literal["blend", "recache", "at_once"]
PROMPT_SWITCHES: tuple[PromptSwitch, ...] = ("blend", "recache", "at_once")
# vLLM-Omni's default blend length (its prompt handler's DEFAULT_TRANSITION_CHUNKS).
DEFAULT_PROMPT_TRANSITION_CHUNKS = 3


def default_num_frames(card: dict[str, Any]) -> int:
    """The frames a request that names no length gets from this model."""
    value = card.get("default_num_frames", DEFAULT_NUM_FRAMES)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"the model card's default_num_frames must be an integer >= 1, got {value!r}")
    return value


def prompt_switch(card: dict[str, Any]) -> PromptSwitch | None:
    """How the model takes a prompt change, or None where it reads no prompt (a change cannot be taken)."""
    if not card.get("reads_prompt"):
        return None
    value = card.get("prompt_switch", "at_once")
    if value not in PROMPT_SWITCHES:
        raise ValueError(f"the model card's prompt_switch must be one of {PROMPT_SWITCHES}, got {value!r}")
    return value


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


@runtime_checkable
class SupportsCompile(Protocol):
    """Optional: compiled forwards (``--compile``), built on the first call of each shape (the warm-up's)."""

    def compile_forward(self) -> None:
        """Wrap the forward for compilation; the warm-up that follows compiles it."""


@runtime_checkable
class SupportsPromptPreparation(Protocol):
    """Optional: the model's own normalisation of a prompt (LongLive cleans it as Wan does).

    The server runs it once per prompt as the prompt arrives, off the model
    thread: every ``TickRequest.prompt``, and a session's prompt in a snapshot,
    is its result, so the model never prepares a prompt for a chunk. Pure and
    thread-safe; a prepared prompt is not prepared again.
    """

    def prepare_prompt(self, prompt: str) -> str: ...


def prepare_prompt(pipeline: object, prompt: str) -> str:
    """``prompt`` as ``pipeline`` reads it: its :meth:`SupportsPromptPreparation.prepare_prompt`, or unchanged."""
    return pipeline.prepare_prompt(prompt) if isinstance(pipeline, SupportsPromptPreparation) else prompt


@runtime_checkable
class SupportsBatchedChunks(Protocol):
    """Optional: one forward that produces a chunk for each of several sessions.

    The runner calls :meth:`generate_chunks` with ticks of distinct sessions
    that are all bound (``bind_session_state``) for this forward and whose
    visible histories have the same length, so their rows stack without
    padding. Each session's :class:`SessionKVState` writes to its own staging
    row; the pipeline runs each row's passes on that row's state exactly as
    ``generate_chunk`` would (one committing pass per session).

    All or nothing for model-owned state: if ``generate_chunks`` raises, no
    session's model-owned state (noise generator, camera, last controls, ...)
    may have advanced, because the runner then retries every tick of the batch
    alone with ``generate_chunk`` and the retry must produce the chunk the
    session would have got had it never been batched. Snapshot such state and
    restore it on failure, or update it only after the whole forward succeeded.
    (The runner undoes the KV side itself.)
    """

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        """One uint8 ``[F, H, W, 3]`` array per tick, in the order of ``ticks``."""


@runtime_checkable
class SupportsSplitDecode(Protocol):
    """Optional: a chunk in two calls, the forward (latents) and the decode (frames), so the decode can overlap
    the next forward.

    :meth:`generate_latents` is :meth:`SupportsBatchedChunks.generate_chunks`
    without the decode: same binding, same all-or-nothing rule, and it commits
    the KV and every model-owned state except the decoder's.
    :meth:`decode_latents` may run on another thread while the next forward
    runs, of these sessions too: the runner hands each session's chunks over in
    order, one round at a time, and never two decodes at once. It updates a
    session's decoder state only if it succeeds, and the state that
    ``export_session_state`` sees (snapshots, rewind points) is always a whole
    chunk's: export waits for a decode in flight. A reset or close of a session
    with a decode in flight keeps that decode from storing its state.
    """

    def generate_latents(self, ticks: Sequence[TickRequest]) -> list[PendingDecode]:
        """One forward for the bound sessions of ``ticks``; a chunk to decode per tick, in order."""

    def decode_latents(self, chunks: Sequence[PendingDecode]) -> list[np.ndarray]:
        """uint8 ``[F, H, W, 3]`` frames per chunk (distinct sessions), in order; raises if any fails."""

    def decode_in_flight(self, session_id: str) -> bool:
        """A chunk of the session was forwarded and its decode has not succeeded yet."""

    def forget_decodes(self, chunks: Sequence[PendingDecode]) -> None:
        """These chunks will never be decoded (a rank other than 0 of a replica over several devices: only rank 0
        sends frames): drop their sessions' decoder state, so that nothing waits for them."""

    def export_forward_state(self, session_id: str) -> ModelState:
        """``export_session_state`` less the decoder's part (never waits); top-level keys apart from the decoder's."""

    def export_decoder_state(self, session_id: str, chunks: int | None = None) -> ModelState:
        """The decoder's part of ``export_session_state`` (waits for a decode in flight); with ``chunks``, the
        state after the session's first ``chunks`` chunks (a rewind point's), even with later ones decoding.

        ``export_forward_state(s).merge(export_decoder_state(s))`` is what
        ``export_session_state(s)`` returns, and what ``import_session_state`` takes.
        """


@dataclass
class ModelState:
    """A session's model-owned state in portable form: JSON-able values and named tensors."""

    json: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def merge(self, other: ModelState) -> ModelState:
        """Both parts in one (their keys are disjoint: a forward's part and a decoder's, say)."""
        return ModelState({**self.json, **other.json}, {**self.tensors, **other.tensors})


@runtime_checkable
class SupportsSessionTransfer(Protocol):
    """Optional: a session's model-owned state can leave this process and continue in another.

    Called by :mod:`arstream.runner.snapshot` at a chunk boundary only (no
    forward of the session in flight). Import must give the session exactly the
    state export saw, so its next chunk is bit-identical to the one it would
    have had here; the KV side is the runner's.
    """

    def transfer_fingerprint(self) -> dict[str, Any]:
        """JSON-able identity of what the state depends on (config, weights digest); must match to import."""

    def export_session_state(self, session_id: str) -> ModelState:
        """The session's model-owned state (empty for a session that has none yet)."""

    def import_session_state(self, session_id: str, state: ModelState) -> None:
        """Install state from :meth:`export_session_state` (of the same fingerprint) for ``session_id``."""
