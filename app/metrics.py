"""Prometheus metrics: one CollectorRegistry per app, names prefixed ``arstream_``, base units.

Event-loop counters and histograms are updated where things happen; the
KV pool and session gauges are read from the worker's latest runner stats at
scrape time by :class:`RunnerCollector`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .admission import chunk_period_s
from .balancer import free_slots
from ..runner.stats import RunnerStats

if TYPE_CHECKING:
    from .hub import SessionHub

# Chunk latencies of interest run from a millisecond (tiny models) to seconds (big ones).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RunnerCollector(Collector):
    """KV blocks, capacity, residency, evictions and failures from the runner's stats snapshot."""

    def __init__(
        self, stats: Callable[[], RunnerStats | None], connected: Callable[[], int], detached: Callable[[], int]
    ) -> None:
        self._stats = stats
        self._connected = connected
        self._detached = detached

    def collect(self) -> Iterable[Metric]:
        connected = GaugeMetricFamily("arstream_sessions_connected", "Sessions with an open, started connection")
        connected.add_metric([], self._connected())
        yield connected
        detached = GaugeMetricFamily(
            "arstream_sessions_detached", "Sessions whose connection dropped, kept for a resume (they hold KV)"
        )
        detached.add_metric([], self._detached())
        yield detached
        stats = self._stats()
        if stats is None:
            return
        blocks = GaugeMetricFamily("arstream_kv_blocks", "KV pool blocks by state", labels=["state"])
        blocks.add_metric(["free"], stats.blocks_free)
        blocks.add_metric(["used"], stats.blocks_used)
        yield blocks
        # (family, name, help, value): one sample each, straight from the runner's stats
        single_samples = (
            (GaugeMetricFamily, "arstream_kv_pool_bytes", "Bytes preallocated for the KV pool", stats.pool_bytes),
            (
                GaugeMetricFamily,
                "arstream_session_capacity",
                "Sessions the replica can hold: pool slots plus parked sessions (--park-budget-bytes)",
                stats.session_capacity,
            ),
            (GaugeMetricFamily, "arstream_resident_capacity", "Sessions the KV pool can hold", stats.resident_capacity),
            (GaugeMetricFamily, "arstream_sessions_resident", "Sessions holding KV in the pool", stats.sessions_resident),
            (GaugeMetricFamily, "arstream_sessions_parked", "Sessions parked in host memory or on disk", stats.sessions_parked),
            (GaugeMetricFamily, "arstream_parked_bytes", "Host memory parked sessions take", stats.parked_bytes),
            (GaugeMetricFamily, "arstream_spilled_bytes", "Disk bytes parked sessions take", stats.spilled_bytes),
            (CounterMetricFamily, "arstream_parks", "Sessions moved out of the pool to host memory", stats.parks_total),
            (CounterMetricFamily, "arstream_restores", "Parked sessions restored into the pool", stats.restores_total),
            (
                CounterMetricFamily,
                "arstream_restore_failures",
                "Parked sessions whose restore failed (the session ended)",
                stats.restore_failures_total,
            ),
            (CounterMetricFamily, "arstream_evictions", "Sessions evicted from the pool (LRU)", stats.evictions_total),
            (
                CounterMetricFamily,
                "arstream_failures",
                "Chunk forwards that failed (session released)",
                stats.failures_total,
            ),
        )
        for family, name, help_text, value in single_samples:
            metric = family(name, help_text)
            metric.add_metric([], value)
            yield metric


class ServerMetrics:
    """Every metric one app exports, on its own registry (so tests can run several apps)."""

    def __init__(
        self, stats: Callable[[], RunnerStats | None], connected: Callable[[], int], detached: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.chunks = Counter("arstream_chunks", "Chunks sent to clients", registry=registry)
        self.chunk_compute_seconds = Histogram(
            "arstream_chunk_compute_seconds", "Model wall time per chunk", buckets=LATENCY_BUCKETS_S, registry=registry
        )
        self.queue_wait_seconds = Histogram(
            "arstream_queue_wait_seconds",
            "Time from a tick's acceptance to its chunk starting on the worker",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.action_to_frame_seconds = Histogram(
            "arstream_action_to_frame_seconds",
            "Time from an input event's arrival to the first frame of the chunk that applied it, sent",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.frames_sent = Counter("arstream_frames_sent", "Binary frame messages sent", registry=registry)
        self.bytes_sent = Counter("arstream_bytes_sent", "Bytes of binary frame messages sent", registry=registry)
        self.errors = Counter("arstream_errors", "Error messages sent, by code", ["code"], registry=registry)
        self.websocket_connections = Counter(
            "arstream_websocket_connections", "WebSocket connections opened", registry=registry
        )
        self.websocket_open = Gauge("arstream_websocket_open", "WebSocket connections open now", registry=registry)
        self.resumes = Counter(
            "arstream_resumes",
            "Resume attempts, by outcome (resumed; refused: resume_failed or over_capacity; moved: answered with "
            "the peer its session moved to)",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("resumed", "refused", "moved"):
            self.resumes.labels(outcome=outcome)  # both series exist from the start, so rates are never empty
        self.recorded_bytes = Counter(
            "arstream_recorded_bytes", "Bytes of fragmented MP4 written to recordings (--record-dir)", registry=registry
        )
        self.recording_drops = Counter(
            "arstream_recording_drops",
            "Chunks not recorded, by reason (session_bytes, total_bytes: a budget reached; error: a write failed)",
            ["reason"],
            registry=registry,
        )
        for reason in ("session_bytes", "total_bytes", "error"):
            self.recording_drops.labels(reason=reason)
        self.drains = Counter(
            "arstream_drains",
            "Drains begun on this replica (SIGTERM, POST /v1/cluster/drain, arstream drain)",
            registry=registry,
        )
        self.drained_sessions = Counter(
            "arstream_drain_sessions",
            "Sessions a drain settled, by kind (live, ready, detached, resuming) and outcome (moved, ended)",
            ["kind", "outcome"],
            registry=registry,
        )
        for kind in ("live", "ready", "detached", "resuming"):
            for outcome in ("moved", "ended"):
                self.drained_sessions.labels(kind=kind, outcome=outcome)
        self.rewinds = Counter("arstream_rewinds", "Ticks that rewound their session (tick.rewind_to)", registry=registry)
        self.branches = Counter("arstream_branches", "Sessions branched from another's chunk boundary", registry=registry)
        registry.register(RunnerCollector(stats, connected, detached))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ReplicaCollector(Collector):
    """What an operator needs to see overload and readiness: the model's pace against what is delivered.

    Read from the hub at scrape time: the model card's fps and chunk period, the realtime capacity
    (app/admission.py), the free slots the HAProxy agent check reports (app/balancer.py), the worker's
    queue depth, sessions with ticks pending, and readiness.
    """

    def __init__(self, hub: SessionHub) -> None:
        self._hub = hub

    def collect(self) -> Iterable[Metric]:
        hub = self._hub
        info = GaugeMetricFamily("arstream_replica_info", "This replica's id and model", labels=["replica_id", "model"])
        info.add_metric([hub.settings.replica_id, str(hub.model_card.get("name", hub.settings.model))], 1)
        yield info
        runtime = GaugeMetricFamily("arstream_runtime_info", "The AR runtime serving the model", labels=["runtime"])
        runtime.add_metric([hub.settings.runtime], 1)
        yield runtime
        ready = 0 if hub.admission_refusal() else 1
        yield _gauge("arstream_ready", "1 while the replica admits new sessions (/readyz), else 0", ready)
        active = sum(1 for c in hub.connections.values() if c.session is not None and c.session.pending_ticks > 0)
        yield _gauge("arstream_sessions_active", "Sessions with a tick queued or running", active)
        yield _gauge("arstream_viewers", "Connections watching a session (watch links)", hub.shares.viewer_count)
        worker = hub.worker
        if worker is None or worker.runner_stats is None or not hub.model_card:
            return
        yield _gauge("arstream_queue_depth", "Ticks waiting for the model worker", worker.queue_depth)
        rounds, dit_s, decode_s, overlap = worker.times.phase_seconds()
        for name, help_text, value in (
            ("arstream_rounds", "Worker rounds whose phases are counted below", rounds),
            ("arstream_round_dit_seconds", "Time in DiT forwards, summed over rounds", dit_s),
            ("arstream_round_decode_seconds", "Time in decodes run apart from their forward, summed over rounds", decode_s),
            ("arstream_round_overlap_seconds", "Time a decode and the next forward ran at once, summed", overlap),
        ):
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], value)
            yield counter
        yield _gauge("arstream_free_session_slots", "New sessions the replica would admit now", free_slots(hub))
        fps = hub.model_card.get("fps")
        if isinstance(fps, (int, float)) and fps > 0:
            yield _gauge("arstream_model_fps", "Frames per second of video the model card promises", fps)
            yield _gauge("arstream_chunk_period_seconds", "Seconds of video in one chunk", chunk_period_s(hub.model_card))
        capacity = hub.realtime_capacity()
        if capacity is not None:
            yield _gauge(
                "arstream_realtime_capacity_sessions",
                "Sessions that can each get the model's fps at the measured round times",
                capacity.sessions,
            )


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    metric = GaugeMetricFamily(name, help_text)
    metric.add_metric([], value)
    return metric
