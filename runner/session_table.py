"""The session table: which sessions a runner holds, in least-recently-used order, and the one way out.

A session is held in the pool (its :class:`SessionKVState` binds pool blocks)
or parked (its copy in host memory, runner/session_parking.py). The table
admits a session to the pool (:meth:`SessionTable.admit`: a new one, or a
parked one brought back), making room when the pool is full: the least
recently used session that can be parked is parked, else the oldest is
ended (``lru_eviction``). Every path that ends a session (reset, close,
eviction, failure) goes through :meth:`SessionTable.release`, which attempts
each cleanup step even when one fails: its blocks, its rewind points
(runner/rewinds.py), its parked copy and the pipeline's own state.

This is where a session lives, not how a chunk runs: the runner
(runner/runner.py) binds an admitted session's state for one forward at a time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from .contract import ARPipeline
from .kv_state import SessionKVState
from .parking import ParkingLot
from .pool import PagedKVPool, PoolExhausted
from .rewinds import SessionRewinds
from .stats import RuntimeCounters
from .types import RewindUnavailable, TickRequest

log = logging.getLogger("arstream.runner")


class Parks(Protocol):
    """What the table asks of parking (runner/session_parking.py) when it needs a slot or a parked session."""

    def parkable(self, session_id: str) -> bool:
        """Whether the session can leave the pool for host memory now."""

    def park(self, session_id: str) -> bool:
        """Move a parkable session to host memory; False (nothing changed) when it does not fit."""

    def restore(self, session_id: str) -> SessionKVState:
        """Bring a parked session back (a slot is free); a failure ends it and raises RestoreFailed."""


class SessionTable:
    """A runner's sessions by id, least recently used first; see the module docstring."""

    def __init__(
        self,
        pipeline: ARPipeline,
        pool: PagedKVPool,
        capacity: int,
        *,
        rewinds: SessionRewinds,
        lot: ParkingLot,
        counters: RuntimeCounters,
        clock: Callable[[], float],
    ) -> None:
        self.pipeline = pipeline
        self.pool = pool
        self.spec = pool.spec
        self.capacity = capacity
        self.rewinds = rewinds
        self.lot = lot
        self.counters = counters
        self._clock = clock
        self.parking: Parks | None = None  # set by a runner that parks
        self.on_evict: Callable[[str], None] | None = None
        self._states: OrderedDict[str, SessionKVState] = OrderedDict()
        self._last_used: dict[str, float] = {}
        # sessions being exported (kv_state): never parked while their blocks are read, until their next chunk
        self._pinned: set[str] = set()

    # ---- questions ----------------------------------------------------------------------------------

    def holds(self, session_id: str) -> bool:
        """Whether the session is held: in the pool, or parked (its next use restores it)."""
        return session_id in self._states or session_id in self.lot

    def in_pool(self, session_id: str) -> bool:
        """Whether the session holds pool blocks now (not parked)."""
        return session_id in self._states

    def resident(self) -> list[str]:
        """Session ids in the pool, from least to most recently used (parked ones are not: :meth:`parked`)."""
        return list(self._states)

    def parked(self) -> list[str]:
        """Session ids parked in host memory, least recently parked first."""
        return self.lot.sessions()

    def state(self, session_id: str) -> SessionKVState | None:
        """The KV state of a session in the pool (a parked one's is not restored: None)."""
        return self._states.get(session_id)

    def full_of_exports(self) -> bool:
        """Whether every pool slot holds a session being exported (none can make room)."""
        return len(self._states) >= self.capacity and self._pinned.issuperset(self._states)

    def last_used(self, session_id: str) -> float:
        return self._last_used.get(session_id, self._clock())

    def pinned(self, session_id: str) -> bool:
        return session_id in self._pinned

    def history_frames(self, session_id: str) -> int:
        """Frames of history the session's next chunk sees (0 for a session that is not held)."""
        state = self._states.get(session_id)
        if state is None:
            parked = self.lot.get(session_id)
            return 0 if parked is None else parked.history_frames
        return state.history_frames(self.spec.branch_names[0])

    def next_chunk_index(self, session_id: str) -> int:
        """The ``chunk_index`` the session's next chunk will have (0 when it is not held: a new rollout)."""
        state = self._states.get(session_id)
        if state is None:
            parked = self.lot.get(session_id)
            return 0 if parked is None else parked.chunk_index
        return state.chunk_index

    def rewind_held(self, session_id: str) -> tuple[int, ...] | None:
        """Every boundary ``rewind_to`` may name now, oldest first (the last: where the session is); None when off.

        A parked session answers from its copy; one not held is at boundary 0 of a new rollout.
        """
        if self.rewinds.refusal:
            return None
        state = self._states.get(session_id)
        if state is None:
            parked = self.lot.get(session_id)
            return (0,) if parked is None or parked.rewind_held is None else parked.rewind_held
        return self.rewinds.held(session_id, state.chunk_index)

    # ---- admission to the pool ----------------------------------------------------------------------

    def resident_state(self, session_id: str) -> SessionKVState | None:
        """The session's KV state, restored first when it is parked; None when the table does not hold it."""
        state = self._states.get(session_id)
        if state is None and session_id in self.lot:
            assert self.parking is not None  # only a runner that parks fills the lot
            state = self.parking.restore(session_id)  # it makes room itself (a swap)
        return state

    def kv_state(self, session_id: str) -> SessionKVState | None:
        """The session's KV state between forwards (for :mod:`arstream.runner.snapshot`), or None.

        A parked session is restored first (exports take it from its host copy
        instead: :func:`~arstream.runner.snapshot.export_parked`). With parking on,
        the session is then kept in the pool (never parked or evicted to make room)
        until its next chunk or its release: an export reads its blocks in pieces
        between others' forwards.
        """
        state = self.resident_state(session_id)
        if state is not None and self.lot.enabled:
            self._pinned.add(session_id)
        return state

    def admit(self, session_id: str) -> SessionKVState:
        """The session's state in the pool, most recently used: restored when parked, new when not held."""
        state = self.resident_state(session_id)
        if state is None:
            self.make_room()
            state = SessionKVState(self.pool, session_id)
            self._states[session_id] = state
            self.rewinds.start(session_id)
        self._pinned.discard(session_id)  # it runs a chunk: an export of it is over
        self.touch(session_id)
        return state

    def bring_in(self, session_ids: list[str]) -> dict[str, Exception]:
        """Restore the parked sessions of one forward's group; each failed restore, by session (it has ended).

        The group's sessions in the pool count as just used first, so bringing
        one back never parks another member of the same forward.
        """
        for session_id in session_ids:
            if session_id in self._states:
                self.touch(session_id)
        failed: dict[str, Exception] = {}
        for session_id in session_ids:
            try:
                self.resident_state(session_id)
            except Exception as exc:  # noqa: BLE001 - reported in the tick's place
                failed[session_id] = exc
        return failed

    def adopt(self, state: SessionKVState) -> None:
        """Make an imported session resident (most recently used); the caller filled ``state`` from a snapshot."""
        if state.pool is not self.pool or state.session_id in self._states:
            raise ValueError(f"cannot adopt session {state.session_id!r}: another pool's, or already resident")
        self._states[state.session_id] = state
        self._last_used[state.session_id] = self._clock()
        self.rewinds.start(state.session_id)  # its boundaries stayed behind: it can rewind to those it passes

    def put_back(self, state: SessionKVState) -> None:
        """A parked session's state is in the pool again (runner/session_parking.py), most recently used."""
        self._states[state.session_id] = state
        self._last_used[state.session_id] = self._clock()

    def take_out(self, session_id: str) -> SessionKVState:
        """Remove a session parked a moment ago from the pool's table (its device state is the caller's to free)."""
        self._last_used.pop(session_id, None)
        return self._states.pop(session_id)

    def touch(self, session_id: str) -> None:
        """The session was just used: most recently used, and its idle time starts again."""
        self._states.move_to_end(session_id)
        self._last_used[session_id] = self._clock()

    def idle(self, after_s: float) -> list[str]:
        """Sessions in the pool unused for ``after_s`` seconds or longer, least recently used first."""
        now = self._clock()
        return [s for s in self._states if now - self._last_used.get(s, now) >= after_s]

    def make_room(self, *, evict: bool = True) -> bool:
        """Until a pool slot is free: park the least recently used parkable session, else end the oldest (evict).

        Without ``evict``, returns False when no slot can be freed (an import: it never ends a session).
        """
        while len(self._states) >= self.capacity:
            parking = self.parking
            victim = None if parking is None else next((s for s in self._states if parking.parkable(s)), None)
            if victim is not None and parking is not None and parking.park(victim):
                continue
            if not evict:
                return False
            oldest = next((s for s in self._states if s not in self._pinned), None)
            if oldest is None:  # ending one would break an export reading its blocks
                raise PoolExhausted(f"all {self.capacity} session slots hold sessions being exported")
            self.release(oldest, reset_model=False, reason="lru_eviction", suppress_errors=True)
            self.counters.evictions_total += 1
            if self.on_evict is not None:
                self.on_evict(oldest)
        return True

    # ---- rewind and branch ----------------------------------------------------------------------------

    def check_rewind(self, tick: TickRequest) -> None:
        """Raise :class:`RewindUnavailable` unless ``tick.rewind_to`` names a boundary held; answered from a
        parked session's copy too (a refusal restores nothing)."""
        session_id = tick.session_id
        self.rewinds.check(tick, self.next_chunk_index(session_id), self.rewind_held(session_id))

    def go_back(self, session_id: str, index: int) -> None:
        """Put the session back at held boundary ``index`` (checked by :meth:`check_rewind`); a parked session
        comes back to the pool first. Fails closed: a state that will not go back ends the session."""
        state = self.resident_state(session_id)
        if state is None:
            return
        try:
            self.rewinds.go_back(session_id, state, index)
        except BaseException:
            self.fail(session_id, "rewind_failed")
            raise

    def branch(self, source_id: str, boundary: int | None, new_session_id: str) -> int:
        """Make ``new_session_id`` a resident session that continues from ``source_id``'s boundary ``boundary``.

        ``boundary`` None is the latest: where the source is now. Returns the
        boundary; the new session's next chunk has that ``chunk_index``; it shares the
        boundary's blocks with the source (copy-on-write: neither ever writes
        a committed block) and gets a copy of the model-owned state there.
        Room is made like for any new session (LRU eviction; the source counts
        as just used). :class:`RewindUnavailable` if the boundary is not held,
        before anything changes.
        """
        if self.rewinds.refusal:
            raise RewindUnavailable(self.rewinds.refusal)
        if self.holds(new_session_id):
            raise ValueError(f"cannot branch into session {new_session_id!r}: it is already resident")
        source = self.resident_state(source_id)
        if source is None:  # the message reaches clients: no internal session id in it
            raise RewindUnavailable("the shared session is not resident here; it holds no chunk boundaries")
        index = source.chunk_index if boundary is None else boundary
        branch = self.rewinds.share(source_id, source, index)
        self.touch(source_id)
        adopted = False
        try:
            self.admit(new_session_id).adopt_tables(branch.tables)
            adopted = True
            self.rewinds.install_model_state(new_session_id, branch)
        except BaseException:
            if not adopted:
                self.pool.free(branch.tables.blocks())
            self.release(new_session_id, reset_model=False, reason="branch_failed", suppress_errors=True)
            raise
        return index

    # ---- the way out ------------------------------------------------------------------------------------

    def release(self, session_id: str, *, reset_model: bool, reason: str, suppress_errors: bool = False) -> None:
        """The one release path for reset, close, eviction and failure (its boundaries, or its parked copy, go too)."""
        state = self._states.pop(session_id, None)
        points = self.rewinds.drop(session_id)
        self._last_used.pop(session_id, None)
        self._pinned.discard(session_id)
        self.lot.discard(session_id)
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

    def fail(self, session_id: str, reason: str) -> None:
        """A session's chunk failed: it ends (fail closed, every block back) and counts as a failure."""
        self.counters.failures_total += 1
        self.release(session_id, reset_model=False, reason=reason, suppress_errors=True)
