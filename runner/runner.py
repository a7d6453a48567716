"""ARRunner: the forward path over the paged pool, fail-closed, one or several sessions per forward.

The runner never inspects model internals. It builds the pool from the
pipeline's :class:`KVCacheSpec` and binds an admitted session's
:class:`SessionKVState` for one forward at a time. Where sessions live is
the session table's (runner/session_table.py: LRU order, admission to the
pool, the one release path for reset, close, eviction and failure); the
runner keeps the forward path and hands each part to its owner:

- Rewind and branch (a ``rewind`` schedule, runner/rewinds.py): each session
  keeps the chunk boundaries of its last seconds of play, sharing blocks with
  its live history; ``TickRequest.rewind_to`` goes back to one before the
  chunk runs, and :meth:`ARRunner.branch_session` starts a new session from one.
- Parking (a :class:`~arstream.runner.types.ParkingPolicy` with a budget,
  runner/session_parking.py): the LRU victim of a full pool, an idle session and
  one the server parks move to host memory and come back on their next use.
- Split decode (``split_decode=True`` and a pipeline that implements
  :class:`SupportsSplitDecode`, runner/split_decode.py): :meth:`ARRunner.execute`
  runs the forwards only and its chunks carry ``pending`` instead of frames;
  :meth:`ARRunner.decode_chunks` decodes them (on another thread, while the next
  forward runs: the worker's decode stage) and :meth:`ARRunner.fail_session`
  releases a session whose decode failed, on the runner's own thread.
  :meth:`ARRunner.execute_tick` and warm-up still decode in line. A rank of a
  replica over several devices other than 0 never decodes (``decodes=False``:
  :meth:`ARRunner.decode_chunks` forgets the chunks), and with ``in_step`` a
  chunk's decode counts as in flight until :meth:`ARRunner.join_decodes`.

Cross-session batching (:meth:`ARRunner.execute`): with ``max_batch_sessions``
above 1 and a pipeline that implements :class:`SupportsBatchedChunks`, ticks of
distinct sessions whose visible histories are equally long share one forward.
A batch is all or nothing: if the model raises, every session's KV is put
back as it was and each tick runs again alone, where a failure releases only
that tick's session (see :meth:`ARRunner._forward_batch` for failures after
the model returned).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, TypeVar

import numpy as np
import torch

from .chunks import (
    WARMUP_SESSION_ID,
    check_batch,
    check_commits,
    check_frames,
    check_pending,
    one_pending,
    video_frames_of,
)
from .contract import ARPipeline, SupportsBatchedChunks, SupportsSplitDecode, SupportsWarmup, prepare_prompt
from .kv_state import SessionKVState
from .parking import ParkingLot
from .pool import PagedKVPool, budget_for_sessions, plan_pool, resolve_budget_bytes
from .rewind_schedule import RewindSchedule
from .rewinds import SessionRewinds, rewind_for, rewind_refusal
from .session_parking import SessionParking
from .session_table import SessionTable
from .spec import KVCacheSpec
from .split_decode import DecodesInFlight, SplitDecoder
from .stats import RunnerStats, RuntimeCounters
from .types import (
    NOT_DECODED,
    ChunkResult,
    ParkingPolicy,
    PendingDecode,
    RuntimeOptions,
    TickFailure,
    TickRequest,
    TickResult,
    UnsupportedConfiguration,
)

__all__ = ["WARMUP_SESSION_ID", "ARRunner", "rewind_for", "runner_for_sessions"]

log = logging.getLogger("arstream.runner")

RUNTIME = "arstream"  # the name `arstream serve --runtime` gives this runner (runner/types.py RUNTIMES)
_T = TypeVar("_T")


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ARRunner:
    """Model-neutral AR runtime: one pipeline, one pool, many sessions."""

    @classmethod
    def for_pipeline(cls, pipeline: object, options: RuntimeOptions) -> ARRunner:
        """``--runtime arstream``: the settings' pool, rewind horizon and decode split over ``pipeline``."""
        if not isinstance(pipeline, ARPipeline):  # one registered in vLLM-Omni goes to its runtime (runtimes.py)
            raise _not_a_pipeline(pipeline)
        rewind = rewind_for(pipeline, seconds=options.rewind_seconds, budget_bytes=options.rewind_budget_bytes)
        return cls(
            pipeline, rewind=rewind, split_decode=options.split_decode, parking=options.parking,
            decodes=options.decodes, in_step=options.in_step, **options.pool(),
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
        decodes: bool = True,
        in_step: bool = False,
    ) -> None:
        if not isinstance(pipeline, ARPipeline):
            raise _not_a_pipeline(pipeline)
        spec = pipeline.kv_cache_spec()
        if not isinstance(spec, KVCacheSpec):
            raise UnsupportedConfiguration(f"kv_cache_spec() must return KVCacheSpec, got {type(spec).__name__}")
        self.device = torch.device(device)
        self.pipeline = pipeline
        self.spec = spec
        if not isinstance(max_batch_sessions, int) or isinstance(max_batch_sessions, bool) or max_batch_sessions < 1:
            raise UnsupportedConfiguration(f"max_batch_sessions must be an integer >= 1, got {max_batch_sessions!r}")
        self.max_batch_sessions = max_batch_sessions
        # the forward and the decode are separate calls (pipelines without the split always decode in the forward);
        # a runner that never decodes (``decodes`` False: a rank other than 0) forgets its chunks where it can
        self.decodes = decodes or not isinstance(pipeline, SupportsSplitDecode)
        self.split_decode = (split_decode or not self.decodes) and isinstance(pipeline, SupportsSplitDecode)
        self.decoding = DecodesInFlight(pipeline, split_decode=self.split_decode, in_step=in_step)
        self.video_frames_per_chunk, self.first_chunk_frames = video_frames_of(pipeline.model_card(), spec)
        # Why rewind and branch are refused (None: they are offered), and which boundaries a session keeps.
        self.rewind_refusal = rewind_refusal(pipeline, spec, rewind)
        self.rewind: RewindSchedule | None = None if self.rewind_refusal else rewind
        if rewind is not None and self.rewind_refusal:
            log.info("rewind not used: %s", self.rewind_refusal)
        budget = resolve_budget_bytes(self.device, budget_bytes=kv_budget_bytes, memory_fraction=memory_fraction)
        self.plan = plan_pool(spec, budget, max_batch_sessions=max_batch_sessions, rewind=self.rewind)
        self.pool = PagedKVPool(spec, self.plan, self.device)
        self.blocks_free_at_start = self.pool.num_free
        self._sync = sync
        self.counters = RuntimeCounters()
        policy = parking or ParkingPolicy()
        self.rewinds = SessionRewinds(pipeline, self.pool, self.rewind, self.rewind_refusal, decoding=self.decoding)
        self.sessions = SessionTable(
            pipeline,
            self.pool,
            self.plan.session_capacity,
            rewinds=self.rewinds,
            lot=ParkingLot.for_policy(policy),
            counters=self.counters,
            clock=clock,
        )
        self.parking = SessionParking(
            self.sessions, policy, self.plan, counters=self.counters, decoding=self.decoding, clock=clock
        )
        self._decoder: SplitDecoder | None = None
        if self.split_decode:
            assert isinstance(pipeline, SupportsSplitDecode)
            self._decoder = SplitDecoder(
                pipeline, video_frames=self.video_frames, counters=self.counters, device=self.device, sync=sync
            )
        self.on_evict: Callable[[str], None] | None = None
        self.sessions.on_evict = lambda session_id: None if self.on_evict is None else self.on_evict(session_id)
        # median seconds of one warm-up step (an execute call) per batch size, filled by warmup()
        self.warmup_round_s: dict[int, float] = {}
        # Rewind points cost capacity (a lot where the model's own state is large): say how much.
        without = plan_pool(spec, budget, max_batch_sessions=max_batch_sessions).session_capacity
        log.info(
            "model memory (KV pool): %.0f MiB, room for %d sessions%s; each remembers %s; rewind: %s; "
            "up to %d session(s) per forward%s [%d blocks of %d bytes, +%d scratch]",
            self.plan.num_blocks * self.plan.block_bytes / 2**20,
            self.plan.session_capacity,
            f" ({without} without rewind)" if without != self.plan.session_capacity else "",
            spec.kept_window_text,
            (self.rewind.describe(spec) if self.rewind else 'off'),
            self.batch_limit,
            "" if self.batches or max_batch_sessions == 1 else " (the pipeline does not batch)",
            self.plan.num_blocks,
            self.plan.block_bytes,
            self.plan.scratch_blocks,
        )

    # ---- what the server asks ------------------------------------------------------------

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

    def is_resident(self, session_id: str) -> bool:
        """Whether this runner holds the session: in the pool, or parked (its next use restores it)."""
        return self.sessions.holds(session_id)

    def resident_sessions(self) -> list[str]:
        """Session ids in the pool, from least to most recently used (parked ones are not: ``parking.sessions()``)."""
        return self.sessions.resident()

    def next_chunk_index(self, session_id: str) -> int:
        """The ``chunk_index`` the session's next chunk will have (0 when it is not held: a new rollout)."""
        return self.sessions.next_chunk_index(session_id)

    def rewind_points(self, session_id: str) -> tuple[int, int] | None:
        """``(oldest, newest)`` boundaries ``rewind_to`` may name now (newest: where the session is); None when off.

        A session that is not resident is at boundary 0 of a new rollout: ``(0, 0)``.
        """
        held = self.sessions.rewind_held(session_id)
        return None if held is None else (held[0], held[-1])

    def reset_session(self, session_id: str) -> None:
        """Release KV and tell the pipeline to start a new rollout."""
        self.sessions.release(session_id, reset_model=True, reason="reset")

    def close_session(self, session_id: str) -> None:
        """Release KV and tell the pipeline to drop the session."""
        self.sessions.release(session_id, reset_model=False, reason="close")

    def branch_session(self, source_id: str, boundary: int | None, new_session_id: str) -> int:
        """Make ``new_session_id`` a resident session continuing from ``source_id``'s boundary ``boundary``
        (None: where the source is now); returns the boundary (:meth:`SessionTable.branch`)."""
        return self.sessions.branch(source_id, boundary, new_session_id)

    def park_session(self, session_id: str) -> bool:
        """Park a session now (it detached: its next use restores it); whether it was parked."""
        return self.parking.park_session(session_id)

    def park_idle(self) -> int:
        """Park every session idle for ``park_after_s`` or longer; how many were parked."""
        return self.parking.park_idle()

    def complete_boundaries(self) -> None:
        """Rewind points recorded while a decode was in flight get its decoder state (runner/rewinds.py)."""
        self.rewinds.complete()

    def join_decodes(self, session_ids: Sequence[str]) -> None:
        """The caller joined the decode of these sessions' chunks (``in_step``: they count as in flight until
        now), then :meth:`complete_boundaries`."""
        self.decoding.joined(session_ids)
        self.rewinds.complete()

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
                    failed = self._attempt(ticks[i], self._before_forward)
                    results[i] = failed if isinstance(failed, TickFailure) else None
            waiting = [i for i in run if results[i] is None]
            while waiting:
                # Recomputed each round: a batch of new sessions may have evicted a waiting one.
                history = self.sessions.history_frames(ticks[waiting[0]].session_id)
                group = [i for i in waiting if self.sessions.history_frames(ticks[i].session_id) == history]
                group = group[: self.batch_limit]
                waiting = [i for i in waiting if i not in group]
                # a parked member comes back to the pool first; one whose restore fails has that as its result
                not_back = self.sessions.bring_in([ticks[i].session_id for i in group])
                for i in group:
                    if ticks[i].session_id in not_back:
                        results[i] = TickFailure(ticks[i].session_id, ticks[i].request_id, not_back[ticks[i].session_id])
                group = [i for i in group if results[i] is None]
                if not group:
                    continue
                group_ticks = [ticks[i] for i in group]
                if len(group) > 1:
                    forwarded = self._forward_batch(group_ticks)
                else:
                    forwarded = [self._attempt(group_ticks[0], self._forward_alone)]
                for i, result in zip(group, forwarded):
                    results[i] = result
                    if ticks[i].close and isinstance(result, ChunkResult):
                        closed = self._attempt(ticks[i], lambda tick: self.close_session(tick.session_id))
                        results[i] = closed if isinstance(closed, TickFailure) else result
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def execute_tick(self, tick: TickRequest) -> ChunkResult:
        """Reset and rewind before (if asked), one bound forward, close after (if asked); raises if the forward does.

        A ``rewind_to`` that is not held raises :class:`RewindUnavailable` before anything changes.
        """
        self._before_forward(tick)
        result = self._forward_alone(tick)
        if result.pending is not None:  # decoded in line; a failed decode releases the session and raises
            (decoded,) = self.decode_chunks([result])
            self.decoding.joined([result.session_id])
            if isinstance(decoded, TickFailure):
                self.fail_session(result.session_id)
                raise decoded.error
            result = decoded
        if tick.close:
            self.close_session(tick.session_id)
        return result

    def _attempt(self, tick: TickRequest, step: Callable[[TickRequest], _T]) -> _T | TickFailure:
        """``step(tick)``, or the failure in the tick's place (a forward that raised has released its session)."""
        try:
            return step(tick)
        except Exception as exc:  # noqa: BLE001 - reported in the tick's place
            return TickFailure(tick.session_id, tick.request_id, exc)

    def _forward_alone(self, tick: TickRequest) -> ChunkResult:
        """One bound forward of one session with ``generate_chunk``; fails closed."""
        held = self.sessions.state(tick.session_id)
        new_rollout = held is None or held.chunks_committed == 0
        started = time.perf_counter()
        pending: PendingDecode | None = None
        with self._bound(tick.session_id) as state:
            chunk_index = state.chunk_index
            if self.split_decode:
                assert isinstance(self.pipeline, SupportsSplitDecode)
                pending = one_pending(self.pipeline.generate_latents([tick]), tick)
                frames = NOT_DECODED
            else:
                frames = self.pipeline.generate_chunk(tick)
                check_frames(frames, self.video_frames(chunk_index))
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
                    state = self.sessions.admit(tick.session_id)
                    states.append(state)
                    self.rewinds.record(tick.session_id, state)
                    state.prepare_forward(staging_row=row, hold_commit=True)
                    bindings.enter_context(self.pipeline.bind_session_state(tick.session_id, state))
                pendings: list[PendingDecode | None] = [None] * len(ticks)
                if self.split_decode:
                    assert isinstance(self.pipeline, SupportsSplitDecode)
                    pendings = list(self.pipeline.generate_latents(ticks))
                    generated = True
                    frames = [NOT_DECODED] * len(ticks)
                    check_pending(pendings, ticks)
                    check_commits(states)
                else:
                    frames = self.pipeline.generate_chunks(ticks)
                    generated = True
                    check_batch(frames, states, [self.video_frames(s.chunk_index) for s in states])
            self._sync(self.device)
        except BaseException as exc:
            if generated:
                _fail_batch(self.sessions, ticks, exc)
                if not isinstance(exc, Exception):
                    raise
                return [TickFailure(t.session_id, t.request_id, exc) for t in ticks]
            aborted = _abort_batch(self.sessions, ticks, states, exc)
            if not isinstance(exc, Exception):
                raise
            return [aborted[t.session_id] if t.session_id in aborted else self._attempt(t, self._forward_alone)
                    for t in ticks]
        for state in states:
            state.accept_chunk()
        compute_s = time.perf_counter() - started
        self.counters.batched_forwards_total += 1
        self.counters.chunks(compute_s, len(ticks))
        return [
            self._result(tick, state.chunk_index - 1, chunk, compute_s, state.chunk_index == 1, pending)
            for tick, state, chunk, pending in zip(ticks, states, frames, pendings)
        ]

    @contextmanager
    def _bound(self, session_id: str) -> Iterator[SessionKVState]:
        """Bind the session's KV for one forward; on any failure release it, then re-raise."""
        state = self.sessions.admit(session_id)
        try:
            self.rewinds.record(session_id, state)
            state.prepare_forward(staging_row=0, hold_commit=False)
            with self.pipeline.bind_session_state(session_id, state):
                yield state
            self._sync(self.device)
        except BaseException:
            self.sessions.fail(session_id, "forward_exception")
            log.warning("forward failed for session=%s; its KV and model state were released", session_id)
            raise

    def _before_forward(self, tick: TickRequest) -> None:
        """Check ``rewind_to`` first (a refusal changes nothing), then reset, then rewind."""
        if tick.rewind_to is not None:
            self.sessions.check_rewind(tick)
        if tick.reset:
            self.reset_session(tick.session_id)
        if tick.rewind_to is not None:
            self.sessions.go_back(tick.session_id, tick.rewind_to)

    def _result(
        self,
        tick: TickRequest,
        chunk_index: int,
        frames: np.ndarray,
        compute_s: float,
        new_rollout: bool,
        pending: PendingDecode | None = None,
    ) -> ChunkResult:
        held = self.sessions.rewind_held(tick.session_id)
        if pending is not None:
            self.decoding.forwarded(tick.session_id)
        return ChunkResult(
            pending=pending,
            session_id=tick.session_id,
            request_id=tick.request_id,
            chunk_index=chunk_index,
            frames=frames,
            compute_s=compute_s,
            new_rollout=new_rollout,
            applied_event_ids=tick.applied_event_ids,
            restarted="rewind" if self.rewinds.take_rewound(tick.session_id) else None,
            rewind_points=None if held is None else (held[0], held[-1]),
            rewind_held=held,
        )

    # ---- split decode (runner/split_decode.py) ------------------------------------------

    def decode_chunks(self, results: Sequence[ChunkResult]) -> list[TickResult]:
        """Decode one round's pending chunks, safe beside :meth:`execute` (runner/split_decode.py); a session
        whose own decode fails gets a :class:`TickFailure`, and the caller then calls :meth:`fail_session`."""
        if self._decoder is None:
            return list(results)
        return self._decoder.decode(results) if self.decodes else self._decoder.forget(results)

    def fail_session(self, session_id: str, reason: str = "decode_failed") -> None:
        """Release a session whose chunk failed after its forward (its decode): fail closed, every block back."""
        self.sessions.fail(session_id, reason)
        log.warning("session=%s failed after its forward (%s); its KV and model state were released", session_id, reason)

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
                    self.decoding.joined([r.session_id for r in executed])
                    for result in [*executed, *decoded]:
                        if isinstance(result, TickFailure):
                            raise result.error
                    steps.append(time.perf_counter() - started)
                    ran += size
                if steps:
                    self.warmup_round_s[size] = statistics.median(steps)
                for session_id in session_ids[:size]:
                    self.sessions.release(session_id, reset_model=False, reason="warmup_complete")
        finally:
            for session_id in session_ids:
                if self.sessions.in_pool(session_id):  # left over by a warm-up step that raised
                    self.sessions.release(session_id, reset_model=False, reason="warmup_complete", suppress_errors=True)
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
            sessions_resident=len(self.sessions.resident()),
            batch_limit=self.batch_limit,
            rewind_points=0 if self.rewind is None else self.rewind.peak(self.spec).copies,
            rewind_seconds=0.0 if self.rewind is None else self.rewind.seconds,
            park_capacity=self.parking.capacity,
            sessions_parked=len(self.parking.lot),
            sessions_spilled=self.parking.lot.spilled_sessions,
            parked_bytes=self.parking.lot.host_bytes,
            spilled_bytes=self.parking.lot.spilled_bytes,
            park_budget_bytes=self.parking.lot.budget_bytes,
        )

    def model_card(self) -> dict[str, Any]:
        return {**self.pipeline.model_card(), "runtime": RUNTIME}

    def prepare_prompt(self, prompt: str) -> str:
        """A client's prompt as the model reads it (the server calls it as the prompt arrives, on its own thread)."""
        return prepare_prompt(self.pipeline, prompt)


def _not_a_pipeline(pipeline: object) -> UnsupportedConfiguration:
    return UnsupportedConfiguration(
        f"{type(pipeline).__name__} does not implement the ARPipeline contract: "
        "kv_cache_spec(), model_card(), bind_session_state(), generate_chunk(), "
        "reset_session() and close_session()"
    )


def _fail_batch(sessions: SessionTable, ticks: Sequence[TickRequest], error: BaseException) -> None:
    """Release every session of a batch that failed after the pipeline's forward returned."""
    for tick in ticks:
        sessions.fail(tick.session_id, "forward_exception")
    log.warning(
        "batched forward of %d sessions failed after the model ran (%s: %s); all of them were released",
        len(ticks),
        type(error).__name__,
        error,
    )


def _abort_batch(
    sessions: SessionTable, ticks: Sequence[TickRequest], states: list[SessionKVState], error: BaseException
) -> dict[str, TickFailure]:
    """Put every session of a failed batch back as it was; a session that cannot be is released."""
    sessions.counters.batch_fallbacks_total += 1
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
            sessions.fail(tick.session_id, "batch_abort_failed")
            failed[tick.session_id] = TickFailure(tick.session_id, tick.request_id, exc)
    return failed


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
