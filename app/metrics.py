"""Prometheus metrics: one CollectorRegistry per app, names prefixed ``arstream_``, base units.

Event-loop counters and histograms are updated where things happen; the
KV pool and session gauges are read from the worker's latest runner stats at
scrape time by :class:`RunnerCollector`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from arstream.runner.runner import RunnerStats

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
            (GaugeMetricFamily, "arstream_session_capacity", "Sessions the KV pool can hold", stats.session_capacity),
            (GaugeMetricFamily, "arstream_sessions_resident", "Sessions holding KV in the pool", stats.sessions_resident),
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
        registry.register(RunnerCollector(stats, connected, detached))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
