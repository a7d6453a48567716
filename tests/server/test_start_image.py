"""Start images (PROTOCOL.md, "Start images"): parsing and bounds, then a real server and the fake model.

The fake-kv pipeline offers start images when asked (``start_images``) and
records the StartImage every tick carried (``start_images_seen``), so these
tests see exactly what reached the model: the name or the decoded pixels and
their digest, on every tick, after a reset and after a resume. Every refusal
must leave the pool at its baseline and a session already running untouched.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from websockets.exceptions import ConnectionClosed

from arstream.programs import client, client_lib
from arstream.app.protocol import ErrorCode, ProtocolError, StartMessage, parse_client_message
from arstream.app.settings import WS_FRAME_SLACK_BYTES
from arstream.app.start_image import (
    ImageLimits,
    StartImageRefused,
    base64_length,
    decode_base64,
    decode_pixels,
    fit_to_frame,
    named_start_image,
    offered_start_images,
    pixels_digest,
)
from arstream.models.fake import FakeKVPipeline
from arstream.runner.types import StartImage, TickRequest
from servers import RECEIVE_GUARD_S, LiveServer, ProbeClient, fake_settings, running_server, session_client

OFFERED = ["meadow", "canyon"]
MAX_IMAGE_BYTES = 64 * 1024
MAX_IMAGE_PIXELS = 200 * 200
LIMITS = ImageLimits(max_bytes=MAX_IMAGE_BYTES, max_pixels=MAX_IMAGE_PIXELS, max_jpeg_scans=64)  # no frame: as sent


def image_file(pixels: np.ndarray, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=image_format)
    return buffer.getvalue()


def noise(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels and that holds almost no picture at all."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---- parsing and bounds, no server ---------------------------------------------------------------


def test_start_image_field_shape_is_checked_by_the_protocol() -> None:
    parsed = parse_client_message('{"type": "start", "image": {"name": "meadow"}}')
    assert isinstance(parsed, StartMessage) and parsed.image is not None and parsed.image.name == "meadow" and parsed.image.data is None
    for image in ('{}', '{"name": "a", "data": "AA=="}', '"meadow"', '{"data": 5}', '{"name": ""}'):
        with pytest.raises(ProtocolError) as refused:
            parse_client_message(f'{{"type": "start", "image": {image}}}')
        assert refused.value.code is ErrorCode.INVALID_MESSAGE and refused.value.message_type == "start"


def test_offered_names_come_from_the_card_and_a_bad_list_is_refused() -> None:
    assert offered_start_images({"start_images": OFFERED}) == ("meadow", "canyon")
    assert offered_start_images({}) == ()
    for bad in ("meadow", ["a", "a"], ["a", ""], [3]):
        with pytest.raises(ValueError, match="start_images"):
            offered_start_images({"start_images": bad})


def test_a_name_must_be_offered() -> None:
    assert named_start_image("canyon", OFFERED) == StartImage(digest="name:canyon", name="canyon")
    with pytest.raises(StartImageRefused, match=r"'desert' is not offered; expected one of \['meadow', 'canyon'\]"):
        named_start_image("desert", OFFERED)
    with pytest.raises(StartImageRefused, match="offers no start_images"):
        named_start_image("meadow", ())


def test_base64_is_bounded_by_its_length_before_it_is_decoded() -> None:
    assert decode_base64(b64(b"x" * 100), 100) == b"x" * 100
    # 101 bytes of base64 text that is not even base64: refused for its length, never decoded.
    with pytest.raises(StartImageRefused, match="over 100 bytes"):
        decode_base64("!" * (base64_length(100) + 1), 100)
    with pytest.raises(StartImageRefused, match="is 101 bytes, over 100"):
        decode_base64(b64(b"x" * 101), 100)
    for bad in ("not base64!", "AAA", "data:image/png;base64,AAAA"):
        with pytest.raises(StartImageRefused, match="not base64"):
            decode_base64(bad, 100)
    with pytest.raises(StartImageRefused, match="empty"):
        decode_base64("", 100)


@pytest.mark.parametrize("image_format", ["PNG", "WEBP"])
def test_lossless_files_decode_to_their_exact_pixels(image_format: str) -> None:
    pixels = noise(12, 20)
    encoded = image_file(pixels, image_format) if image_format == "PNG" else _lossless_webp(pixels)
    decoded = decode_pixels(encoded, LIMITS)
    assert decoded.dtype == np.uint8 and decoded.shape == (12, 20, 3)
    np.testing.assert_array_equal(decoded, pixels)
    assert not decoded.flags.writeable


def _lossless_webp(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="WEBP", lossless=True)
    return buffer.getvalue()


def test_jpeg_and_other_modes_decode_to_rgb() -> None:
    flat = np.full((16, 16, 3), (200, 40, 90), dtype=np.uint8)
    decoded = decode_pixels(image_file(flat, "JPEG"), LIMITS)
    assert decoded.shape == (16, 16, 3) and np.abs(decoded.astype(int) - (200, 40, 90)).max() <= 4
    grey = Image.new("L", (5, 3), 77)
    buffer = io.BytesIO()
    grey.save(buffer, format="PNG")
    assert (decode_pixels(buffer.getvalue(), LIMITS) == 77).all()


def test_a_photo_is_turned_upright_by_its_exif_orientation() -> None:
    stored = np.zeros((10, 30, 3), dtype=np.uint8)
    stored[:, :10] = 255  # the stored picture's left third is white
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation 6: a viewer turns it 90 degrees clockwise
    buffer = io.BytesIO()
    Image.fromarray(stored).save(buffer, format="PNG", exif=exif)
    upright = decode_pixels(buffer.getvalue(), LIMITS)
    assert upright.shape == (30, 10, 3)
    assert upright[:10].min() == 255 and upright[10:].max() == 0  # the white third is on top now


@pytest.mark.parametrize(
    ("encoded", "complaint"),
    [
        (b"hello, not an image", "not a PNG, JPEG, WEBP file"),
        (image_file(noise(8, 8), "GIF"), "not a PNG, JPEG, WEBP file"),
        (image_file(noise(8, 8), "BMP"), "not a PNG, JPEG, WEBP file"),
        (image_file(noise(64, 64))[:200], "not a PNG, JPEG, WEBP file that decodes"),
        (png_header_only(201, 200), "201x200 = 40200 pixels, over 40000 (max_start_image_pixels)"),
        (png_header_only(100_000, 100_000), "pixels"),
    ],
    ids=["not-an-image", "gif", "bmp", "truncated", "over-the-pixel-limit", "pillow-bomb-limit"],
)
def test_what_does_not_decode_is_refused(encoded: bytes, complaint: str) -> None:
    with pytest.raises(StartImageRefused, match=complaint.replace("(", r"\(").replace(")", r"\)")) as refused:
        decode_pixels(encoded, LIMITS)
    # the client reads this message: no Python object names ("<_io.BytesIO object at 0x7f...>")
    assert " object at 0x" not in str(refused.value) and "BytesIO" not in str(refused.value), refused.value


def test_the_pixel_limit_is_checked_before_decoding() -> None:
    """A small file that decodes to a large picture (a decompression bomb) is refused by its header."""
    bomb = image_file(np.zeros((2000, 2000, 3), dtype=np.uint8))
    assert len(bomb) < 64 * 1024  # 12 MB of pixels in a few KB
    with pytest.raises(StartImageRefused, match="2000x2000 = 4000000 pixels"):
        decode_pixels(bomb, LIMITS)


def test_the_digest_is_of_the_pixels_and_their_size() -> None:
    pixels = noise(4, 6)
    assert pixels_digest(pixels) == pixels_digest(pixels.copy())
    assert pixels_digest(pixels) != pixels_digest(pixels.reshape(6, 4, 3))  # same bytes, other size
    assert pixels_digest(pixels).startswith("sha256:") and len(pixels_digest(pixels)) == 7 + 64


def test_start_message_limit_makes_room_for_one_base64_image() -> None:
    settings = fake_settings(max_message_bytes=1024, max_start_image_bytes=3000)
    assert settings.max_start_message_bytes == 1024 + 4000
    assert settings.ws_max_size == 1024 + 4000 + WS_FRAME_SLACK_BYTES


# ---- a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake() -> FakeKVPipeline:
    return FakeKVPipeline(start_images=OFFERED)


@pytest.fixture(scope="module")
def server(fake: FakeKVPipeline) -> Iterator[LiveServer]:
    settings = fake_settings(
        max_message_bytes=4096,
        max_start_image_bytes=MAX_IMAGE_BYTES,
        max_start_image_pixels=MAX_IMAGE_PIXELS,
    )
    with running_server(settings, fake) as live:
        yield live


def seen_by_the_model(fake: FakeKVPipeline, session_id: str) -> list[StartImage | None]:
    return [image for seen_id, image in list(fake.start_images_seen) if seen_id == session_id]


async def tick_chunks(client: ProbeClient, first_tick: int, count: int, **fields: Any) -> list[dict[str, Any]]:
    chunks = []
    for tick_id in range(first_tick, first_tick + count):
        await client.send(type="tick", tick_id=tick_id, **(fields if tick_id == first_tick else {}))
        chunk, _ = await client.recv_chunk()
        chunks.append(chunk)
    return chunks


def test_the_card_offers_start_images_and_ready_says_the_upload_limit(server: LiveServer, baseline: int) -> None:
    async def scenario() -> dict[str, Any]:
        async with session_client(server.ws_url, start={}) as client:
            assert client.ready is not None
            return client.ready

    ready = asyncio.run(scenario())
    assert ready["model"]["start_images"] == OFFERED
    assert ready["limits"]["max_start_image_bytes"] == MAX_IMAGE_BYTES
    assert server.get("/v1/model").json()["start_images"] == OFFERED


def test_a_named_image_reaches_the_model_on_every_tick_and_after_reset(
    server: LiveServer, fake: FakeKVPipeline, baseline: int
) -> None:
    async def scenario() -> tuple[str, list[dict[str, Any]], str]:
        async with session_client(server.ws_url, start={"image": {"name": "canyon"}, "codec": "raw"}) as named:
            async with session_client(server.ws_url, start={"codec": "raw"}) as default:
                chunks = await tick_chunks(named, 0, 3)
                chunks += await tick_chunks(named, 3, 2, reset=True)
                await tick_chunks(default, 0, 2)
                assert named.ready is not None and default.ready is not None
                return named.ready["session_id"], chunks, default.ready["session_id"]

    session_id, chunks, default_id = asyncio.run(scenario())
    assert chunks[3]["restarted"] == "reset"
    assert seen_by_the_model(fake, session_id) == [StartImage(digest="name:canyon", name="canyon")] * 5
    assert seen_by_the_model(fake, default_id) == [None, None]  # no image asked: the model's default


def test_an_uploaded_image_reaches_the_model_as_its_pixels(
    server: LiveServer, fake: FakeKVPipeline, baseline: int
) -> None:
    pixels = noise(30, 50, seed=7)

    async def scenario() -> str:
        start = {"image": {"data": b64(image_file(pixels))}}
        async with session_client(server.ws_url, start=start) as uploaded:
            await tick_chunks(uploaded, 0, 2)
            await tick_chunks(uploaded, 2, 2, reset=True)
            assert uploaded.ready is not None
            return uploaded.ready["session_id"]

    session_id = asyncio.run(scenario())
    seen = seen_by_the_model(fake, session_id)
    assert len(seen) == 4
    # What the model uses: the centred 30x30 of the 50x30 picture (its 8x8 frame's aspect), scaled to 8x8.
    fitted = np.asarray(Image.fromarray(pixels).crop((10, 0, 40, 30)).resize((8, 8), Image.Resampling.BILINEAR))
    for image in seen:
        assert image is not None and image.name is None and image.digest == pixels_digest(fitted)
        np.testing.assert_array_equal(image.pixels, fitted)


def test_a_resumed_session_keeps_its_image() -> None:
    fake = FakeKVPipeline(start_images=OFFERED)
    with running_server(fake_settings(resume_grace_s=30.0), fake) as live:
        blocks_free = live.stats()["kv"]["blocks_free"]

        async def scenario() -> str:
            async with session_client(live.ws_url, start={"image": {"name": "meadow"}}) as first:
                await tick_chunks(first, 0, 2)
                assert first.ready is not None
                token, session_id = first.ready["resume"]["token"], first.ready["session_id"]
                first.abort()
            url = client_lib.session_url(live.ws_url, resume=token)
            # An image in a resume's start is ignored, as its prompt and seed are.
            async with session_client(url, start={"resume": token, "image": {"name": "canyon"}}) as resumed:
                assert resumed.ready is not None and resumed.ready["resumed"] is True
                await tick_chunks(resumed, 2, 2)
                await resumed.send(type="close")
                assert (await resumed.closed_by_server()).code == 1000
            return session_id

        session_id = asyncio.run(scenario())
        assert seen_by_the_model(fake, session_id) == [StartImage(digest="name:meadow", name="meadow")] * 4
        live.settled(blocks_free)


REFUSALS = {
    "unknown-name": ({"name": "desert"}, "'desert' is not offered"),
    "not-base64": ({"data": "this is not base64!"}, "not base64"),
    "not-an-image": ({"data": b64(b"just some text, not a picture")}, "not a PNG, JPEG, WEBP file"),
    "gif": ({"data": b64(image_file(noise(8, 8), "GIF"))}, "not a PNG, JPEG, WEBP file"),
    # Over max_start_image_bytes, yet the start message still fits its limit: refused as an image.
    "too-many-bytes": ({"data": b64(image_file(noise(150, 148)))}, f"over {MAX_IMAGE_BYTES} bytes"),
    "too-many-pixels": ({"data": b64(image_file(np.zeros((8, 5001, 3), np.uint8)))}, "over 40000 (max_start_image"),
    "bomb": ({"data": b64(image_file(np.zeros((3000, 3000, 3), np.uint8)))}, "3000x3000 = 9000000 pixels"),
}


@pytest.mark.parametrize("image, complaint", REFUSALS.values(), ids=REFUSALS.keys())
def test_a_refused_image_is_invalid_image_and_nothing_else_changes(
    server: LiveServer, fake: FakeKVPipeline, baseline: int, image: dict[str, str], complaint: str
) -> None:
    async def scenario() -> tuple[Any, list[dict[str, Any]]]:
        async with session_client(server.ws_url, start={"image": {"name": "meadow"}}) as bystander:
            before = await tick_chunks(bystander, 0, 2)
            async with session_client(server.ws_url) as refused:
                await refused.send(type="start", image=image)
                closed = await refused.closed_by_server()
            after = await tick_chunks(bystander, 2, 2)
            return closed, before + after

    closed, bystander_chunks = asyncio.run(scenario())
    assert closed.code == 4004
    [error] = closed.messages
    assert error["type"] == "error" and error["code"] == "invalid_image" and error["fatal"] is True
    assert complaint in error["message"]
    assert [chunk["chunk_index"] for chunk in bystander_chunks] == [0, 1, 2, 3]  # it never noticed
    stats = server.stats()
    assert stats["sessions"]["connected"] == 0 and stats["sessions"]["failures_total"] == 0


def test_a_start_over_the_start_limit_is_message_too_large(server: LiveServer, baseline: int) -> None:
    settings = server.server.hub.settings if server.server else None
    assert settings is not None
    oversized = "A" * (settings.max_start_message_bytes + 1)

    async def scenario() -> Any:
        async with session_client(server.ws_url) as client:
            await client.send(type="start", image={"data": oversized})
            return await client.closed_by_server()

    closed = asyncio.run(scenario())
    assert closed.code == 1009
    assert closed.messages[0]["code"] == "message_too_large"
    assert f"start messages are limited to {settings.max_start_message_bytes} bytes" in closed.messages[0]["message"]


def test_only_start_may_be_large_once_the_session_has_started(server: LiveServer, baseline: int) -> None:
    """After `start`, a message far over max_message_bytes (but one a start could be) is cut off by the
    WebSocket layer before it is buffered whole: a bare close 1009, not the app's message_too_large."""

    async def scenario(size: int) -> Any:
        async with session_client(server.ws_url, start={"image": {"name": "meadow"}}) as client:
            try:
                await client.send(type="ping", t="x" * size)
            except ConnectionClosed:
                pass
            return await client.closed_by_server()

    just_over = asyncio.run(scenario(4096))  # the app's own limit: its error, then 1009
    assert just_over.code == 1009 and just_over.messages[0]["code"] == "message_too_large"
    far_over = asyncio.run(scenario(2 * (4096 + WS_FRAME_SLACK_BYTES)))
    assert far_over.code == 1009 and far_over.messages == []


def test_an_image_for_a_model_without_start_images_is_refused() -> None:
    with running_server(fake_settings()) as plain:
        blocks_free = plain.stats()["kv"]["blocks_free"]

        async def scenario(image: dict[str, str]) -> Any:
            async with session_client(plain.ws_url) as client:
                await client.send(type="start", image=image)
                return await client.closed_by_server()

        for image in ({"name": "meadow"}, {"data": b64(image_file(noise(4, 4)))}):
            closed = asyncio.run(scenario(image))
            assert closed.code == 4004 and closed.messages[0]["code"] == "invalid_image"
            assert "offers no start_images" in closed.messages[0]["message"]

        async def ready() -> dict[str, Any]:
            async with session_client(plain.ws_url, start={}) as client:
                assert client.ready is not None
                return client.ready

        limits = asyncio.run(ready())["limits"]
        assert "max_start_image_bytes" not in limits
        plain.settled(blocks_free)


class LoadingFakeKVPipeline(FakeKVPipeline):
    """A fake offering start images whose warm-up waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__(start_images=OFFERED)
        self.loaded = threading.Event()

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        if not self.loaded.wait(RECEIVE_GUARD_S):
            raise RuntimeError("the test never let the warm-up finish")
        return super().warmup_requests(session_id)


def test_an_image_while_the_model_loads_is_over_capacity_not_invalid_image() -> None:
    """The card (and so its images) is unknown until the model is loaded: try later, not "bad image"."""
    pipeline = LoadingFakeKVPipeline()
    with running_server(fake_settings(), pipeline, wait_ready=False) as loading:

        async def scenario() -> Any:
            async with session_client(loading.ws_url) as client:
                await client.send(type="start", image={"name": "canyon"})
                return await client.closed_by_server()

        try:
            closed = asyncio.run(scenario())
        finally:
            pipeline.loaded.set()
        assert closed.code == 1013 and closed.messages[0]["code"] == "over_capacity"


def test_a_decode_does_not_hold_up_other_sessions() -> None:
    """A picture at the pixel limit takes a while to decode; another session's ping is answered meanwhile."""
    # A generous deadline: the decode must finish, however loaded the machine running the test.
    settings = fake_settings(start_image_timeout_s=120.0)
    with running_server(settings, FakeKVPipeline(start_images=OFFERED)) as live:
        largest = b64(image_file(np.zeros((4096, 4096, 3), np.uint8)))  # 16 MP in about 50 KB

        async def scenario() -> list[str]:
            order: list[str] = []
            async with session_client(live.ws_url, start={}) as bystander, session_client(live.ws_url) as uploader:

                async def answered(client: ProbeClient, name: str) -> None:
                    await client.recv_json()
                    order.append(name)

                await uploader.send(type="start", image={"data": largest})
                await bystander.send(type="ping", t=1)
                await asyncio.gather(answered(uploader, "ready"), answered(bystander, "pong"))
            return order

        assert asyncio.run(scenario()) == ["pong", "ready"]


# ---- arstream client --image ----------------------------------------------------------------------


def test_the_client_sends_a_name_or_a_file(
    server: LiveServer, fake: FakeKVPipeline, baseline: int, tmp_path: Path
) -> None:
    pixels = noise(24, 40, seed=3)
    picture = tmp_path / "mine.png"
    picture.write_bytes(image_file(pixels))
    before = len(fake.start_images_seen)
    assert client.main([server.base_url, "--image", "canyon", "--keys", "d*2", "--out", str(tmp_path / "a")]) == 0
    named = [image for _, image in fake.start_images_seen[before:]]
    assert named == [StartImage(digest="name:canyon", name="canyon")] * 2
    before = len(fake.start_images_seen)
    assert client.main([server.base_url, "--image", str(picture), "--keys", "w*2", "--out", str(tmp_path / "b")]) == 0
    uploaded = [image for _, image in fake.start_images_seen[before:]]
    fitted = np.asarray(fit_to_frame(Image.fromarray(pixels), (8, 8)))  # the fake's frame
    assert len(uploaded) == 2 and all(image is not None and image.digest == pixels_digest(fitted) for image in uploaded)


def test_the_client_reports_a_refused_image(
    server: LiveServer, baseline: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert client.main([server.base_url, "--image", "desert", "--keys", "d*2", "--out", str(tmp_path)]) == 1
    assert "invalid_image" in capsys.readouterr().err
