#!/usr/bin/env python3
"""What rewind points cost: a session's memory with K kept boundaries vs K full copies, and the chunk time.

    .venv/bin/python scripts/bench-rewind.py                      # fake-kv, tiny-world, tiny matrix-game-2, K=8
    .venv/bin/python scripts/bench-rewind.py --models tiny-world --rewind-points 4 --chunks 12

Per model, one session runs ``--chunks`` chunks (enough for the window to slide and the
K boundaries to fill) on a runner keeping K rewind points, and the bench reads back:

- KV bytes held: the live history alone; the live history plus its K boundaries as
  ARStream keeps them (blocks shared, counted once: the pool's allocated blocks); and
  what K full copies of the live window would take instead (``(K + 1) x live``), with
  the ratio between the two;
- the model-owned bytes of one boundary, and of all K (a tensor that did not change
  from one boundary to the next is kept once);
- what the plan counts per session (``plan_pool``'s per-session bytes) with K and with 0;
- the median chunk time with K boundaries vs with none (the same chunks, alternating
  runners chunk by chunk), the cost of taking a boundary before each chunk.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from arstream.models.registry import load_pipeline
from arstream.runner.contract import ARPipeline
from arstream.runner.runner import ARRunner, runner_for_sessions
from arstream.runner.types import TickRequest

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "fake-kv": ("fake-kv", {}),
    "tiny-world": ("tiny-world", {}),
    "matrix-game-2-tiny": ("matrix-game-2", {"config": "tiny", "random_init": True}),
}
KEYS = [["d"], ["w"], [], ["a"], ["s"], ["w", "d"]]


def _tick(session: str, index: int) -> TickRequest:
    return TickRequest(session_id=session, request_id=index, controls={"keys": KEYS[index % len(KEYS)]}, seed=7)


def _model_state_bytes(runner: ARRunner, session: str) -> tuple[int, int]:
    """(bytes of one boundary's model-owned tensors, bytes all kept boundaries hold: a shared tensor counted once)."""
    boundaries = runner._rewind[session]._boundaries
    distinct = {id(t): t for b in boundaries for t in b.model.tensors.values()}
    one = max((sum(t.numel() * t.element_size() for t in b.model.tensors.values()) for b in boundaries), default=0)
    return one, sum(t.numel() * t.element_size() for t in distinct.values())


def measure(name: str, pipeline: ARPipeline, rewind_points: int, chunks: int) -> dict[str, Any]:
    kept = runner_for_sessions(pipeline, 1, rewind_points=rewind_points)
    plain = runner_for_sessions(pipeline, 1)
    times: dict[str, list[float]] = {"kept": [], "plain": []}
    for index in range(chunks):  # alternating, each first every other chunk, so both see the same machine load
        pair = [("kept", kept), ("plain", plain)]
        for label, runner in pair if index % 2 == 0 else pair[::-1]:
            started = time.perf_counter()
            runner.execute_tick(_tick(label, index))
            times[label].append(time.perf_counter() - started)
    block = kept.plan.block_bytes
    live_kv = len(kept.kv_state("kept").held_blocks()) * block  # type: ignore[union-attr]
    shared_kv = kept.pool.num_used * block
    copies_kv = (rewind_points + 1) * live_kv
    model_one, model_kept = _model_state_bytes(kept, "kept")
    oldest, newest = kept.rewind_points("kept") or (0, 0)
    chunk_ms_kept = statistics.median(times["kept"][2:]) * 1000
    chunk_ms_plain = statistics.median(times["plain"][2:]) * 1000
    figures: dict[str, Any] = {
        "model": name,
        "rewind_points": rewind_points,
        "boundaries_held": newest - oldest + 1,
        "block_bytes": block,
        "live_kv_bytes": live_kv,
        "kept_kv_bytes": shared_kv,
        "full_copies_kv_bytes": copies_kv,
        "copies_vs_kept_ratio": round(copies_kv / shared_kv, 2),
        "model_state_bytes_per_boundary": model_one,
        "model_state_bytes_kept": model_kept,
        "plan_per_session_bytes": kept.plan.per_session_bytes,
        "plan_per_session_bytes_without": plain.plan.per_session_bytes,
        "chunk_ms_kept": round(chunk_ms_kept, 2),
        "chunk_ms_plain": round(chunk_ms_plain, 2),
        "chunk_time_ratio": round(chunk_ms_kept / chunk_ms_plain, 3),
    }
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--rewind-points", type=int, default=8, help="K, boundaries kept per session (default 8)")
    parser.add_argument("--chunks", type=int, default=0, help="chunks to run (default: window + K + 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    header = (
        f"{'model':<20} {'K':>3} {'live KV':>10} {'K kept':>10} {'K copies':>10} {'copies/kept':>11} "
        f"{'model: 1 / K kept':>19} {'plan/session':>21} {'chunk ms kept/none':>20}"
    )
    print(header)
    for name in args.models:
        model, options = MODELS[name]
        pipeline = load_pipeline(model, "cpu", **options)
        assert isinstance(pipeline, ARPipeline)  # built-in models, not vllm-omni: ones
        spec = pipeline.kv_cache_spec()
        chunks = args.chunks or (spec.window_frames // spec.frames_per_chunk + args.rewind_points + 4)
        f = measure(name, pipeline, args.rewind_points, chunks)
        results.append(f)
        print(
            f"{name:<20} {f['rewind_points']:>3} {f['live_kv_bytes']:>10} {f['kept_kv_bytes']:>10} "
            f"{f['full_copies_kv_bytes']:>10} {f['copies_vs_kept_ratio']:>11} "
            f"{f['model_state_bytes_per_boundary']:>9}/{f['model_state_bytes_kept']:<9} "
            f"{f['plan_per_session_bytes']:>10} vs {f['plan_per_session_bytes_without']:>8} "
            f"{f['chunk_ms_kept']:>8} / {f['chunk_ms_plain']:<8} ({f['chunk_time_ratio']}x)"
        )
    print(json.dumps({"bench": "rewind", "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
