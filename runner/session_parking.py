"""Parking a runner's sessions: which leave the pool for host memory, when, and how they come back.

The copies themselves are runner/parking.py's (:func:`park_payload`,
:func:`restore_payload`, the :class:`ParkingLot` within its budgets); this
module decides. The least recently used session of a full pool (the session
table asks, runner/session_table.py), a session idle past ``after_s``
(:meth:`SessionParking.park_idle`) and one the server parks
(:meth:`SessionParking.park_session`, a detached session) move to host memory
with their rewind points; their next tick, rewind, branch or export brings
them back (:meth:`SessionParking.restore`). A restore that fails ends its
session (``restore_failed``) and leaves the pool at its baseline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from .contract import ARPipeline, SupportsSessionTransfer
from .kv_state import SessionKVState
from .parking import ParkedSession, ParkingLot, RestoreFailed, park_payload, restore_payload
from .pool import PoolExhausted, PoolPlan
from .rewind import RewindPoints
from .rewinds import SessionRewinds
from .session_table import SessionTable
from .stats import RuntimeCounters
from .types import ParkingPolicy

log = logging.getLogger("arstream.runner")


class SessionParking:
    """Parks and restores the sessions of one table within the lot's budgets; see the module docstring."""

    def __init__(
        self,
        table: SessionTable,
        policy: ParkingPolicy,
        plan: PoolPlan,
        *,
        counters: RuntimeCounters,
        decoding: Callable[[str], bool],
        clock: Callable[[], float],
    ) -> None:
        self.table = table
        self.policy = policy
        self.lot: ParkingLot = table.lot
        self.pipeline: ARPipeline = table.pipeline
        self.pool = table.pool
        self.rewinds: SessionRewinds = table.rewinds
        self.counters = counters
        self.decoding = decoding  # whether a session's decode is in flight (runner/split_decode.py)
        self._clock = clock
        # Most sessions parked at once: each park budget over a session's worst-case bytes. Apiece, since a
        # parked session is kept whole in host memory or in a file: so whenever fewer are parked, one more
        # fits somewhere, and a restore's swap never finds the lot too small.
        per_session = max(plan.per_session_bytes, 1)
        transferable = self.lot.enabled and isinstance(self.pipeline, SupportsSessionTransfer)
        room = self.lot.budget_bytes // per_session + self.lot.spill_budget_bytes // per_session
        self.capacity = room if transferable else 0
        # the device <-> host copies run here, beside the forward (CUDA only)
        self._copy_stream: Any = None
        if self.pool.device.type == "cuda" and self.lot.enabled:
            self._copy_stream = torch.cuda.Stream(self.pool.device)  # type: ignore[no-untyped-call]
        table.parking = self

    def sessions(self) -> list[str]:
        """Session ids parked in host memory, least recently parked first."""
        return self.lot.sessions()

    def parkable(self, session_id: str) -> bool:
        """Whether the session can be parked now: at its chunk boundary, no decode of it in flight, not exported."""
        state = self.table.state(session_id)
        if state is None or self.table.pinned(session_id) or not self.capacity:
            return False
        if state.in_pass or state.chunk_held or any(state.pending.values()) or state.rewritten:
            return False
        if self.rewinds.recording(session_id):
            return False
        return not self.decoding(session_id)

    def park_session(self, session_id: str) -> bool:
        """Park a session now (it detached: its next use restores it); whether it was parked."""
        return self.parkable(session_id) and self.park(session_id)

    def park_idle(self) -> int:
        """Park every session idle for ``after_s`` or longer; how many were parked."""
        after = self.policy.after_s
        if after is None:
            return 0
        idle = [s for s in self.table.idle(after) if self.parkable(s)]
        return sum(1 for s in idle if self.park(s))

    def restore_session(self, session_id: str) -> bool:
        """Bring a parked session back into the pool now (ahead of its next tick, e.g. as it resumes); whether it
        was parked. A failed restore ends it and raises :class:`RestoreFailed`."""
        if session_id not in self.lot:
            return False
        self.table.resident_state(session_id)
        return True

    def park(self, session_id: str) -> bool:
        """Move a parkable session to the parking lot; False (nothing changed) when it does not fit or fails."""
        if len(self.lot) >= self.capacity:
            return False
        pipeline = self.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)  # else the capacity is 0
        state = self.table.state(session_id)
        assert state is not None
        started = time.perf_counter()
        try:
            layout, tensors, ready = park_payload(
                self.pool,
                state,
                self.rewinds.boundaries(session_id),
                pipeline.export_session_state(session_id),
                copy_stream=self._copy_stream,
            )
            layout["rewound"] = self.rewinds.rewound(session_id)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            if not self.lot.room_for(nbytes):
                return False
            parked = ParkedSession(
                session_id,
                layout,
                tensors,
                nbytes,
                last_used=self.table.last_used(session_id),
                chunk_index=state.chunk_index,
                history_frames=state.history_frames(self.pool.spec.branch_names[0]),
                rewind_held=self.table.rewind_held(session_id),
                ready=ready,
            )
            self.lot.put(parked)
        except Exception as exc:  # noqa: BLE001 - the session stays resident; making room may end it instead
            log.warning("session=%s could not be parked (%s: %s)", session_id, type(exc).__name__, exc)
            return False
        # Its state is in the lot: the device side goes (blocks, boundaries, the pipeline's copy), not the session.
        self.table.take_out(session_id)
        points = self.rewinds.drop(session_id)
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

    def restore(self, session_id: str) -> SessionKVState:
        """Bring a parked session back into the pool, parking another to make room; a failure ends it and raises
        RestoreFailed.

        It leaves the lot before room is made: with every slot and park place held the lot is full, and the
        least recently used resident session takes its place there (a swap). Made the other way round, no
        session could be parked and making room would end one that a connection holds.
        """
        pipeline = self.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)
        if self.table.full_of_exports():
            raise PoolExhausted(f"all {self.table.capacity} session slots hold sessions being exported")
        started = time.perf_counter()
        try:
            parked, tensors = self.lot.take(session_id)
            self.table.make_room()
            restored = restore_payload(self.pool, session_id, parked.layout, tensors)
            try:
                pipeline.import_session_state(session_id, restored.live_model)
                schedule = self.rewinds.schedule
                points = RewindPoints(self.pool, schedule) if schedule else None
                if points is not None:
                    points.restore(restored.boundaries)
                elif restored.boundaries:
                    raise RestoreFailed("the session was parked with rewind points this runner does not keep")
            except BaseException:
                restored.state.release()
                self.pool.free(i for b in restored.boundaries for i in b.tables.blocks())
                raise
        except Exception as exc:  # noqa: BLE001 - fail closed: the session ends, the pool is back at baseline
            self.counters.restore_failures_total += 1
            self.table.fail(session_id, "restore_failed")
            log.warning("session=%s could not be restored from parking (%s: %s); it ended", session_id, type(exc).__name__, exc)
            raise RestoreFailed(
                f"the session was parked in host memory and could not be restored ({type(exc).__name__}: {exc})"
            ) from exc
        self.table.put_back(restored.state)
        self.rewinds.install(session_id, points, bool(parked.layout.get("rewound")))
        self.counters.restored(time.perf_counter() - started)
        return restored.state
