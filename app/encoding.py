"""Frame encoding beside the forwards: a few encoder threads with one ordered lane per session.

The model worker hands every tick outcome to an :class:`EncoderPool` and goes
straight back to the next forward. The pool encodes a chunk's frames on one of
its threads and delivers the outcome to the event loop. Two rules keep the
protocol's guarantees:

- **Order per session.** Each session has a lane: its tasks (chunks to encode,
  errors to report, encoder resets) run one at a time, in the order they were
  submitted, so a session's chunks reach its connection in order and a
  stateful video encoder sees its frames in order. Lanes of different sessions
  run in parallel.
- **No GIL on the critical path.** The encoders (simplejpeg, libx264 through
  PyAV) release the GIL while they compress, so threads suffice: a process pool
  would copy every frame across a pipe instead.
- **The worker first.** The encoder threads run at a lower CPU priority
  (``encoder_nice``): where cores are short, the kernel gives the model
  worker's next forward the core and the encoders catch up inside it.

A session's encoder state (a video stream's reference frames) lives here too,
touched only by tasks on that session's lane.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .codecs import ChunkEncoder, new_encoder

log = logging.getLogger("arstream.encoding")

Task = Callable[[], None]


def lower_thread_priority(steps: int) -> None:
    """Run the calling thread ``steps`` of CPU niceness below the thread that started it (at most 19)."""
    # Linux nice values are per thread: this lowers only the calling thread (raising a nice value needs no
    # privilege; lowering one would).
    if steps:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(os.getpriority(os.PRIO_PROCESS, thread) + steps, 19))


def default_encode_threads() -> int:
    """One encoder thread per core: encoders release the GIL, and a lane never runs on two threads."""
    return max(1, os.cpu_count() or 1)


class OrderedLanes:
    """Runs tasks on a shared thread pool, one at a time per lane, in submission order per lane.

    A lane exists while it has a task running or waiting. When a lane's task
    ends, the lane's next task goes to the back of the pool's queue, so a busy
    session cannot starve the others.
    """

    def __init__(self, threads: int, *, name: str, nice: int = 0) -> None:
        if threads < 1:
            raise ValueError(f"an encoder pool needs at least 1 thread, got {threads}")
        self.threads = threads
        self.nice = nice
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name, initializer=self._start_thread)
        self._lock = threading.Lock()
        # lane -> its waiting tasks; a lane is present while one of its tasks is running
        self._lanes: dict[str, deque[Task]] = {}
        self._closed = False

    def _start_thread(self) -> None:
        lower_thread_priority(self.nice)

    def submit(self, lane: str, task: Task) -> None:
        with self._lock:
            if self._closed:
                return
            waiting = self._lanes.get(lane)
            if waiting is not None:
                waiting.append(task)
                return
            self._lanes[lane] = deque()
            self._executor.submit(self._run, lane, task)

    def _run(self, lane: str, task: Task) -> None:
        try:
            task()
        except BaseException:  # noqa: BLE001 - one failed task must not stall its lane
            log.exception("lane %s: task failed", lane)
        with self._lock:
            waiting = self._lanes[lane]
            if not waiting or self._closed:
                del self._lanes[lane]
                return
            self._executor.submit(self._run, lane, waiting.popleft())

    def busy_lanes(self) -> int:
        with self._lock:
            return len(self._lanes)

    def shutdown(self, *, wait: bool) -> None:
        """Run nothing more that was not started; with ``wait``, let running tasks finish."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)


class EncoderPool:
    """Per-session ordered lanes plus each session's encoder; see the module docstring."""

    def __init__(self, threads: int | None = None, *, nice: int = 0) -> None:
        self._lanes = OrderedLanes(threads or default_encode_threads(), name="arstream-encoder", nice=nice)
        self._encoders: dict[str, ChunkEncoder] = {}
        self._encoders_lock = threading.Lock()

    @property
    def threads(self) -> int:
        return self._lanes.threads

    def submit(self, session_id: str, task: Task) -> None:
        """Run ``task`` after every task submitted earlier for the same session."""
        self._lanes.submit(session_id, task)

    def encode(
        self, session_id: str, frames: np.ndarray, *, codec: str, quality: int, chunk_index: int, tick_id: int
    ) -> list[bytes]:
        """Encode a chunk with the session's encoder; call only from a task on the session's lane.

        A chunk that begins a rollout (``chunk_index`` 0: start, reset, or a
        restart after eviction), or a change of codec or quality, starts a
        fresh encoder, so a video stream begins with a keyframe there.
        """
        with self._encoders_lock:
            encoder = self._encoders.get(session_id)
        if encoder is None or chunk_index == 0 or (encoder.codec, encoder.quality) != (codec, quality):
            if encoder is not None:
                encoder.close()
            encoder = new_encoder(codec, quality)
            with self._encoders_lock:
                self._encoders[session_id] = encoder
        return encoder.encode(frames, chunk_index=chunk_index, tick_id=tick_id)

    def encode_standalone(
        self, frames: np.ndarray, *, codec: str, quality: int, chunk_index: int, tick_id: int
    ) -> list[bytes]:
        """Encode a chunk as a stream of its own (H.264: a keyframe first), for viewers (app/viewers.py):
        any chunk of it can be decoded without the ones before. Holds no state: call from any task."""
        encoder = new_encoder(codec, quality)
        try:
            return encoder.encode(frames, chunk_index=chunk_index, tick_id=tick_id)
        finally:
            encoder.close()

    def restart_stream(self, session_id: str) -> None:
        """After the session's queued tasks, drop its encoder: its next chunk starts a new stream (keyframe)."""
        self._lanes.submit(session_id, lambda: self._drop_encoder(session_id))

    def _drop_encoder(self, session_id: str) -> None:
        with self._encoders_lock:
            encoder = self._encoders.pop(session_id, None)
        if encoder is not None:
            encoder.close()

    def sessions_with_encoders(self) -> int:
        with self._encoders_lock:
            return len(self._encoders)

    def shutdown(self, *, wait: bool) -> None:
        self._lanes.shutdown(wait=wait)
        with self._encoders_lock:
            encoders = list(self._encoders.values())
            self._encoders.clear()
        for encoder in encoders:
            encoder.close()
