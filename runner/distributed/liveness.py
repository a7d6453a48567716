"""Whether the other ranks are alive: each beats a heartbeat, and rank 0's watchdog kills one that stops.

A rank that stops (a ``SIGSTOP``, a deadlock, a machine that froze) neither exits nor answers, and a collective
waiting on it may block rank 0 inside the backend's C++ with no Python able to run. So every rank other than 0
writes the time into shared memory from a thread of its own (it keeps beating while its main thread computes: torch
releases the interpreter lock), and a thread on rank 0 reads those times. A rank whose heartbeat is older than
``collective_timeout_s`` is hung: the watchdog kills it (``SIGKILL``, which a stopped process cannot ignore). That
closes its pipe and its sockets, so whatever rank 0 was blocked on (a collective, a reply, a send into a full
pipe) fails at once, and rank 0 loses the replica with the watchdog's reason. The watchdog also tells the server
of a rank that exited or hung while the replica is idle, so that it fails then too rather than at its next call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized

log = logging.getLogger("arstream.runner.distributed")


def beat_interval_s(timeout_s: float) -> float:
    """How often a heartbeat is written and read: several times within the deadline."""
    return min(0.5, timeout_s / 6)


def start_heartbeat(heartbeat: Synchronized[float], timeout_s: float) -> None:
    """On a rank other than 0: write the time into ``heartbeat`` from a daemon thread, for as long as it lives."""

    def beat() -> None:
        while True:
            heartbeat.value = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
            time.sleep(beat_interval_s(timeout_s))

    threading.Thread(target=beat, name="arstream-heartbeat", daemon=True).start()


@dataclass
class RankProcess:
    """Rank 0's handle on another rank: its process, its pipe, its heartbeat, and why the watchdog killed it."""

    rank: int
    process: BaseProcess
    conn: Connection
    heartbeat: Synchronized[float]
    hung: str | None = field(default=None)

    def kill(self) -> None:
        """``SIGKILL`` (a stopped process cannot ignore it), then reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)

    def exit_reason(self) -> str:
        """Why the rank stopped answering: the watchdog's reason, or how it exited."""
        if self.hung is not None:
            return self.hung
        for _ in range(50):  # another thread may be reaping it this moment (the watchdog, or the caller)
            self.process.join(0.1)
            if self.process.exitcode is not None:
                break
        return f"rank {self.rank} exited with code {self.process.exitcode}"


class Watchdog:
    """Rank 0's thread that kills a rank whose heartbeat stopped, and tells of one that exited (see the module
    docstring): ``on_lost`` is told once per rank, from the watchdog's thread."""

    def __init__(self, ranks: list[RankProcess], timeout_s: float, on_lost: Callable[[str], None]) -> None:
        self._ranks = ranks
        self._timeout_s = timeout_s
        self._on_lost = on_lost
        self._told: set[int] = set()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="arstream-rank-watchdog", daemon=True)

    def start(self) -> None:
        for rank in self._ranks:  # a rank that is up beats from now on (it started its heartbeat before joining)
            rank.heartbeat.value = max(rank.heartbeat.value, time.monotonic())
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(beat_interval_s(self._timeout_s)):
            for rank in self._ranks:
                if rank.rank in self._told or self._stopped.is_set():
                    continue
                silent_s = time.monotonic() - rank.heartbeat.value
                if rank.process.is_alive() and silent_s <= self._timeout_s:
                    continue
                if rank.process.is_alive():
                    rank.hung = f"rank {rank.rank} stopped answering (no heartbeat for {silent_s:.1f} s)"
                    log.error("%s: killing it", rank.hung)
                    rank.kill()
                self._told.add(rank.rank)
                self._on_lost(rank.exit_reason())
