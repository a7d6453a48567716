"""HTTP endpoints: /healthz, /readyz, /v1/model, /v1/stats, /metrics and the demo page."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from arstream.app import server as server_module
from arstream.app.server import create_app
from arstream.models.fake import FakeKVPipeline
from arstream.runner.types import TickRequest
from servers import fake_settings, running_server, session_client


class SlowWarmupFakePipeline(FakeKVPipeline):
    """FakeKVPipeline whose warm-up waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__()
        self.release_warmup = threading.Event()

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        if not self.release_warmup.wait(30):
            raise RuntimeError("the test never released the warm-up")
        return super().warmup_requests(session_id)


def test_not_ready_while_warming_up_then_ready() -> None:
    pipeline = SlowWarmupFakePipeline()
    with running_server(fake_settings(), pipeline, wait_ready=False) as server:
        try:
            assert server.get("/healthz").json() == {"status": "ok"}
            readyz = server.get("/readyz")
            assert readyz.status_code == 503
            assert readyz.json()["ready"] is False and "loading" in readyz.json()["reason"]
            assert server.get("/v1/stats").status_code == 503
            assert server.get("/v1/model").status_code == 503

            async def early_session() -> Any:
                async with session_client(server.ws_url) as client:
                    await client.send(type="start")
                    return await client.closed_by_server()

            closed = asyncio.run(early_session())
            assert closed.code == 1013 and closed.messages[0]["code"] == "over_capacity"
        finally:
            pipeline.release_warmup.set()
        server.wait_ready()
        assert server.get("/readyz").json() == {"ready": True}
        assert server.get("/v1/model").json()["name"] == "fake-kv"


def test_stats_document_has_the_protocol_fields() -> None:
    with running_server(fake_settings()) as server:
        stats = server.stats()
    assert {
        "blocks_total",
        "blocks_free",
        "blocks_used",
        "block_bytes",
        "pool_bytes",
        "session_capacity",
        "sessions_resident",
        "sink_frames",
        "window_frames",
        "strided_window_frames",
        "frame_stride",
        "frames_per_chunk",
    } <= set(stats["kv"])
    assert {"connected", "active", "evictions_total", "failures_total"} <= set(stats["sessions"])
    assert set(stats["queue"]) >= {"depth"}
    assert {"total", "compute_ms_p50", "compute_ms_p99"} <= set(stats["chunks"])
    assert stats["kv"]["blocks_free"] == stats["kv"]["blocks_total"]  # warm-up left the pool as it found it
    assert stats["chunks"]["total"] == 0  # warm-up chunks are not traffic
    assert (stats["kv"]["sink_frames"], stats["kv"]["window_frames"], stats["kv"]["frames_per_chunk"]) == (1, 6, 2)
    assert (stats["kv"]["strided_window_frames"], stats["kv"]["frame_stride"]) == (0, 1)  # no strided tail


def test_stats_say_the_strided_tail_a_session_keeps() -> None:
    options = {"window_frames": 4, "strided_window_frames": 12, "frame_stride": 3}
    with running_server(fake_settings(model_options=options)) as server:
        kv = server.stats()["kv"]
    assert (kv["sink_frames"], kv["window_frames"], kv["strided_window_frames"], kv["frame_stride"]) == (1, 4, 12, 3)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_names_and_values_after_traffic() -> None:
    with running_server(fake_settings()) as server:

        async def traffic() -> None:
            async with session_client(server.ws_url, start={"codec": "raw"}) as client:
                await client.send(type="input", event_id=1, controls={"keys": ["w"]})
                await client.recv_json()
                await client.send(type="tick", tick_id=1)
                _, frames = await client.recv_chunk()
                assert len(frames) == 2
                await client.send_text("nonsense")
                await client.recv_json()
                await client.send(type="close")
                await client.closed_by_server()

        asyncio.run(traffic())
        server.wait_for_stats(lambda s: s["sessions"]["connected"] == 0 and s["kv"]["sessions_resident"] == 0)
        response = server.get("/metrics")
        assert response.headers["content-type"].startswith("text/plain")
        samples = metric_samples(response.text)
        stats = server.stats()

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("arstream_kv_blocks", state="free") == stats["kv"]["blocks_free"]
    assert value("arstream_kv_blocks", state="used") == 0
    assert value("arstream_session_capacity") == stats["kv"]["session_capacity"]
    assert value("arstream_sessions_connected") == 0
    assert value("arstream_sessions_resident") == 0
    assert value("arstream_evictions_total") == 0
    assert value("arstream_failures_total") == 0
    assert value("arstream_chunks_total") == 1
    assert value("arstream_chunk_compute_seconds_count") == 1
    assert value("arstream_queue_wait_seconds_count") == 1
    assert value("arstream_action_to_frame_seconds_count") == 1
    assert value("arstream_frames_sent_total") == 2
    assert value("arstream_bytes_sent_total") == 2 * (20 + 8 * 8 * 3)
    assert value("arstream_errors_total", code="invalid_message") == 1
    assert value("arstream_websocket_connections_total") == 1
    assert value("arstream_websocket_open") == 0


def test_each_app_has_its_own_registry() -> None:
    first, second = create_app(fake_settings()), create_app(fake_settings())
    first.state.hub.metrics.chunks.inc()
    assert b"arstream_chunks_total 1.0" in first.state.hub.metrics.exposition()
    assert b"arstream_chunks_total 0.0" in second.state.hub.metrics.exposition()


def test_model_card_matches_ready() -> None:
    with running_server(fake_settings()) as server:
        card = server.get("/v1/model").json()

        async def ready() -> dict[str, Any]:
            async with session_client(server.ws_url, start={}) as client:
                assert client.ready is not None
                return client.ready["model"]

        assert asyncio.run(ready()) == card
    assert {"name", "width", "height", "fps", "frames_per_chunk", "controls"} <= set(card)


def test_demo_page_is_served_at_root() -> None:
    index = server_module.STATIC_DIR / "index.html"
    assert index.is_file(), f"the demo page is missing: {index}"
    with running_server(fake_settings()) as server:
        response = server.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.text == index.read_text()


def test_missing_static_directory_does_not_break_the_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(server_module, "STATIC_DIR", tmp_path / "no-static-here")
    with running_server(fake_settings()) as server:
        assert server.get("/").status_code == 404
        assert server.get("/healthz").status_code == 200
        assert server.get("/readyz").status_code == 200
