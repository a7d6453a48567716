"""Hostile start images against real servers: scan bombs (and scans hidden behind bytes libjpeg skips), busy
decode workers, decodes stopped at their deadline, clients that leave, and what a session holds of its picture.

A progressive JPEG of thousands of tiny scans costs libjpeg a pass over the
whole picture per scan: refused by its scan count before a pixel is decoded.
A decode waits for one of the 2 decode threads and runs within
``start_image_timeout_s`` in all (``over_capacity`` if it never started,
``invalid_image`` if it ran past), in a worker process that is killed at the
deadline or when its client leaves (counted in /proc); a client that leaves
stops counting as waiting to start at once. A session keeps only the part of its picture the
model uses, at most one frame, and ``/v1/stats`` counts what is held.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from arstream.app.start_image import ImageLimits, StartImageRefused, decode_pixels, fit_to_frame, jpeg_scans
from arstream.models.matrix_game.config import get_config
from arstream.models.matrix_game.images import prepare_image
from arstream.models.fake import FakeKVPipeline
from raw_clients import child_processes, jpeg_scan_bomb, rss_bytes
from servers import LiveServer, fake_settings, running_server, server_process, session_client, wait_until

MB = 2**20
OFFERED = ["meadow"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# ---- counting scans, no server -------------------------------------------------------------------


def test_scans_are_counted_from_the_markers() -> None:
    baseline = io.BytesIO()
    Image.new("RGB", (64, 48), (1, 2, 3)).save(baseline, "JPEG")
    assert jpeg_scans(baseline.getvalue(), 64) == 1
    progressive = jpeg_scan_bomb(64, 48, 0)
    normal = jpeg_scans(progressive, 64)
    assert 2 <= normal <= 12  # libjpeg's progression: about 10
    assert jpeg_scans(jpeg_scan_bomb(64, 48, 30), 64) == normal + 30
    assert jpeg_scans(jpeg_scan_bomb(64, 48, 5000), 64) == 65  # counting stops past the limit


def test_a_scan_bomb_is_refused_before_decoding_and_an_ordinary_progressive_jpeg_decodes() -> None:
    limits = ImageLimits(max_bytes=4 * MB, max_pixels=4096 * 4096, max_jpeg_scans=64)
    with pytest.raises(StartImageRefused, match="more than 64 scans \\(max_start_image_jpeg_scans"):
        decode_pixels(jpeg_scan_bomb(4096, 4096, 4000), limits)
    assert decode_pixels(jpeg_scan_bomb(640, 352, 0), limits).shape == (352, 640, 3)
    # Pillow opens a JPEG with a second picture as MPO, not JPEG: its scans are counted all the same.
    with pytest.raises(StartImageRefused, match="more than 64 scans"):
        decode_pixels(jpeg_scan_bomb(1024, 1024, 500, multi_picture=True), limits)
    assert decode_pixels(jpeg_scan_bomb(64, 48, 0, multi_picture=True), limits).shape == (48, 64, 3)


def test_bytes_libjpeg_skips_hide_no_scan() -> None:
    """libjpeg skips bytes that are no marker between segments (a warning) and decodes on; before the fix the
    count stopped at the first such byte: one 0x00 after the frame header hid every scan (0 counted)."""
    normal = jpeg_scans(jpeg_scan_bomb(64, 48, 0), 64)
    for junk in (b"\x00", b"\x00\x12\xff\x00", b"\xff\xff\x00"):
        assert jpeg_scans(jpeg_scan_bomb(64, 48, 30, junk_after_frame=junk), 64) == normal + 30
        assert jpeg_scans(jpeg_scan_bomb(64, 48, 5000, junk_after_frame=junk), 64) == 65
    # What libjpeg makes of the file: it decodes (the skipped bytes cost nothing), and is refused by its scans.
    limits = ImageLimits(max_bytes=4 * MB, max_pixels=4096 * 4096, max_jpeg_scans=64)
    assert decode_pixels(jpeg_scan_bomb(64, 48, 3, junk_after_frame=b"\x00"), limits).shape == (48, 64, 3)
    with pytest.raises(StartImageRefused, match="more than 64 scans"):
        decode_pixels(jpeg_scan_bomb(1024, 1024, 6000, junk_after_frame=b"\x00"), limits)


@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_counting_scans_ends_on_any_bytes(tail: bytes) -> None:
    """Whatever follows the start-of-image marker, the walk ends, counting at most one past its limit."""
    assert 0 <= jpeg_scans(b"\xff\xd8" + tail, 8) <= 9


# ---- what is kept of a picture -------------------------------------------------------------------


@pytest.mark.parametrize("size", [(480, 640), (720, 1280), (1000, 333), (353, 641), (37, 101), (4096, 4096)])
def test_the_kept_picture_conditions_matrix_game_exactly_as_the_whole_upload_would(size: tuple[int, int]) -> None:
    """What the server keeps (at most one frame) prepares into the same conditioning image as the upload."""
    cfg = get_config("1.3b")
    pixels = np.random.default_rng(sum(size)).integers(0, 256, (*size, 3), dtype=np.uint8)
    kept = np.asarray(fit_to_frame(Image.fromarray(pixels), (cfg.width, cfg.height)))
    assert kept.shape == (cfg.height, cfg.width, 3)
    torch.testing.assert_close(prepare_image(kept, cfg), prepare_image(pixels, cfg), rtol=0, atol=0)


def test_a_picture_too_narrow_for_the_frame_is_refused() -> None:
    assert fit_to_frame(Image.new("RGB", (30, 20)), (64, 48)).size == (64, 48)
    with pytest.raises(StartImageRefused, match=r"\(1x4000\) is too narrow for the model's 640x352 frame"):
        fit_to_frame(Image.new("RGB", (1, 4000)), (640, 352))


# ---- a real server ---------------------------------------------------------------------------------


async def upload(live: LiveServer, data: bytes, *, host: str | None = None) -> tuple[int | None, dict[str, Any]]:
    """Start a session with ``data`` as its start image (from client address ``host``); the close code and the
    first message."""
    async with session_client(live.ws_url, source_host=host) as client:
        await client.send(type="start", image={"data": b64(data)})
        first = await client.recv_json()
        if first["type"] == "ready":
            await client.send(type="close")
        closed = await client.closed_by_server()
        return closed.code, first


def test_a_scan_bomb_is_invalid_image_and_an_honest_upload_beside_it_starts() -> None:
    """Before the fix the bomb decoded (a pass over the picture per scan: 4 MiB of them is minutes of a core)."""
    settings = fake_settings(start_image_timeout_s=120.0)  # the honest decode must finish on a loaded machine
    with running_server(settings, FakeKVPipeline(start_images=OFFERED)) as live:
        blocks_free = live.stats()["kv"]["blocks_free"]

        async def scenario() -> list[tuple[int | None, dict[str, Any]]]:
            bomb = jpeg_scan_bomb(2048, 2048, 3000)
            honest = png(np.full((64, 64, 3), 90, np.uint8))
            return list(await asyncio.gather(upload(live, bomb), upload(live, bomb), upload(live, honest)))

        (bomb_code, bomb), (_, bomb_again), (honest_code, honest) = asyncio.run(scenario())
        assert bomb_code == 4004 and bomb["code"] == "invalid_image" and bomb_again["code"] == "invalid_image"
        assert "max_start_image_jpeg_scans" in bomb["message"]
        assert honest["type"] == "ready" and honest_code == 1000
        live.settled(blocks_free)


def decode_workers() -> dict[int, str]:
    """This process's decode worker processes (the servers here run in it), from /proc: pid -> state."""
    return child_processes(os.getpid(), "arstream.app.image_worker")


def test_hidden_scan_bombs_from_clients_that_left_leave_an_honest_upload_its_decode() -> None:
    """Before the fix a 0x00 after the frame header hid a bomb's 6,000 scans: two such uploads, their clients
    gone at once, held both decode threads (about 10 s each here) and the honest upload was over_capacity."""
    settings = fake_settings(start_image_timeout_s=5.0)
    with running_server(settings, FakeKVPipeline(start_images=OFFERED)) as live:
        assert live.server is not None
        wait_until(lambda: live.server.hub.start_images.workers.idle_ready() == 2)
        blocks_free = live.stats()["kv"]["blocks_free"]
        bomb = jpeg_scan_bomb(1024, 1024, 6000, junk_after_frame=b"\x00")

        async def leave_with(data: bytes) -> None:
            async with session_client(live.ws_url) as client:
                await client.send(type="start", image={"data": b64(data)})
                client.abort()

        async def scenario() -> tuple[int | None, dict[str, Any], dict[str, Any]]:
            await asyncio.gather(leave_with(bomb), leave_with(bomb))
            honest_code, honest = await upload(live, png(np.full((64, 64, 3), 90, np.uint8)))
            _, refused = await upload(live, bomb)
            return honest_code, honest, refused

        honest_code, honest, refused = asyncio.run(scenario())
        assert honest["type"] == "ready" and honest_code == 1000
        assert refused["code"] == "invalid_image" and "max_start_image_jpeg_scans" in refused["message"]
        live.settled(blocks_free)


def test_a_decode_past_its_deadline_is_killed_and_its_worker_replaced() -> None:
    """Scans allowed here, so the bomb decodes (seconds) until start_image_timeout_s: then its worker process is
    killed and reaped, and a new one takes its place. Before the fix the decode ran on in its thread, counted as
    decoding in /v1/stats, for seconds after the client had its answer."""
    settings = fake_settings(max_start_image_jpeg_scans=100_000, start_image_timeout_s=0.5)
    with running_server(settings, FakeKVPipeline(start_images=OFFERED)) as live:
        assert live.server is not None
        wait_until(lambda: live.server.hub.start_images.workers.idle_ready() == 2)
        before = decode_workers()
        assert list(before.values()) == ["S", "S"]  # two idle workers, waiting for a file
        code, refused = asyncio.run(upload(live, jpeg_scan_bomb(1024, 1024, 6000)))
        assert code == 4004 and "did not decode within 0.5 s (start_image_timeout_s)" in refused["message"]
        assert live.stats()["start_images"]["decoding"] == 0
        after = decode_workers()
        assert len(set(before) - set(after)) == 1  # the bomb's worker: killed and reaped (no zombie left)
        assert len(after) == 2 and "Z" not in after.values()  # its replacement beside the other
        wait_until(lambda: live.server.hub.start_images.workers.idle_ready() == 2)
        assert asyncio.run(upload(live, png(np.full((64, 64, 3), 90, np.uint8))))[1]["type"] == "ready"


def test_a_decode_whose_client_leaves_is_killed_at_once() -> None:
    """A long timeout: the bomb would decode for seconds, but its client leaves; its worker is killed as the
    connection stops waiting. Before the fix the decode ran to its end on its thread."""
    settings = fake_settings(max_start_image_jpeg_scans=100_000, start_image_timeout_s=60.0)
    with running_server(settings, FakeKVPipeline(start_images=OFFERED)) as live:
        assert live.server is not None
        hub = live.server.hub
        wait_until(lambda: hub.start_images.workers.idle_ready() == 2)
        before = set(decode_workers())

        async def scenario() -> None:
            async with session_client(live.ws_url, source_host="127.0.0.5") as leaver:
                await leaver.send(type="start", image={"data": b64(jpeg_scan_bomb(1024, 1024, 6000))})
                await asyncio.to_thread(wait_until, lambda: hub.unstarted.waiting_from("127.0.0.5") == 1)
                # Leaves once a worker has the file: leaving earlier stops the decode before it takes one.
                await asyncio.to_thread(wait_until, lambda: hub.start_images.workers.busy() == 1)
                leaver.abort()
            await asyncio.to_thread(wait_until, lambda: hub.unstarted.waiting_from("127.0.0.5") == 0)

        asyncio.run(scenario())
        assert live.stats()["start_images"]["decoding"] == 0
        assert len(before - set(decode_workers())) == 1


def test_decodes_that_cannot_start_or_finish_in_time_are_refused() -> None:
    """Scans allowed here, so two bombs hold both decode threads: past start_image_timeout_s they are
    invalid_image, and an upload that never got a thread is over_capacity (before the fix it waited for them)."""
    settings = fake_settings(max_start_image_jpeg_scans=100_000, start_image_timeout_s=0.3)
    with running_server(settings, FakeKVPipeline(start_images=OFFERED)) as live:
        blocks_free = live.stats()["kv"]["blocks_free"]
        bomb = jpeg_scan_bomb(2048, 2048, 2500)
        assert live.server is not None
        wait_until(lambda: live.server.hub.start_images.workers.idle_ready() == 2)  # both decode workers started

        async def scenario() -> list[tuple[int | None, dict[str, Any]]]:
            bombs = [asyncio.create_task(upload(live, bomb)) for _ in range(2)]
            await asyncio.to_thread(wait_until, lambda: live.stats()["start_images"]["decoding"] == 2)
            honest = await upload(live, png(np.full((16, 16, 3), 90, np.uint8)))
            return [*(await asyncio.gather(*bombs)), honest]

        (code_a, bomb_a), (code_b, bomb_b), (honest_code, honest) = asyncio.run(scenario())
        for code, refused in ((code_a, bomb_a), (code_b, bomb_b)):
            assert code == 4004 and "did not decode within 0.3 s (start_image_timeout_s)" in refused["message"]
        assert honest_code == 1013 and honest["code"] == "over_capacity"
        assert "no start image decode could start within 0.3 s" in honest["message"]
        live.settled(blocks_free)


def test_a_client_that_leaves_while_its_image_waits_stops_counting_at_once() -> None:
    """Before the fix it counted against max_unstarted_connections until its decode returned."""
    settings = fake_settings(max_start_image_jpeg_scans=100_000, start_image_timeout_s=60.0)
    with running_server(settings, FakeKVPipeline(start_images=OFFERED)) as live:
        assert live.server is not None
        unstarted = live.server.hub.unstarted
        bomb = jpeg_scan_bomb(2048, 2048, 2500)

        async def scenario() -> tuple[int, int, int]:
            bombs = [asyncio.create_task(upload(live, bomb, host=f"127.0.0.{i}")) for i in (2, 3)]
            await asyncio.to_thread(wait_until, lambda: live.stats()["start_images"]["decoding"] == 2)
            async with session_client(live.ws_url, source_host="127.0.0.4") as leaver:
                await leaver.send(type="start", image={"data": b64(png(np.zeros((16, 16, 3), np.uint8)))})
                await asyncio.to_thread(wait_until, lambda: unstarted.waiting_from("127.0.0.4") == 1)
                leaver.abort()
            await asyncio.to_thread(wait_until, lambda: unstarted.waiting_from("127.0.0.4") == 0)
            # The bombs' decodes are still running: their connections still wait, the leaver's never ran.
            still = (unstarted.waiting_from("127.0.0.2"), unstarted.waiting_from("127.0.0.3"), unstarted.count)
            assert live.stats()["start_images"]["decoding"] == 2
            for task in bombs:
                task.cancel()
            await asyncio.gather(*bombs, return_exceptions=True)
            return still

        assert asyncio.run(scenario()) == (1, 1, 2)
        wait_until(lambda: unstarted.count == 0)


def test_a_huge_flat_picture_is_held_as_one_frame_and_counted() -> None:
    """Before the fix a 16 MP PNG of a few tens of KB was held whole, 48 MB a session, counted nowhere."""
    options = json.dumps({"width": 64, "height": 48, "start_images": OFFERED})
    # One malloc arena: a decode's freed memory (the server keeps it, app/memory.py) is reused by the next decode
    # on either thread, so what grows is what is held, not each thread's own peak.
    # A generous deadline: each 16 MP decode must finish, however loaded the machine running the test.
    serve = ["--model", "fake-kv", "--model-options", options, "--log-level", "warning"]
    serve += ["--start-image-timeout-s", "120"]
    with server_process(serve, {"MALLOC_ARENA_MAX": "1"}) as live:
        assert live.process is not None
        pid = live.process.pid
        flat = png(np.full((4096, 4096, 3), 90, np.uint8))
        assert len(flat) < 128 * 1024

        async def scenario() -> tuple[int, dict[str, Any]]:
            async with session_client(live.ws_url, start={"image": {"data": b64(flat)}}):
                pass  # warm: the decode's allocations are set up once
            before = rss_bytes(pid)
            clients = []
            for _ in range(4):
                client = session_client(live.ws_url, start={"image": {"data": b64(flat)}})
                await client.__aenter__()
                clients.append(client)
            grown, stats = rss_bytes(pid) - before, live.stats()
            for client in clients:
                await client.__aexit__(None, None, None)
            return grown, stats

        grown, stats = asyncio.run(scenario())
        assert grown < 40 * MB, f"4 sessions with a 16 MP start image grew the server by {grown / MB:.0f} MB"
        assert stats["start_images"] == {"held": 4, "bytes": 4 * 64 * 48 * 3, "decoding": 0}
        wait_until(lambda: live.stats()["start_images"] == {"held": 0, "bytes": 0, "decoding": 0})
