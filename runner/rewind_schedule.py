"""Which chunk boundaries a session keeps to rewind to, and what that costs: a horizon in seconds of play.

A :class:`RewindSchedule` keeps every boundary of the last ``dense`` chunks,
then every 2nd, every 4th, ... further back (each tier twice as long and half
as dense as the one before), and none older than ``horizon`` chunks. Whether
boundary ``b`` is kept depends only on ``b`` and on the newest boundary, and a
boundary dropped once is never wanted again (strides only grow with age and
each divides the next), so thinning as the session plays is a filter over what
it holds (:meth:`RewindSchedule.keeps`).

:func:`plan_rewind` turns a horizon in seconds and a per-session byte budget
into a schedule that honours it: points reach back about that far (a point
near every time back, the horizon included) and none is older than
:data:`HORIZON_SLACK` times it. It takes the densest recent tier (up to
:data:`DENSE_SECONDS` of every-chunk points, at least :data:`PRECISE_DENSE`
where the budget allows) whose worst case fits the budget, and shortens the
horizon only when even two dense points do not fit. :meth:`RewindSchedule.peak`
is that worst case, exact: the pool plan (runner/pool.py) counts it for every
session, so capacity includes rewind.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .spec import KVCacheSpec, kept_history

DENSE_SECONDS = 2.0  # every chunk boundary of the last this many seconds is kept (when the budget allows)
# With this many every-chunk points each tier's stride is at most a third of its age, so some point lies within
# 20 % of any time back; fewer (a tight budget) keep that only near some ages.
PRECISE_DENSE = 6
HORIZON_SLACK = 1.2  # the oldest point kept is at most this many times the horizon back


class RewindPlanError(ValueError):
    """A rewind horizon or budget that is not a number the plan can use."""


@dataclass(frozen=True)
class RewindPeak:
    """The most a session holds between chunks under a schedule: blocks per KV branch (its live history
    included) and kept copies of its model-owned state."""

    frames: int
    copies: int

    def extra_bytes(self, spec: KVCacheSpec) -> int:
        """Bytes beyond what the session holds without rewind (its live history and model state)."""
        kv = (self.frames - spec.resident_frames) * len(spec.kv_branches) * spec.block_bytes
        return kv + self.copies * spec.model_owned_bytes_per_session


@dataclass(frozen=True)
class RewindSchedule:
    """Keep every boundary of the last ``dense`` chunks, sparser tiers behind them, nothing older than ``horizon``.

    Ages count chunks back from the newest kept boundary (the one a session's
    next chunk starts from, age 0). ``chunks_per_second`` (the model's play
    rate) only converts the horizon into seconds for people.
    """

    dense: int
    horizon: int
    chunks_per_second: float = 0.0
    span: int = -1  # chunks back the schedule was planned to reach (its points lie around it); -1: ``horizon``

    def __post_init__(self) -> None:
        if self.dense < 1 or self.horizon < self.dense - 1:
            raise RewindPlanError(f"a schedule needs dense >= 1 and horizon >= dense - 1, got {self}")
        if self.span < 0:
            object.__setattr__(self, "span", self.horizon)

    @classmethod
    def last(cls, points: int, chunks_per_second: float = 0.0) -> RewindSchedule:
        """Exactly the last ``points`` boundaries, every one (no thinning)."""
        return cls(dense=points, horizon=points - 1, chunks_per_second=chunks_per_second)

    @property
    def reach(self) -> int:
        """Chunks back the oldest kept boundary always is, once a session has played that long.

        The oldest is the oldest multiple of the last tier's stride inside the
        horizon, so it may sit up to a stride short of the horizon.
        """
        return self.horizon - self.stride(self.horizon) + 1

    @property
    def seconds(self) -> float:
        """The horizon it honours, :attr:`span`, in seconds of play (0 when the play rate is unknown)."""
        return self.span / self.chunks_per_second if self.chunks_per_second > 0 else 0.0

    def describe(self, spec: KVCacheSpec) -> str:
        """The schedule in words, for logs and refusals: in seconds of play when the play rate is known."""
        copies = self.peak(spec).copies
        if self.chunks_per_second <= 0:
            return f"up to {copies} points over the last {self.horizon} chunks, every one of the last {self.dense}"

        def secs(chunks: int) -> str:
            return f"{chunks / self.chunks_per_second:.3g} s"

        if self.dense > self.horizon:
            return f"every chunk of the last {secs(self.horizon)} ({copies} points)"
        return (
            f"{copies} points: every chunk of the last {secs(self.dense)}, then sparser back to "
            f"{secs(self.span)} (none older than {secs(self.horizon)})"
        )

    def stride(self, age: int) -> int:
        """Spacing of kept boundaries at this age: 1 for the last ``dense``, then 2, 4, ... per tier."""
        return 1 << (age // self.dense).bit_length()

    def keeps(self, index: int, newest: int) -> bool:
        """Whether boundary ``index`` is kept while ``newest`` is the newest one."""
        age = newest - index
        return 0 <= age <= self.horizon and index % self.stride(age) == 0

    def kept(self, newest: int) -> list[int]:
        """Every boundary kept while ``newest`` is the newest, oldest first (for a session that ran from 0).

        Built tier by tier (each tier's multiples of its stride) rather than by
        asking :meth:`keeps` of every boundary in the horizon: a model with
        one-frame chunks at 60 fps has horizons of thousands of chunks, and the
        plan evaluates this for every newest boundary of several schedules.
        """
        kept: list[int] = []
        low_age, stride = 0, 1
        while low_age <= self.horizon:
            # ages [low_age, high_age] share one stride: [0, dense) stride 1, then [dense * 2^k, dense * 2^(k+1))
            high_age = min(self.horizon, (self.dense if low_age == 0 else 2 * low_age) - 1)
            first, last = max(0, newest - high_age), newest - low_age
            if last >= first:
                kept.extend(range(first + (-first) % stride, last + 1, stride))
            low_age, stride = high_age + 1, stride * 2
        return sorted(kept)

    def peak(self, spec: KVCacheSpec) -> RewindPeak:
        """The most blocks (per branch) and model-state copies a session holds between chunks."""
        return _peak(
            self.dense, self.horizon, spec.frames_per_chunk, spec.sink_frames, spec.history_window_frames,
            spec.strided_history_frames, spec.frame_stride,
        )


def boundary_frames(
    index: int, chunk: int, sink: int, history: int, strided_history: int = 0, stride: int = 1
) -> tuple[tuple[int, int], ...]:
    """Frame ranges ``[start, end)`` boundary ``index``'s history holds: its sink, its strided tail's frames one
    range each (none without one), and its dense window."""
    committed = index * chunk
    dense = (max(sink, committed - history), committed)
    strided = [(f, f + 1) for f in kept_history(sink, committed, history, strided_history, stride) if f < dense[0]]
    return ((0, min(committed, sink)), *strided, dense)


@functools.cache
def _peak(dense: int, horizon: int, chunk: int, sink: int, history: int, strided_history: int, stride: int) -> RewindPeak:
    schedule = RewindSchedule(dense, horizon)
    # Past the horizon the kept set repeats with the largest stride's period (times the chunks a strided tail's
    # phase takes to come round); a few periods cover every shape, once the oldest kept boundary's history is
    # whole (a window longer than the horizon keeps growing until then: one-frame chunks with a 16-frame window
    # and a short horizon).
    period = schedule.stride(horizon) * (stride // math.gcd(stride, chunk))
    reach = math.ceil((sink + max(history, strided_history)) / chunk)
    most_frames = most_copies = 0
    for newest in range(horizon + 2 * period + reach + 1):
        kept = schedule.kept(newest)
        # Between chunks the live history is at newest + 1: the chunk from the newest boundary was committed.
        ranges = sorted(
            r for b in [*kept, newest + 1] for r in boundary_frames(b, chunk, sink, history, strided_history, stride)
        )
        frames, covered = 0, 0
        for start, end in ranges:
            start = max(start, covered)
            if end > start:
                frames += end - start
                covered = end
        most_frames = max(most_frames, frames)
        most_copies = max(most_copies, len(kept))
    return RewindPeak(frames=most_frames, copies=most_copies)


def plan_rewind(
    spec: KVCacheSpec, *, chunks_per_second: float, seconds: float, budget_bytes: int
) -> RewindSchedule | None:
    """The schedule for a horizon of ``seconds`` of play within ``budget_bytes`` per session; None: rewind off.

    The horizon is honoured: boundaries are kept back to :data:`HORIZON_SLACK`
    times ``seconds`` and no further, so a point always lies around
    ``seconds`` back (not a tier's stride beyond it). Tries every-chunk points
    for the last :data:`DENSE_SECONDS` (at least :data:`PRECISE_DENSE`) first
    and shortens the dense tier (so every tier behind it) a chunk at a time
    until the worst case fits; when not even two dense points fit, the
    horizon halves. None when ``seconds`` is 0 or no horizon of one chunk fits.
    """
    if not (math.isfinite(seconds) and seconds >= 0) or not (math.isfinite(chunks_per_second) and chunks_per_second > 0):
        raise RewindPlanError(
            f"rewind needs a horizon >= 0 s and a play rate > 0 chunks/s, got {seconds} s at {chunks_per_second}"
        )
    if budget_bytes < 0:
        raise RewindPlanError(f"the rewind budget must be >= 0 bytes per session, got {budget_bytes}")
    span = math.ceil(seconds * chunks_per_second - 1e-9)  # chunks back the points must reach
    while span >= 1:
        horizon = max(span, math.floor(span * HORIZON_SLACK + 1e-9))
        # a horizon of h chunks spans h + 1 boundaries (ages 0..h): all of them when it is short
        # at least 2: with one dense point the tiers behind it hold half a point each, and may hold none
        dense = min(horizon + 1, max(PRECISE_DENSE, math.ceil(DENSE_SECONDS * chunks_per_second)))

        # The longest dense tier that fits: a longer one keeps every boundary a shorter one keeps (each age's
        # stride is no larger), so what fits is a prefix of 2 .. dense and a bisection finds its end.
        schedules = [RewindSchedule(points, horizon, chunks_per_second, span=span) for points in range(2, dense + 1)]
        if schedules and schedules[0].peak(spec).extra_bytes(spec) <= budget_bytes:
            low, high = 0, len(schedules) - 1  # schedules[low] fits; the longest that fits is in low .. high
            while low < high:
                middle = (low + high + 1) // 2
                if schedules[middle].peak(spec).extra_bytes(spec) <= budget_bytes:
                    low = middle
                else:
                    high = middle - 1
            return schedules[low]
        span //= 2
    return None
