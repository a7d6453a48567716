"""Start image decode workers: a process per decode thread, which a deadline or a client that leaves kills.

A thread cannot be stopped in the middle of a Pillow call, so a decode that
runs long (a file the checks before decoding let through, or a decoder slower
than they expect) would hold its thread, and a decode slot, to its end. Each
decode runs in a worker process of its own instead (``python -m
arstream.app.image_worker``): the server sends the file and its limits, the
worker answers the pixels or why it refused them, and the server kills it
when the deadline passes or the client goes, so the slot is free at once.
A worker serves one decode after another while none is killed, and is started
by the decode thread that needs one (it inherits the thread's lowered CPU
priority); starting counts against the decode's deadline as waiting does.

What crosses the pipe is bytes: a JSON header and the raw file one way, a JSON
header and raw RGB bytes the other (never pickles: a worker that a hostile
file took over could not run code in the server through its answer), each
message bounded in length.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Pipe

import numpy as np

from .image_decode import ImageLimits, StartImageRefused, decode_pixels

WORKER_MODULE = "arstream.app.image_worker"
MAX_HEADER_BYTES = 64 * 1024  # the JSON header of an answer: a refusal's text and a picture's size


class DecodeDeadline(Exception):
    """The decode was stopped (its worker killed): the deadline passed, or :meth:`DecodeJob.abort` was called."""

    def __init__(self, started: bool) -> None:
        super().__init__("the decode was stopped")
        self.started = started  # False: no worker was ready to take it by then


class DecodeWorker:
    """One worker process and the server's end of its pipe."""

    def __init__(self) -> None:
        ours, theirs = Pipe(duplex=True)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # what the worker says goes to stderr, beside the server's logs
                close_fds=True,
            )
        finally:
            theirs.close()
        self.connection: Connection = ours
        self._reaping = threading.Lock()  # a pid is never signalled once reaped (it may be another process's)
        self.ready = False  # the worker said it has loaded its imports

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, deadline: float) -> bool:
        """True once the worker has started (False: the deadline passed, or it died starting)."""
        if not self.ready:
            self.ready = self._receive(deadline, MAX_HEADER_BYTES) == b"ready"
        return self.ready

    def decode(self, encoded: bytes, limits: ImageLimits, deadline: float) -> np.ndarray | None:
        """The pixels of ``encoded``, or None when the worker was killed or the deadline passed first (the worker
        is then of no more use). Raises :class:`StartImageRefused` with the worker's reason."""
        header = {"max_pixels": limits.max_pixels, "max_jpeg_scans": limits.max_jpeg_scans, "frame": limits.frame}
        try:
            self.connection.send_bytes(json.dumps(header).encode())
            self.connection.send_bytes(encoded)
        except OSError:  # killed already
            return None
        answer = self._receive(deadline, MAX_HEADER_BYTES)
        if answer is None:
            return None
        reply = json.loads(answer)
        if "refused" in reply:
            raise StartImageRefused(str(reply["refused"]))
        width, height = int(reply["width"]), int(reply["height"])
        expected = width * height * 3
        if width * height > limits.max_pixels or limits.frame not in (None, (width, height)):
            raise RuntimeError(f"the decode worker answered a {width}x{height} picture for limits {limits}")
        data = self._receive(deadline, expected)
        if data is None or len(data) != expected:
            return None
        pixels = np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3)
        return pixels  # read-only: np.frombuffer over bytes

    def _receive(self, deadline: float, max_bytes: int) -> bytes | None:
        try:
            if not self.connection.poll(max(0.0, deadline - time.monotonic())):
                return None
            return self.connection.recv_bytes(max_bytes)
        except (EOFError, OSError):  # killed, or an answer over its bound
            return None

    def stop(self) -> None:
        """SIGKILL, from any thread, without waiting: the thread using the worker sees its pipe end and reaps it."""
        with self._reaping:
            if self.process.returncode is None:
                self.process.send_signal(signal.SIGKILL)

    def kill(self) -> None:
        """Stop the worker and reap it (by the thread that uses it, or for an idle one)."""
        with self._reaping:
            self.process.kill()
            self.process.wait()
        self.connection.close()


class DecodeWorkers:
    """The idle workers of one server's decode threads (one per thread), and those decoding now.

    Workers are started ahead (:meth:`start_spare`), and one that is killed is replaced at once, so a decode
    seldom waits for a worker's imports; a decode that finds no worker ready by its deadline never started.
    """

    def __init__(self, size: int) -> None:
        self.size = size  # one per decode thread
        self._lock = threading.Lock()
        self._idle: list[DecodeWorker] = []
        self._busy: set[DecodeWorker] = set()
        self._closed = False

    def decode(self, encoded: bytes, limits: ImageLimits, deadline: float, job: DecodeJob) -> np.ndarray:
        """Run one decode on a decode thread: an idle worker, or one started for it. Raises
        :class:`StartImageRefused` (the worker's reason) or :class:`DecodeDeadline`."""
        worker = self._take(job)
        if worker is None:
            raise DecodeDeadline(started=False)
        if not worker.wait_ready(deadline):
            if job.aborted:  # stopped while it started
                self._discard(worker)
            else:  # still loading: the next decode finds it ready
                self._give_back(worker)
            raise DecodeDeadline(started=False)
        pixels = None
        try:
            pixels = worker.decode(encoded, limits, deadline)
        finally:
            if pixels is None:  # killed, past its deadline, or it answered what it may not: it goes
                self._discard(worker)
            else:
                self._give_back(worker)
        if pixels is None:
            if job.aborted or time.monotonic() >= deadline:
                raise DecodeDeadline(started=True)
            # It died on its own (a decoder crash): the file is what it could not decode.
            raise StartImageRefused("start.image.data is not a file that decodes: the decoder stopped on it")
        return pixels

    def _take(self, job: DecodeJob) -> DecodeWorker | None:
        with self._lock:
            if self._closed or job.aborted:
                return None
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = DecodeWorker()
        with self._lock:
            self._busy.add(worker)
            closed = self._closed
        if not job.attach(worker) or closed:  # stopped while it started: nothing else stops this worker
            worker.stop()
        return worker

    def _give_back(self, worker: DecodeWorker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _discard(self, worker: DecodeWorker | None) -> None:
        if worker is None:
            return
        with self._lock:
            self._busy.discard(worker)
        worker.kill()
        self.start_spare()

    def start_spare(self) -> None:
        """Start a worker for the calling decode thread to find idle (its imports load while the thread goes on)."""
        with self._lock:
            if self._closed or len(self._idle) + len(self._busy) >= self.size:
                return
        spare = DecodeWorker()
        with self._lock:
            if not self._closed:
                self._idle.append(spare)
                return
        spare.kill()

    def idle_ready(self) -> int:
        """Idle workers that have loaded their imports (a decode given one starts at once)."""
        now = time.monotonic()
        with self._lock:
            return sum(worker.wait_ready(now) for worker in self._idle)

    def busy(self) -> int:
        """Workers given a decode now (tests wait for one before its client leaves)."""
        with self._lock:
            return len(self._busy)

    def pids(self) -> list[int]:
        """The worker processes alive now, idle or decoding (tests read them in /proc)."""
        with self._lock:
            return [w.pid for w in (*self._idle, *self._busy)]

    def close(self) -> None:
        """Kill every worker, idle or decoding; a decode running ends with :class:`DecodeDeadline`."""
        with self._lock:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for worker in idle:
            worker.kill()
        for worker in busy:
            worker.stop()


class DecodeJob:
    """One upload's decode, which the event loop may stop: :meth:`abort` kills its worker if it has one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.aborted = False
        self._worker: DecodeWorker | None = None

    def attach(self, worker: DecodeWorker) -> bool:
        """The worker that runs this decode; False if the decode was aborted already."""
        with self._lock:
            self._worker = worker
            return not self.aborted

    def abort(self) -> None:
        """Stop the decode: never started, or its worker killed (the decode thread reaps it)."""
        with self._lock:
            self.aborted = True
            worker = self._worker
        if worker is not None:
            worker.stop()


# ---- the worker process --------------------------------------------------------------------------


def serve(connection: Connection) -> None:
    """Answer decodes until the server closes the pipe."""
    connection.send_bytes(b"ready")
    while True:
        try:
            header = json.loads(connection.recv_bytes(MAX_HEADER_BYTES))
            encoded = connection.recv_bytes()
        except EOFError:
            return
        frame = header["frame"]
        limits = ImageLimits(len(encoded), header["max_pixels"], header["max_jpeg_scans"],
                             None if frame is None else (int(frame[0]), int(frame[1])))  # fmt: skip
        try:
            pixels = decode_pixels(encoded, limits)
        except StartImageRefused as exc:
            connection.send_bytes(json.dumps({"refused": str(exc)}).encode())
            continue
        height, width, _ = pixels.shape
        connection.send_bytes(json.dumps({"width": width, "height": height}).encode())
        connection.send_bytes(np.ascontiguousarray(pixels).tobytes())


def main() -> None:
    sys.stdout = sys.stderr  # the pipe is the only way out
    # The server stops a worker with SIGKILL; Ctrl-C in a terminal reaches the server, which does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(Connection(int(sys.argv[1])))
    os._exit(0)


if __name__ == "__main__":
    main()
