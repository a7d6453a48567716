"""ARRunner: sessions, LRU eviction, fail-closed forwards over the paged pool.

The runner never inspects model internals. It builds the pool from the
pipeline's :class:`KVCacheSpec`, keeps sessions in LRU order, and binds a
session's :class:`SessionKVState` for one forward at a time. Every path that
ends a session (reset, close, eviction, failure) goes through
:meth:`ARRunner._release`, which attempts each cleanup step even when one fails.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from runner.contract import ARPipeline, SupportsWarmup
from runner.kv_state import SessionKVState
from runner.pool import PagedKVPool, plan_pool, resolve_budget_bytes
from runner.spec import KVCacheSpec
from runner.types import ChunkResult, TickRequest

log = logging.getLogger("arstream.runner")

WARMUP_SESSION_ID = "__arstream_warmup__"
CHUNK_TIMES_KEPT = 100_000


class UnsupportedConfiguration(ValueError):
    """The pipeline or settings ask for something this runner does not do."""


class ChunkShapeError(RuntimeError):
    """A pipeline returned frames that are not uint8 ``[F, H, W, 3]``."""


@dataclass(frozen=True)
class RunnerStats:
    blocks_total: int
    blocks_free: int
    blocks_used: int
    scratch_blocks: int
    block_bytes: int
    pool_bytes: int
    session_capacity: int
    sessions_resident: int
    sink_frames: int
    window_frames: int
    frames_per_chunk: int
    evictions_total: int
    failures_total: int
    chunks_total: int


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ARRunner:
    """Model-neutral AR runtime: one pipeline, one pool, many sessions."""

    def __init__(
        self,
        pipeline: ARPipeline,
        *,
        device: torch.device | str = "cpu",
        kv_budget_bytes: int | None = None,
        memory_fraction: float | None = None,
        sync: Callable[[torch.device], None] = _device_sync,
    ) -> None:
        if not isinstance(pipeline, ARPipeline):
            raise UnsupportedConfiguration(
                f"{type(pipeline).__name__} does not implement the ARPipeline contract: "
                "kv_cache_spec(), model_card(), bind_session_state(), generate_chunk(), "
                "reset_session() and close_session()"
            )
        spec = pipeline.kv_cache_spec()
        if not isinstance(spec, KVCacheSpec):
            raise UnsupportedConfiguration(f"kv_cache_spec() must return KVCacheSpec, got {type(spec).__name__}")
        self.device = torch.device(device)
        self.pipeline = pipeline
        self.spec = spec
        budget = resolve_budget_bytes(self.device, budget_bytes=kv_budget_bytes, memory_fraction=memory_fraction)
        self.plan = plan_pool(spec, budget)
        self.pool = PagedKVPool(spec, self.plan, self.device)
        self.blocks_free_at_start = self.pool.num_free
        self._sync = sync
        self._sessions: OrderedDict[str, SessionKVState] = OrderedDict()
        # One entry per chunk, bounded so a long-running server does not grow.
        self.chunk_times_s: deque[float] = deque(maxlen=CHUNK_TIMES_KEPT)
        self.chunks_total = 0
        self.evictions_total = 0
        self.failures_total = 0
        self.on_evict: Callable[[str], None] | None = None
        log.info(
            "KV pool: %d blocks of %d bytes (+%d scratch), capacity %d sessions, sink %d, window %d",
            self.plan.num_blocks,
            self.plan.block_bytes,
            self.plan.scratch_blocks,
            self.plan.session_capacity,
            spec.sink_frames,
            spec.window_frames,
        )

    # ---- sessions -----------------------------------------------------------------

    @property
    def session_capacity(self) -> int:
        return self.plan.session_capacity

    def resident_sessions(self) -> list[str]:
        """Session ids from least to most recently used."""
        return list(self._sessions)

    def is_resident(self, session_id: str) -> bool:
        return session_id in self._sessions

    def _get_or_create(self, session_id: str) -> SessionKVState:
        state = self._sessions.get(session_id)
        if state is None:
            while len(self._sessions) >= self.session_capacity:
                oldest = next(iter(self._sessions))
                self._release(oldest, reset_model=False, reason="lru_eviction", suppress_errors=True)
                self.evictions_total += 1
                if self.on_evict is not None:
                    self.on_evict(oldest)
            state = SessionKVState(self.pool, session_id)
            self._sessions[session_id] = state
        self._sessions.move_to_end(session_id)
        return state

    def _release(self, session_id: str, *, reset_model: bool, reason: str, suppress_errors: bool = False) -> None:
        """The one release path for reset, close, eviction and failure."""
        state = self._sessions.pop(session_id, None)
        errors: list[Exception] = []
        if state is not None:
            try:
                state.release()
            except Exception as exc:  # noqa: BLE001 - still notify the pipeline
                errors.append(exc)
        try:
            if reset_model:
                self.pipeline.reset_session(session_id)
            else:
                self.pipeline.close_session(session_id)
        except Exception as exc:  # noqa: BLE001 - every cleanup step is attempted
            errors.append(exc)
        log.debug("released session=%s reason=%s", session_id, reason)
        if errors:
            if suppress_errors:
                log.warning("session=%s cleanup after %s had errors: %s", session_id, reason, errors)
            else:
                raise errors[0]

    def reset_session(self, session_id: str) -> None:
        """Release KV and tell the pipeline to start a new rollout."""
        self._release(session_id, reset_model=True, reason="reset")

    def close_session(self, session_id: str) -> None:
        """Release KV and tell the pipeline to drop the session."""
        self._release(session_id, reset_model=False, reason="close")

    @contextmanager
    def _bound(self, session_id: str) -> Iterator[SessionKVState]:
        """Bind the session's KV for one forward; on any failure release it, then re-raise."""
        state = self._get_or_create(session_id)
        try:
            with self.pipeline.bind_session_state(session_id, state):
                yield state
            self._sync(self.device)
        except BaseException:
            self.failures_total += 1
            self._release(session_id, reset_model=False, reason="forward_exception", suppress_errors=True)
            log.warning("forward failed for session=%s; its KV and model state were released", session_id)
            raise

    # ---- execution ----------------------------------------------------------------

    def execute(self, ticks: Sequence[TickRequest]) -> list[ChunkResult]:
        """Run ticks in order, one forward each.

        The list form is where cross-session batching will go; today each tick
        is its own forward so every one fails closed on its own.
        """
        return [self.execute_tick(t) for t in ticks]

    def execute_tick(self, tick: TickRequest) -> ChunkResult:
        """Reset before (if asked), one bound forward, close after (if asked)."""
        if tick.reset:
            self.reset_session(tick.session_id)
        new_rollout = tick.session_id not in self._sessions or self._sessions[tick.session_id].chunks_committed == 0
        started = time.perf_counter()
        with self._bound(tick.session_id) as state:
            chunk_index = state.chunk_index
            frames = self.pipeline.generate_chunk(tick)
            _check_frames(frames, self.spec)
            if state.chunk_index != chunk_index + 1:
                raise RuntimeError(
                    f"pipeline did not commit exactly one chunk (chunk index {chunk_index} -> {state.chunk_index})"
                )
        compute_s = time.perf_counter() - started
        self.chunk_times_s.append(compute_s)
        self.chunks_total += 1
        if tick.close:
            self.close_session(tick.session_id)
        return ChunkResult(
            session_id=tick.session_id,
            request_id=tick.request_id,
            chunk_index=chunk_index,
            frames=frames,
            compute_s=compute_s,
            new_rollout=new_rollout,
            applied_event_ids=tick.applied_event_ids,
        )

    def warmup(self) -> int:
        """Run the pipeline's warm-up ticks through the real path; return how many ran.

        The synthetic session is always released and the pool must end as it began.
        """
        if not isinstance(self.pipeline, SupportsWarmup):
            return 0
        free_before = self.pool.num_free
        ran = 0
        try:
            for tick in self.pipeline.warmup_requests(WARMUP_SESSION_ID):
                self.execute_tick(tick)
                ran += 1
        finally:
            self._release(WARMUP_SESSION_ID, reset_model=False, reason="warmup_complete", suppress_errors=True)
            # Warm-up chunks are not traffic: keep the counters users see clean.
            self.chunk_times_s.clear()
            self.chunks_total = 0
        if self.pool.num_free != free_before:
            raise RuntimeError(f"warm-up did not restore the KV pool (free {free_before} -> {self.pool.num_free})")
        return ran

    def stats(self) -> RunnerStats:
        return RunnerStats(
            blocks_total=self.pool.num_blocks,
            blocks_free=self.pool.num_free,
            blocks_used=self.pool.num_used,
            scratch_blocks=self.plan.scratch_blocks,
            block_bytes=self.plan.block_bytes,
            pool_bytes=self.plan.pool_bytes,
            session_capacity=self.session_capacity,
            sessions_resident=len(self._sessions),
            sink_frames=self.spec.sink_frames,
            window_frames=self.spec.window_frames,
            frames_per_chunk=self.spec.frames_per_chunk,
            evictions_total=self.evictions_total,
            failures_total=self.failures_total,
            chunks_total=self.chunks_total,
        )

    def model_card(self) -> dict[str, Any]:
        return self.pipeline.model_card()


def _check_frames(frames: object, spec: KVCacheSpec) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        got = f"{type(frames).__name__} {getattr(frames, 'dtype', '')} {getattr(frames, 'shape', '')}"
        raise ChunkShapeError(f"pipeline must return uint8 [F, H, W, 3] frames, got {got}")
    if frames.shape[0] != spec.frames_per_chunk:
        raise ChunkShapeError(f"pipeline returned {frames.shape[0]} frames, spec says {spec.frames_per_chunk}")
