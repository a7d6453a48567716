"""``arstream bench model``: frames per second of a registered model through the runner on this machine.

Runs one stream for several repetitions after the runner's warm-up. With
``--streams N`` it also serves N sessions together, chunk boundary by chunk
boundary as the server's worker does, twice per repetition and in alternating
order: round robin (``max_batch_sessions=1``, one forward per session) and
batched (``max_batch_sessions=N``, the sessions' chunks in one forward).
Alternating makes machine noise hit both alike; the median of the
per-repetition ratios is the batching speed-up. Prints a table and, as the
last line, one JSON object whose ``"fps"`` is the median one-stream rate and
``"batched_vs_round_robin_ratio"`` the speed-up, every denoising and
committing pass included.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..measure import compare, percentile, print_summary
from ..models.registry import DEFAULT_MODEL, load_pipeline
from ..runner.contract import ARPipeline
from ..runner.runner import ARRunner, runner_for_sessions
from ..runner.threads import default_torch_threads
from ..runner.types import ChunkResult, TickRequest

# Held keys per 8-chunk stretch, shifted per stream; keys a model does not take are left out.
KEY_CYCLE: tuple[list[str], ...] = (["d"], ["d"], ["s"], ["w", "a"], [])


def control_keys(model_card: dict[str, Any]) -> list[str]:
    """Key names the model's controls schema allows (empty when it has no ``keys`` enum)."""
    keys = model_card.get("controls", {}).get("properties", {}).get("keys", {})
    return [str(k) for k in keys.get("items", {}).get("enum", [])]


@dataclass
class StreamRun:
    """One measurement: wall seconds, video frames delivered, each chunk's compute time and model-reported split."""

    wall_s: float
    frames: int
    chunk_s: list[float]
    # per chunk, seconds the pipeline reports for its DiT passes and its VAE decode (pipelines with ``timings``)
    split_s: list[tuple[float, float]]


def forward_split_s(pipeline: ARPipeline) -> tuple[float, float] | None:
    """Seconds of the pipeline's last forward in DiT passes and in VAE decode, for pipelines that keep ``timings``."""
    timings = getattr(pipeline, "timings", None)
    return None if timings is None else (timings.dit_s, timings.vae_s)


def run_streams(
    runner: ARRunner, streams: int, chunks: int, rep: int, name: str, keys: Sequence[str]
) -> StreamRun:
    """``chunks`` chunks per stream, one runner call per chunk boundary.

    Frames are counted as delivered (``ChunkResult.frames``): a video model's
    chunk holds more frames than the KV spec's latent frames, and its first
    chunk may hold fewer than the rest.
    """
    ids = [f"bench-{name}-{rep}-{i}" for i in range(streams)]
    cycle = [[k for k in held if k in keys] for held in KEY_CYCLE]
    times: list[float] = []
    split: list[tuple[float, float]] = []
    frames = 0
    started = time.perf_counter()
    for c in range(chunks):
        ticks = [
            TickRequest(
                session_id=sid,
                request_id=c,
                controls={"keys": cycle[(c // 8 + i) % len(cycle)]} if keys else {},
                seed=rep * 100 + i,
                close=c == chunks - 1,
            )
            for i, sid in enumerate(ids)
        ]
        for result in runner.execute(ticks):
            if not isinstance(result, ChunkResult):
                raise RuntimeError(f"bench chunk failed: {result.error!r}")
            times.append(result.compute_s)
            frames += result.frames.shape[0]
        forward = forward_split_s(runner.pipeline)
        if forward is not None and streams == 1:
            split.append(forward)
    if runner.pool.num_free != runner.blocks_free_at_start:
        raise RuntimeError("bench sessions leaked KV blocks")
    return StreamRun(time.perf_counter() - started, frames, times, split)


def denoise_passes(pipeline: ARPipeline) -> int | None:
    """Denoising passes per chunk when the pipeline's config says (tiny-world's does), else None."""
    times = getattr(getattr(pipeline, "cfg", None), "denoise_times", None)
    return None if times is None else len(times)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"registered model name (default {DEFAULT_MODEL})")
    parser.add_argument(
        "--model-options", type=json.loads, default={}, help="JSON object of keyword arguments for the model's loader"
    )
    parser.add_argument(
        "--weights", default=None, help="tiny-world: safetensors file (default: the shipped weights)"
    )
    parser.add_argument("--chunks", type=int, default=48, help="chunks per stream per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--streams", type=int, default=4, help="also compare this many streams batched vs round robin (0 or 1: skip)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the cores free now, less one; at least 1: two threads on a busy 2-core "
        "machine ran ten times slower than one)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (cuda: the KV budget is sized for the streams)")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or default_torch_threads())
    options = dict(args.model_options)
    if args.weights is not None:
        options["weights_path"] = args.weights
    pipeline = load_pipeline(args.model, args.device, **options)
    if not isinstance(pipeline, ARPipeline):  # this bench drives ARStream's own runner
        raise SystemExit(f"arstream bench model: {args.model} runs only on the vllm-omni runtime")
    streams = max(args.streams, 1)
    runners = {"round_robin": runner_for_sessions(pipeline, streams, device=args.device)}
    if streams > 1:
        runners["batched"] = runner_for_sessions(pipeline, streams, max_batch_sessions=streams, device=args.device)
    for runner in runners.values():
        runner.warmup()
    card = runners["round_robin"].model_card()
    keys = control_keys(card)
    fpc = runners["round_robin"].spec.frames_per_chunk
    passes = denoise_passes(pipeline)
    print(
        f"{card['name']} {card['width']}x{card['height']}, {fpc} frames/chunk, "
        f"{'' if passes is None else f'{passes} denoise passes + 1 commit per chunk, '}"
        f"torch threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}"
    )
    spec = runners["round_robin"].spec
    kv_bytes = spec.resident_frames * len(spec.kv_branches) * spec.block_bytes + spec.cross_attention_bytes_per_session
    print(
        f"per session: KV {kv_bytes / 2**20:.2f} MiB, model-owned {spec.model_owned_bytes_per_session / 2**20:.2f} MiB; "
        f"video frames per chunk {runners['round_robin'].video_frames(1)} "
        f"(first chunk {runners['round_robin'].video_frames(0)}), {fpc} latent frames"
    )
    fps: dict[str, list[float]] = {}
    chunk_ms: dict[str, list[float]] = {}
    split_ms: list[tuple[float, float, float]] = []
    print(
        f"{'streams':>7} {'mode':>11} {'rep':>3} {'frames':>6} {'wall s':>7} {'fps total':>9} "
        f"{'fps/stream':>10} {'chunk ms p50':>12}"
    )

    def measure(label: str, runner: ARRunner, n: int, rep: int) -> float:
        measured = run_streams(runner, n, args.chunks, rep, label, keys)
        wall, times, frames = measured.wall_s, measured.chunk_s, measured.frames
        split_ms.extend((d * 1000, v * 1000, (t - d - v) * 1000) for t, (d, v) in zip(times, measured.split_s))
        rate = frames / wall
        fps.setdefault(label, []).append(rate)
        chunk_ms.setdefault(label, []).extend(t * 1000 for t in times)
        p50 = statistics.median(times) * 1000
        print(f"{n:>7} {label:>11} {rep:>3} {frames:>6} {wall:>7.2f} {rate:>9.1f} {rate / n:>10.1f} {p50:>12.1f}")
        return rate

    for rep in range(args.repeats):
        measure("one", runners["round_robin"], 1, rep)
    one = chunk_ms["one"]
    summary: dict[str, object] = {
        "model": args.model,
        "fps": round(statistics.median(fps["one"]), 2),
        "fps_min": round(min(fps["one"]), 2),
        "chunk_ms_p50": round(percentile(one, 50), 2),
        "chunk_ms_p95": round(percentile(one, 95), 2),
        "frames_per_chunk": fpc,
        "denoise_passes": passes,
        "repeats": args.repeats,
        "chunks_per_repeat": args.chunks,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "kv_bytes_per_session": kv_bytes,
        "model_owned_bytes_per_session": spec.model_owned_bytes_per_session,
    }
    if split_ms:
        dit, vae, rest = (round(statistics.median(part), 2) for part in zip(*split_ms))
        summary.update(dit_ms_p50=dit, vae_ms_p50=vae, rest_ms_p50=rest)
        print(f"one stream, per chunk (median): DiT passes {dit} ms, VAE decode {vae} ms, rest {rest} ms")
    if streams > 1:
        # The ratio is batched over round robin; round robin runs first on even repetitions.
        batching = compare(
            ("batched", "round_robin"),
            args.repeats,
            lambda rep, order: {label: measure(label, runners[label], streams, rep) for label in reversed(order)},
        )
        summary["streams"] = streams
        # round robin, as this key always meant
        summary["fps_total_streams"] = round(batching.median("round_robin"), 2)
        summary["fps_total_batched"] = round(batching.median("batched"), 2)
        summary["batched_chunk_ms_p50"] = round(percentile(chunk_ms["batched"], 50), 2)
        summary["batched_vs_round_robin_ratio"] = round(batching.median_ratio, 3)
        print(
            f"{streams} streams: round robin {summary['fps_total_streams']} fps, "
            f"batched {summary['fps_total_batched']} fps in total; "
            f"median ratio {summary['batched_vs_round_robin_ratio']}"
        )
    print_summary(summary)
    return 0
