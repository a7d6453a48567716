#!/usr/bin/env python3
"""Encode time and bytes per frame of the WebRTC track (aiortc's encoders) beside the WebSocket's JPEG and H.264.

    .venv/bin/python scripts/bench-webrtc-encode.py --repeats 5

The same moving 640x352 test picture as scripts/bench-video-codecs.py, chunk by chunk: ``jpeg`` (q80) and
``h264`` are the server's own chunk encoders (what a WebSocket session's encoder lane runs); ``rtc-h264``
and ``rtc-vp8`` are what a session on the WebRTC track costs the server per frame instead: the pixels made
into an ``av.VideoFrame`` (app/webrtc.py's ``ChunkTrack.push``) and aiortc's encoder at its starting
bitrate (H.264 1 Mbit/s, VP8 0.5 Mbit/s; REMB moves it later), its RTP payloads counted as bytes. Each
repetition starts fresh encoders in a rotating order; ratios are taken within a repetition and their medians
printed, then one JSON line. Times are wall time on this thread.
"""

from __future__ import annotations

import argparse
import fractions
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import av
import numpy as np
from aiortc.codecs import get_encoder
from aiortc.rtcrtpparameters import RTCRtpCodecParameters

from arstream.app.codecs import new_encoder
from arstream.app.webrtc_track import VIDEO_CLOCK_HZ, frame_step
from arstream.measure import print_summary

_codecs_bench = importlib.util.spec_from_file_location(
    "bench_video_codecs", Path(__file__).with_name("bench-video-codecs.py")
)
assert _codecs_bench is not None and _codecs_bench.loader is not None
bench_video_codecs = importlib.util.module_from_spec(_codecs_bench)
_codecs_bench.loader.exec_module(bench_video_codecs)
test_picture = bench_video_codecs.test_picture

CODECS = ("jpeg", "h264", "rtc-h264", "rtc-vp8")
RTC_MIME = {"rtc-h264": "video/H264", "rtc-vp8": "video/VP8"}


def rtc_encoder(codec: str) -> Any:
    parameters: dict[str, Any] = (
        {"packetization-mode": "1", "profile-level-id": "42e01f"} if codec == "rtc-h264" else {}
    )
    return get_encoder(RTCRtpCodecParameters(mimeType=RTC_MIME[codec], clockRate=VIDEO_CLOCK_HZ, parameters=parameters))


def measure(codec: str, chunks: list[np.ndarray], quality: int, fps: int) -> tuple[float, float]:
    """(bytes per frame, encode ms per frame) of one fresh stream over ``chunks``."""
    total_bytes, total_s, frames = 0, 0.0, 0
    if codec in RTC_MIME:
        encoder, step = rtc_encoder(codec), frame_step(fps)
        for chunk in chunks:
            for rgb in chunk:
                started = time.perf_counter()
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts, frame.time_base = frames * step, fractions.Fraction(1, VIDEO_CLOCK_HZ)
                payloads, _ = encoder.encode(frame)
                total_s += time.perf_counter() - started
                total_bytes += sum(len(p) for p in payloads)
                frames += 1
        return total_bytes / frames, total_s * 1e3 / frames
    server_encoder = new_encoder(codec, quality)
    try:
        for index, chunk in enumerate(chunks):
            started = time.perf_counter()
            messages = server_encoder.encode(chunk, chunk_index=index, tick_id=index)
            total_s += time.perf_counter() - started
            total_bytes += sum(len(m) for m in messages)
            frames += len(chunk)
    finally:
        server_encoder.close()
    return total_bytes / frames, total_s * 1e3 / frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=352)
    parser.add_argument("--frames-per-chunk", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quality", type=int, default=80)
    parser.add_argument("--fps", type=int, default=16)
    args = parser.parse_args()

    frames = [test_picture(i, args.height, args.width) for i in range(args.chunks * args.frames_per_chunk)]
    chunks = [np.stack(frames[i : i + args.frames_per_chunk]) for i in range(0, len(frames), args.frames_per_chunk)]
    figures: dict[str, dict[str, list[float]]] = {c: {"bytes": [], "ms": []} for c in CODECS}
    pairs = [("rtc-h264", "h264"), ("rtc-h264", "jpeg"), ("rtc-vp8", "jpeg")]
    ratios: dict[str, list[float]] = {f"{a}/{b} {unit}": [] for a, b in pairs for unit in ("bytes", "ms")}
    print(f"{args.width}x{args.height}, {args.chunks} chunks of {args.frames_per_chunk} frames, quality {args.quality}")
    for codec in CODECS:  # untimed: the first stream of each encoder pays for loading and initialising
        measure(codec, chunks[:1], args.quality, args.fps)
    for repetition in range(args.repeats):
        shift = repetition % len(CODECS)
        order = CODECS[shift:] + CODECS[:shift]
        this = {codec: measure(codec, chunks, args.quality, args.fps) for codec in order}
        for codec, (per_frame_bytes, per_frame_ms) in this.items():
            figures[codec]["bytes"].append(per_frame_bytes)
            figures[codec]["ms"].append(per_frame_ms)
        for a, b in pairs:
            ratios[f"{a}/{b} bytes"].append(this[a][0] / this[b][0])
            ratios[f"{a}/{b} ms"].append(this[a][1] / this[b][1])
        print(f"repetition {repetition}: " + ", ".join(f"{c} {b:.0f} B {m:.2f} ms" for c, (b, m) in this.items()))
    print(f"{'codec':9} {'bytes/frame':>12} {'encode ms/frame':>16}   (medians of {args.repeats})")
    for codec in CODECS:
        per_frame_bytes, per_frame_ms = (statistics.median(figures[codec][unit]) for unit in ("bytes", "ms"))
        print(f"{codec:9} {per_frame_bytes:12.0f} {per_frame_ms:16.2f}")
    for name, values in ratios.items():
        print(f"{name}: {statistics.median(values):.3f} (median of per-repetition ratios)")
    print_summary(
        {
            "size": f"{args.width}x{args.height}",
            **{
                f"{c.replace('-', '_')}_bytes_per_frame": round(statistics.median(figures[c]["bytes"]), 1)
                for c in CODECS
            },
            **{
                f"{c.replace('-', '_')}_encode_ms_per_frame": round(statistics.median(figures[c]["ms"]), 3)
                for c in CODECS
            },
            **{
                name.replace("/", "_over_").replace(" ", "_").replace("-", "_"): round(statistics.median(values), 3)
                for name, values in ratios.items()
            },
        }
    )


if __name__ == "__main__":
    main()
