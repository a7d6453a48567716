#!/usr/bin/env python3
"""Bytes and encode time per frame of the realtime video dialect's fMP4 beside protocol 1's H.264 and JPEG.

    .venv/bin/python scripts/bench-video-codecs.py --repeats 5

Encodes the same moving 640x352 test picture (a drifting gradient under a
moving sinusoidal texture: not a model's output, but neither flat nor static)
chunk by chunk with each codec's chunk encoder, the very classes the encoder
lanes use: ``fmp4/16`` (:mod:`arstream.app.fmp4`, one fragment per chunk, the
init segment on the first), ``h264`` (protocol 1's ARF1 frames) and ``jpeg``
(q80). Each repetition starts a fresh stream per codec (a keyframe, as every
session does) and runs the codecs in a rotating order; ratios are taken within
a repetition and their medians printed, then one JSON line with the figures.
Encode time is wall time on this thread, colour conversion included.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from arstream.app.codecs import new_encoder
from arstream.app.fmp4 import NAL_AUD, NAL_PPS, NAL_SPS, fmp4_codec, fragment, nal_units
from arstream.app.video import H264Stream
from arstream.measure import print_summary

CODECS = ("fmp4", "h264", "jpeg")


def test_picture(index: int, height: int, width: int) -> np.ndarray:
    """Frame ``index`` of a moving test picture, uint8 ``[H, W, 3]``."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    texture = 40.0 * np.sin((x + 3.0 * index) / 9.0) * np.cos((y - 2.0 * index) / 13.0)
    red = (x / width * 200.0 + index * 2.0) % 256.0
    green = y / height * 180.0 + texture
    blue = 120.0 + texture * 0.5 + 60.0 * np.sin((x - y + 5.0 * index) / 40.0)
    return np.clip(np.stack([red, green, blue], axis=-1), 0, 255).astype(np.uint8)


def measure(codec: str, chunks: list[np.ndarray], quality: int, fps: int) -> tuple[float, float]:
    """(bytes per frame, encode ms per frame) of one fresh stream over ``chunks``."""
    encoder = new_encoder(fmp4_codec(fps) if codec == "fmp4" else codec, quality)
    total_bytes, total_s, frames = 0, 0.0, 0
    try:
        for index, chunk in enumerate(chunks):
            started = time.perf_counter()
            messages = encoder.encode(chunk, chunk_index=index, tick_id=index)
            total_s += time.perf_counter() - started
            total_bytes += sum(len(m) for m in messages)
            frames += len(chunk)
    finally:
        encoder.close()
    return total_bytes / frames, total_s * 1e3 / frames


def key_of(ratio_name: str) -> str:
    """``fmp4/h264 bytes`` -> ``fmp4_over_h264_bytes`` (a JSON key)."""
    return ratio_name.replace("/", "_over_").replace(" ", "_")


def boxing_ms_per_frame(chunks: list[np.ndarray], quality: int, rounds: int = 20) -> float:
    """What fMP4 adds to H.264 alone: Annex B to length-prefixed NAL units and a moof + mdat per chunk.

    The access units are encoded once, untimed; only the boxing is timed (it is small beside the encoder's
    noise, so the side-by-side encode times above cannot show it).
    """
    _, height, width, _ = chunks[0].shape
    stream = H264Stream(width, height, quality=quality)
    encoded = [[stream.encode(frame) for frame in chunk] for chunk in chunks]
    stream.close()
    started = time.perf_counter()
    for _ in range(rounds):
        for sequence, chunk in enumerate(encoded):
            samples = []
            for access_unit, keyframe in chunk:
                kept = [u for u in nal_units(access_unit) if u[0] & 0x1F not in (NAL_SPS, NAL_PPS, NAL_AUD)]
                samples.append((b"".join(len(u).to_bytes(4, "big") + u for u in kept), keyframe))
            fragment(sequence + 1, sequence * 4 * 5625, 5625, samples)
    frames = rounds * sum(len(chunk) for chunk in chunks)
    return (time.perf_counter() - started) * 1e3 / frames


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
    ratios: dict[str, list[float]] = {f"fmp4/{other} {unit}": [] for other in CODECS[1:] for unit in ("bytes", "ms")}
    print(f"{args.width}x{args.height}, {args.chunks} chunks of {args.frames_per_chunk} frames, quality {args.quality}")
    for codec in CODECS:  # untimed: the first libx264 stream of a process pays for loading and initialising
        measure(codec, chunks[:1], args.quality, args.fps)
    for repetition in range(args.repeats):
        order = CODECS[repetition % 3 :] + CODECS[: repetition % 3]
        this = {codec: measure(codec, chunks, args.quality, args.fps) for codec in order}
        for codec, (per_frame_bytes, per_frame_ms) in this.items():
            figures[codec]["bytes"].append(per_frame_bytes)
            figures[codec]["ms"].append(per_frame_ms)
        for other in ("h264", "jpeg"):
            ratios[f"fmp4/{other} bytes"].append(this["fmp4"][0] / this[other][0])
            ratios[f"fmp4/{other} ms"].append(this["fmp4"][1] / this[other][1])
        print(f"repetition {repetition}: " + ", ".join(f"{c} {b:.0f} B {m:.2f} ms" for c, (b, m) in this.items()))
    print(f"{'codec':6} {'bytes/frame':>12} {'encode ms/frame':>16}   (medians of {args.repeats})")
    for codec in CODECS:
        per_frame_bytes, per_frame_ms = (statistics.median(figures[codec][unit]) for unit in ("bytes", "ms"))
        print(f"{codec:6} {per_frame_bytes:12.0f} {per_frame_ms:16.2f}")
    for name, values in ratios.items():
        print(f"{name}: {statistics.median(values):.3f} (median of per-repetition ratios)")
    boxing_ms = boxing_ms_per_frame(chunks, args.quality)
    print(f"fMP4 boxing alone: {boxing_ms:.4f} ms per frame")
    print_summary(
        {
            "fmp4_boxing_ms_per_frame": round(boxing_ms, 4),
            "size": f"{args.width}x{args.height}",
            "frames_per_chunk": args.frames_per_chunk,
            **{f"{c}_bytes_per_frame": round(statistics.median(figures[c]["bytes"]), 1) for c in CODECS},
            **{f"{c}_encode_ms_per_frame": round(statistics.median(figures[c]["ms"]), 3) for c in CODECS},
            **{key_of(name): round(statistics.median(values), 3) for name, values in ratios.items()},
        }
    )


if __name__ == "__main__":
    main()
