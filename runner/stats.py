"""What a runtime counts and reports, defined once for both runtimes (ARRunner and VllmOmniRunner).

Each runtime keeps a :class:`RuntimeCounters` and builds its :class:`RunnerStats`
with :meth:`RunnerStats.build` from its own pool figures: the counters, their
meaning and the warm-up reset are the same whichever runtime serves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .spec import KVCacheSpec

CHUNK_TIMES_KEPT = 100_000


@dataclass
class RuntimeCounters:
    """A runtime's traffic counters since start-up (warm-up excluded)."""

    # One entry per chunk, bounded so a long-running server does not grow. A batched
    # forward adds one entry per chunk, each its whole wall time (what every row waited).
    chunk_times_s: deque[float] = field(default_factory=lambda: deque(maxlen=CHUNK_TIMES_KEPT))
    chunks_total: int = 0
    evictions_total: int = 0
    failures_total: int = 0
    batched_forwards_total: int = 0
    # batched forwards that raised; their ticks were run again one by one
    batch_fallbacks_total: int = 0

    # parking (runner/parking.py): sessions moved to host memory and back, and the seconds each move took
    parks_total: int = 0
    restores_total: int = 0
    restore_failures_total: int = 0
    restore_times_s: deque[float] = field(default_factory=lambda: deque(maxlen=CHUNK_TIMES_KEPT))
    park_seconds_total: float = 0.0

    def parked(self, seconds: float) -> None:
        self.parks_total += 1
        self.park_seconds_total += seconds

    def restored(self, seconds: float) -> None:
        self.restores_total += 1
        self.restore_times_s.append(seconds)

    # chunks decoded apart from their forward (a split decode) and the seconds those decodes took
    decodes_total: int = 0
    decode_seconds_total: float = 0.0
    # chunks whose decode a runner that never decodes dropped (a rank other than 0 of a replica)
    decodes_forgotten_total: int = 0

    def decodes(self, decode_s: float, count: int = 1) -> None:
        """``count`` chunks came out of one decode of ``decode_s`` seconds (after their forward)."""
        self.decodes_total += count
        self.decode_seconds_total += decode_s

    def chunks(self, compute_s: float, count: int = 1) -> None:
        """``count`` chunks came out of one forward of ``compute_s`` seconds."""
        self.chunk_times_s.extend([compute_s] * count)
        self.chunks_total += count

    def forget_warmup(self) -> None:
        """Warm-up chunks are not traffic: the figures users see start clean."""
        self.chunk_times_s.clear()
        self.chunks_total = 0
        self.batched_forwards_total = 0
        self.batch_fallbacks_total = 0
        self.decodes_total = 0
        self.decode_seconds_total = 0.0
        self.decodes_forgotten_total = 0


@dataclass(frozen=True)
class RunnerStats:
    """A runtime's pool and counters at one moment (/v1/stats, /metrics, admission)."""

    blocks_total: int
    blocks_free: int
    blocks_used: int
    scratch_blocks: int
    block_bytes: int
    pool_bytes: int
    session_capacity: int
    sessions_resident: int
    sink_frames: int
    window_frames: int
    frames_per_chunk: int
    evictions_total: int
    failures_total: int
    chunks_total: int
    # a strided tail behind the dense window (KVCacheSpec): 0 and 1 where there is none
    strided_window_frames: int = 0
    frame_stride: int = 1
    # most sessions in one forward (the runtime's batch_limit, not the max_batch_sessions setting)
    batch_limit: int = 1
    batched_forwards_total: int = 0
    batch_fallbacks_total: int = 0
    # most chunk boundaries a session keeps to rewind to (0: the runtime keeps none; docs/rewind.md),
    # and how far back they reach in seconds of play
    rewind_points: int = 0
    rewind_seconds: float = 0.0
    # Parking (docs/deployment.md, "Parking"). ``session_capacity`` above counts the sessions the replica
    # holds in all: ``resident_capacity`` pool slots plus ``park_capacity`` parked ones.
    resident_capacity: int = 0
    park_capacity: int = 0
    sessions_parked: int = 0
    sessions_spilled: int = 0
    parked_bytes: int = 0
    spilled_bytes: int = 0
    park_budget_bytes: int = 0
    parks_total: int = 0
    restores_total: int = 0
    restore_failures_total: int = 0

    def parking(self) -> dict[str, int]:
        """The /v1/stats ``parking`` section: resident and parked sessions and bytes, and the moves so far."""
        return {
            "resident_capacity": self.resident_capacity,
            "park_capacity": self.park_capacity,
            "sessions_resident": self.sessions_resident,
            "sessions_parked": self.sessions_parked,
            "sessions_spilled": self.sessions_spilled,
            "parked_bytes": self.parked_bytes,
            "spilled_bytes": self.spilled_bytes,
            "park_budget_bytes": self.park_budget_bytes,
            "parks_total": self.parks_total,
            "restores_total": self.restores_total,
            "restore_failures_total": self.restore_failures_total,
        }

    @classmethod
    def build(
        cls,
        *,
        spec: KVCacheSpec,
        counters: RuntimeCounters,
        blocks_total: int,
        blocks_free: int,
        blocks_used: int,
        scratch_blocks: int,
        block_bytes: int,
        pool_bytes: int,
        session_capacity: int,
        sessions_resident: int,
        batch_limit: int,
        rewind_points: int = 0,
        rewind_seconds: float = 0.0,
        park_capacity: int = 0,
        sessions_parked: int = 0,
        sessions_spilled: int = 0,
        parked_bytes: int = 0,
        spilled_bytes: int = 0,
        park_budget_bytes: int = 0,
    ) -> RunnerStats:
        """The stats of a runtime with these pool figures, over ``spec``, with these counters.

        ``session_capacity`` is the pool's slots; the stats' ``session_capacity`` adds ``park_capacity``.
        """
        return cls(
            blocks_total=blocks_total,
            blocks_free=blocks_free,
            blocks_used=blocks_used,
            scratch_blocks=scratch_blocks,
            block_bytes=block_bytes,
            pool_bytes=pool_bytes,
            session_capacity=session_capacity + park_capacity,
            sessions_resident=sessions_resident,
            resident_capacity=session_capacity,
            park_capacity=park_capacity,
            sessions_parked=sessions_parked,
            sessions_spilled=sessions_spilled,
            parked_bytes=parked_bytes,
            spilled_bytes=spilled_bytes,
            park_budget_bytes=park_budget_bytes,
            parks_total=counters.parks_total,
            restores_total=counters.restores_total,
            restore_failures_total=counters.restore_failures_total,
            sink_frames=spec.sink_frames,
            window_frames=spec.window_frames,
            strided_window_frames=spec.strided_window_frames,
            frame_stride=spec.frame_stride,
            frames_per_chunk=spec.frames_per_chunk,
            evictions_total=counters.evictions_total,
            failures_total=counters.failures_total,
            chunks_total=counters.chunks_total,
            batch_limit=batch_limit,
            batched_forwards_total=counters.batched_forwards_total,
            batch_fallbacks_total=counters.batch_fallbacks_total,
            rewind_points=rewind_points,
            rewind_seconds=rewind_seconds,
        )
