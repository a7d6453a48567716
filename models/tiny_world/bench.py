"""``arstream bench model``: frames per second of tiny-world through the runner on this machine.

Runs one stream (and, with ``--streams N``, N sessions served round robin as
the server does) for several repetitions after the runner's warm-up, and
prints a table plus, as the last line, one JSON object whose ``"fps"`` is the
median one-stream rate, every denoising and committing pass included.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from models.tiny_world.evaluate import make_runner
from models.tiny_world.pipeline import load_tiny_world
from runner.runner import ARRunner
from runner.types import TickRequest

KEY_CYCLE = (["d"], ["d"], ["s"], ["w", "a"], [])


def run_streams(runner: ARRunner, streams: int, chunks: int, rep: int) -> tuple[float, list[float]]:
    """Wall seconds for ``chunks`` chunks per stream, round robin, and each tick's compute time."""
    ids = [f"bench-{rep}-{i}" for i in range(streams)]
    times = []
    started = time.perf_counter()
    for c in range(chunks):
        for i, sid in enumerate(ids):
            tick = TickRequest(
                session_id=sid,
                request_id=c,
                controls={"keys": KEY_CYCLE[(c // 8) % len(KEY_CYCLE)]},
                seed=rep * 100 + i,
                close=c == chunks - 1,
            )
            times.append(runner.execute_tick(tick).compute_s)
    return time.perf_counter() - started, times


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arstream bench model", description=__doc__.split("\n")[0])
    p.add_argument("--weights", default=None, help="safetensors file (default: the shipped weights)")
    p.add_argument("--chunks", type=int, default=48, help="chunks per stream per repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", type=int, default=4, help="also measure this many streams together (0: skip)")
    p.add_argument("--threads", type=int, default=2)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    pipeline = load_tiny_world(torch.device("cpu"), args.weights)
    runner = make_runner(pipeline, sessions=max(args.streams, 1))
    runner.warmup()
    fpc = runner.spec.frames_per_chunk
    card = pipeline.model_card()
    cfg = pipeline.cfg
    print(
        f"tiny-world {card['width']}x{card['height']}, {fpc} frames/chunk, {len(cfg.denoise_times)} denoise "
        f"passes + 1 commit per chunk, {cfg.num_layers} layers d={cfg.d_model}, torch threads {torch.get_num_threads()}, "
        f"{platform.processor() or platform.machine()}"
    )
    configs = [1] + ([args.streams] if args.streams > 1 else [])
    results: dict[int, list[float]] = {}
    chunk_ms: dict[int, list[float]] = {}
    print(f"{'streams':>7} {'rep':>3} {'frames':>6} {'wall s':>7} {'fps total':>9} {'fps/stream':>10} {'chunk ms p50':>12}")
    for streams in configs:
        results[streams] = []
        chunk_ms[streams] = []
        for rep in range(args.repeats):
            wall, times = run_streams(runner, streams, args.chunks, rep)
            frames = streams * args.chunks * fpc
            fps = frames / wall
            p50 = statistics.median(times) * 1000
            results[streams].append(fps)
            chunk_ms[streams].extend(t * 1000 for t in times)
            print(f"{streams:>7} {rep:>3} {frames:>6} {wall:>7.2f} {fps:>9.1f} {fps / streams:>10.1f} {p50:>12.1f}")
    summary = {
        "model": "tiny-world",
        "fps": round(statistics.median(results[1]), 2),
        "fps_min": round(min(results[1]), 2),
        "chunk_ms_p50": round(statistics.median(chunk_ms[1]), 2),
        "chunk_ms_p95": round(sorted(chunk_ms[1])[int(0.95 * (len(chunk_ms[1]) - 1))], 2),
        "frames_per_chunk": fpc,
        "denoise_passes": len(cfg.denoise_times),
        "repeats": args.repeats,
        "chunks_per_repeat": args.chunks,
        "threads": torch.get_num_threads(),
    }
    if args.streams > 1:
        summary["streams"] = args.streams
        summary["fps_total_streams"] = round(statistics.median(results[args.streams]), 2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
