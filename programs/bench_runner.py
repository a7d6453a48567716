"""``arstream bench runner``: the runner's bookkeeping cost, measured side by side.

The same ToyAttentionModel generates the same chunks twice, chunk by chunk
in alternating order:
once through :class:`ARRunner` (paged pool, session lookup, fail-closed
binding, timing) and once in a direct loop over :class:`DenseKVCache`
(contiguous buffer, zero-copy slices), both ending in the same uint8 frames. Interleaving makes machine noise hit
both sides alike; the median of the per-repetition ratios is the overhead.

With ``--runtime vllm-omni`` the two sides are the two runtimes instead: the
same pipeline through :class:`ARRunner` and through vLLM-Omni's runner
(:mod:`arstream.runner.vllm_omni`, needs the vllm-omni extra), same ticks,
alternating chunk by chunk; the ratio is vLLM-Omni's time over ARStream's.

It lives with the models because it drives one; the runner never imports a model.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping

import torch

from ..measure import compare, print_summary
from ..models.toy_attention import DenseKVCache, ToyAttentionPipeline, chunk_noise, run_chunk
from ..runner.runner import ARRunner
from ..runner.runtimes import InspectableRuntime, build_runtime
from ..runner.types import RUNTIMES, UnsupportedConfiguration
from ..runner.threads import default_torch_threads
from ..runner.types import TickRequest

SIDES = ("runner", "direct")
RUNTIME_SIDES = ("vllm-omni", "arstream")
BUDGET_BYTES = 64 << 20


def _interleaved_chunk_s(
    pipeline: ToyAttentionPipeline, chunks: int, session: str, first: str = "runner"
) -> dict[str, float]:
    """Seconds per chunk on each side, alternating chunk by chunk (``first`` first) so load hits both alike.

    Both sides end in host frames (``latent_to_frames`` copies them back), which waits for the device.
    """
    runner = ARRunner(pipeline, device=pipeline.device, kv_budget_bytes=BUDGET_BYTES)
    runner.warmup()
    cache = DenseKVCache(pipeline.spec, pipeline.device)
    generator = torch.Generator().manual_seed(1)
    total = dict.fromkeys(SIDES, 0.0)
    second = SIDES[1] if first == SIDES[0] else SIDES[0]
    for i in range(chunks):
        for side in (first, second) if i % 2 == 0 else (second, first):
            started = time.perf_counter()
            if side == "runner":
                runner.execute_tick(TickRequest(session_id=session, request_id=i, seed=1))
            else:
                noise = chunk_noise(pipeline.spec, pipeline.model.dim, generator).to(pipeline.device)
                pipeline.latent_to_frames(run_chunk(pipeline.model, cache, noise, pipeline.steps))
            total[side] += time.perf_counter() - started
    runner.close_session(session)
    if runner.pool.num_free != runner.blocks_free_at_start:
        raise RuntimeError("bench session leaked KV blocks")
    return {side: seconds / chunks for side, seconds in total.items()}


def _runtimes_chunk_s(
    runners: Mapping[str, InspectableRuntime], chunks: int, session: str, first: str
) -> dict[str, float]:
    """Seconds per chunk through each runtime, alternating chunk by chunk (``first`` first), then closed."""
    total = dict.fromkeys(runners, 0.0)
    second = next(side for side in runners if side != first)
    for i in range(chunks):
        for side in (first, second) if i % 2 == 0 else (second, first):
            started = time.perf_counter()
            runners[side].execute_tick(TickRequest(session_id=session, request_id=i, seed=1))
            total[side] += time.perf_counter() - started
    for side, runner in runners.items():
        runner.close_session(session)
        if runner.stats().blocks_free != runner.blocks_free_at_start:
            raise RuntimeError(f"bench session leaked KV blocks on {side}")
    return {side: seconds / chunks for side, seconds in total.items()}


def _run_runtimes(args: argparse.Namespace) -> int:
    """``--runtime vllm-omni``: ARStream's runner and vLLM-Omni's, same pipeline and ticks, side by side."""
    try:
        runners = {
            side: build_runtime(side, ToyAttentionPipeline(steps=args.steps), kv_budget_bytes=BUDGET_BYTES)
            for side in RUNTIME_SIDES
        }
    except UnsupportedConfiguration as exc:
        print(f"arstream bench runner: {exc}", file=sys.stderr)
        return 2
    for runner in runners.values():
        runner.warmup()
    _runtimes_chunk_s(runners, 4, "bench-warm", RUNTIME_SIDES[0])  # first-call allocations out of the way
    print(f"{'rep':>4} {'vllm-omni ms/chunk':>19} {'arstream ms/chunk':>18} {'ratio':>7}")

    def measure(rep: int, order: tuple[str, str]) -> dict[str, float]:
        return _runtimes_chunk_s(runners, args.chunks, f"bench-{rep}", order[0])

    def report(rep: int, figures: Mapping[str, float], ratio: float) -> None:
        print(f"{rep:>4} {figures['vllm-omni'] * 1e3:>19.3f} {figures['arstream'] * 1e3:>18.3f} {ratio:>7.3f}")

    result = compare(RUNTIME_SIDES, args.repeats, measure, report)
    omni_med, mine_med, ratio = result.median("vllm-omni"), result.median("arstream"), result.median_ratio
    print(f"median: vllm-omni {omni_med * 1e3:.3f} ms, arstream {mine_med * 1e3:.3f} ms, median ratio {ratio:.3f}")
    print_summary(
        {
            "bench": "runner",
            "runtime": "vllm-omni",
            "chunks": args.chunks,
            "repeats": args.repeats,
            "steps": args.steps,
            "threads": args.threads,
            "vllm_omni_ms_per_chunk": round(omni_med * 1e3, 4),
            "arstream_ms_per_chunk": round(mine_med * 1e3, 4),
            "vllm_omni_over_arstream_ratio": round(ratio, 4),
        }
    )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--chunks", type=int, default=60, help="chunks per measurement (several windows long)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="denoise passes per chunk (plus one commit)")
    parser.add_argument(
        "--threads", type=int, default=default_torch_threads(), help="torch threads (default: CPU cores - 1, at least 1)"
    )
    parser.add_argument("--device", default="cpu", help="torch device for both sides (default cpu)")
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="arstream",
        help="vllm-omni: compare ARStream's runner with vLLM-Omni's (needs the vllm-omni extra) instead of a direct loop",
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.runtime == "vllm-omni":
        if args.device != "cpu":
            print("arstream bench runner: --runtime vllm-omni compares the two runtimes on the CPU only", file=sys.stderr)
            return 2
        return _run_runtimes(args)
    pipeline = ToyAttentionPipeline(steps=args.steps, device=args.device)
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
            "device": args.device,
            "runner_ms_per_chunk": round(runner_med * 1e3, 4),
            "direct_ms_per_chunk": round(direct_med * 1e3, 4),
            "overhead_ms_per_chunk": round((runner_med - direct_med) * 1e3, 4),
            "runner_overhead_ratio": round(ratio, 4),
        }
    )
    return 0
