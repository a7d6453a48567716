#!/usr/bin/env python3
"""What a rewind horizon costs: a session's memory with its kept boundaries, and the chunk time.

    .venv/bin/python scripts/bench-rewind.py                          # fake-kv, tiny-world, tiny matrix-game-2
    .venv/bin/python scripts/bench-rewind.py --models tiny-world --seconds 10 --out /tmp/rewind.json

Per model, the server's schedule for ``--seconds`` of play within ``--budget-mib`` per
session (``rewind_for``, what ``arstream serve`` builds) is printed, and one session runs
until its boundaries reach the horizon and the thinning has cycled through its pattern.
The bench reads back, at the session's peak between chunks:

- the KV bytes it holds (the pool's allocated blocks: shared blocks counted once) and the
  model-owned bytes of its kept boundaries (a tensor unchanged between two boundaries
  counted once), against what the plan counts for it (``plan_pool``'s per-session bytes);
- how many boundaries it holds and how far back (seconds) the oldest is;
- the median chunk time with boundaries vs without (its first ``--timed`` chunks,
  alternating which runner goes first), the cost of taking a boundary before each chunk.

Ends with one JSON line; ``--out FILE`` writes it with the machine, the command and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from arstream.app.settings import Settings
from arstream.models.registry import load_pipeline
from arstream.runner.contract import ARPipeline
from arstream.runner.runner import ARRunner, rewind_for, runner_for_sessions
from arstream.runner.types import TickRequest

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "fake-kv": ("fake-kv", {}),
    "tiny-world": ("tiny-world", {}),
    "matrix-game-2-tiny": ("matrix-game-2", {"config": "tiny", "random_init": True}),
}
KEYS = [["d"], ["w"], [], ["a"], ["s"], ["w", "d"]]


def _tick(session: str, index: int) -> TickRequest:
    return TickRequest(session_id=session, request_id=index, controls={"keys": KEYS[index % len(KEYS)]}, seed=7)


def _model_state_bytes(runner: ARRunner, session: str) -> int:
    """Bytes the session's kept boundaries hold in model-owned tensors (a shared tensor counted once)."""
    boundaries = runner.rewinds.boundaries(session)
    distinct = {id(t): t for b in boundaries for t in b.model.tensors.values()}
    return sum(t.numel() * t.element_size() for t in distinct.values())


def measure(name: str, pipeline: ARPipeline, seconds: float, budget_mib: float, timed: int) -> dict[str, Any]:
    schedule = rewind_for(pipeline, seconds=seconds, budget_bytes=int(budget_mib * 1024 * 1024))
    if schedule is None:
        return {"model": name, "rewind": "off: not even one point fits the budget"}
    kept = runner_for_sessions(pipeline, 1, rewind=schedule)
    plain = runner_for_sessions(pipeline, 1)
    block = kept.plan.block_bytes
    chunks = schedule.horizon + 2 * schedule.stride(schedule.horizon) + 2
    times: dict[str, list[float]] = {"kept": [], "plain": []}
    peak_kv = peak_model = 0
    for index in range(chunks):
        pair = [("kept", kept), ("plain", plain)] if index < timed else [("kept", kept)]
        for label, runner in pair if index % 2 == 0 else pair[::-1]:  # each first every other chunk
            started = time.perf_counter()
            runner.execute_tick(_tick(label, index))
            times[label].append(time.perf_counter() - started)
        peak_kv = max(peak_kv, kept.pool.num_used * block)
        peak_model = max(peak_model, _model_state_bytes(kept, "kept"))
    held = kept.sessions.rewind_held("kept") or (0,)
    live_kv = len(kept.sessions.kv_state("kept").held_blocks()) * block  # type: ignore[union-attr]
    chunk_ms_kept = statistics.median(times["kept"][2:timed]) * 1000
    chunk_ms_plain = statistics.median(times["plain"][2:]) * 1000
    return {
        "model": name,
        "schedule": {"dense": schedule.dense, "horizon_chunks": schedule.horizon, "seconds": schedule.seconds},
        "chunks_run": chunks,
        "points_held": len(held) - 1,
        "oldest_seconds_back": round((held[-1] - held[0]) / schedule.chunks_per_second, 2),
        "live_kv_bytes": live_kv,
        "peak_kv_bytes": peak_kv,
        "peak_model_state_bytes": peak_model,
        "measured_extra_bytes": peak_kv - live_kv + peak_model,
        "plan_per_session_bytes": kept.plan.per_session_bytes,
        "plan_per_session_bytes_without": plain.plan.per_session_bytes,
        "chunk_ms_kept": round(chunk_ms_kept, 2),
        "chunk_ms_plain": round(chunk_ms_plain, 2),
        "chunk_time_ratio": round(chunk_ms_kept / chunk_ms_plain, 3),
    }


def main() -> int:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--seconds", type=float, default=defaults.rewind_seconds, help="rewind horizon (the server's)")
    parser.add_argument("--budget-mib", type=float, default=defaults.rewind_budget_mib, help="per session (the server's)")
    parser.add_argument("--timed", type=int, default=24, help="chunks timed with and without boundaries (default 24)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", type=Path, help="write the JSON result here, with machine, command and date")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models:
        model, options = MODELS[name]
        pipeline = load_pipeline(model, "cpu", **options)
        assert isinstance(pipeline, ARPipeline)  # built-in models, not vllm-omni: ones
        f = measure(name, pipeline, args.seconds, args.budget_mib, args.timed)
        results.append(f)
        print(json.dumps(f), flush=True)
    record = {
        "bench": "rewind",
        "command": " ".join(["scripts/bench-rewind.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.processor() or platform.system()}",
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
