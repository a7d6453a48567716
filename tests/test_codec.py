"""The h264 codec: PyAV stream and decoder, the ARF1 keyframe flag, the encoder pool's streams, and a real server.

The server runs fake-kv, whose frames are flat colours (R: a KV-derived value,
G: the frame's absolute position, B: a bit per held key). A raw session and an
h264 session with the same controls get the same pictures, so the h264 one,
decoded, must match the raw one up to compression error.
"""

from __future__ import annotations

import ast
import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest

from arstream import cli
from arstream.app import codecs, protocol, settings, video, wire
from arstream.programs import bench, client
from arstream.app.encoding import EncoderPool
from arstream.app.protocol import ProtocolError
from arstream.app.codecs import FrameDecoder
from arstream.app.video import H264Decoder, H264Stream, crf_for_quality
from arstream.models.fake import FakeKVPipeline
from servers import fake_settings, running_server, session_client

av = pytest.importorskip("av")
pytestmark = pytest.mark.skipif("libx264" not in av.codecs_available, reason="this PyAV build has no libx264")

GUARD_S = 30.0  # hang guard only


def moving_gradient(count: int, width: int, height: int) -> np.ndarray:
    """Frames with detail and motion, so that delta frames have something to say."""
    x = np.arange(width)[None, :]
    y = np.arange(height)[:, None]
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for i in range(count):
        frames[i, ..., 0] = (2 * x + 3 * i) % 256
        frames[i, ..., 1] = (3 * y + 5 * i) % 256
        frames[i, ..., 2] = (x + y) % 256
    return frames


def header(width: int, height: int, *, keyframe: bool, index: int = 0) -> wire.FrameHeader:
    return wire.FrameHeader(wire.Codec.H264, False, index, 0, 0, width, height, keyframe=keyframe)


# ---- the stream and its decoder ----------------------------------------------------------------


def test_a_stream_starts_with_a_keyframe_and_decodes_back_close_to_the_input() -> None:
    frames = moving_gradient(8, 64, 48)
    stream = H264Stream(64, 48, quality=90)
    decoder = H264Decoder()
    keyframes = []
    for index, frame in enumerate(frames):
        payload, keyframe = stream.encode(frame)
        keyframes.append(keyframe)
        assert payload[:4] == b"\x00\x00\x00\x01"  # Annex B
        decoded = decoder.decode(header(64, 48, keyframe=keyframe, index=index), payload)
        error = np.abs(decoded.astype(int) - frame.astype(int))
        assert decoded.shape == (48, 64, 3) and error.mean() < 4, (index, error.mean())
    assert keyframes == [True] + [False] * 7


def test_odd_sizes_travel_padded_and_come_back_cropped() -> None:
    frames = moving_gradient(3, 33, 17)
    stream = H264Stream(33, 17, quality=90)
    decoder = FrameDecoder()
    for index, frame in enumerate(frames):
        payload, keyframe = stream.encode(frame)
        message = header(33, 17, keyframe=keyframe, index=index).pack() + payload
        _, decoded = decoder.decode_frame(message)
        assert decoded.shape == (17, 33, 3)
        assert np.abs(decoded.astype(int) - frame.astype(int)).mean() < 6
    with pytest.raises(ValueError, match="the stream is 33x17, got a 34x17 frame"):
        stream.encode(np.zeros((17, 34, 3), np.uint8))


def test_a_decoder_refuses_a_stream_that_does_not_begin_with_a_keyframe() -> None:
    stream = H264Stream(32, 32, quality=80)
    frames = moving_gradient(2, 32, 32)
    stream.encode(frames[0])
    delta, keyframe = stream.encode(frames[1])
    assert not keyframe
    with pytest.raises(wire.WireError, match="must begin with one"):
        H264Decoder().decode(header(32, 32, keyframe=False), delta)


def test_quality_maps_to_x264_crf() -> None:
    assert [crf_for_quality(q) for q in (1, 50, 80, 100)] == [51, 34, 23, 16]
    with pytest.raises(ValueError, match="1..100"):
        crf_for_quality(0)


# ---- the wire format ---------------------------------------------------------------------------


def test_the_keyframe_flag_is_bit_1_of_the_flags_byte() -> None:
    packed = wire.FrameHeader(wire.Codec.H264, True, 1, 7, 9, 640, 352, keyframe=True).pack()
    assert packed[4] == 2 and packed[5] == 0b11
    parsed = wire.FrameHeader.unpack(packed)
    assert parsed.codec is wire.Codec.H264 and parsed.keyframe and parsed.last_in_chunk
    assert not wire.FrameHeader.unpack(wire.FrameHeader(wire.Codec.JPEG, True, 0, 0, 0, 8, 8).pack()).keyframe
    assert wire.Codec.from_name("h264") is wire.Codec.H264 and "h264" in codecs.CODEC_NAMES


def test_stateless_decoding_points_at_the_stream_decoder() -> None:
    with pytest.raises(wire.WireError, match="FrameDecoder"):
        wire.decode_payload(header(8, 8, keyframe=True), b"\x00\x00\x00\x01")
    with pytest.raises(wire.WireError, match="H264Stream"):
        wire.encode_frame(np.zeros((8, 8, 3), np.uint8), wire.Codec.H264, 80)


def test_a_server_without_pyav_refuses_h264_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video, "h264_available", lambda: False)
    with pytest.raises(ProtocolError, match="cannot encode h264") as refused:
        protocol.parse_client_message('{"type": "start", "codec": "h264"}')
    assert refused.value.code is protocol.ErrorCode.INVALID_MESSAGE
    assert protocol.parse_client_message('{"type": "start", "codec": "jpeg"}').codec == "jpeg"


# ---- the encoder pool keeps one stream per session ----------------------------------------------


def test_the_pool_starts_a_new_stream_at_rollout_start_and_on_restart() -> None:
    pool = EncoderPool(2)
    chunks = moving_gradient(10, 32, 32).reshape(5, 2, 32, 32, 3)
    keyframes: list[list[bool]] = []
    done = threading.Event()

    def encode(chunk_index: int, frames: np.ndarray) -> None:
        messages = pool.encode("s", frames, codec="h264", quality=80, chunk_index=chunk_index, tick_id=chunk_index)
        keyframes.append([wire.FrameHeader.unpack(m).keyframe for m in messages])

    for chunk_index, frames in zip((0, 1, 2, 0), chunks):  # the second 0: a reset
        pool.submit("s", lambda c=chunk_index, f=frames: encode(c, f))
    pool.restart_stream("s")  # a resume
    pool.submit("s", lambda: encode(1, chunks[4]))
    pool.submit("s", done.set)
    assert done.wait(GUARD_S)
    pool.shutdown(wait=True)
    assert keyframes == [[True, False], [False, False], [False, False], [True, False], [True, False]]


# ---- a real server -----------------------------------------------------------------------------


async def read_chunk(session: Any) -> tuple[dict[str, Any], list[bytes]]:
    """A chunk message and its frames, undecoded (the test servers' helper decodes statelessly)."""
    chunk = await session.recv_json()
    assert chunk["type"] == "chunk", chunk
    frames = [await session.recv() for _ in range(chunk["frames"])]
    assert all(isinstance(f, bytes) for f in frames)
    return chunk, frames


KEY_PLAN = [["d"], ["d"], ["w"], [], ["a", "s"], ["a"]]


async def run_session(url: str, codec: str, *, reset_at: int | None = None) -> list[tuple[dict, list[bytes]]]:
    received = []
    async with session_client(url, start={"codec": codec, "quality": 95}) as session:
        for tick_id, keys in enumerate(KEY_PLAN):
            reset = tick_id == reset_at
            await session.send(type="tick", tick_id=tick_id, controls={"keys": keys}, reset=reset)
            received.append(await read_chunk(session))
    return received


def test_h264_sessions_see_what_raw_sessions_see_with_keyframes_where_streams_begin() -> None:
    with running_server(fake_settings(), FakeKVPipeline(width=64, height=48)) as server:

        async def scenario() -> tuple[list, list]:
            return await asyncio.gather(
                run_session(server.ws_url, "raw", reset_at=3), run_session(server.ws_url, "h264", reset_at=3)
            )

        raw, h264 = asyncio.run(scenario())
    decoder = FrameDecoder()
    h264_bytes = raw_bytes = 0
    for (raw_chunk, raw_frames), (chunk, frames) in zip(raw, h264):
        assert chunk["chunk_index"] == raw_chunk["chunk_index"] and chunk["restarted"] == raw_chunk["restarted"]
        for raw_message, message in zip(raw_frames, frames):
            head, pixels = decoder.decode_frame(message)
            _, expected = wire.decode_frame(raw_message)
            assert head.codec is wire.Codec.H264 and (head.width, head.height) == (64, 48)
            # A new stream at the first frame of every rollout (start, and the reset at tick 3), nowhere else.
            assert head.keyframe == (chunk["chunk_index"] == 0 and head.frame_index == 0)
            assert np.abs(pixels.astype(int) - expected.astype(int)).max() <= 4
            h264_bytes += len(message)
            raw_bytes += len(raw_message)
    assert [c["chunk_index"] for c, _ in h264] == [0, 1, 2, 0, 1, 2]
    assert h264_bytes < raw_bytes / 10


def test_a_resumed_h264_session_begins_a_new_stream() -> None:
    settings = fake_settings(replica_id="r0", resume_grace_s=30)
    with running_server(settings, FakeKVPipeline(width=64, height=48)) as server:

        async def scenario() -> tuple[list[bool], np.ndarray, int]:
            async with session_client(server.ws_url, start={"codec": "h264"}) as first:
                token = first.ready["resume"]["token"]  # type: ignore[index]
                for tick_id in range(2):
                    await first.send(type="tick", tick_id=tick_id)
                    await read_chunk(first)
                first.abort()
            await asyncio.to_thread(server.wait_for_stats, lambda s: s["sessions"]["detached"] == 1)
            async with session_client(f"{server.ws_url}?resume={token}", start={"resume": token}) as second:
                await second.send(type="tick", tick_id=2)
                chunk, frames = await read_chunk(second)
            decoder = FrameDecoder()  # a new client: it can decode only from a keyframe
            heads_pixels = [decoder.decode_frame(m) for m in frames]
            return [h.keyframe for h, _ in heads_pixels], heads_pixels[0][1], chunk["chunk_index"]

        keyframes, pixels, chunk_index = asyncio.run(scenario())
    assert chunk_index == 2 and keyframes == [True, False]
    assert abs(int(pixels[0, 0, 1]) - 4) <= 3  # G: the chunk's first frame is the rollout's frame 4


def test_arstream_client_decodes_and_saves_an_h264_session(tmp_path: Path) -> None:
    with running_server(fake_settings(), FakeKVPipeline(width=64, height=48)) as server:
        result = asyncio.run(client.run_script(server.ws_url, [("d",)] * 3 + [()] * 3, codec="h264"))
    assert len(result.frames) == 12
    # G is the absolute frame position, B the held keys (d = 8): decoded within compression error.
    greens = [int(frame[0, 0, 1]) for frame in result.frames]
    blues = [int(frame[0, 0, 2]) for frame in result.frames]
    assert max(abs(g - i) for i, g in enumerate(greens)) <= 3
    assert max(abs(b - e) for b, e in zip(blues, [8] * 6 + [0] * 6)) <= 3
    assert client.save_mp4(result.frames, tmp_path / "out.mp4", fps=16)
    with av.open(str(tmp_path / "out.mp4")) as container:
        assert sum(1 for _ in container.decode(video=0)) == 12

    # A small model's video is scaled up by whole factors (64x48: 8, 512x384), pixels kept as sharp squares.
    scale = client.video_scale(64, 48)
    assert scale == 8
    assert client.save_mp4(result.frames, tmp_path / "big.mp4", fps=16, scale=scale)
    with av.open(str(tmp_path / "big.mp4")) as container:
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert decoded[0].shape == (384, 512, 3)
    assert abs(int(decoded[5][100, 100, 1]) - greens[5]) <= 3


# ---- bench serve reports each codec's cost ------------------------------------------------------


@pytest.mark.parametrize("codec", ["raw", "h264"])
def test_bench_serve_reports_bytes_and_encode_time_per_frame(codec: str, capsys: pytest.CaptureFixture[str]) -> None:
    options = '{"compute_delay_s": 0.005, "width": 64, "height": 48}'
    argv = ["--model", "fake-kv", "--sessions", "2", "--max-batch-sessions", "2", "--chunks", "4", "--repeat", "1"]
    assert bench.main([*argv, "--codec", codec, "--model-options", options, "--kv-budget-bytes", "4194304"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["codec"] == codec and summary["encode_ms_per_frame"] > 0
    if codec == "raw":
        assert summary["bytes_per_frame"] == 64 * 48 * 3  # exactly the pixels: nothing else is counted
    else:
        assert 0 < summary["bytes_per_frame"] < 64 * 48 * 3 / 4
    assert 1 <= summary["server_sessions_per_round"] <= summary["full_round_sessions"] == 2


def palette_picture(height: int, width: int) -> np.ndarray:
    """Two flat colours split by a diagonal edge: what a palette world's frame is made of."""
    rows, cols = np.mgrid[:height, :width]
    picture = np.empty((height, width, 3), np.uint8)
    picture[...] = (38, 84, 170)
    picture[rows * width > cols * height] = (222, 200, 130)
    return picture


@pytest.mark.parametrize(("height", "width", "full_chroma"), [(64, 64, True), (128, 128, True), (352, 640, False)])
def test_small_jpeg_frames_keep_full_chroma(height: int, width: int, full_chroma: bool) -> None:
    import simplejpeg

    picture = palette_picture(height, width)
    payload = wire.encode_frame(picture, wire.Codec.JPEG, 80)
    decoded = simplejpeg.decode_jpeg(payload)
    # the chroma subsampling the JPEG header states
    header = simplejpeg.decode_jpeg_header(payload)
    assert header[:2] == (height, width)
    assert (header[3] == "444") == full_chroma, header
    if full_chroma:  # the edge keeps its colours: no blend of the two along it
        off = np.abs(decoded.astype(int) - picture.astype(int)).max(axis=-1) > 40
        assert off.mean() < 0.02


# ---- the codec table ---------------------------------------------------------------------------------


def test_the_codec_table_names_every_arf1_codec_once_with_its_header_id() -> None:
    assert set(codecs.CODECS) == set(get_args(codecs.CodecName)) == {codec.wire_name for codec in wire.Codec}
    for name, codec in codecs.CODECS.items():
        assert codec.name == name and codec.header_id is wire.Codec.from_name(name)
    assert codecs.codec_named("fmp4/16") is codecs.FMP4 and codecs.FMP4.header_id is None
    with pytest.raises(ValueError, match=r"unknown codec 'vp9'; expected one of \['raw', 'jpeg', 'h264'\]"):
        codecs.new_encoder("vp9", 80)


def test_one_frame_decoder_reads_every_codec_through_the_table() -> None:
    """A session's frames in each codec in turn (a client that restarts with another codec) decode back."""
    frames = moving_gradient(2, 16, 16)
    decoder = FrameDecoder()
    for name in codecs.CODECS:
        encoder = codecs.new_encoder(name, 95)
        for message, frame in zip(encoder.encode(frames, chunk_index=0, tick_id=0), frames, strict=True):
            header, pixels = decoder.decode_frame(message)
            assert header.codec is wire.Codec.from_name(name)
            assert np.abs(pixels.astype(int) - frame.astype(int)).mean() < 6, name
        encoder.close()


def test_the_server_offers_the_codecs_it_can_encode(monkeypatch: pytest.MonkeyPatch) -> None:
    every = [
        {"name": name, "id": int(codec.header_id)}
        for name, codec in codecs.CODECS.items()
        if codec.header_id is not None
    ]
    assert [offer["name"] for offer in every] == ["raw", "jpeg", "h264"] and every[0]["id"] == 0
    with running_server(fake_settings()) as server:
        assert server.get("/v1/codecs").json() == {"codecs": every, "default": "jpeg"}
        monkeypatch.setattr(video, "h264_available", lambda: False)  # as on a machine without PyAV
        assert [offer["name"] for offer in server.get("/v1/codecs").json()["codecs"]] == ["raw", "jpeg"]


def test_each_codec_gets_its_own_encoder_class() -> None:
    frames = moving_gradient(2, 16, 16)
    for name in codecs.CODECS:
        encoder = codecs.new_encoder(name, 80)
        messages = encoder.encode(frames, chunk_index=0, tick_id=0)
        encoder.close()
        assert [wire.FrameHeader.unpack(m).codec for m in messages] == [wire.Codec.from_name(name)] * 2


@pytest.fixture
def pyav_missing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``import av`` fails, as on a machine without the video extra."""
    monkeypatch.setitem(sys.modules, "av", None)
    video.h264_available.cache_clear()
    yield
    video.h264_available.cache_clear()


@pytest.mark.usefixtures("pyav_missing")
def test_a_codec_whose_dependency_is_missing_is_refused_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--codec", "h264", "--port", "0"]) == 2  # before a port is bound or a model loaded
    assert capsys.readouterr().err == (
        "arstream serve: --codec (ARSTREAM_CODEC): the h264 codec needs PyAV with libx264 "
        "(pip install 'arstream[video]'), got 'h264'\n"
    )
    assert settings.settings_from_argv(["--codec", "jpeg"]).codec == "jpeg"


@pytest.mark.usefixtures("pyav_missing")
def test_a_start_naming_a_codec_whose_dependency_is_missing_gets_the_usable_ones() -> None:
    with pytest.raises(ProtocolError, match=r"cannot encode h264 \(.*PyAV.*\); use one of \['raw', 'jpeg'\]"):
        protocol.parse_client_message('{"type": "start", "codec": "h264"}')


def test_the_encoders_do_not_import_the_encoder_pool_or_the_table() -> None:
    """One way only: encoding -> codecs -> (video, fmp4) -> wire; no module imports back up."""
    app = Path(codecs.__file__).parent
    for module, forbidden in (("video", {"encoding", "codecs", "fmp4"}), ("fmp4", {"encoding", "codecs"})):
        imported = {
            name.rsplit(".", 1)[-1]
            for node in ast.walk(ast.parse((app / f"{module}.py").read_text()))
            for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            + [alias.name for alias in getattr(node, "names", []) if isinstance(node, ast.ImportFrom)]
        }
        assert not imported & forbidden, (module, imported & forbidden)
