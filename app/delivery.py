"""How a tick's outcome reaches its session: encoded on the session's encoder lane, handed to the event loop.

The model worker (app/worker.py) runs forwards and nothing else: each chunk it
makes goes to :class:`Delivery`, whose encoder threads encode its frames and
hand the :class:`TickOutcome` to the event loop while the next forward runs,
in order per session (each session's lane carries its chunks, its errors and
its position reports). :class:`Handoff` batches those calls so a round of
many sessions wakes the loop once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import numpy as np

from .encoding import EncoderPool
from .recorder import Recordings
from .session import ChunkInputs, PendingEvent, TickJob
from ..runner.types import ChunkResult

log = logging.getLogger("arstream.worker")

VIEWERS_LANE_SUFFIX = "#viewers"  # the encoder lane of a session's viewers' formats (never a session id)


class OutcomeKind(Enum):
    CHUNK = "chunk"
    MODEL_FAILED = "model_failed"  # this tick's forward raised; the runner released the session
    REWIND_UNAVAILABLE = "rewind_unavailable"  # its rewind_to names a boundary not held: nothing ran
    SKIPPED_FAILED = "skipped_failed"  # queued behind a failed tick and not a reset: not run
    INTERNAL = "internal"  # a server fault after the forward (e.g. encoding)


@dataclass(frozen=True)
class TickOutcome:
    """What became of one tick; delivered on the event loop."""

    job: TickJob
    kind: OutcomeKind
    chunk_index: int = 0
    frame_messages: tuple[bytes, ...] = ()
    events: tuple[PendingEvent, ...] = ()
    restarted: str | None = None
    queue_s: float = 0.0
    compute_s: float = 0.0
    encode_s: float = 0.0
    error: str = ""
    # The format of frame_messages, and the chunk's pixels, kept only when its session's viewers need
    # other formats (Session.viewer_formats).
    codec: str = ""
    quality: int = 0
    frames: np.ndarray | None = None
    rewind_points: tuple[int, ...] | None = None  # boundaries a later rewind_to may name, oldest first (None: off)

    @property
    def applied_event_ids(self) -> list[int]:
        return [e.event_id for e in self.events]


@dataclass(frozen=True)
class SessionPosition:
    """Where a session's rollout stands at a chunk boundary (for a resume ticket)."""

    next_chunk_index: int
    failed: bool  # its last forward failed: only a tick with reset: true runs next
    evicted: bool  # it had produced chunks and the pool reclaimed its KV


def deliver_to_session(outcome: TickOutcome) -> None:
    """Hand an outcome to whoever serves its session now (``Session.deliver``; nobody: it is dropped)."""
    deliver = outcome.job.session.deliver
    if deliver is not None:
        deliver(outcome)


class Handoff:
    """Calls from the encoder threads run on the event loop in arrival order, many per loop wake-up.

    A round of 16 sessions yields 16 outcomes within a few milliseconds; one
    ``call_soon_threadsafe`` for all that are waiting spares the loop 15 wake-ups.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._waiting: list[Callable[[], None]] = []

    def call(self, function: Callable[[], None]) -> None:
        with self._lock:
            self._waiting.append(function)
            if len(self._waiting) > 1:
                return  # a drain is already scheduled and will take this one too
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for function in waiting:
            try:
                function()
            except Exception:  # noqa: BLE001 - as call_soon would: log it, and still run the others
                log.exception("delivering a worker result failed")


class Delivery:
    """The encoder lanes and the hand-off to the event loop, shared by the worker and its decode stage."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[TickOutcome], None],
        *,
        encode_threads: int | None,
        encoder_nice: int,
    ) -> None:
        self.deliver = deliver
        self.encoders = EncoderPool(encode_threads, nice=encoder_nice)
        self.handoff = Handoff(loop)
        self.recorder: Recordings | None = None  # set by the server when it records (--record-dir)
        self.fps = 16.0  # the model card's, once the model is loaded (a recording's frame rate)

    def send(self, outcome: TickOutcome) -> None:
        """Deliver on the event loop, after the session's earlier outcomes."""
        self.encoders.submit(outcome.job.session.id, lambda: self.handoff.call(lambda: self.deliver(outcome)))

    def recording_ends(self, session_id: str) -> None:
        """The session was released: its recording, if any, is finished after its last chunk (on its lane)."""
        recorder = self.recorder
        if recorder is not None:
            self.encoders.submit(session_id, lambda: recorder.finish(session_id))

    def recording_pauses(self, session_id: str) -> None:
        """The session stopped recording: its file ends after the chunks already on its lane."""
        recorder = self.recorder
        if recorder is not None:
            self.encoders.submit(session_id, lambda: recorder.pause(session_id))

    def _record(self, session_id: str, share_token: str, result: ChunkResult, restarted: str | None) -> None:
        """Append the chunk to the session's recording (on its encoder lane, in order); a failure costs the
        recording, never the session."""
        assert self.recorder is not None
        try:
            self.recorder.write(
                session_id, share_token, result.frames, chunk_index=result.chunk_index, restarted=restarted, fps=self.fps
            )
        except Exception:  # noqa: BLE001 - a disk or encoder fault: the chunk is not recorded, play goes on
            log.exception("session=%s chunk %d not recorded", session_id, result.chunk_index)
            self.recorder.metrics.dropped("error")

    def after_lane(self, lane: str | None, function: Callable[[], None]) -> None:
        """Run ``function`` on the event loop: after the outcomes queued on ``lane`` (a session), or at once (None)."""
        if lane is None:
            self.handoff.call(function)
        else:
            self.encoders.submit(lane, lambda: self.handoff.call(function))

    def encode_for_viewers(
        self,
        session_id: str,
        frames: np.ndarray,
        formats: frozenset[tuple[str, int]],
        *,
        chunk_index: int,
        tick_id: int,
        deliver: Callable[[dict[tuple[str, int], tuple[bytes, ...]]], None],
    ) -> None:
        """Encode a chunk once in each of ``formats`` (codec, quality) for the session's viewers; ``deliver``
        gets them on the event loop. On a lane of their own: the session's next chunk never waits for them."""

        def encode() -> None:
            encoded: dict[tuple[str, int], tuple[bytes, ...]] = {}
            for codec, quality in formats:
                try:
                    encoded[(codec, quality)] = tuple(
                        self.encoders.encode_standalone(
                            frames, codec=codec, quality=quality, chunk_index=chunk_index, tick_id=tick_id
                        )
                    )
                except Exception:  # noqa: BLE001 - its viewers miss this chunk; the session goes on
                    log.exception("session=%s chunk %d: encoding %s for viewers failed", session_id, chunk_index, codec)
            self.handoff.call(lambda: deliver(encoded))

        self.encoders.submit(session_id + VIEWERS_LANE_SUFFIX, encode)

    def encode_and_send(
        self, job: TickJob, inputs: ChunkInputs, result: ChunkResult, restarted: str | None, queue_s: float
    ) -> None:
        """Queue the chunk on the session's encoder lane; the worker moves on to the next forward."""
        session = job.session
        # Read now, on the worker: a resume may change the codec before the lane runs this.
        codec, quality = session.codec, session.quality
        keep_frames = bool(session.viewer_formats)
        self.encoders.submit(
            session.id,
            lambda: self._encode_and_deliver(job, inputs, result, restarted, queue_s, codec, quality, keep_frames),
        )

    def _encode_and_deliver(
        self,
        job: TickJob,
        inputs: ChunkInputs,
        result: ChunkResult,
        restarted: str | None,
        queue_s: float,
        codec: str,
        quality: int,
        keep_frames: bool = False,
    ) -> None:
        """Runs on an encoder thread, in the session's lane."""
        session = job.session
        encode_started = time.perf_counter()
        try:
            messages = self.encoders.encode(
                session.id,
                result.frames,
                codec=codec,
                quality=quality,
                chunk_index=result.chunk_index,
                tick_id=job.tick_id,
            )
        except Exception as exc:  # noqa: BLE001 - a server fault: the session ends with `internal`
            log.exception("session=%s tick=%d frame encoding failed", session.id, job.tick_id)
            failed = TickOutcome(job, OutcomeKind.INTERNAL, queue_s=queue_s, error=f"frame encoding failed: {exc}")
            self.handoff.call(lambda: self.deliver(failed))
            return
        if self.recorder is not None and session.record_to is not None:
            self._record(session.id, session.record_to, result, restarted)
        chunk = TickOutcome(
            job,
            OutcomeKind.CHUNK,
            chunk_index=result.chunk_index,
            frame_messages=tuple(messages),
            events=inputs.events,
            restarted=restarted,
            queue_s=queue_s,
            compute_s=result.compute_s,
            encode_s=time.perf_counter() - encode_started,
            codec=codec,
            quality=quality,
            frames=result.frames if keep_frames else None,
            rewind_points=result.rewind_held,
        )
        self.handoff.call(lambda: self.deliver(chunk))
