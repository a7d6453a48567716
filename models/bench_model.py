"""``arstream bench model``: frames per second of tiny-world through the runner on this machine.

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
import sys
import time

import torch

from arstream.models.tiny_world.evaluate import make_runner
from arstream.models.tiny_world.pipeline import load_tiny_world
from arstream.runner.runner import ARRunner
from arstream.runner.types import ChunkResult, TickRequest

KEY_CYCLE = (["d"], ["d"], ["s"], ["w", "a"], [])


def run_streams(runner: ARRunner, streams: int, chunks: int, rep: int, name: str) -> tuple[float, list[float]]:
    """Wall seconds for ``chunks`` chunks per stream, one runner call per chunk boundary; each chunk's compute time."""
    ids = [f"bench-{name}-{rep}-{i}" for i in range(streams)]
    times = []
    started = time.perf_counter()
    for c in range(chunks):
        ticks = [
            TickRequest(
                session_id=sid,
                request_id=c,
                controls={"keys": KEY_CYCLE[(c // 8 + i) % len(KEY_CYCLE)]},
                seed=rep * 100 + i,
                close=c == chunks - 1,
            )
            for i, sid in enumerate(ids)
        ]
        for result in runner.execute(ticks):
            if not isinstance(result, ChunkResult):
                raise RuntimeError(f"bench chunk failed: {result.error!r}")
            times.append(result.compute_s)
    if runner.pool.num_free != runner.blocks_free_at_start:
        raise RuntimeError("bench sessions leaked KV blocks")
    return time.perf_counter() - started, times


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arstream bench model", description=__doc__.split("\n")[0])
    p.add_argument("--weights", default=None, help="safetensors file (default: the shipped weights)")
    p.add_argument("--chunks", type=int, default=48, help="chunks per stream per repetition")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--streams", type=int, default=4, help="also compare this many streams batched vs round robin (0 or 1: skip)"
    )
    p.add_argument("--threads", type=int, default=2)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    pipeline = load_tiny_world(torch.device("cpu"), args.weights)
    streams = max(args.streams, 1)
    runners = {"round_robin": make_runner(pipeline, sessions=streams)}
    if streams > 1:
        runners["batched"] = make_runner(pipeline, sessions=streams, max_batch_sessions=streams)
    for runner in runners.values():
        runner.warmup()
    fpc = runners["round_robin"].spec.frames_per_chunk
    card = pipeline.model_card()
    cfg = pipeline.cfg
    print(
        f"tiny-world {card['width']}x{card['height']}, {fpc} frames/chunk, {len(cfg.denoise_times)} denoise "
        f"passes + 1 commit per chunk, {cfg.num_layers} layers d={cfg.d_model}, torch threads {torch.get_num_threads()}, "
        f"{platform.processor() or platform.machine()}"
    )
    fps: dict[str, list[float]] = {}
    chunk_ms: dict[str, list[float]] = {}
    print(
        f"{'streams':>7} {'mode':>11} {'rep':>3} {'frames':>6} {'wall s':>7} {'fps total':>9} "
        f"{'fps/stream':>10} {'chunk ms p50':>12}"
    )

    def measure(label: str, runner: ARRunner, n: int, rep: int) -> float:
        wall, times = run_streams(runner, n, args.chunks, rep, label)
        frames = n * args.chunks * fpc
        rate = frames / wall
        fps.setdefault(label, []).append(rate)
        chunk_ms.setdefault(label, []).extend(t * 1000 for t in times)
        p50 = statistics.median(times) * 1000
        print(f"{n:>7} {label:>11} {rep:>3} {frames:>6} {wall:>7.2f} {rate:>9.1f} {rate / n:>10.1f} {p50:>12.1f}")
        return rate

    for rep in range(args.repeats):
        measure("one", runners["round_robin"], 1, rep)
    ratios = []
    if streams > 1:
        for rep in range(args.repeats):
            order = ("round_robin", "batched") if rep % 2 == 0 else ("batched", "round_robin")
            rates = {label: measure(label, runners[label], streams, rep) for label in order}
            ratios.append(rates["batched"] / rates["round_robin"])
    one = chunk_ms["one"]
    summary: dict[str, object] = {
        "model": "tiny-world",
        "fps": round(statistics.median(fps["one"]), 2),
        "fps_min": round(min(fps["one"]), 2),
        "chunk_ms_p50": round(statistics.median(one), 2),
        "chunk_ms_p95": round(sorted(one)[int(0.95 * (len(one) - 1))], 2),
        "frames_per_chunk": fpc,
        "denoise_passes": len(cfg.denoise_times),
        "repeats": args.repeats,
        "chunks_per_repeat": args.chunks,
        "threads": torch.get_num_threads(),
    }
    if streams > 1:
        summary["streams"] = streams
        # round robin, as this key always meant
        summary["fps_total_streams"] = round(statistics.median(fps["round_robin"]), 2)
        summary["fps_total_batched"] = round(statistics.median(fps["batched"]), 2)
        summary["batched_chunk_ms_p50"] = round(statistics.median(chunk_ms["batched"]), 2)
        summary["batched_vs_round_robin_ratio"] = round(statistics.median(ratios), 3)
        print(
            f"{streams} streams: round robin {summary['fps_total_streams']} fps, "
            f"batched {summary['fps_total_batched']} fps in total; median ratio {summary['batched_vs_round_robin_ratio']}"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
