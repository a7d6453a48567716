"""The one writer of a live session's socket: it sends what the outbox holds, in order, whole.

A chunk's frames never interleave with anything else, because only this task writes. A controller's chunk goes
through its dialect (``Dialect.send_chunk``) and gives its credit back once written; a viewer's chunk says how
many chunks it skipped before it; the close frame ends the writer. A viewer's writer is on one item at most
``viewer_stall_timeout_s`` (:meth:`~arstream.app.viewers.ViewerRole.arm_stall`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from .dialect import ChunkSent, Dialect, SessionPort
from .metrics import ServerMetrics
from .outbox import QueuedChunk, QueuedText, ViewerChunk
from .protocol import dumps
from .session import Session
from .viewers import ViewerRole

if TYPE_CHECKING:
    from .delivery import TickOutcome

log = logging.getLogger("arstream.session")


def observe_action_to_frame(live: SessionPort, outcome: TickOutcome) -> None:
    """Each input the chunk applied, from its arrival to the chunk's first frame leaving."""
    sent_at = time.perf_counter()
    for event in outcome.events:
        live.gate.metrics.action_to_frame_seconds.observe(sent_at - event.arrived_at)


async def send_chunk_on_websocket(live: SessionPort, outcome: TickOutcome, header: dict[str, Any]) -> ChunkSent:
    """A chunk's `chunk` message, then its frames as binary messages (one frame each)."""
    await live.ws.send_text(dumps(header))
    for index, frame in enumerate(outcome.frame_messages):
        await live.ws.send_bytes(frame)
        if index == 0:
            observe_action_to_frame(live, outcome)
    return ChunkSent(len(outcome.frame_messages), sum(len(frame) for frame in outcome.frame_messages))


class Written(SessionPort, Protocol):
    """The live session whose socket the writer writes."""

    @property
    def dialect(self) -> Dialect: ...

    @property
    def metrics(self) -> ServerMetrics: ...

    @property
    def session_id(self) -> str: ...


async def write_outbox(live: Written, session: Session) -> None:
    """Send what ``live``'s outbox holds until its close frame is sent (or the client is gone)."""
    outbox, ws, metrics = live.outbox, live.ws, live.metrics
    role: ViewerRole | None = None
    try:
        while True:
            item = await outbox.get()
            role = live.watch
            if role is not None:
                role.arm_stall()
            if isinstance(item, QueuedText):
                await ws.send_text(item.text)
                if item.returns_credit:
                    session.release_credit()
            elif isinstance(item, QueuedChunk):
                sent = await live.dialect.send_chunk(live, item.outcome)
                if sent.on_track:
                    metrics.track_frames_sent.inc(sent.frames)
                else:
                    count_sent(metrics, sent.frames, sent.websocket_bytes)
                metrics.chunks.inc()
                session.release_credit()
                live.dialect.chunk_sent(live)
            elif isinstance(item, ViewerChunk):
                skipped, outbox.chunks_skipped = outbox.chunks_skipped, 0
                on_track = await live.dialect.send_viewer_chunk_on_track(live, item, skipped)
                if on_track is not None:
                    metrics.track_frames_sent.inc(on_track.frames)
                else:
                    await ws.send_text(dumps({**item.header, "skipped_before": skipped}) if skipped else item.text)
                    for frame in item.frames:
                        await ws.send_bytes(frame)
                        count_sent(metrics, 1, len(frame))
            else:
                if item.text is not None:
                    await ws.send_text(item.text)
                await ws.close(item.code, item.reason)
                return
            if role is not None:
                role.disarm_stall()
    except Exception as exc:  # noqa: BLE001 - a vanished client ends the writer quietly
        log.debug("session=%s writer stopped: %s", live.session_id, exc)
    finally:
        if role is not None:
            role.disarm_stall()
        outbox.close()


class Writer:
    """The writer task of one socket: started once its session starts, waited on (bounded) as it ends."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def start(self, live: Written, session: Session, name: str) -> None:
        self._task = asyncio.create_task(write_outbox(live, session), name=f"writer-{name}")

    async def wait_sent(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for everything queued to be sent, then stop; False if it was cut short."""
        task = self._task
        if task is None or task.done():
            return True
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            await self.stop()
        return bool(done)

    async def stop(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})


def count_sent(metrics: ServerMetrics, frames: int, nbytes: int) -> None:
    metrics.frames_sent.inc(frames)
    metrics.bytes_sent.inc(nbytes)
