"""One client session: its state machine, tick credits, event ids and staged control updates.

The event loop owns a :class:`Session`. The worker thread touches only the
staging area (controls, prompt, pending input events), through
:meth:`Session.take_chunk_inputs` under the session's lock, because the
chunk boundary is the moment the worker picks the session's next tick.

Latest wins: every update (a tick's or an input event's controls/prompt) gets
an arrival number on the event loop; at a chunk boundary an update only
replaces a value that came from an older update. Pending input events keep
only their ids and arrival times: their values are merged on arrival into one
staged update per field (the latest controls, the latest prompt), so a client
that sends many large events and no tick holds one payload, not all of them.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from collections.abc import Callable
from typing import Any

from .prompts import PromptAllowance
from .protocol import ErrorCode, InputMessage, ProtocolError, TickMessage
from ..runner.types import StartImage, TickRequest

# Event ids remembered for `duplicate` acks; older repeats are `stale_event`.
RECENT_EVENT_IDS = 256
# Input events waiting for the next chunk; one more is refused until a chunk applies them.
MAX_PENDING_EVENTS = 4096
# A session's chunks made (or being made) and not yet written to its socket, at most, before the worker starts
# its next one (Session.chunks_ahead_limit, where its dialect bounds it): one in the model and one on its way out
# keep both busy, and a chunk not started yet takes the newest input. Queued ticks wait in line, credits unchanged.
CHUNKS_AHEAD = 2


class SessionState(Enum):
    """Where a session is in its lifecycle (PROTOCOL.md, "Session lifecycle")."""

    AWAITING_START = "awaiting_start"
    ACTIVE = "active"
    FAILED = "failed"  # the model failed; only a tick with reset: true is accepted
    DRAINING = "draining"  # a tick with close: true was accepted; its chunk is the last
    CLOSING = "closing"  # `closed` is queued; nothing more is sent
    CLOSED = "closed"


# Legal transitions; anything else is a bug that SessionStateError names.
TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.AWAITING_START: frozenset({SessionState.ACTIVE, SessionState.CLOSING, SessionState.CLOSED}),
    SessionState.ACTIVE: frozenset(
        {SessionState.FAILED, SessionState.DRAINING, SessionState.CLOSING, SessionState.CLOSED}
    ),
    SessionState.FAILED: frozenset(
        {SessionState.ACTIVE, SessionState.DRAINING, SessionState.CLOSING, SessionState.CLOSED}
    ),
    # DRAINING -> ACTIVE: the close: true tick ran nothing (a refused rewind), so the session goes on.
    SessionState.DRAINING: frozenset(
        {SessionState.ACTIVE, SessionState.FAILED, SessionState.CLOSING, SessionState.CLOSED}
    ),
    SessionState.CLOSING: frozenset({SessionState.CLOSED}),
    SessionState.CLOSED: frozenset(),
}

# States in which the session still sends chunks and replies.
LIVE_STATES = frozenset({SessionState.ACTIVE, SessionState.FAILED, SessionState.DRAINING})


class SessionStateError(RuntimeError):
    """An operation or transition not allowed in the session's current state."""

    def __init__(self, operation: str, expected: frozenset[SessionState] | set[SessionState], actual: SessionState):
        names = " or ".join(sorted(s.value for s in expected)) or "no state"
        super().__init__(f"cannot {operation}: expected session state {names}, but it is {actual.value}")
        self.expected = expected
        self.actual = actual


@dataclass(frozen=True)
class Update:
    """A controls and/or prompt change with its arrival number (for latest-wins)."""

    seq: int
    controls: dict[str, Any] | None = None
    prompt: str | None = None
    # The dialect's camera target: ``controls`` hold for this many chunks, then ``release`` replaces them.
    hold_chunks: int | None = None
    release: dict[str, Any] | None = None
    prompt_transition_chunks: int = 0  # the chunks the model blends a prompt change over (0: at once)


@dataclass(frozen=True, slots=True)
class PendingEvent:
    """An accepted input event waiting for its chunk; its values are already in the staged update."""

    event_id: int
    arrived_at: float  # time.perf_counter() on arrival, for the action-to-frame histogram
    replaceable: bool = False  # a newer latest-wins input replaces it while it waits (a WebRTC data channel's)


@dataclass(frozen=True)
class ChunkInputs:
    """What one chunk is conditioned on, taken at its chunk boundary."""

    controls: dict[str, Any]
    prompt: str | None
    events: tuple[PendingEvent, ...]
    prompt_transition_chunks: int = 0

    @property
    def applied_event_ids(self) -> tuple[int, ...]:
        return tuple(e.event_id for e in self.events)


@dataclass(frozen=True)
class TickJob:
    """An accepted tick on its way to the worker."""

    session: Session
    tick_id: int
    update: Update
    reset: bool
    close: bool
    accepted_at: float = field(default_factory=time.perf_counter)
    rewind_to: int | None = None  # go back to this chunk boundary before the chunk (PROTOCOL.md, "Rewind ...")


class Session:
    """A session's protocol state; see the module docstring for the thread split."""

    def __init__(
        self,
        session_id: str,
        *,
        codec: str,
        quality: int,
        seed: int | None,
        prompt: str | None,
        max_pending_ticks: int,
        start_image: StartImage | None = None,
    ) -> None:
        self.id = session_id
        self.codec = codec
        self.quality = quality
        # The codec and quality the session chose, kept while its frames are raw pixels for a WebRTC track
        # (app/webrtc.py); None otherwise. A resume and a move go on in it: the new socket starts on the WebSocket.
        self.chosen_format: tuple[str, int] | None = None
        self.seed = seed
        # Chosen at start, on every tick the session sends to the model, kept across resets and resumes.
        self.start_image = start_image
        self.max_pending_ticks = max_pending_ticks
        # The share token whose recordings folder this session's chunks go to (app/recorder.py); None: not recorded.
        self.record_to: str | None = None
        self.state = SessionState.AWAITING_START
        self.last_tick_id: int | None = None
        self._last_reset_tick_id: int | None = None
        self.event_floor: int | None = None
        self._recent_events: deque[int] = deque(maxlen=RECENT_EVENT_IDS)
        self._recent_event_set: set[int] = set()
        # Ticks accepted and not yet written out in full (the credits in use).
        self.pending_ticks = 0
        # At most this many of its chunks started and not yet written before its next one starts (None: no
        # bound, for sessions no socket serves); the worker reads it, and is woken when a credit comes back.
        self.chunks_ahead_limit: int | None = None
        self.on_credit_returned: Callable[[], None] | None = None
        # What its dialect keeps beyond this object, for a resume (the realtime video dialect's VideoStreamState;
        # None for protocol 1, whose state is all here). Event loop only; a resume gets a copy.
        self.dialect_state: Any = None
        self._seq = 0
        self._lock = threading.Lock()
        self._controls: dict[str, Any] = {}
        self._controls_seq = -1
        self._prompt = prompt
        self.prompt_allowance = PromptAllowance()  # its new prompts per second (event loop only)
        self._prompt_seq = -1
        self._prompt_transition_chunks = 0
        # Chunks the current controls still hold for, and what replaces them then (a camera target's release).
        self._controls_hold: tuple[int, dict[str, Any]] | None = None
        self._pending_events: list[PendingEvent] = []
        # The latest pending event values per field, with their arrival numbers (see the module docstring).
        self._staged_controls: Update | None = None
        self._staged_prompt: Update | None = None
        # Formats (codec, quality) its viewers need encoded apart from its own frames (app/viewers.py): set on
        # the event loop, replaced whole, read by the worker when a chunk is done.
        self.viewer_formats: frozenset[tuple[str, int]] = frozenset()
        self.viewer_count = 0  # its viewers now (app/viewers.py, event loop only): a chunk is held for none
        # Event loop only: the index of the next chunk to reach the client, and chunks offered to viewers so far.
        self.next_chunk_index = 0
        self.chunks_out = 0
        # Whoever serves the session's outcomes now (its live session; passing control moves it): the worker
        # hands each tick's outcome here, on the event loop (app/worker.py, deliver_to_session).
        # It takes app/worker.py's TickOutcome; named Any here, as the worker's module is above this one.
        self.deliver: Callable[[Any], None] | None = None

    # ---- state machine -----------------------------------------------------------

    def transition(self, new_state: SessionState) -> None:
        allowed = TRANSITIONS[self.state]
        if new_state not in allowed:
            sources = {state for state in SessionState if new_state in TRANSITIONS[state]}
            raise SessionStateError(f"move to {new_state.value}", sources, self.state)
        self.state = new_state

    def expect(self, operation: str, *states: SessionState) -> None:
        if self.state not in states:
            raise SessionStateError(operation, frozenset(states), self.state)

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def prompt(self) -> str | None:
        """The prompt the session's chunks use now (a branch from it starts with it)."""
        with self._lock:
            return self._prompt

    # ---- messages (event loop) ----------------------------------------------------

    def _next_update(self, controls: dict[str, Any] | None, prompt: str | None, **extra: Any) -> Update:
        self._seq += 1
        return Update(self._seq, controls, prompt, **extra)

    def accept_tick(self, message: TickMessage) -> TickJob:
        """Check a tick against the session's state, id floor and credits; on success it holds a credit.

        Controls must already be validated against the model's schema. A
        refused tick changes nothing (the id floor stays where it was).
        """
        tick_id = message.tick_id
        if self.state is SessionState.DRAINING:
            raise ProtocolError(
                ErrorCode.INVALID_MESSAGE, "the session is closing after a tick with close: true", tick_id=tick_id
            )
        self.expect("accept a tick", SessionState.ACTIVE, SessionState.FAILED)
        if self.last_tick_id is not None and tick_id <= self.last_tick_id:
            raise ProtocolError(
                ErrorCode.STALE_TICK,
                f"tick_id {tick_id} is not greater than the last accepted tick_id {self.last_tick_id}",
                tick_id=tick_id,
            )
        if self.state is SessionState.FAILED and not message.reset:
            raise ProtocolError(
                ErrorCode.SESSION_FAILED,
                "the model failed on this session; send a tick with reset: true to start a new rollout",
                tick_id=tick_id,
            )
        if self.pending_ticks >= self.max_pending_ticks:
            raise ProtocolError(
                ErrorCode.TOO_MANY_TICKS,
                f"{self.pending_ticks} ticks already queued or running; the limit is {self.max_pending_ticks}",
                tick_id=tick_id,
            )
        self.last_tick_id = tick_id
        self.pending_ticks += 1
        if message.reset:
            self._last_reset_tick_id = tick_id
        if self.state is SessionState.FAILED:
            self.transition(SessionState.ACTIVE)
        if message.close:
            self.transition(SessionState.DRAINING)
        update = self._next_update(message.controls, message.prompt)
        return TickJob(self, tick_id, update, message.reset, message.close, rewind_to=message.rewind_to)

    def keep_open(self) -> None:
        """The tick with close: true ran nothing (its rewind was refused): no chunk, so no close either."""
        if self.state is SessionState.DRAINING:
            self.transition(SessionState.ACTIVE)

    def accept_event(
        self,
        message: InputMessage,
        *,
        hold_chunks: int | None = None,
        release: dict[str, Any] | None = None,
        prompt_transition_chunks: int = 0,
        latest_wins: bool = False,
    ) -> bool:
        """Stage an input event; returns True when it is a recent duplicate (acknowledged, not applied again).

        With ``hold_chunks``, the event's controls hold for that many chunks and
        then ``release`` applies (at the chunk boundary, whatever is queued);
        ``prompt_transition_chunks`` goes to the model with the prompt. A ``latest_wins`` event replaces the
        latest-wins events still waiting (their ids are never applied; its values replace theirs when staged).
        """
        event_id = message.event_id
        if self.event_floor is not None and event_id <= self.event_floor:
            if event_id in self._recent_event_set:
                return True
            raise ProtocolError(
                ErrorCode.STALE_EVENT,
                f"event_id {event_id} is not greater than the last accepted event_id {self.event_floor} "
                "and is not a recent duplicate",
            )
        if len(self._pending_events) >= MAX_PENDING_EVENTS:
            # The closest code in protocol 1: too much is queued; a tick applies the pending events.
            raise ProtocolError(
                ErrorCode.TOO_MANY_TICKS,
                f"{len(self._pending_events)} input events are waiting for the next chunk; send a tick to apply them",
            )
        self.event_floor = event_id
        if len(self._recent_events) == self._recent_events.maxlen:
            self._recent_event_set.discard(self._recent_events[0])
        self._recent_events.append(event_id)
        self._recent_event_set.add(event_id)
        update = self._next_update(
            message.controls,
            message.prompt,
            hold_chunks=hold_chunks,
            release=release,
            prompt_transition_chunks=prompt_transition_chunks,
        )
        with self._lock:
            if latest_wins:
                self._pending_events = [e for e in self._pending_events if not e.replaceable]
            self._pending_events.append(PendingEvent(event_id, time.perf_counter(), replaceable=latest_wins))
            if update.controls is not None:
                self._staged_controls = update
            if update.prompt is not None:
                self._staged_prompt = update
        return False

    def note_failure(self, tick_id: int) -> None:
        """The model failed on ``tick_id``: refuse non-reset ticks unless a later reset is already queued."""
        recovering = self._last_reset_tick_id is not None and self._last_reset_tick_id > tick_id
        if self.state is SessionState.ACTIVE and not recovering:
            self.transition(SessionState.FAILED)

    def release_credit(self) -> None:
        if self.pending_ticks <= 0:
            raise RuntimeError(f"session {self.id} returned a tick credit it did not hold")
        self.pending_ticks -= 1
        if self.on_credit_returned is not None:
            self.on_credit_returned()  # a queued tick held back by chunks_ahead_limit may start now

    def may_start_chunk(self, queued: int) -> bool:
        """Whether its next chunk may start, with ``queued`` of its ticks still queued (worker thread)."""
        limit = self.chunks_ahead_limit
        return limit is None or self.pending_ticks - queued < limit

    # ---- chunk boundary (worker thread) --------------------------------------------

    def _apply(self, update: Update) -> None:
        if update.controls is not None and update.seq > self._controls_seq:
            self._controls, self._controls_seq = update.controls, update.seq
            held = update.hold_chunks is not None and update.release is not None
            self._controls_hold = (update.hold_chunks, update.release) if held else None  # type: ignore[assignment]
        if update.prompt is not None and update.seq > self._prompt_seq:
            self._prompt, self._prompt_seq = update.prompt, update.seq
            self._prompt_transition_chunks = update.prompt_transition_chunks

    def _count_held_chunk(self) -> None:
        """A chunk used the held controls: after their last one, the release replaces them (same arrival number)."""
        if self._controls_hold is None:
            return
        left, release = self._controls_hold
        self._controls_hold = (left - 1, release) if left > 1 else None
        if left <= 1:
            self._controls = release

    def take_chunk_inputs(self, job: TickJob) -> ChunkInputs:
        """Apply the tick's own update and every pending input event, newest last; return the result."""
        with self._lock:
            events = tuple(self._pending_events)
            self._pending_events.clear()
            staged = [u for u in (self._staged_controls, self._staged_prompt) if u is not None]
            self._staged_controls = self._staged_prompt = None
            for update in sorted([job.update, *staged], key=lambda u: u.seq):
                self._apply(update)
            inputs = ChunkInputs(dict(self._controls), self._prompt, events, self._prompt_transition_chunks)
            self._count_held_chunk()
            return inputs

    def absorb_update(self, job: TickJob) -> None:
        """Apply the update of an accepted tick that will not run; pending events wait for the next chunk."""
        with self._lock:
            self._apply(job.update)

    def pending_event_ids(self) -> list[int]:
        """The ids of the input events waiting for their chunk."""
        with self._lock:
            return [e.event_id for e in self._pending_events]

    def restore_events(self, events: tuple[PendingEvent, ...]) -> None:
        """Put back the events of a chunk that failed, so the next chunk lists them as applied.

        Their values were already applied to the current controls, which is
        what the next chunk uses anyway.
        """
        if not events:
            return
        with self._lock:
            self._pending_events[:0] = events

    @property
    def own_format(self) -> tuple[str, int]:
        """The codec and quality the session chose (its frames' own, unless they are raw pixels for a track)."""
        return self.chosen_format or (self.codec, self.quality)

    def carry_over(self, *, codec: str, quality: int, failed: bool) -> Session:
        """This session's state for the connection that resumes it (PROTOCOL.md, "Resume ...").

        Everything the protocol keeps across a resume comes along (controls,
        prompt, seed, start image, id floors, input events waiting for their chunk); what
        belonged to the old connection does not: its tick credits (its queued
        ticks were dropped) and its state. A copy rather than the same object,
        so the old connection, still winding down, cannot touch the new one's.
        """
        with self._lock:
            resumed = copy.copy(self)
            for name, value in vars(self).items():
                if isinstance(value, (list, dict, set, deque)):
                    setattr(resumed, name, copy.copy(value))
        resumed._lock = threading.Lock()
        resumed.dialect_state = copy.deepcopy(self.dialect_state)
        resumed.codec, resumed.quality = codec, quality
        resumed.chosen_format = None
        resumed.pending_ticks = 0
        resumed.viewer_formats = frozenset()  # viewers end with the connection they watched
        resumed.viewer_count = 0
        resumed.deliver = None  # the resuming live session takes its outcomes once it is registered
        resumed.state = SessionState.FAILED if failed else SessionState.ACTIVE
        return resumed

    # ---- moving to another replica (app/migration.py) -------------------------------------

    def portable_state(self) -> dict[str, Any]:
        """The protocol state a peer needs to go on with this session (JSON), at a chunk boundary.

        What :meth:`carry_over` keeps, in values: controls and prompt (with any
        still staged by input events, only when newer than the current ones),
        seed, codec, id floors, and the ids of input events waiting for their
        chunk (their arrival times do not travel: a clock is per process).
        """
        with self._lock:
            staged_controls = self._staged_controls
            staged_prompt = self._staged_prompt
            return {
                "id": self.id,
                "codec": self.own_format[0],
                "quality": self.own_format[1],
                "seed": self.seed,
                "controls": self._controls,
                "prompt": self._prompt,
                "staged_controls": staged_controls.controls
                if staged_controls is not None and staged_controls.seq > self._controls_seq
                else None,
                "staged_prompt": staged_prompt.prompt
                if staged_prompt is not None and staged_prompt.seq > self._prompt_seq
                else None,
                "pending_event_ids": [e.event_id for e in self._pending_events],
                "last_tick_id": self.last_tick_id,
                "last_reset_tick_id": self._last_reset_tick_id,
                "event_floor": self.event_floor,
                "recent_event_ids": list(self._recent_events),
                # its dialect's own (a realtime video session's VideoStreamState), as JSON; None for protocol 1
                "dialect_state": None if self.dialect_state is None else self.dialect_state.portable(),
                # whether it is recorded: its files travel beside this section, and the peer goes on recording
                "record": self.record_to is not None,
            }

    @classmethod
    def from_portable(cls, state: dict[str, Any], *, session_id: str, max_pending_ticks: int) -> Session:
        """A detached session rebuilt from :meth:`portable_state`, ready to be resumed (state ACTIVE)."""
        session = cls(
            session_id,
            codec=str(state["codec"]),
            quality=int(state["quality"]),
            seed=state["seed"],
            prompt=state["prompt"],
            max_pending_ticks=max_pending_ticks,
        )
        session._controls = dict(state["controls"])
        session._controls_seq = session._prompt_seq = 0
        session._seq = 1
        if state["staged_controls"] is not None:
            session._staged_controls = session._next_update(dict(state["staged_controls"]), None)
        if state["staged_prompt"] is not None:
            session._staged_prompt = session._next_update(None, str(state["staged_prompt"]))
        now = time.perf_counter()
        session._pending_events = [PendingEvent(int(i), now) for i in state["pending_event_ids"]]
        session.last_tick_id = state["last_tick_id"]
        session._last_reset_tick_id = state["last_reset_tick_id"]
        session.event_floor = state["event_floor"]
        for event_id in state["recent_event_ids"]:
            session._recent_events.append(int(event_id))
        session._recent_event_set = set(session._recent_events)
        # As JSON until its dialect's resume reads it (realtime_video.VideoStreamState.from_portable).
        session.dialect_state = state.get("dialect_state")
        session.state = SessionState.ACTIVE
        return session


def tick_request(job: TickJob, inputs: ChunkInputs) -> TickRequest:
    """The runner's request for a tick's chunk: what the tick asks (reset, close, rewind) with the inputs its chunk
    took (:meth:`Session.take_chunk_inputs`)."""
    session = job.session
    return TickRequest(
        session_id=session.id,
        request_id=job.tick_id,
        controls=inputs.controls,
        prompt=inputs.prompt,
        prompt_transition_chunks=inputs.prompt_transition_chunks,
        seed=session.seed,
        reset=job.reset,
        close=job.close,
        applied_event_ids=inputs.applied_event_ids,
        start_image=session.start_image,
        rewind_to=job.rewind_to,
    )


def restart_reason(*, reset: bool, new_rollout: bool, produced_before: bool, rewound: bool = False) -> str | None:
    """The chunk's ``restarted`` field (PROTOCOL.md, `chunk`)."""
    if reset:
        return "reset"
    if rewound:
        return "rewind"
    if new_rollout and produced_before:
        return "evicted"
    return None
