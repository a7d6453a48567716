"""``arstream bench runner``: the runner's bookkeeping cost, measured side by side.

The same ToyAttentionModel generates the same chunks twice, chunk by chunk
in alternating order:
once through :class:`ARRunner` (paged pool, session lookup, fail-closed
binding, timing) and once in a direct loop over :class:`DenseKVCache`
(contiguous buffer, zero-copy slices), both ending in the same uint8 frames. Interleaving makes machine noise hit
both sides alike; the median of the per-repetition ratios is the overhead.

It lives with the models because it drives one; the runner never imports a model.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping

import torch

from arstream.measure import compare, print_summary
from arstream.models.toy_attention import DenseKVCache, ToyAttentionPipeline, chunk_noise, run_chunk
from arstream.runner.runner import ARRunner
from arstream.runner.threads import default_torch_threads
from arstream.runner.types import TickRequest

SIDES = ("runner", "direct")


def _interleaved_chunk_s(
    pipeline: ToyAttentionPipeline, chunks: int, session: str, first: str = "runner"
) -> dict[str, float]:
    """Seconds per chunk on each side, alternating chunk by chunk (``first`` first) so load hits both alike."""
    runner = ARRunner(pipeline, kv_budget_bytes=64 << 20)
    runner.warmup()
    cache = DenseKVCache(pipeline.spec)
    generator = torch.Generator().manual_seed(1)
    total = dict.fromkeys(SIDES, 0.0)
    second = SIDES[1] if first == SIDES[0] else SIDES[0]
    for i in range(chunks):
        for side in (first, second) if i % 2 == 0 else (second, first):
            started = time.perf_counter()
            if side == "runner":
                runner.execute_tick(TickRequest(session_id=session, request_id=i, seed=1))
            else:
                noise = chunk_noise(pipeline.spec, pipeline.model.dim, generator)
                pipeline.latent_to_frames(run_chunk(pipeline.model, cache, noise, pipeline.steps))
            total[side] += time.perf_counter() - started
    runner.close_session(session)
    if runner.pool.num_free != runner.blocks_free_at_start:
        raise RuntimeError("bench session leaked KV blocks")
    return {side: seconds / chunks for side, seconds in total.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--chunks", type=int, default=60, help="chunks per measurement (several windows long)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="denoise passes per chunk (plus one commit)")
    parser.add_argument(
        "--threads", type=int, default=default_torch_threads(), help="torch threads (default: CPU cores - 1, at least 1)"
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    pipeline = ToyAttentionPipeline(steps=args.steps)
    _interleaved_chunk_s(pipeline, 4, "bench-warm")  # first-call allocations out of the way
    print(f"{'rep':>4} {'runner ms/chunk':>16} {'direct ms/chunk':>16} {'ratio':>7}")

    def measure(rep: int, order: tuple[str, str]) -> dict[str, float]:
        return _interleaved_chunk_s(pipeline, args.chunks, f"bench-{rep}", first=order[0])

    def report(rep: int, figures: Mapping[str, float], ratio: float) -> None:
        print(f"{rep:>4} {figures['runner'] * 1e3:>16.3f} {figures['direct'] * 1e3:>16.3f} {ratio:>7.3f}")

    result = compare(SIDES, args.repeats, measure, report)
    runner_med, direct_med, ratio = result.median("runner"), result.median("direct"), result.median_ratio
    print(f"median: runner {runner_med * 1e3:.3f} ms, direct {direct_med * 1e3:.3f} ms, median ratio {ratio:.3f}")
    print_summary(
        {
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
    )
    return 0
