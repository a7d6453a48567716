"""``arstream bench runner``: the runner's bookkeeping cost, measured side by side.

The same ToyAttentionModel generates the same chunks twice, chunk by chunk
in alternating order:
once through :class:`ARRunner` (paged pool, session lookup, fail-closed
binding, timing) and once in a direct loop over :class:`DenseKVCache`
(contiguous buffer, zero-copy slices), both ending in the same uint8 frames. Interleaving makes machine noise hit
both sides alike; the median of the per-repetition ratios is the overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from arstream.models.toy_attention import DenseKVCache, ToyAttentionPipeline, chunk_noise, run_chunk
from arstream.runner.runner import ARRunner
from arstream.runner.threads import default_torch_threads
from arstream.runner.types import TickRequest


def _interleaved_chunk_s(pipeline: ToyAttentionPipeline, chunks: int, session: str) -> tuple[float, float]:
    """Seconds per chunk (runner, direct), alternating chunk by chunk so load hits both alike."""
    runner = ARRunner(pipeline, kv_budget_bytes=64 << 20)
    runner.warmup()
    cache = DenseKVCache(pipeline.spec)
    generator = torch.Generator().manual_seed(1)
    runner_total = direct_total = 0.0
    for i in range(chunks):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            started = time.perf_counter()
            if side == 0:
                runner.execute_tick(TickRequest(session_id=session, request_id=i, seed=1))
                runner_total += time.perf_counter() - started
            else:
                noise = chunk_noise(pipeline.spec, pipeline.model.dim, generator)
                pipeline.latent_to_frames(run_chunk(pipeline.model, cache, noise, pipeline.steps))
                direct_total += time.perf_counter() - started
    runner.close_session(session)
    if runner.pool.num_free != runner.blocks_free_at_start:
        raise RuntimeError("bench session leaked KV blocks")
    return runner_total / chunks, direct_total / chunks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="arstream bench runner", description=__doc__)
    parser.add_argument("--chunks", type=int, default=60, help="chunks per measurement (several windows long)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="denoise passes per chunk (plus one commit)")
    parser.add_argument(
        "--threads", type=int, default=default_torch_threads(), help="torch threads (default: CPU cores - 1, at least 1)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    pipeline = ToyAttentionPipeline(steps=args.steps)
    _interleaved_chunk_s(pipeline, 4, "bench-warm")  # first-call allocations out of the way
    runner_s: list[float] = []
    direct_s: list[float] = []
    ratios: list[float] = []
    print(f"{'rep':>4} {'runner ms/chunk':>16} {'direct ms/chunk':>16} {'ratio':>7}")
    for rep in range(args.repeats):
        r, d = _interleaved_chunk_s(pipeline, args.chunks, f"bench-{rep}")
        runner_s.append(r)
        direct_s.append(d)
        ratios.append(r / d)
        print(f"{rep:>4} {r * 1e3:>16.3f} {d * 1e3:>16.3f} {r / d:>7.3f}")
    runner_med = statistics.median(runner_s)
    direct_med = statistics.median(direct_s)
    ratio = statistics.median(ratios)
    result = {
        "bench": "runner",
        "chunks": args.chunks,
        "repeats": args.repeats,
        "steps": args.steps,
        "threads": args.threads,
        "runner_ms_per_chunk": round(runner_med * 1e3, 4),
        "direct_ms_per_chunk": round(direct_med * 1e3, 4),
        "overhead_ms_per_chunk": round((runner_med - direct_med) * 1e3, 4),
        "runner_overhead_ratio": round(ratio, 4),
    }
    print(f"median: runner {runner_med * 1e3:.3f} ms, direct {direct_med * 1e3:.3f} ms, median ratio {ratio:.3f}")
    print(json.dumps(result))
    return 0
