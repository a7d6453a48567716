"""Prometheus metrics: one CollectorRegistry per app, names prefixed ``arstream_``, base units.

Event-loop counters and histograms are updated where things happen; the
KV pool and session gauges are read from the worker's latest runner stats at
scrape time by :class:`RunnerCollector`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import webrtc_track
from .admission import RealtimeCapacity, chunk_period_s
from ..runner.stats import RunnerStats

if TYPE_CHECKING:
    from .admission import RoundTimes
    from .session import Session
    from .settings import Settings

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
        self.track_frames_sent = Counter(
            "arstream_webrtc_frames_sent", "Video frames handed to WebRTC tracks (no binary message)", registry=registry
        )
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


# The small views below are what metrics and /v1/stats read of the replica's parts (the worker, the registries),
# named here so that this module imports none of them.


class Queued(Protocol):
    @property
    def replies_queued(self) -> int: ...


class Served(Protocol):
    """A connection that controls a session, as the stats count it."""

    @property
    def session(self) -> Session | None: ...

    @property
    def outbox(self) -> Queued: ...


class Times(Protocol):
    """The worker's chunk and round times (:class:`arstream.app.decode_stage.WorkerTimes`)."""

    def phases_summary(self) -> dict[str, float | int]: ...

    def phase_seconds(self) -> tuple[int, float, float, float]: ...

    def compute_ms_percentiles(self) -> tuple[float | None, float | None]: ...


class WorkerFigures(Protocol):
    """The model worker's figures (:class:`arstream.app.worker.ModelWorker`)."""

    @property
    def round_times(self) -> RoundTimes: ...

    @property
    def times(self) -> Times: ...

    @property
    def runner_stats(self) -> RunnerStats | None: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def decode_overlap(self) -> bool: ...


class DetachedEntry(Protocol):
    @property
    def session_id(self) -> str: ...


class Detached(Protocol):
    """The resume registry's detached sessions (:class:`arstream.app.resume.ResumeRegistry`)."""

    @property
    def detached_count(self) -> int: ...

    def detached(self) -> Sequence[DetachedEntry]: ...

    def detached_session(self, session_id: str) -> Session | None: ...


class Counted(Protocol):
    @property
    def viewer_count(self) -> int: ...


class Decoding(Protocol):
    @property
    def decoding(self) -> int: ...


class ReplicaView(Protocol):
    """What the replica's metrics and ``/v1/stats`` read (the hub is one): the model, the worker, admission and
    the registries of sessions served, detached and shared."""

    settings: Settings
    model_card: dict[str, Any]
    closing: set[Any]

    @property
    def start_images(self) -> Decoding: ...

    @property
    def resume(self) -> Detached: ...

    @property
    def shares(self) -> Counted: ...

    @property
    def worker(self) -> WorkerFigures | None: ...

    @property
    def connections(self) -> Mapping[str, Served]: ...

    @property
    def session_capacity(self) -> int: ...

    def admission_refusal(self) -> str | None: ...

    def realtime_capacity(self) -> RealtimeCapacity | None: ...

    def free_slots(self) -> int: ...


class ReplicaCollector(Collector):
    """What an operator needs to see overload and readiness: the model's pace against what is delivered.

    Read from the replica (the hub) at scrape time: the model card's fps and chunk period, the realtime capacity
    (app/admission.py), the free slots the HAProxy agent check reports (app/balancer.py), the worker's
    queue depth, sessions with ticks pending, and readiness.
    """

    def __init__(self, replica: ReplicaView) -> None:
        self._hub = replica

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
        yield _gauge("arstream_free_session_slots", "New sessions the replica would admit now", hub.free_slots())
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


def start_images_held(replica: ReplicaView, live: list[Session]) -> dict[str, int]:
    """Uploaded start images the live and detached sessions hold: how many pictures, and their bytes
    (a branch shares its source's picture: counted once); and uploads waiting for or in their decode."""
    resume = replica.resume
    detached = (resume.detached_session(d.session_id) for d in resume.detached())
    held = {
        id(session.start_image.pixels): session.start_image.pixels.nbytes
        for session in (*live, *detached)
        if session is not None and session.start_image is not None and session.start_image.pixels is not None
    }
    return {"held": len(held), "bytes": sum(held.values()), "decoding": replica.start_images.decoding}


def stats_document(replica: ReplicaView) -> dict[str, Any] | None:
    """The /v1/stats document (PROTOCOL.md), or None before the model is loaded."""
    worker = replica.worker
    runner_stats = worker.runner_stats if worker else None
    if worker is None or runner_stats is None:
        return None
    p50, p99 = worker.times.compute_ms_percentiles()
    capacity = replica.realtime_capacity()
    connections = list(replica.connections.values())
    sessions = [c.session for c in connections if c.session is not None]
    return {
        "start_images": start_images_held(replica, sessions),
        "kv": {
            "blocks_total": runner_stats.blocks_total,
            "blocks_free": runner_stats.blocks_free,
            "blocks_used": runner_stats.blocks_used,
            "block_bytes": runner_stats.block_bytes,
            "pool_bytes": runner_stats.pool_bytes,
            "session_capacity": replica.session_capacity,
            "sessions_resident": runner_stats.sessions_resident,
            "sink_frames": runner_stats.sink_frames,
            "window_frames": runner_stats.window_frames,
            "strided_window_frames": runner_stats.strided_window_frames,
            "frame_stride": runner_stats.frame_stride,
            "frames_per_chunk": runner_stats.frames_per_chunk,
            "scratch_blocks": runner_stats.scratch_blocks,
        },
        "sessions": {
            "connected": len(sessions),
            "viewers": replica.shares.viewer_count,
            "detached": replica.resume.detached_count,
            "closing": len(replica.closing),
            "realtime_capacity": None if capacity is None else capacity.sessions,
            "active": sum(1 for s in sessions if s.pending_ticks > 0),
            "evictions_total": runner_stats.evictions_total,
            "failures_total": runner_stats.failures_total,
            "pending_ticks": sum(s.pending_ticks for s in sessions),
            "replies_queued": sum(c.outbox.replies_queued for c in connections),
        },
        "parking": runner_stats.parking(),  # runner/parking.py
        # where each of the model's components lives and its bytes (the model card's, as loaded)
        "components": replica.model_card.get("components", []),
        "queue": {"depth": worker.queue_depth},
        "chunks": {
            "total": runner_stats.chunks_total,
            "compute_ms_p50": None if p50 is None else round(p50, 3),
            "compute_ms_p99": None if p99 is None else round(p99, 3),
            # worker rounds (runner calls) since start-up, warm-up included, and the sessions they served
            "rounds_total": worker.round_times.rounds_total,
            "round_sessions_total": worker.round_times.round_sessions_total,
        },
        # per round: the DiT forward, the decode (apart from it with --decode-overlap) and the time both ran
        "phases": {"decode_overlap": worker.decode_overlap, **worker.times.phases_summary()},
        # WebRTC video (app/webrtc_track.py): the peer connections held open, whether the server offers the path
        "webrtc": {
            "available": webrtc_track.AVAILABLE and replica.settings.webrtc,
            "peer_connections": webrtc_track.open_peer_connections(),
            # inputs read on `inputs` data channels since start-up: staged for a chunk, or dropped as overtaken
            "channel_inputs": webrtc_track.channel_inputs.taken,
            "channel_inputs_overtaken": webrtc_track.channel_inputs.overtaken,
        },
    }
