"""Which ticks the model worker runs next: per-session lanes, round robin, and the straggler wait.

Pure policy, no threads and no clock: the worker holds its lock, passes the
time in, and does what the answer says (run these sessions' next ticks, or
wait this long for more). Both classes here are therefore tested by calling
them with chosen times (tests/app/test_scheduler.py).

- :class:`TickLanes`: each session's queued ticks in order, and the line of
  sessions that have one. A round takes the next tick of each of the first
  ``batch_limit`` sessions in line; those with more go to the back of the
  line, so every session gets one tick per round (round robin).
- :class:`RoundScheduler`: when to take that round. A client sends its next
  tick when it has read a chunk, so at a round boundary some of the last
  round's sessions may have a tick on its way. Running at once would make a
  partial round and then a whole forward for the stragglers alone; waiting up
  to ``wait_fraction`` of the last round's time for them (while the batch has
  room) costs little. A session that really stopped sending is out of the
  next round and so is not waited for again. A round that starts from idle
  (nobody in the last round: the server's first round, or everyone had left)
  waits that long for others' first ticks: sessions that start together (a
  burst of new clients, or of resumes after a restart) then share their first
  forward. Had the first one run alone, the rest would be a chunk behind it,
  and sessions whose histories differ in length cannot share a forward until
  their windows are full: every round would run twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

_Job = TypeVar("_Job")


class TickLanes(Generic[_Job]):
    """Each session's queued jobs in order, and the round-robin line of sessions with one (not thread-safe)."""

    def __init__(self) -> None:
        self._lanes: dict[str, deque[_Job]] = {}
        # a session is in line while its lane is non-empty
        self._line: deque[str] = deque()
        self.queued = 0

    @property
    def line(self) -> tuple[str, ...]:
        """Sessions with a queued job, the next round's first."""
        return tuple(self._line)

    def lane_length(self, session_id: str) -> int:
        lane = self._lanes.get(session_id)
        return 0 if lane is None else len(lane)

    def push(self, session_id: str, job: _Job) -> None:
        """Queue ``job`` behind the session's earlier ones."""
        lane = self._lanes.setdefault(session_id, deque())
        if not lane:
            self._line.append(session_id)
        lane.append(job)
        self.queued += 1

    def take_lane(self, session_id: str) -> tuple[_Job, ...]:
        """Remove and return the session's queued jobs."""
        lane = self._lanes.pop(session_id, None)
        if not lane:
            return ()
        self.queued -= len(lane)
        self._line.remove(session_id)
        return tuple(lane)

    def front(self, session_id: str) -> _Job:
        """The session's next job (it must be in line)."""
        return self._lanes[session_id][0]

    def take_round(self, sessions: Sequence[str]) -> list[_Job]:
        """The next job of each of ``sessions`` (in line order; sessions held back keep their places ahead of
        them); those with more go to the back."""
        if list(sessions) != [s for s in self._line if s in set(sessions)] or len(set(sessions)) != len(sessions):
            line = list(self._line)
            raise ValueError(f"a round takes sessions of the line {line} in its order, got {list(sessions)}")
        jobs: list[_Job] = []
        still_queued: list[str] = []
        for session_id in sessions:
            self._line.remove(session_id)
            lane = self._lanes[session_id]
            jobs.append(lane.popleft())
            self.queued -= 1
            if lane:
                still_queued.append(session_id)
            else:
                del self._lanes[session_id]
        self._line.extend(still_queued)
        return jobs

    def clear(self) -> None:
        self._lanes.clear()
        self._line.clear()
        self.queued = 0


@dataclass(frozen=True)
class Run:
    """Run the next tick of each of these sessions now, as one round."""

    sessions: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    """Nothing to run yet: wait this many seconds (None: until something is queued), then ask again."""

    seconds: float | None


class RoundScheduler:
    """Decides each next round from the line of sessions and the time; see the module docstring."""

    def __init__(self, wait_fraction: float = 0.0, *, first_round_s: float = 0.0) -> None:
        self.wait_fraction = wait_fraction
        self.last_round: frozenset[str] = frozenset()
        # what a round's wait is a fraction of: the last round's time (from idle: warm-up's one-session step)
        self.last_round_s = first_round_s
        self._waiting_since: float | None = None

    def next_round(self, line: Sequence[str], batch_limit: int, *, now: float) -> Run | Wait:
        """The next round of at most ``batch_limit`` sessions from the front of ``line``, or how long to wait."""
        if not line:
            self._waiting_since = None
            return Wait(None)
        if self.wait_fraction and len(line) < batch_limit and not (self.last_round and self.last_round <= set(line)):
            if self._waiting_since is None:
                self._waiting_since = now
            left = self._waiting_since + self.wait_fraction * self.last_round_s - now
            if left > 0:
                return Wait(left)
        self._waiting_since = None
        return Run(tuple(line[:batch_limit]))

    def round_ran(self, sessions: Sequence[str], seconds: float) -> None:
        """A round of ``sessions`` took ``seconds``: the next round waits for them, a fraction of that."""
        self.last_round = frozenset(sessions)
        self.last_round_s = seconds

    def forget(self, session_id: str) -> None:
        """The session's ticks left the queue (it closed or detached): the next round does not wait for it."""
        self.last_round -= {session_id}
