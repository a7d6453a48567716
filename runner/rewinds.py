"""Every session's rewind points, and how a session goes back to one or shares one with a branch.

:mod:`arstream.runner.rewind` holds one session's kept boundaries; this
module keeps them for all of a runner's sessions: it records the boundary
each chunk starts from (:meth:`SessionRewinds.record`), completes the ones
recorded while the chunk before them was still decoding (a split decode,
:meth:`SessionRewinds.complete`), and moves a session back to one
(:meth:`SessionRewinds.go_back`) or hands one to a branch
(:meth:`SessionRewinds.share`). Which sessions are held, and releasing
them, is the session table's (runner/session_table.py); it asks this module
for a session's points when one starts, parks, comes back or ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .contract import ARPipeline, ModelState, SupportsSessionTransfer, SupportsSplitDecode
from .chunks import video_frames_of
from .kv_state import SessionKVState
from .pool import PagedKVPool
from .rewind import Boundary, RewindPoints, copy_model_state
from .rewind_schedule import RewindSchedule, plan_rewind
from .spec import KVCacheSpec
from .types import RewindUnavailable, TickRequest, UnsupportedConfiguration

log = logging.getLogger("arstream.runner")


class SessionRewinds:
    """The rewind points of a runner's resident sessions (none while rewind is refused: :attr:`refusal`)."""

    def __init__(
        self,
        pipeline: ARPipeline,
        pool: PagedKVPool,
        schedule: RewindSchedule | None,
        refusal: str | None,
        *,
        decoding: Callable[[str], bool],
    ) -> None:
        self.pipeline = pipeline
        self.pool = pool
        self.spec = pool.spec
        # Why rewind and branch are refused (None: they are offered), and which boundaries a session keeps.
        self.refusal = refusal
        self.schedule = None if refusal else schedule
        self.decoding = decoding  # whether a session's decode is in flight (runner/split_decode.py)
        self._points: dict[str, RewindPoints] = {}
        # Sessions whose next chunk follows a rewind that went back (``restarted: "rewind"``); a rewind_to
        # naming where the session already is changes nothing and its chunk is a plain one.
        self._rewound: set[str] = set()
        # boundaries recorded while the chunk before them was decoding: (session, boundary, the one before it)
        self._unfinished: list[tuple[str, Boundary, Boundary | None]] = []

    # ---- the table's side: a session starts, parks, comes back, ends -------------------------------------

    def start(self, session_id: str) -> None:
        """A session joins the pool with no boundary behind it (new, imported: it keeps those it passes)."""
        if self.schedule is not None:
            self._points[session_id] = RewindPoints(self.pool, self.schedule)

    def drop(self, session_id: str) -> RewindPoints | None:
        """Forget the session's points and hand them (with their block references) to the caller to release."""
        self._rewound.discard(session_id)
        return self._points.pop(session_id, None)

    def boundaries(self, session_id: str) -> list[Boundary]:
        """The session's kept boundaries, oldest first (still held here: for a copy, e.g. parking)."""
        points = self._points.get(session_id)
        return [] if points is None else points.boundaries()

    def movable(self, session_id: str) -> list[Boundary]:
        """The kept boundaries a snapshot can carry, oldest first: those whose decoder state is complete."""
        waiting = {id(b) for sid, b, _before in self._unfinished if sid == session_id}
        return [b for b in self.boundaries(session_id) if id(b) not in waiting]

    def blocks(self, session_id: str) -> list[int]:
        """Every block reference the session's kept boundaries hold (a block two of them keep is listed twice)."""
        points = self._points.get(session_id)
        return [] if points is None else points.blocks()

    def rewound(self, session_id: str) -> bool:
        return session_id in self._rewound

    def take_rewound(self, session_id: str) -> bool:
        """Whether the session's next chunk follows a rewind; it does not any more."""
        if session_id in self._rewound:
            self._rewound.remove(session_id)
            return True
        return False

    def install(self, session_id: str, points: RewindPoints | None, rewound: bool) -> None:
        if points is not None:
            self._points[session_id] = points
        if rewound:
            self._rewound.add(session_id)

    def recording(self, session_id: str) -> bool:
        """Whether a boundary of the session waits for its decoder state (it cannot be parked meanwhile)."""
        return any(sid == session_id for sid, _b, _p in self._unfinished)

    # ---- boundaries --------------------------------------------------------------------------------

    def held(self, session_id: str, now: int) -> tuple[int, ...] | None:
        """Every boundary a resident session at ``now`` may go back to, oldest first; None when rewind is off."""
        return None if self.refusal else self._points[session_id].indices(now)

    def record(self, session_id: str, state: SessionKVState) -> None:
        """Keep the boundary the session's next chunk starts from (once: a batch retried alone keeps it).

        With a split decode whose previous chunk is still decoding, the boundary
        takes the forward's state now and the decoder's once that decode is done
        (:meth:`complete`): waiting here would undo the overlap.
        """
        points = self._points.get(session_id)
        newest = None if points is None else points.newest
        if points is None or (newest is not None and newest.index == state.chunk_index):
            return
        previous = None if newest is None else newest.model
        pipeline = self.pipeline
        if isinstance(pipeline, SupportsSplitDecode) and self.decoding(session_id):
            boundary = Boundary(state.share_tables(), copy_model_state(pipeline.export_forward_state(session_id), previous))
            self._unfinished.append((session_id, boundary, newest))
        else:
            boundary = Boundary(state.share_tables(), self.export_model_state(session_id, previous))
        points.record(boundary)

    def complete(self) -> None:
        """Give the boundaries recorded while a decode was in flight their decoder state, now that it is done.

        Called on the runner's thread once the decode of the chunk before each
        such boundary has ended and before the next one starts (the worker
        does, when it joins its decode stage), so the decoder state is exactly
        the boundary's. A session released meanwhile took its boundaries along.
        """
        unfinished, self._unfinished = self._unfinished, []
        pipeline = self.pipeline
        for session_id, boundary, before in unfinished:
            points = self._points.get(session_id)
            if points is None or not points.holds(boundary.index) or not isinstance(pipeline, SupportsSplitDecode):
                continue
            previous = None if before is None else before.model  # completed by now: boundaries complete in order
            decoder = copy_model_state(pipeline.export_decoder_state(session_id, boundary.index), previous)
            boundary.model = boundary.model.merge(decoder)

    def go_back(self, session_id: str, state: SessionKVState, index: int) -> None:
        """Put a resident session back at its held boundary ``index`` (checked before); raises if the state will
        not go back (the caller then ends the session: its KV is no longer a whole)."""
        if index == state.chunk_index:
            return
        self._rewound.add(session_id)
        boundary = self._points[session_id].take(index)
        adopted = False
        try:
            state.adopt_tables(boundary.tables)
            adopted = True
            self.install_model_state(session_id, boundary)
        except BaseException:
            if not adopted:
                self.pool.free(boundary.tables.blocks())
            raise

    def share(self, session_id: str, state: SessionKVState, index: int) -> Boundary:
        """Boundary ``index`` of a resident session, for a branch (references and a model-state copy of its own)."""
        if index == state.chunk_index:
            return Boundary(state.share_tables(), self.export_model_state(session_id))
        points = self._points[session_id]
        if not points.holds(index):
            raise self.not_held(points.indices(state.chunk_index), index)
        return points.share(index)

    def not_held(self, held: tuple[int, ...], index: object) -> RewindUnavailable:
        """The refusal clients see (so no internal session id): what is held instead."""
        held = held or (0,)
        shown = ", ".join(map(str, held)) if len(held) <= 12 else f"{held[0]}..{held[-1]} ({len(held)} of them)"
        schedule = self.schedule.describe(self.spec) if self.schedule else "rewind off"
        return RewindUnavailable(
            f"chunk boundary {index!r} is not held: the session holds boundaries {shown} of its current rollout "
            f"({schedule})"
        )

    def check(self, tick: TickRequest, now: int, held: tuple[int, ...] | None) -> None:
        """Raise :class:`RewindUnavailable` unless ``tick.rewind_to`` names a boundary held (after its reset);
        ``now`` and ``held``: where the session is and what it holds (a parked one's copy answers too)."""
        target = tick.rewind_to
        if self.refusal:
            raise RewindUnavailable(self.refusal)
        if not isinstance(target, int) or isinstance(target, bool):
            raise RewindUnavailable(f"rewind_to must be a chunk boundary (an integer), got {target!r}")
        if tick.reset:  # the reset drops every boundary but the new rollout's first
            if target != 0:
                raise RewindUnavailable(f"chunk boundary {target} is not held after a reset; only 0 is")
            return
        if target != now and target not in (held or ()):
            raise self.not_held(held or (0,), target)

    def export_model_state(self, session_id: str, previous: ModelState | None = None) -> ModelState:
        pipeline = self.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)  # else the refusal says so
        return copy_model_state(pipeline.export_session_state(session_id), previous)

    def install_model_state(self, session_id: str, boundary: Boundary) -> None:
        pipeline = self.pipeline
        assert isinstance(pipeline, SupportsSessionTransfer)
        pipeline.reset_session(session_id)  # a boundary before the first chunk has no model state to import
        pipeline.import_session_state(session_id, boundary.model)


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
    per_chunk, _first = video_frames_of(card, spec)
    schedule = plan_rewind(spec, chunks_per_second=fps / per_chunk, seconds=seconds, budget_bytes=budget_bytes)
    if schedule is None or schedule.seconds < seconds:
        log.warning(
            "a rewind horizon of %g s does not fit the rewind budget of %g MiB a session (--rewind-budget-mib); %s",
            seconds,
            round(budget_bytes / 2**20, 3),
            "rewind is off" if schedule is None else f"it reaches back {schedule.seconds:g} s",
        )
    return schedule


def rewind_refusal(pipeline: ARPipeline, spec: KVCacheSpec, rewind: RewindSchedule | None) -> str | None:
    """Why a runner cannot offer rewind and branch, or None when it can."""
    if rewind is not None and not isinstance(rewind, RewindSchedule):
        raise UnsupportedConfiguration(f"rewind must be a RewindSchedule or None, got {type(rewind).__name__}")
    if rewind is None:
        return "rewind is off (no rewind horizon)"
    if not isinstance(pipeline, SupportsSessionTransfer):
        name = pipeline.model_card().get("name")
        return f"model {name!r} cannot snapshot its per-session state (no export_session_state hook)"
    if spec.cross_attention_lengths:
        return "rewind does not snapshot cross-attention caches, which this model's KV spec declares"
    return None
