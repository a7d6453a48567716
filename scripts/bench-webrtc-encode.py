#!/usr/bin/env python3
"""Encode time and bytes per frame of the WebRTC track (aiortc's encoders) beside the WebSocket's JPEG and H.264.

    .venv/bin/python scripts/bench-webrtc-encode.py --repeats 5

The same moving 640x352 test picture as scripts/bench-video-codecs.py, chunk by chunk: ``jpeg`` (q80) and
``h264`` are the server's own chunk encoders (what a WebSocket session's encoder lane runs); ``rtc-h264``
and ``rtc-vp8`` are what a session on the WebRTC track costs the server per frame instead: the pixels made
into an ``av.VideoFrame`` (app/webrtc.py's ``ChunkTrack.push``) and aiortc's encoder at its starting
bitrate (H.264 1 Mbit/s, VP8 0.5 Mbit/s; REMB moves it later), its RTP payloads counted as bytes.
``rtc-pass`` is the other way to feed the track, encoded once by the server: the server's own H.264 chunk
encoder, then each access unit handed to aiortc as an ``av.Packet`` (its sender packetizes a packet without
encoding it again: ``H264Encoder.pack``). Each repetition starts fresh encoders in a rotating order; ratios are
taken within a repetition and their medians printed, then one JSON line. Times are wall time on this thread
and the process's CPU time (every thread: x264's included), per frame.
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
from arstream.app.wire import parse_frame
from arstream.measure import print_summary

_codecs_bench = importlib.util.spec_from_file_location(
    "bench_video_codecs", Path(__file__).with_name("bench-video-codecs.py")
)
assert _codecs_bench is not None and _codecs_bench.loader is not None
bench_video_codecs = importlib.util.module_from_spec(_codecs_bench)
_codecs_bench.loader.exec_module(bench_video_codecs)
test_picture = bench_video_codecs.test_picture

CODECS = ("jpeg", "h264", "rtc-h264", "rtc-vp8", "rtc-pass")
RTC_MIME = {"rtc-h264": "video/H264", "rtc-vp8": "video/VP8"}


def rtc_encoder(codec: str) -> Any:
    parameters: dict[str, Any] = (
        {"packetization-mode": "1", "profile-level-id": "42e01f"} if codec == "rtc-h264" else {}
    )
    return get_encoder(RTCRtpCodecParameters(mimeType=RTC_MIME[codec], clockRate=VIDEO_CLOCK_HZ, parameters=parameters))


def measure(codec: str, chunks: list[np.ndarray], quality: int, fps: int) -> tuple[float, float, float]:
    """(bytes per frame, wall ms per frame, CPU ms per frame) of one fresh stream over ``chunks``."""
    total_bytes, frames = 0, 0
    started, cpu_started = time.perf_counter(), time.process_time()
    step = frame_step(fps)
    if codec in RTC_MIME:
        encoder = rtc_encoder(codec)
        for chunk in chunks:
            for rgb in chunk:
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts, frame.time_base = frames * step, fractions.Fraction(1, VIDEO_CLOCK_HZ)
                payloads, _ = encoder.encode(frame)
                total_bytes += sum(len(p) for p in payloads)
                frames += 1
    else:
        server_encoder = new_encoder("h264" if codec == "rtc-pass" else codec, quality)
        packer = rtc_encoder("rtc-h264") if codec == "rtc-pass" else None
        try:
            for index, chunk in enumerate(chunks):
                messages = server_encoder.encode(chunk, chunk_index=index, tick_id=index)
                if packer is None:
                    total_bytes += sum(len(m) for m in messages)
                    frames += len(chunk)
                    continue
                for message in messages:  # one access unit a frame, Annex B: what aiortc's sender packetizes
                    _, payload = parse_frame(message)
                    packet = av.Packet(bytes(payload))
                    packet.pts, packet.time_base = frames * step, fractions.Fraction(1, VIDEO_CLOCK_HZ)
                    payloads, _ = packer.pack(packet)
                    total_bytes += sum(len(p) for p in payloads)
                    frames += 1
        finally:
            server_encoder.close()
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    return total_bytes / frames, wall_s * 1e3 / frames, cpu_s * 1e3 / frames


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
    units = ("bytes", "ms", "cpu_ms")
    figures: dict[str, dict[str, list[float]]] = {c: {unit: [] for unit in units} for c in CODECS}
    pairs = [("rtc-h264", "h264"), ("rtc-h264", "jpeg"), ("rtc-vp8", "jpeg"), ("rtc-pass", "rtc-h264")]
    ratios: dict[str, list[float]] = {f"{a}/{b} {unit}": [] for a, b in pairs for unit in units}
    print(f"{args.width}x{args.height}, {args.chunks} chunks of {args.frames_per_chunk} frames, quality {args.quality}")
    for codec in CODECS:  # untimed: the first stream of each encoder pays for loading and initialising
        measure(codec, chunks[:1], args.quality, args.fps)
    for repetition in range(args.repeats):
        shift = repetition % len(CODECS)
        order = CODECS[shift:] + CODECS[:shift]
        this = {codec: measure(codec, chunks, args.quality, args.fps) for codec in order}
        for codec, measured in this.items():
            for unit, value in zip(units, measured):
                figures[codec][unit].append(value)
        for a, b in pairs:
            for position, unit in enumerate(units):
                ratios[f"{a}/{b} {unit}"].append(this[a][position] / this[b][position])
        print(
            f"repetition {repetition}: "
            + ", ".join(f"{c} {b:.0f} B {m:.2f} ms {cpu:.2f} cpu-ms" for c, (b, m, cpu) in this.items())
        )
    print(f"{'codec':9} {'bytes/frame':>12} {'wall ms/frame':>14} {'CPU ms/frame':>13}   (medians of {args.repeats})")
    for codec in CODECS:
        per_frame_bytes, per_frame_ms, per_frame_cpu = (statistics.median(figures[codec][unit]) for unit in units)
        print(f"{codec:9} {per_frame_bytes:12.0f} {per_frame_ms:14.2f} {per_frame_cpu:13.2f}")
    for name, values in ratios.items():
        print(f"{name}: {statistics.median(values):.3f} (median of per-repetition ratios)")
    print_summary(
        {
            "size": f"{args.width}x{args.height}",
            **{
                f"{c.replace('-', '_')}_{unit}_per_frame": round(statistics.median(figures[c][unit]), 3)
                for c in CODECS
                for unit in units
            },
            **{
                name.replace("/", "_over_").replace(" ", "_").replace("-", "_"): round(statistics.median(values), 3)
                for name, values in ratios.items()
            },
        }
    )

if __name__ == "__main__":
    main()
