"""Admission policies, chosen by name (``--admission``): how many sessions a replica serves at once.

- ``kv`` (:class:`KVAdmission`): while the KV pool has a session slot (capped
  by ``--max-sessions``).
- ``realtime`` (:class:`RealtimeAdmission`): that, and only while every
  admitted session still gets the model's fps (below).

A policy answers two questions from the same figures: why one more session
may not start (:meth:`AdmissionPolicy.refusal`, asked by the hub on start,
resume and ``/readyz``) and how many sessions it admits in all
(:meth:`AdmissionPolicy.slots`, the HAProxy agent check's free slots). The
per-client caps (``--max-sessions-per-client``, ``--max-sessions-per-token``)
apply under every policy and stay in the hub, which also knows who holds what.
A new policy is a class here and one entry in :data:`ADMISSION_POLICIES`.

Realtime admission: admit a session only while every admitted session still gets the model's fps.

With ``admission = "realtime"`` the server promises each admitted session one
chunk per *chunk period*, ``frames_per_chunk / fps`` seconds of video (the
model card's figures). The worker serves sessions in rounds: each round runs
the next tick of up to ``B`` sessions (the batch limit) as one
:meth:`~arstream.runner.runner.ARRunner.execute` call. ``N`` sessions that all
keep ticks queued therefore get one chunk each per *cycle* of ``N // B`` full
rounds plus one round of ``N % B`` sessions::

    cycle(N) = (N // B) * T(B) + T(N % B)        (T(0) = 0)

where ``T(n)`` is the measured wall time of a round of ``n`` sessions. The
realtime capacity is the largest ``N`` (at most the KV pool's session
capacity) with ``cycle(n) <= chunk period`` for every ``n <= N``; session
``N + 1`` is refused with ``over_capacity``.

``T(n)`` comes from measurement only: warm-up runs every batch size once
(:meth:`~arstream.runner.runner.ARRunner.warmup`), then every round of
traffic adds its time, and the estimate is the median of the last
:data:`ROUNDS_KEPT` rounds of that size. A size not measured yet borrows
from its neighbours: the next larger measured size (a round of fewer sessions
is not slower), else the largest smaller one scaled up in proportion (the
pessimistic guess for a compute-bound model). With nothing measured at all
(a pipeline without warm-up, before its first chunk) one session is admitted,
so that the server can measure.

What it does not see: a CPU too busy encoding frames, or a network too slow to
carry them, slows delivery without slowing rounds; the encoder pool keeps
encoding off the worker, and ``bench serve`` measures the whole path.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

ROUNDS_KEPT = 32


class RoundTimes:
    """Recent wall times of worker rounds, per number of sessions in the round (thread-safe)."""

    def __init__(self, kept: int = ROUNDS_KEPT) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._times: dict[int, deque[float]] = {}
        # every round recorded, and the sessions in them: their ratio is the mean batch the worker formed
        self.rounds_total = 0
        self.round_sessions_total = 0

    def record(self, sessions: int, seconds: float) -> None:
        if sessions < 1:
            raise ValueError(f"a round has at least one session, got {sessions}")
        with self._lock:
            self._times.setdefault(sessions, deque(maxlen=self._kept)).append(seconds)
            self.rounds_total += 1
            self.round_sessions_total += sessions

    def estimates(self) -> dict[int, float]:
        """Median round time in seconds per measured session count."""
        with self._lock:
            samples = {size: list(times) for size, times in self._times.items()}
        return {size: statistics.median(times) for size, times in samples.items()}


def round_estimate(estimates: Mapping[int, float], sessions: int) -> float | None:
    """``T(sessions)``: measured, else borrowed from a neighbour (module docstring); None with no figures."""
    if sessions in estimates:
        return estimates[sessions]
    larger = [size for size in estimates if size > sessions]
    if larger:
        return estimates[min(larger)]
    smaller = [size for size in estimates if size < sessions]
    if smaller:
        size = max(smaller)
        return estimates[size] * sessions / size
    return None


def cycle_seconds(estimates: Mapping[int, float], sessions: int, batch_limit: int) -> float | None:
    """Time for ``sessions`` busy sessions to get one chunk each: ``cycle(N)`` in the module docstring."""
    full_rounds, rest = divmod(sessions, batch_limit)
    total = 0.0
    for size, count in ((batch_limit, full_rounds), (rest, 1 if rest else 0)):
        if count:
            estimate = round_estimate(estimates, size)
            if estimate is None:
                return None
            total += count * estimate
    return total


@dataclass(frozen=True)
class RealtimeCapacity:
    """How many sessions can each get the model's fps, and the arithmetic behind it."""

    sessions: int
    chunk_period_s: float
    batch_limit: int
    kv_capacity: int
    # cycle(sessions + 1), the time one more session would make every session wait; None when unknown
    next_cycle_s: float | None

    def refusal(self, admitted: int) -> str | None:
        """Why session ``admitted + 1`` would not get realtime, or None when it would."""
        if admitted < self.sessions:
            return None
        period_ms = self.chunk_period_s * 1e3
        if self.sessions >= self.kv_capacity:
            return f"realtime admission: all {self.kv_capacity} session slots of the KV pool are in use"
        if self.next_cycle_s is None:
            return (
                f"realtime admission: {admitted} session(s) admitted and no chunk time measured yet; "
                "waiting for the first figures"
            )
        return (
            f"realtime admission: {admitted} session(s) already admitted; with one more, each would get a chunk "
            f"every {self.next_cycle_s * 1e3:.0f} ms of model time (batches of up to {self.batch_limit}), "
            f"more than the {period_ms:.0f} ms of video a chunk holds, so no session would keep its fps"
        )


def realtime_capacity(
    estimates: Mapping[int, float], *, chunk_period_s: float, batch_limit: int, kv_capacity: int
) -> RealtimeCapacity:
    """The largest N whose every prefix meets the chunk period (module docstring), capped by the KV pool."""
    if chunk_period_s <= 0 or batch_limit < 1:
        raise ValueError(f"need a positive chunk period and batch limit, got {chunk_period_s} s and {batch_limit}")
    sessions = 0
    next_cycle: float | None = None
    while sessions < kv_capacity:
        next_cycle = cycle_seconds(estimates, sessions + 1, batch_limit)
        if next_cycle is None:
            # Nothing measured: one session may run, so that there is something to measure.
            if sessions == 0:
                sessions = 1
                next_cycle = None
            break
        if next_cycle > chunk_period_s:
            break
        sessions += 1
        next_cycle = None
    return RealtimeCapacity(sessions, chunk_period_s, batch_limit, kv_capacity, next_cycle)


def chunk_period_s(model_card: Mapping[str, object]) -> float:
    """Seconds of video in one chunk: ``frames_per_chunk / fps`` from the model card."""
    fps = model_card.get("fps")
    frames = model_card.get("frames_per_chunk")
    if not isinstance(fps, (int, float)) or not isinstance(frames, int) or fps <= 0 or frames < 1:
        raise ValueError(f"the model card needs a positive fps and frames_per_chunk, got fps={fps!r}, frames={frames!r}")
    return frames / fps


# ---- the policies ------------------------------------------------------------------

# What the hub knows about realtime capacity, computed only when a policy asks (None before loading).
RealtimeFigures = Callable[[], RealtimeCapacity | None]


class AdmissionPolicy(Protocol):
    """What the hub asks of an admission policy; see the module docstring."""

    name: ClassVar[str]

    def refusal(self, live: int, kv_capacity: int, realtime: RealtimeFigures) -> str | None:
        """Why session ``live + 1`` may not start, or None when it may."""
        ...

    def slots(self, kv_capacity: int, realtime: RealtimeFigures) -> int:
        """Sessions admitted in all, live ones included."""
        ...


class KVAdmission:
    """Admit while the KV pool has a session slot."""

    name: ClassVar[str] = "kv"

    def refusal(self, live: int, kv_capacity: int, realtime: RealtimeFigures) -> str | None:
        if live >= kv_capacity:
            return f"all {kv_capacity} session slots are in use; try again later"
        return None

    def slots(self, kv_capacity: int, realtime: RealtimeFigures) -> int:
        return kv_capacity


class RealtimeAdmission(KVAdmission):
    """Admit while the KV pool has a slot and every admitted session still gets the model's fps."""

    name: ClassVar[str] = "realtime"

    def refusal(self, live: int, kv_capacity: int, realtime: RealtimeFigures) -> str | None:
        refusal = super().refusal(live, kv_capacity, realtime)
        if refusal is not None:
            return refusal
        capacity = realtime()
        return None if capacity is None else capacity.refusal(live)

    def slots(self, kv_capacity: int, realtime: RealtimeFigures) -> int:
        capacity = realtime()
        return kv_capacity if capacity is None else min(kv_capacity, capacity.sessions)


# The names ``--admission`` takes (settings.py), each with its policy.
AdmissionName = Literal["kv", "realtime"]
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {policy.name: policy for policy in (KVAdmission, RealtimeAdmission)}


def admission_policy(name: str) -> AdmissionPolicy:
    """The policy ``--admission name`` chooses."""
    try:
        return ADMISSION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown admission policy {name!r}; expected one of {list(ADMISSION_POLICIES)}") from None
