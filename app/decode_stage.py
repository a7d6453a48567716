"""The worker's decode stage: one round's decode on a thread of its own while the model thread runs the next forward.

With a runtime that splits its chunks (``split_decode``, a pipeline with
:class:`~arstream.runner.contract.SupportsSplitDecode`), a round's forward
returns latents; the worker hands them here and goes on to the next round's
forward. The stage holds at most one round: the worker joins it after the
next forward and before it sends anything of that round, so each session's
outcomes leave in chunk order and a decode never races another decode. On a
GPU the decode runs on a CUDA stream of its own, so its kernels can overlap
the forward's (the forward ends with a device sync, so its latents are
ready when the decode starts).

A decode failure is not released here: the runner is the model thread's, so
:meth:`DecodeStage.join` returns the failures and the worker releases their
sessions (``fail_session``) before the next round.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from .session import ChunkInputs, TickJob
from ..measure import percentile
from ..runner.runtimes import SplitDecodeRuntime
from ..runner.types import ChunkResult, TickResult

_Item = TypeVar("_Item")


@dataclass(frozen=True)
class DecodedRound(Generic[_Item]):
    """A round's decode: the caller's items, one result per chunk, and when it ran (perf_counter seconds)."""

    items: tuple[_Item, ...]
    results: list[TickResult]
    started: float
    ended: float

    @property
    def decode_s(self) -> float:
        return self.ended - self.started


class DecodeStage(Generic[_Item]):
    def __init__(
        self, runtime: SplitDecodeRuntime, device: torch.device, on_done: Callable[[], None] = lambda: None
    ) -> None:
        """``on_done`` runs on the stage's thread when a round's decode ends (the worker wakes up to join it)."""
        self._runtime = runtime
        self._on_done = on_done
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="arstream-decode")
        self._stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._inflight: Future[DecodedRound[_Item]] | None = None

    @property
    def busy(self) -> bool:
        """A round was handed over and not joined yet."""
        return self._inflight is not None

    @property
    def done(self) -> bool:
        """The round handed over has finished decoding (joining it will not wait)."""
        return self._inflight is not None and self._inflight.done()

    def submit(self, items: Sequence[_Item], results: Sequence[ChunkResult]) -> None:
        """Start decoding one round's chunks (``items[i]`` goes with ``results[i]``); join the previous one first."""
        if self._inflight is not None:
            raise RuntimeError("the decode stage holds a round already: join it before submitting the next")
        self._inflight = self._executor.submit(self._decode, tuple(items), list(results))
        self._inflight.add_done_callback(lambda _: self._on_done())

    def join(self) -> DecodedRound[_Item] | None:
        """Wait for the round in flight (None if there is none); its failures are the caller's to release."""
        inflight, self._inflight = self._inflight, None
        return None if inflight is None else inflight.result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    def _decode(self, items: tuple[_Item, ...], results: list[ChunkResult]) -> DecodedRound[_Item]:
        started = time.perf_counter()
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            decoded = self._runtime.decode_chunks(results)
        return DecodedRound(items, decoded, started, time.perf_counter())


@dataclass
class RoundPhases:
    """Per round, what ran: the DiT forward, the decode, and the time both ran at once (overlap), summed.

    Serial rounds (decode inside the forward) count their whole time as DiT and
    no decode; a split round counts its forward as DiT, its decode, and the part of
    that decode that ran beside the next round's forward as overlap.
    """

    rounds_total: int = 0
    dit_seconds_total: float = 0.0
    decode_seconds_total: float = 0.0
    overlap_seconds_total: float = 0.0
    last_dit_s: float = 0.0
    last_decode_s: float = 0.0
    last_overlap_s: float = 0.0

    def record(self, dit_s: float, decode_s: float, overlap_s: float) -> None:
        self.rounds_total += 1
        self.dit_seconds_total += dit_s
        self.decode_seconds_total += decode_s
        self.overlap_seconds_total += overlap_s
        self.last_dit_s, self.last_decode_s, self.last_overlap_s = dit_s, decode_s, overlap_s

    def summary(self) -> dict[str, float | int]:
        """Means per round in ms (for /v1/stats)."""
        n = max(self.rounds_total, 1)
        return {
            "rounds_total": self.rounds_total,
            "dit_ms_mean": round(self.dit_seconds_total / n * 1e3, 3),
            "decode_ms_mean": round(self.decode_seconds_total / n * 1e3, 3),
            "overlap_ms_mean": round(self.overlap_seconds_total / n * 1e3, 3),
            "dit_ms_last": round(self.last_dit_s * 1e3, 3),
            "decode_ms_last": round(self.last_decode_s * 1e3, 3),
            "overlap_ms_last": round(self.last_overlap_s * 1e3, 3),
        }


@dataclass(frozen=True)
class Decoding:
    """A chunk the worker handed to the decode stage, with what its outcome needs."""

    job: TickJob
    inputs: ChunkInputs
    restarted: str | None
    queue_s: float
    forward_s: float


class WorkerTimes:
    """The worker's timings, written on its thread and read on the event loop: each chunk's compute time (its
    percentiles for /v1/stats) and the rounds' phases (:class:`RoundPhases`)."""

    def __init__(self, kept: int) -> None:
        self._lock = threading.Lock()
        self._compute: deque[float] = deque(maxlen=kept)
        self.phases = RoundPhases()

    def chunk(self, compute_s: float) -> None:
        with self._lock:
            self._compute.append(compute_s)

    def round(self, dit_s: float, decode_s: float, overlap_s: float) -> None:
        with self._lock:
            self.phases.record(dit_s, decode_s, overlap_s)

    def phases_summary(self) -> dict[str, float | int]:
        with self._lock:
            return self.phases.summary()

    def phase_seconds(self) -> tuple[int, float, float, float]:
        """(rounds, DiT s, decode s, overlap s) since start-up, for /metrics."""
        with self._lock:
            p = self.phases
            return p.rounds_total, p.dit_seconds_total, p.decode_seconds_total, p.overlap_seconds_total

    def compute_ms_percentiles(self) -> tuple[float | None, float | None]:
        with self._lock:
            times = list(self._compute)
        if not times:
            return None, None
        return percentile(times, 50) * 1e3, percentile(times, 99) * 1e3


def overlap_s(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two intervals (start, end) have in common."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
