"""The chunks a controller's viewers get (app/viewers.py holds the audience; this feeds it).

Viewers get every chunk the controller gets: held until the controller's next
tick is on its way (so writing to many viewers runs beside the forward, not
before it), then offered in the controller's own frames where they can share
them and encoded once per other format in use, on the encoder threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .protocol import chunk_message
from .viewers import Format, shares_frames

if TYPE_CHECKING:
    from .dialect import Gate
    from .session import Session
    from .worker import TickOutcome

# A controller's chunks being encoded in its viewers' other formats at once; past it, those viewers skip one.
VIEWER_ENCODES_IN_FLIGHT = 2
# How long a chunk waits for the controller's next tick before it goes to the viewers anyway (ViewerFeed.hold).
VIEWER_HOLD_S = 0.02


def chunk_header(outcome: TickOutcome) -> dict[str, Any]:
    """A chunk outcome's `chunk` message (protocol 1's, for its controller and, through this feed, its viewers)."""
    return chunk_message(
        tick_id=outcome.job.tick_id,
        chunk_index=outcome.chunk_index,
        frames=len(outcome.frame_messages),
        applied_event_ids=outcome.applied_event_ids,
        restarted=outcome.restarted,
        queue_ms=outcome.queue_s * 1e3,
        compute_ms=outcome.compute_s * 1e3,
        encode_ms=outcome.encode_s * 1e3,
        rewind_points=outcome.rewind_points,
    )


class ViewerFeed:
    """One controller's feed to its viewers: chunks held for them, and its encodes in flight for them."""

    def __init__(self, header: Callable[[TickOutcome], dict[str, Any]]) -> None:
        self._header = header  # the chunk's message on the dialect's wire
        self._encodes = 0  # chunks being encoded for the viewers' formats
        # Chunks not yet offered to the viewers, and the timer that will offer them.
        self.held: list[tuple[Session, TickOutcome]] = []
        self._timer: asyncio.TimerHandle | None = None

    def hold(self, gate: Gate, session: Session, outcome: TickOutcome) -> None:
        """Offer the chunk to the viewers once the controller has sent its next tick (or VIEWER_HOLD_S later).

        Writing a chunk to dozens of viewers takes the event loop a while; done right after the controller's
        own chunk, it would hold up the controller's next tick, which arrives a round trip later. Done when that
        tick is on its way to the worker, it runs beside the forward instead.
        """
        if not gate.shares.viewers(session.id):
            return
        self.held.append((session, outcome))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(VIEWER_HOLD_S, self.offer_held, gate)

    def offer_held(self, gate: Gate) -> None:
        """Offer the chunks held for the viewers now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self.held = self.held, []
        for session, outcome in held:
            self._fan_out(gate, session, outcome)

    def _fan_out(self, gate: Gate, session: Session, outcome: TickOutcome) -> None:
        """Offer a chunk to the session's viewers: the controller's own frames where they can share them,
        one encode per other format in use (on the encoder threads; while two are still being encoded, the
        viewers of those formats skip the chunk, so a slow encode never piles up)."""
        shares = gate.shares
        if not shares.viewers(session.id):
            return
        session.chunks_out += 1
        header = self._header(outcome)
        own = (outcome.codec, outcome.quality)
        if shares_frames(own, own):
            shares.offer(session.id, header, session.chunks_out, {own: outcome.frame_messages})
        formats = shares.formats_needed(session.id, own)
        if not formats:
            return
        worker = gate.worker
        if outcome.frames is None or self._encodes >= VIEWER_ENCODES_IN_FLIGHT or worker is None:
            shares.skip(session.id, formats)
            return
        self._encodes += 1
        seq = session.chunks_out

        def deliver(encoded: dict[Format, tuple[bytes, ...]]) -> None:
            self._encodes -= 1
            shares.offer(session.id, header, seq, encoded)

        worker.encode_for_viewers(
            session.id, outcome.frames, formats, chunk_index=outcome.chunk_index, tick_id=outcome.job.tick_id,
            deliver=deliver,
        )
