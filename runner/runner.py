"""ARRunner: sessions, LRU eviction, fail-closed forwards over the paged pool.

The runner never inspects model internals. It builds the pool from the
pipeline's :class:`KVCacheSpec`, keeps sessions in LRU order, and binds a
session's :class:`SessionKVState` for one forward at a time. Every path that
ends a session (reset, close, eviction, failure) goes through
:meth:`ARRunner._release`, which attempts each cleanup step even when one fails.

Rewind and branch (a ``rewind`` schedule, :mod:`arstream.runner.rewind`):
each session keeps the chunk boundaries of its last seconds of play (every
chunk recently, sparser further back), sharing blocks with its live history; ``TickRequest.rewind_to`` goes back to one before the chunk runs, and
:meth:`ARRunner.branch_session` starts a new session from one.

Cross-session batching (:meth:`ARRunner.execute`): with ``max_batch_sessions``
above 1 and a pipeline that implements :class:`SupportsBatchedChunks`, ticks of
distinct sessions whose visible histories are equally long share one forward.
A batch is all or nothing: if the model raises, every session's KV is put
back as it was and each tick runs again alone, where a failure releases only
that tick's session (see :meth:`ARRunner._forward_batch` for failures after
the model returned).

Split decode (``split_decode=True`` and a pipeline that implements
:class:`SupportsSplitDecode`): :meth:`ARRunner.execute` runs the forwards only
and its chunks carry ``pending`` (what to decode) instead of frames;
:meth:`ARRunner.decode_chunks` decodes them (on another thread, while the
next forward runs: the worker's decode stage) and :meth:`ARRunner.fail_session`
releases a session whose decode failed, on the runner's own thread.
:meth:`ARRunner.execute_tick` and warm-up still decode in line.

Parking (a :class:`~arstream.runner.parking.ParkingPolicy` with a budget):
the LRU victim of a full pool, a session idle past ``after_s``
(:meth:`ARRunner.park_idle`) and one the server parks (:meth:`ARRunner.park_session`,
a detached session) move to host memory with their rewind points, and their
next tick, rewind or branch restores them (:mod:`arstream.runner.parking`).
``is_resident`` counts parked sessions as held; ``resident_sessions`` lists
those in the pool. A restore that fails ends its session (``restore_failed``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any, Iterator

import numpy as np
import torch

from .contract import (
    ARPipeline,
    ModelState,
    SupportsBatchedChunks,
    SupportsSessionTransfer,
    SupportsSplitDecode,
    SupportsWarmup,
    prepare_prompt,
)
from .kv_state import SessionKVState
from .parking import ParkedSession, ParkingPolicy, RestoreFailed, park_payload, restore_payload
from .pool import PagedKVPool, PoolExhausted, budget_for_sessions, plan_pool, resolve_budget_bytes
from .rewind import Boundary, RewindPoints, copy_model_state
from .rewind_schedule import RewindSchedule, plan_rewind
from .spec import KVCacheSpec
from .stats import RunnerStats, RuntimeCounters
from .types import (
    NOT_DECODED,
    ChunkResult,
    PendingDecode,
    RewindUnavailable,
    RuntimeOptions,
    TickFailure,
    TickRequest,
    TickResult,
    UnsupportedConfiguration,
)
from .vllm_omni.native import NativePipeline

log = logging.getLogger("arstream.runner")

RUNTIME = "arstream"  # the name `arstream serve --runtime` gives this runner (runner/types.py RUNTIMES)
WARMUP_SESSION_ID = "__arstream_warmup__"


class ChunkShapeError(RuntimeError):
    """A pipeline returned frames that are not uint8 ``[F, H, W, 3]``."""


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ARRunner:
    """Model-neutral AR runtime: one pipeline, one pool, many sessions."""

    @classmethod
    def for_pipeline(cls, pipeline: ARPipeline | NativePipeline, options: RuntimeOptions) -> ARRunner:
        """``--runtime arstream``: the settings' pool, rewind horizon and decode split over ``pipeline``."""
        if isinstance(pipeline, NativePipeline):
            raise UnsupportedConfiguration(
                f"model {pipeline.name!r} is a pipeline registered in vLLM-Omni: serve it with --runtime vllm-omni"
            )
        rewind = rewind_for(pipeline, seconds=options.rewind_seconds, budget_bytes=options.rewind_budget_bytes)
        return cls(
            pipeline, rewind=rewind, split_decode=options.split_decode, parking=options.parking, **options.pool()
        )

    def __init__(
        self,
        pipeline: ARPipeline,
        *,
        device: torch.device | str = "cpu",
        kv_budget_bytes: int | None = None,
        memory_fraction: float | None = None,
        sync: Callable[[torch.device], None] = _device_sync,
        max_batch_sessions: int = 1,
        rewind: RewindSchedule | None = None,
        split_decode: bool = False,
        parking: ParkingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
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
        if not isinstance(max_batch_sessions, int) or isinstance(max_batch_sessions, bool) or max_batch_sessions < 1:
            raise UnsupportedConfiguration(f"max_batch_sessions must be an integer >= 1, got {max_batch_sessions!r}")
        self.max_batch_sessions = max_batch_sessions
        # the forward and the decode are separate calls (pipelines without the split always decode in the forward)
        self.split_decode = split_decode and isinstance(pipeline, SupportsSplitDecode)
        self.video_frames_per_chunk, self.first_chunk_frames = _video_frames(pipeline.model_card(), spec)
        if rewind is not None and not isinstance(rewind, RewindSchedule):
            raise UnsupportedConfiguration(f"rewind must be a RewindSchedule or None, got {type(rewind).__name__}")
        # Why rewind and branch are refused (None: they are offered), and which boundaries a session keeps.
        self.rewind_refusal = _rewind_refusal(pipeline, spec, rewind)
        self.rewind: RewindSchedule | None = None if self.rewind_refusal else rewind
        if rewind is not None and self.rewind_refusal:
            log.info("rewind not used: %s", self.rewind_refusal)
        budget = resolve_budget_bytes(self.device, budget_bytes=kv_budget_bytes, memory_fraction=memory_fraction)
        self.plan = plan_pool(spec, budget, max_batch_sessions=max_batch_sessions, rewind=self.rewind)
        self.pool = PagedKVPool(spec, self.plan, self.device)
        self.blocks_free_at_start = self.pool.num_free
        self._sync = sync
        self._sessions: OrderedDict[str, SessionKVState] = OrderedDict()
        # each resident session's kept boundaries (only while rewind is offered)
        self._rewind: dict[str, RewindPoints] = {}
        # Sessions whose next chunk follows a rewind that went back (``restarted: "rewind"``); a rewind_to
        # naming where the session already is changes nothing and its chunk is a plain one.
        self._rewound: set[str] = set()
        # boundaries recorded while the chunk before them was decoding: (session, boundary, the one before it)
        self._unfinished_boundaries: list[tuple[str, Boundary, Boundary | None]] = []
        self.counters = RuntimeCounters()
        # Parking (runner/parking.py): sessions moved to host memory, restored on their next use.
        self.parking_policy = parking or ParkingPolicy()
        self.parking = self.parking_policy.lot()
        self._clock = clock
        self._last_used: dict[str, float] = {}
        # sessions being exported (kv_state): never parked while their blocks are read, until their next chunk
        self._pinned: set[str] = set()
        # parking's device <-> host copies run here, beside the forward (CUDA only)
        self._copy_stream: Any = None
        if self.device.type == "cuda" and self.parking.enabled:
            self._copy_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.on_evict: Callable[[str], None] | None = None
        # median seconds of one warm-up step (an execute call) per batch size, filled by warmup()
        self.warmup_round_s: dict[int, float] = {}
        # Rewind points cost capacity (a lot where the model's own state is large): say how much.
        without = plan_pool(spec, budget, max_batch_sessions=max_batch_sessions).session_capacity
        log.info(
            "model memory (KV pool): %.0f MiB, room for %d sessions%s; each remembers its first %d and last %d "
            "frames; rewind: %s; up to %d session(s) per forward%s [%d blocks of %d bytes, +%d scratch]",
            self.plan.num_blocks * self.plan.block_bytes / 2**20,
            self.plan.session_capacity,
            f" ({without} without rewind)" if without != self.plan.session_capacity else "",
            spec.sink_frames,
            spec.history_window_frames,
            (self.rewind.describe(spec) if self.rewind else 'off'),
            self.batch_limit,
            "" if self.batches or max_batch_sessions == 1 else " (the pipeline does not batch)",
            self.plan.num_blocks,
            self.plan.block_bytes,
            self.plan.scratch_blocks,
        )

    # ---- sessions -----------------------------------------------------------------

    @property
    def session_capacity(self) -> int:
        return self.plan.session_capacity

    @property
    def batches(self) -> bool:
        """Whether :meth:`execute` may put several sessions in one forward."""
        return self.max_batch_sessions > 1 and isinstance(self.pipeline, SupportsBatchedChunks)

    @property
    def batch_limit(self) -> int:
        """Most sessions in one forward.

        Never above the session capacity: binding a batch's new sessions must
        not LRU-evict another member of the same batch.
        """
        return min(self.max_batch_sessions, self.session_capacity) if self.batches else 1

    def video_frames(self, chunk_index: int) -> int:
        """Frames the client gets for the chunk with this index (the model card's counts)."""
        return self.first_chunk_frames if chunk_index == 0 else self.video_frames_per_chunk

    def history_frames(self, session_id: str) -> int:
        """Frames of history the session's next chunk sees (0 for a session that is not held)."""
        state = self._sessions.get(session_id)
        if state is None:
            parked = self.parking.get(session_id)
            return 0 if parked is None else parked.history_frames
        return state.history_frames(self.spec.branch_names[0])

    def resident_sessions(self) -> list[str]:
        """Session ids in the pool, from least to most recently used (parked ones are not: :meth:`parked_sessions`)."""
        return list(self._sessions)

    def parked_sessions(self) -> list[str]:
        """Session ids parked in host memory (runner/parking.py), least recently parked first."""
        return self.parking.sessions()

    def is_resident(self, session_id: str) -> bool:
        """Whether this runner holds the session: in the pool, or parked (its next use restores it)."""
        return session_id in self._sessions or session_id in self.parking

    def in_pool(self, session_id: str) -> bool:
        """Whether the session holds pool blocks now (not parked)."""
        return session_id in self._sessions

    def next_chunk_index(self, session_id: str) -> int:
        """The ``chunk_index`` the session's next chunk will have (0 when it is not held: a new rollout)."""
        state = self._sessions.get(session_id)
        if state is None:
            parked = self.parking.get(session_id)
            return 0 if parked is None else parked.chunk_index
        return state.chunk_index

    def kv_state(self, session_id: str) -> SessionKVState | None:
        """The session's KV state between forwards (for :mod:`arstream.runner.snapshot`), or None.

        A parked session is restored first (exports take it from its host copy
        instead: :func:`~arstream.runner.snapshot.export_parked`). With parking on,
        the session is then kept in the pool (never parked or evicted to make room)
        until its next chunk or its release: an export reads its blocks in pieces
        between others' forwards.
        """
        state = self._resident_state(session_id)
        if state is not None and self.parking.enabled:
            self._pinned.add(session_id)
        return state

    def _resident_state(self, session_id: str) -> SessionKVState | None:
        """The session's KV state, restored first when it is parked; None when the runner does not hold it."""
        state = self._sessions.get(session_id)
        if state is None and session_id in self.parking:
            state = self._restore(session_id)
        return state

    def make_room(self, *, evict: bool = False) -> bool:
        """Free a pool slot for an incoming session by parking the least recently used one (an import).

        With ``evict`` a session past the park room is ended (as a new session's
        first tick does); without, returns False when no slot can be freed.
        """
        return self._make_room(evict=evict)

    def adopt_kv_state(self, state: SessionKVState) -> None:
        """Make an imported session resident (most recently used); the caller filled ``state`` from a snapshot."""
        if state.pool is not self.pool or state.session_id in self._sessions:
            raise ValueError(f"cannot adopt session {state.session_id!r}: another pool's, or already resident")
        self._sessions[state.session_id] = state
        self._last_used[state.session_id] = self._clock()
        if self.rewind:  # its boundaries stayed behind: it can rewind to those it passes from here
            self._rewind[state.session_id] = RewindPoints(self.pool, self.rewind)

    def _get_or_create(self, session_id: str) -> SessionKVState:
        state = self._resident_state(session_id)
        if state is None:
            self._make_room()
            state = SessionKVState(self.pool, session_id)
            self._sessions[session_id] = state
            if self.rewind:
                self._rewind[session_id] = RewindPoints(self.pool, self.rewind)
        self._pinned.discard(session_id)  # it runs a chunk: an export of it is over
        self._touch(session_id)
        return state

    def _touch(self, session_id: str) -> None:
        """The session was just used: most recently used, and its idle time starts again."""
        self._sessions.move_to_end(session_id)
        self._last_used[session_id] = self._clock()

    def _make_room(self, *, evict: bool = True) -> bool:
        """Until a pool slot is free: park the least recently used parkable session, else end the oldest (evict)."""
        while len(self._sessions) >= self.session_capacity:
            victim = next((s for s in self._sessions if self._parkable(s)), None)
            if victim is not None and self._park(victim):
                continue
            if not evict:
                return False
            oldest = next((s for s in self._sessions if s not in self._pinned), None)
            if oldest is None:  # ending one would break an export reading its blocks
                raise PoolExhausted(f"all {self.session_capacity} session slots hold sessions being exported")
            self._release(oldest, reset_model=False, reason="lru_eviction", suppress_errors=True)
            self.counters.evictions_total += 1
            if self.on_evict is not None:
                self.on_evict(oldest)
        return True

    # ---- parking (runner/parking.py) --------------------------------------------------

    @property
    def park_capacity(self) -> int:
        """Most sessions parked at once: each park budget over a session's worst-case bytes.

        Apiece, since a parked session is kept whole in host memory or in a file: so whenever fewer are
        parked, one more fits somewhere, and a restore's swap never finds the lot too small.
        """
        if not self.parking.enabled or not isinstance(self.pipeline, SupportsSessionTransfer):
            return 0
        per_session = max(self.plan.per_session_bytes, 1)
        return self.parking.budget_bytes // per_session + self.parking.spill_budget_bytes // per_session

    def _parkable(self, session_id: str) -> bool:
        """Whether the session can be parked now: at its chunk boundary, no decode of it in flight, not exported."""
        state = self._sessions.get(session_id)
        pipeline = self.pipeline
        if state is None or session_id in self._pinned or not self.park_capacity:
            return False
        if state.in_pass or state.chunk_held or any(state.pending.values()) or state.rewritten:
            return False
        if any(sid == session_id for sid, _b, _p in self._unfinished_boundaries):
            return False
        return not (self.split_decode and isinstance(pipeline, SupportsSplitDecode) and pipeline.decode_in_flight(session_id))

    def park_session(self, session_id: str) -> bool:
        """Park a session now (it detached: its next use restores it); whether it was parked."""
        return self._parkable(session_id) and self._park(session_id)

    def restore_session(self, session_id: str) -> bool:
        """Bring a parked session back into the pool now (ahead of its next tick, e.g. as it resumes); whether it
        was parked. A failed restore ends it and raises :class:`RestoreFailed`."""
        if session_id not in self.parking:
            return False
        self._resident_state(session_id)
        return True

    def park_idle(self) -> int:
        """Park every session idle for ``park_after_s`` or longer; how many were parked."""
        after = self.parking_policy.after_s
        if after is None:
            return 0
        now = self._clock()
        idle = [s for s in self._sessions if now - self._last_used.get(s, now) >= after and self._parkable(s)]
        return sum(1 for s in idle if self._park(s))

    def _park(self, session_id: str) -> bool:
        """Move a parkable session to the parking lot; False (nothing changed) when it does not fit or fails."""
        if len(self.parking) >= self.park_capacity:
            return False
        pipeline = self.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)  # else park_capacity is 0
        state = self._sessions[session_id]
        points = self._rewind.get(session_id)
        started = time.perf_counter()
        try:
            boundaries = [] if points is None else points.boundaries()
            layout, tensors, ready = park_payload(
                self.pool, state, boundaries, pipeline.export_session_state(session_id), copy_stream=self._copy_stream
            )
            layout["rewound"] = session_id in self._rewound
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            if not self.parking.room_for(nbytes):
                return False
            held = self.rewind_held(session_id)
            parked = ParkedSession(
                session_id,
                layout,
                tensors,
                nbytes,
                last_used=self._last_used.get(session_id, self._clock()),
                chunk_index=state.chunk_index,
                history_frames=state.history_frames(self.spec.branch_names[0]),
                rewind_held=held,
                ready=ready,
            )
            self.parking.put(parked)
        except Exception as exc:  # noqa: BLE001 - the session stays resident; making room may end it instead
            log.warning("session=%s could not be parked (%s: %s)", session_id, type(exc).__name__, exc)
            return False
        # Its state is in the lot: the device side goes (blocks, boundaries, the pipeline's copy), not the session.
        del self._sessions[session_id]
        self._rewind.pop(session_id, None)
        self._rewound.discard(session_id)
        errors: list[Exception] = []
        for owner in (state, points):
            try:
                if owner is not None:
                    owner.release()
            except Exception as exc:  # noqa: BLE001 - each step is attempted
                errors.append(exc)
        try:
            pipeline.close_session(session_id)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        if errors:
            log.warning("session=%s parked; releasing its device state had errors: %s", session_id, errors)
        self.counters.parked(time.perf_counter() - started)
        log.debug("parked session=%s (%d bytes)", session_id, nbytes)
        return True

    def _restore(self, session_id: str) -> SessionKVState:
        """Bring a parked session back into the pool, parking another to make room; a failure ends it and raises
        RestoreFailed.

        It leaves the lot before room is made: with every slot and park place held the lot is full, and the
        least recently used resident session takes its place there (a swap). Made the other way round, no
        session could be parked and making room would end one that a connection holds.
        """
        pipeline = self.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)
        if len(self._sessions) >= self.session_capacity and self._pinned.issuperset(self._sessions):
            raise PoolExhausted(f"all {self.session_capacity} session slots hold sessions being exported")
        started = time.perf_counter()
        try:
            parked, tensors = self.parking.take(session_id)
            self._make_room()
            restored = restore_payload(self.pool, session_id, parked.layout, tensors)
            try:
                pipeline.import_session_state(session_id, restored.live_model)
                points = RewindPoints(self.pool, self.rewind) if self.rewind else None
                if points is not None:
                    points.restore(restored.boundaries)
                elif restored.boundaries:
                    raise RestoreFailed("the session was parked with rewind points this runner does not keep")
            except BaseException:
                restored.state.release()
                self.pool.free(i for b in restored.boundaries for i in b.tables.blocks())
                raise
        except Exception as exc:  # noqa: BLE001 - fail closed: the session ends, the pool is back at baseline
            self.counters.failures_total += 1
            self.counters.restore_failures_total += 1
            self._release(session_id, reset_model=False, reason="restore_failed", suppress_errors=True)
            log.warning("session=%s could not be restored from parking (%s: %s); it ended", session_id, type(exc).__name__, exc)
            raise RestoreFailed(
                f"the session was parked in host memory and could not be restored ({type(exc).__name__}: {exc})"
            ) from exc
        state = restored.state
        self._sessions[session_id] = state
        if points is not None:
            self._rewind[session_id] = points
        if parked.layout.get("rewound"):
            self._rewound.add(session_id)
        self._last_used[session_id] = self._clock()
        self.counters.restored(time.perf_counter() - started)
        return state

    def _release(self, session_id: str, *, reset_model: bool, reason: str, suppress_errors: bool = False) -> None:
        """The one release path for reset, close, eviction and failure (its boundaries, or its parked copy, go too)."""
        state = self._sessions.pop(session_id, None)
        points = self._rewind.pop(session_id, None)
        self._rewound.discard(session_id)
        self._last_used.pop(session_id, None)
        self._pinned.discard(session_id)
        self.parking.discard(session_id)
        errors: list[Exception] = []
        for owner in (state, points):
            if owner is None:
                continue
            try:
                owner.release()
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
            self._record_boundary(session_id, state)
            state.prepare_forward(staging_row=0, hold_commit=False)
            with self.pipeline.bind_session_state(session_id, state):
                yield state
            self._sync(self.device)
        except BaseException:
            self.counters.failures_total += 1
            self._release(session_id, reset_model=False, reason="forward_exception", suppress_errors=True)
            log.warning("forward failed for session=%s; its KV and model state were released", session_id)
            raise

    # ---- rewind and branch ----------------------------------------------------------

    def rewind_points(self, session_id: str) -> tuple[int, int] | None:
        """``(oldest, newest)`` boundaries ``rewind_to`` may name now (newest: where the session is); None when off.

        A session that is not resident is at boundary 0 of a new rollout: ``(0, 0)``.
        """
        held = self.rewind_held(session_id)
        return None if held is None else (held[0], held[-1])

    def rewind_held(self, session_id: str) -> tuple[int, ...] | None:
        """Every boundary ``rewind_to`` may name now, oldest first (the last: where the session is); None when off.

        Between :meth:`rewind_points`' two ends only these are held: older boundaries are thinned out.
        """
        if self.rewind_refusal:
            return None
        state = self._sessions.get(session_id)
        if state is None:
            parked = self.parking.get(session_id)
            return (0,) if parked is None or parked.rewind_held is None else parked.rewind_held
        return self._rewind[session_id].indices(state.chunk_index)

    def branch_session(self, source_id: str, boundary: int | None, new_session_id: str) -> int:
        """Make ``new_session_id`` a resident session that continues from ``source_id``'s boundary ``boundary``.

        ``boundary`` None is the latest: where the source is now. Returns the
        boundary; the new session's next chunk has that ``chunk_index``; it shares the
        boundary's blocks with the source (copy-on-write: neither ever writes
        a committed block) and gets a copy of the model-owned state there.
        Room is made like for any new session (LRU eviction; the source counts
        as just used). :class:`RewindUnavailable` if the boundary is not held,
        before anything changes.
        """
        if self.rewind_refusal:
            raise RewindUnavailable(self.rewind_refusal)
        if self.is_resident(new_session_id):
            raise ValueError(f"cannot branch into session {new_session_id!r}: it is already resident")
        source = self._resident_state(source_id)
        if source is None:  # the message reaches clients: no internal session id in it
            raise RewindUnavailable("the shared session is not resident here; it holds no chunk boundaries")
        index = source.chunk_index if boundary is None else boundary
        branch = self._share_boundary(source_id, index)
        self._touch(source_id)
        adopted = False
        try:
            self._get_or_create(new_session_id).adopt_tables(branch.tables)
            adopted = True
            self._install_model_state(new_session_id, branch)
        except BaseException:
            if not adopted:
                self.pool.free(branch.tables.blocks())
            self._release(new_session_id, reset_model=False, reason="branch_failed", suppress_errors=True)
            raise
        return index

    def _share_boundary(self, session_id: str, index: int) -> Boundary:
        """Boundary ``index`` of a resident session, for a branch (references and a model-state copy of its own)."""
        state = self._sessions[session_id]
        if index == state.chunk_index:
            return Boundary(state.share_tables(), self._export_model_state(session_id))
        points = self._rewind[session_id]
        if not points.holds(index):
            raise self._not_held(session_id, index)
        return points.share(index)

    def _not_held(self, session_id: str, index: object) -> RewindUnavailable:
        """The refusal clients see (so no internal session id): what is held instead."""
        held = self.rewind_held(session_id) or (0,)
        shown = ", ".join(map(str, held)) if len(held) <= 12 else f"{held[0]}..{held[-1]} ({len(held)} of them)"
        schedule = self.rewind.describe(self.spec) if self.rewind else "rewind off"
        return RewindUnavailable(
            f"chunk boundary {index!r} is not held: the session holds boundaries {shown} of its current rollout "
            f"({schedule})"
        )

    def _export_model_state(self, session_id: str, previous: ModelState | None = None) -> ModelState:
        pipeline = self.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)  # else rewind_refusal says so
        return copy_model_state(pipeline.export_session_state(session_id), previous)

    def _install_model_state(self, session_id: str, boundary: Boundary) -> None:
        pipeline = self.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)
        pipeline.reset_session(session_id)  # a boundary before the first chunk has no model state to import
        pipeline.import_session_state(session_id, boundary.model)

    def _record_boundary(self, session_id: str, state: SessionKVState) -> None:
        """Keep the boundary the session's next chunk starts from (once: a batch retried alone keeps it).

        With a split decode whose previous chunk is still decoding, the boundary
        takes the forward's state now and the decoder's once that decode is done
        (:meth:`complete_boundaries`): waiting here would undo the overlap.
        """
        points = self._rewind.get(session_id)
        newest = None if points is None else points.newest
        if points is None or (newest is not None and newest.index == state.chunk_index):
            return
        previous = None if newest is None else newest.model
        pipeline = self.pipeline
        if self.split_decode and isinstance(pipeline, SupportsSplitDecode) and pipeline.decode_in_flight(session_id):
            boundary = Boundary(state.share_tables(), copy_model_state(pipeline.export_forward_state(session_id), previous))
            self._unfinished_boundaries.append((session_id, boundary, newest))
        else:
            boundary = Boundary(state.share_tables(), self._export_model_state(session_id, previous))
        points.record(boundary)

    def complete_boundaries(self) -> None:
        """Give the boundaries recorded while a decode was in flight their decoder state, now that it is done.

        Called on the runner's thread once the decode of the chunk before each
        such boundary has ended and before the next one starts (the worker
        does, when it joins its decode stage), so the decoder state is exactly
        the boundary's. A session released meanwhile took its boundaries along.
        """
        unfinished, self._unfinished_boundaries = self._unfinished_boundaries, []
        pipeline = self.pipeline
        for session_id, boundary, before in unfinished:
            points = self._rewind.get(session_id)
            if points is None or not points.holds(boundary.index) or not isinstance(pipeline, SupportsSplitDecode):
                continue
            previous = None if before is None else before.model  # completed by now: boundaries complete in order
            decoder = copy_model_state(pipeline.export_decoder_state(session_id, boundary.index), previous)
            boundary.model = boundary.model.merge(decoder)

    def _check_rewind(self, tick: TickRequest) -> None:
        """Raise :class:`RewindUnavailable` unless ``tick.rewind_to`` names a boundary held (after its reset)."""
        target = tick.rewind_to
        if self.rewind_refusal:
            raise RewindUnavailable(self.rewind_refusal)
        if not isinstance(target, int) or isinstance(target, bool):
            raise RewindUnavailable(f"rewind_to must be a chunk boundary (an integer), got {target!r}")
        if tick.reset:  # the reset drops every boundary but the new rollout's first
            if target != 0:
                raise RewindUnavailable(f"chunk boundary {target} is not held after a reset; only 0 is")
            return
        # answered from a parked session's copy too: a refusal restores nothing
        now = self.next_chunk_index(tick.session_id)
        if target != now and target not in (self.rewind_held(tick.session_id) or ()):
            raise self._not_held(tick.session_id, target)

    def _rewind_session(self, session_id: str, index: int) -> None:
        """Go back to a held boundary (checked by :meth:`_check_rewind`); fails closed if the state will not go back."""
        state = self._sessions.get(session_id)
        if state is None or index == state.chunk_index:
            return
        self._rewound.add(session_id)
        boundary = self._rewind[session_id].take(index)
        adopted = False
        try:
            state.adopt_tables(boundary.tables)
            adopted = True
            self._install_model_state(session_id, boundary)
        except BaseException:
            if not adopted:
                self.pool.free(boundary.tables.blocks())
            self.counters.failures_total += 1
            self._release(session_id, reset_model=False, reason="rewind_failed", suppress_errors=True)
            raise

    def _before_forward(self, tick: TickRequest) -> None:
        """Check ``rewind_to`` first (a refusal changes nothing), then reset, then rewind."""
        if tick.rewind_to is not None:
            self._check_rewind(tick)
        if tick.reset:
            self.reset_session(tick.session_id)
        if tick.rewind_to is not None:
            self._resident_state(tick.session_id)  # a parked session's boundaries come back to the pool first
            self._rewind_session(tick.session_id, tick.rewind_to)

    def _result(
        self,
        tick: TickRequest,
        chunk_index: int,
        frames: np.ndarray,
        compute_s: float,
        new_rollout: bool,
        pending: PendingDecode | None = None,
    ) -> ChunkResult:
        return ChunkResult(
            pending=pending,
            session_id=tick.session_id,
            request_id=tick.request_id,
            chunk_index=chunk_index,
            frames=frames,
            compute_s=compute_s,
            new_rollout=new_rollout,
            applied_event_ids=tick.applied_event_ids,
            restarted="rewind" if _take(self._rewound, tick.session_id) else None,
            rewind_points=self.rewind_points(tick.session_id),
            rewind_held=self.rewind_held(tick.session_id),
        )

    # ---- execution ----------------------------------------------------------------

    def execute(self, ticks: Sequence[TickRequest]) -> list[TickResult]:
        """Run ticks of any sessions; one result per tick, in the order of ``ticks``.

        Ticks of one session run in the order given. Among ticks of distinct
        sessions, resets run first; then sessions whose visible histories are
        equally long share one forward (up to :attr:`batch_limit`, when the
        pipeline batches), so their rows stack without padding: new sessions
        batch with new ones, long-running ones (all at sink + window) with
        each other. Closes run after the chunks.

        A tick whose forward (or reset, or close) raises gets a
        :class:`TickFailure` in its place and its session is released, as
        with :meth:`execute_tick`; the other ticks' results are unaffected.
        """
        results: list[TickResult | None] = [None] * len(ticks)
        for run in _distinct_session_runs(ticks):
            for i in run:
                if ticks[i].reset or ticks[i].rewind_to is not None:
                    results[i] = self._attempt(ticks[i], self._before_forward)
            waiting = [i for i in run if results[i] is None]
            while waiting:
                # Recomputed each round: a batch of new sessions may have evicted a waiting one.
                history = self.history_frames(ticks[waiting[0]].session_id)
                group = [i for i in waiting if self.history_frames(ticks[i].session_id) == history][: self.batch_limit]
                waiting = [i for i in waiting if i not in group]
                group = self._restore_group(ticks, group, results)
                if not group:
                    continue
                group_ticks = [ticks[i] for i in group]
                if len(group) > 1:
                    forwarded = self._forward_batch(group_ticks)
                else:
                    forwarded = [self._forward_or_failure(group_ticks[0])]
                for i, result in zip(group, forwarded):
                    results[i] = result
                    if ticks[i].close and isinstance(result, ChunkResult):
                        closed = self._attempt(ticks[i], lambda tick: self.close_session(tick.session_id))
                        results[i] = result if closed is None else closed
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _restore_group(
        self, ticks: Sequence[TickRequest], group: list[int], results: list[TickResult | None]
    ) -> list[int]:
        """Restore the parked sessions of one forward's group; a failed restore is that tick's result.

        The group's resident sessions count as just used first, so bringing one
        back never parks another member of the same forward.
        """
        for i in group:
            if ticks[i].session_id in self._sessions:
                self._touch(ticks[i].session_id)
        kept = []
        for i in group:
            failure = self._attempt(ticks[i], lambda tick: self._resident_state(tick.session_id))
            if failure is None:
                kept.append(i)
            else:
                results[i] = failure
        return kept

    def execute_tick(self, tick: TickRequest) -> ChunkResult:
        """Reset and rewind before (if asked), one bound forward, close after (if asked); raises if the forward does.

        A ``rewind_to`` that is not held raises :class:`RewindUnavailable` before anything changes.
        """
        self._before_forward(tick)
        result = self._decoded(self._forward_alone(tick))
        if tick.close:
            self.close_session(tick.session_id)
        return result

    def _attempt(self, tick: TickRequest, step: Callable[[TickRequest], object]) -> TickFailure | None:
        try:
            step(tick)
        except Exception as exc:  # noqa: BLE001 - reported in the tick's place
            return TickFailure(tick.session_id, tick.request_id, exc)
        return None

    def _forward_or_failure(self, tick: TickRequest) -> TickResult:
        try:
            return self._forward_alone(tick)
        except Exception as exc:  # noqa: BLE001 - the session was released; reported in the tick's place
            return TickFailure(tick.session_id, tick.request_id, exc)

    def _forward_alone(self, tick: TickRequest) -> ChunkResult:
        """One bound forward of one session with ``generate_chunk``; fails closed."""
        new_rollout = tick.session_id not in self._sessions or self._sessions[tick.session_id].chunks_committed == 0
        started = time.perf_counter()
        pending: PendingDecode | None = None
        with self._bound(tick.session_id) as state:
            chunk_index = state.chunk_index
            if self.split_decode:
                assert isinstance(self.pipeline, SupportsSplitDecode)
                pending = _one_pending(self.pipeline.generate_latents([tick]), tick)
                frames = NOT_DECODED
            else:
                frames = self.pipeline.generate_chunk(tick)
                _check_frames(frames, self.video_frames(chunk_index))
            if state.chunk_index != chunk_index + 1:
                raise RuntimeError(
                    f"pipeline did not commit exactly one chunk (chunk index {chunk_index} -> {state.chunk_index})"
                )
        compute_s = time.perf_counter() - started
        self.counters.chunks(compute_s)
        return self._result(tick, chunk_index, frames, compute_s, new_rollout, pending)

    def _forward_batch(self, ticks: Sequence[TickRequest]) -> list[TickResult]:
        """One forward for distinct sessions with equally long histories; if the model raises, each tick alone.

        Each session gets its own staging row and its chunk is held until the
        whole forward (device sync included) succeeded. If ``generate_chunks``
        raises, the pipeline's contract says no model-owned state advanced, so
        the runner undoes the KV side for every session and retries each tick
        alone: only a session whose own forward fails is released. A failure
        after ``generate_chunks`` returned (wrong frames, a missing commit,
        an error surfacing at the device sync) cannot be pinned on one row and
        the model state has moved on, so every session of the batch fails closed.
        """
        assert isinstance(self.pipeline, SupportsBatchedChunks)
        states: list[SessionKVState] = []
        generated = False
        started = time.perf_counter()
        try:
            with ExitStack() as bindings:
                for row, tick in enumerate(ticks):
                    state = self._get_or_create(tick.session_id)
                    states.append(state)
                    self._record_boundary(tick.session_id, state)
                    state.prepare_forward(staging_row=row, hold_commit=True)
                    bindings.enter_context(self.pipeline.bind_session_state(tick.session_id, state))
                pendings: list[PendingDecode | None] = [None] * len(ticks)
                if self.split_decode:
                    assert isinstance(self.pipeline, SupportsSplitDecode)
                    pendings = list(self.pipeline.generate_latents(ticks))
                    generated = True
                    frames = [NOT_DECODED] * len(ticks)
                    _check_pending(pendings, ticks)
                    _check_commits(states)
                else:
                    frames = self.pipeline.generate_chunks(ticks)
                    generated = True
                    _check_batch(frames, states, [self.video_frames(s.chunk_index) for s in states])
            self._sync(self.device)
        except BaseException as exc:
            if generated:
                self._fail_batch(ticks, exc)
                if not isinstance(exc, Exception):
                    raise
                return [TickFailure(t.session_id, t.request_id, exc) for t in ticks]
            aborted = self._abort_batch(ticks, states, exc)
            if not isinstance(exc, Exception):
                raise
            return [aborted.get(t.session_id) or self._forward_or_failure(t) for t in ticks]
        for state in states:
            state.accept_chunk()
        compute_s = time.perf_counter() - started
        self.counters.batched_forwards_total += 1
        self.counters.chunks(compute_s, len(ticks))
        return [
            self._result(tick, state.chunk_index - 1, chunk, compute_s, state.chunk_index == 1, pending)
            for tick, state, chunk, pending in zip(ticks, states, frames, pendings)
        ]

    # ---- split decode ---------------------------------------------------------------

    def decode_chunks(self, results: Sequence[ChunkResult]) -> list[TickResult]:
        """Decode one round's pending chunks (distinct sessions); a chunk without ``pending`` passes as it is.

        Safe on another thread while :meth:`execute` runs: it calls only the
        pipeline's ``decode_latents`` and touches no session. If the decode of
        the whole round raises, each chunk is decoded again alone (the
        pipeline stores a decoder state only on success), so only a session
        whose own decode fails gets a :class:`TickFailure`: the caller then
        releases it with :meth:`fail_session` on the runner's thread.
        """
        out: list[TickResult] = list(results)
        todo = [i for i, r in enumerate(results) if r.pending is not None]
        if not todo:
            return out
        try:
            self._decode_into(out, results, todo)
            return out
        except Exception as exc:  # noqa: BLE001 - reported in the tick's place, or retried alone
            if len(todo) == 1:
                r = results[todo[0]]
                out[todo[0]] = TickFailure(r.session_id, r.request_id, exc)
                return out
            log.warning("decoding %d chunks together failed (%s: %s); each alone", len(todo), type(exc).__name__, exc)
        for i in todo:
            try:
                self._decode_into(out, results, [i])
            except Exception as exc:  # noqa: BLE001 - only this session fails
                out[i] = TickFailure(results[i].session_id, results[i].request_id, exc)
        return out

    def _decode_into(self, out: list[TickResult], results: Sequence[ChunkResult], rows: list[int]) -> None:
        started = time.perf_counter()
        chunks = [results[i].pending for i in rows]
        frames = self._decode([c for c in chunks if c is not None], [results[i] for i in rows])
        decode_s = time.perf_counter() - started
        self.counters.decodes(decode_s, len(rows))
        for i, chunk in zip(rows, frames):
            r = results[i]
            out[i] = replace(r, frames=chunk, pending=None, decode_s=decode_s, compute_s=r.compute_s + decode_s)

    def _decode(self, chunks: list[PendingDecode], results: list[ChunkResult]) -> list[np.ndarray]:
        assert isinstance(self.pipeline, SupportsSplitDecode)
        frames = self.pipeline.decode_latents(chunks)
        if not isinstance(frames, list) or len(frames) != len(chunks):
            raise ChunkShapeError(f"decode_latents must return a list of {len(chunks)} frame arrays")
        for chunk, result in zip(frames, results):
            _check_frames(chunk, self.video_frames(result.chunk_index))
        self._sync(self.device)
        return frames

    def fail_session(self, session_id: str, reason: str = "decode_failed") -> None:
        """Release a session whose chunk failed after its forward (its decode): fail closed, every block back."""
        self.counters.failures_total += 1
        self._release(session_id, reset_model=False, reason=reason, suppress_errors=True)
        log.warning("session=%s failed after its forward (%s); its KV and model state were released", session_id, reason)

    def _decoded(self, result: ChunkResult) -> ChunkResult:
        """A chunk decoded in line (execute_tick, warm-up); a failed decode releases its session and raises."""
        if result.pending is None:
            return result
        (decoded,) = self.decode_chunks([result])
        if isinstance(decoded, TickFailure):
            self.fail_session(result.session_id)
            raise decoded.error
        return decoded

    def _fail_batch(self, ticks: Sequence[TickRequest], error: BaseException) -> None:
        """Release every session of a batch that failed after the pipeline's forward returned."""
        self.counters.failures_total += len(ticks)
        for tick in ticks:
            self._release(tick.session_id, reset_model=False, reason="forward_exception", suppress_errors=True)
        log.warning(
            "batched forward of %d sessions failed after the model ran (%s: %s); all of them were released",
            len(ticks),
            type(error).__name__,
            error,
        )

    def _abort_batch(
        self, ticks: Sequence[TickRequest], states: list[SessionKVState], error: BaseException
    ) -> dict[str, TickFailure]:
        """Put every session of a failed batch back as it was; a session that cannot be is released."""
        self.counters.batch_fallbacks_total += 1
        log.warning(
            "batched forward of %d sessions failed (%s: %s); running each alone",
            len(ticks),
            type(error).__name__,
            error,
        )
        failed: dict[str, TickFailure] = {}
        for tick, state in zip(ticks, states):
            try:
                state.abort_forward()
            except Exception as exc:  # noqa: BLE001 - fail closed: release rather than retry from doubtful KV
                self.counters.failures_total += 1
                self._release(tick.session_id, reset_model=False, reason="batch_abort_failed", suppress_errors=True)
                failed[tick.session_id] = TickFailure(tick.session_id, tick.request_id, exc)
        return failed

    def warmup(self) -> int:
        """Run the pipeline's warm-up ticks through the real path at every batch size; return the chunks run.

        Size 1 runs the warm-up ticks for one synthetic session; each larger
        size up to :attr:`batch_limit` runs them for that many sessions in lock
        step (one :meth:`execute` call per step, as the worker does), so the first
        crowded round meets no cold kernels. :attr:`warmup_round_s` keeps the
        median time of one step per size: the first figures for realtime
        admission. The synthetic sessions are always released and the pool
        must end as it began.
        """
        if not isinstance(self.pipeline, SupportsWarmup):
            return 0
        free_before = self.pool.num_free
        ran = 0
        session_ids = [WARMUP_SESSION_ID] + [f"{WARMUP_SESSION_ID}{row}" for row in range(1, self.batch_limit)]
        try:
            for size in range(1, self.batch_limit + 1):
                rows = [list(self.pipeline.warmup_requests(session_id)) for session_id in session_ids[:size]]
                steps: list[float] = []
                for ticks in zip(*rows):
                    started = time.perf_counter()
                    executed = self.execute(ticks)
                    decoded = self.decode_chunks([r for r in executed if isinstance(r, ChunkResult)])
                    for result in [*executed, *decoded]:
                        if isinstance(result, TickFailure):
                            raise result.error
                    steps.append(time.perf_counter() - started)
                    ran += size
                if steps:
                    self.warmup_round_s[size] = statistics.median(steps)
                for session_id in session_ids[:size]:
                    self._release(session_id, reset_model=False, reason="warmup_complete")
        finally:
            for session_id in session_ids:
                if session_id in self._sessions:  # left over by a warm-up step that raised
                    self._release(session_id, reset_model=False, reason="warmup_complete", suppress_errors=True)
            self.counters.forget_warmup()
        if self.pool.num_free != free_before:
            raise RuntimeError(f"warm-up did not restore the KV pool (free {free_before} -> {self.pool.num_free})")
        return ran

    def stats(self) -> RunnerStats:
        return RunnerStats.build(
            spec=self.spec,
            counters=self.counters,
            blocks_total=self.pool.num_blocks,
            blocks_free=self.pool.num_free,
            blocks_used=self.pool.num_used,
            scratch_blocks=self.plan.scratch_blocks,
            block_bytes=self.plan.block_bytes,
            pool_bytes=self.plan.pool_bytes,
            session_capacity=self.session_capacity,
            sessions_resident=len(self._sessions),
            batch_limit=self.batch_limit,
            rewind_points=0 if self.rewind is None else self.rewind.peak(self.spec).copies,
            rewind_seconds=0.0 if self.rewind is None else self.rewind.seconds,
            park_capacity=self.park_capacity,
            sessions_parked=len(self.parking),
            sessions_spilled=self.parking.spilled_sessions,
            parked_bytes=self.parking.host_bytes,
            spilled_bytes=self.parking.spilled_bytes,
            park_budget_bytes=self.parking.budget_bytes,
        )

    def model_card(self) -> dict[str, Any]:
        return {**self.pipeline.model_card(), "runtime": RUNTIME}

    def prepare_prompt(self, prompt: str) -> str:
        """A client's prompt as the model reads it (the server calls it as the prompt arrives, on its own thread)."""
        return prepare_prompt(self.pipeline, prompt)


def _video_frames(card: dict[str, Any], spec: KVCacheSpec) -> tuple[int, int]:
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


def _take(members: set[str], member: str) -> bool:
    """Whether ``member`` was in ``members``; it is not any more."""
    if member in members:
        members.remove(member)
        return True
    return False


def _check_frames(frames: object, expected: int) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        got = f"{type(frames).__name__} {getattr(frames, 'dtype', '')} {getattr(frames, 'shape', '')}"
        raise ChunkShapeError(f"pipeline must return uint8 [F, H, W, 3] frames, got {got}")
    if frames.shape[0] != expected:
        raise ChunkShapeError(f"pipeline returned {frames.shape[0]} frames, the model card says {expected}")


def _one_pending(chunks: object, tick: TickRequest) -> PendingDecode:
    _check_pending(chunks, [tick])
    assert isinstance(chunks, list)
    return chunks[0]


def _check_pending(chunks: object, ticks: Sequence[TickRequest]) -> None:
    if not isinstance(chunks, list) or len(chunks) != len(ticks):
        got = len(chunks) if isinstance(chunks, list) else type(chunks).__name__
        raise ChunkShapeError(f"generate_latents must return a list of {len(ticks)} PendingDecode, got {got}")
    for chunk, tick in zip(chunks, ticks):
        if not isinstance(chunk, PendingDecode) or chunk.session_id != tick.session_id:
            raise ChunkShapeError(f"generate_latents must return a PendingDecode for session {tick.session_id!r}")


def _check_commits(states: Sequence[SessionKVState]) -> None:
    for state in states:
        if state.in_pass or not state.chunk_held:
            raise RuntimeError(f"pipeline did not commit exactly one chunk for session {state.session_id!r}")


def _check_batch(frames: object, states: Sequence[SessionKVState], expected: Sequence[int]) -> None:
    if not isinstance(frames, list) or len(frames) != len(states):
        got = len(frames) if isinstance(frames, list) else type(frames).__name__
        raise ChunkShapeError(f"generate_chunks must return a list of {len(states)} frame arrays, got {got}")
    for chunk, count in zip(frames, expected):
        _check_frames(chunk, count)
    _check_commits(states)


def _distinct_session_runs(ticks: Sequence[TickRequest]) -> Iterator[list[int]]:
    """Indices of ``ticks`` cut into consecutive runs in which no session appears twice."""
    run: list[int] = []
    seen: set[str] = set()
    for i, tick in enumerate(ticks):
        if tick.session_id in seen:
            yield run
            run, seen = [], set()
        run.append(i)
        seen.add(tick.session_id)
    if run:
        yield run


def runner_for_sessions(
    pipeline: ARPipeline,
    sessions: int,
    *,
    max_batch_sessions: int = 1,
    device: torch.device | str = "cpu",
    rewind: RewindSchedule | None = None,
    split_decode: bool = False,
    parking: ParkingPolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ARRunner:
    """A runner whose pool has room for exactly ``sessions`` resident sessions (benches, evaluation, tests)."""
    budget = budget_for_sessions(
        pipeline.kv_cache_spec(), sessions, max_batch_sessions=max_batch_sessions, rewind=rewind
    )
    return ARRunner(
        pipeline,
        device=device,
        kv_budget_bytes=budget,
        max_batch_sessions=max_batch_sessions,
        rewind=rewind,
        split_decode=split_decode,
        parking=parking,
        clock=clock,
    )


def rewind_for(pipeline: ARPipeline, *, seconds: float, budget_bytes: int) -> RewindSchedule | None:
    """The rewind schedule a server gives this pipeline: ``seconds`` of play within ``budget_bytes`` per session.

    The play rate (chunks per second) is the model card's ``fps`` over its
    ``frames_per_chunk``; a card without ``fps`` gets no rewind (logged).
    """
    if seconds == 0:
        return None
    card = pipeline.model_card()
    fps = card.get("fps") if isinstance(card, dict) else None
    if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps <= 0:
        log.info("rewind off: the model card gives no fps, so %g s of play is no chunk count", seconds)
        return None
    spec = pipeline.kv_cache_spec()
    per_chunk, _first = _video_frames(card, spec)
    schedule = plan_rewind(spec, chunks_per_second=fps / per_chunk, seconds=seconds, budget_bytes=budget_bytes)
    if schedule is None or schedule.seconds < seconds:
        log.warning(
            "a rewind horizon of %g s does not fit %d bytes per session; %s",
            seconds,
            budget_bytes,
            "rewind is off" if schedule is None else f"it reaches back {schedule.seconds:g} s (--rewind-budget-mib)",
        )
    return schedule


def _rewind_refusal(pipeline: ARPipeline, spec: KVCacheSpec, rewind: RewindSchedule | None) -> str | None:
    """Why this runner cannot offer rewind and branch, or None when it can."""
    if rewind is None:
        return "rewind is off (no rewind horizon)"
    if not isinstance(pipeline, SupportsSessionTransfer):
        name = pipeline.model_card().get("name")
        return f"model {name!r} cannot snapshot its per-session state (no export_session_state hook)"
    if spec.cross_attention_lengths:
        return "rewind does not snapshot cross-attention caches, which this model's KV spec declares"
    return None
