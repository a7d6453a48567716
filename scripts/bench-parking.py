#!/usr/bin/env python3
"""What parking costs and buys: sessions held per replica, and the time to park and restore one.

    .venv/bin/python scripts/bench-parking.py                            # fake-kv, tiny-world, tiny matrix-game-2
    .venv/bin/python scripts/bench-parking.py --models matrix-game-2-1.3b --device cuda --out /tmp/parking.json

Per model, with the server's rewind schedule (``rewind_for`` with ``arstream serve``'s defaults):

- **held**: the sessions a replica holds with the same device KV budget (``--kv-budget-mib``),
  without parking (the pool's slots) and with ``--park-gib`` of host memory (slots plus the
  parked sessions the park budget counts, at the plan's worst case per session and at the
  bytes one parked session measured here takes);
- **restore / park**: one session plays ``--warm`` chunks (its window and rewind points full),
  then is parked and restored ``--reps`` times (device synchronised around each): p50 / p99;
- **chunk with / without**: two sessions take turns on a pool of one slot (every chunk
  restores one and parks the other) against the same two on a pool of two, the runs
  alternating chunk by chunk: the median chunk time of each and their ratio (the "slower chunk").

Ends with one JSON line; ``--out FILE`` writes it with the machine, the command and the date.
"""

from __future__ import annotations

import argparse
import functools
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
from arstream.measure import percentile
from arstream.models.registry import load_pipeline
from arstream.runner.contract import ARPipeline
from arstream.runner.types import ParkingPolicy
from arstream.runner.pool import plan_pool
from arstream.runner.runner import rewind_for, runner_for_sessions
from arstream.runner.types import TickRequest

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "fake-kv": ("fake-kv", {}),
    "tiny-world": ("tiny-world", {}),
    "matrix-game-2-tiny": ("matrix-game-2", {"config": "tiny", "random_init": True}),
    "matrix-game-2-1.3b": ("matrix-game-2", {"config": "1.3b", "random_init": True}),
}
KEYS = [["d"], ["w"], [], ["a"], ["s"], ["w", "d"]]
PLENTY = 2**40


def _tick(session: str, index: int) -> TickRequest:
    return TickRequest(session_id=session, request_id=index, controls={"keys": KEYS[index % len(KEYS)]}, seed=7)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, step: Any) -> float:
    _sync(device)
    started = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - started


def measure(name: str, pipeline: ARPipeline, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    defaults = Settings(model="fake-kv")
    rewind = rewind_for(pipeline, seconds=defaults.rewind_seconds, budget_bytes=defaults.rewind_budget_bytes())
    spec = pipeline.kv_cache_spec()
    kv_budget = int(args.kv_budget_mib * 2**20)
    park_budget = int(args.park_gib * 2**30)
    plan = plan_pool(spec, kv_budget, rewind=rewind)

    # park and restore one warmed-up session, again and again
    runner = runner_for_sessions(pipeline, 1, device=device, rewind=rewind, parking=ParkingPolicy(PLENTY))
    for index in range(args.warm):
        runner.execute_tick(_tick("s", index))
    parks, restores = [], []
    for _ in range(args.reps):
        parks.append(_timed(device, lambda: runner.park_session("s")))
        restores.append(_timed(device, lambda: runner.parking.restore_session("s")))
    runner.park_session("s")
    parked_bytes = runner.stats().parked_bytes
    runner.close_session("s")

    # two sessions taking turns on one slot (each chunk restores one, parks the other) vs on two slots
    turns = runner_for_sessions(pipeline, 1, device=device, rewind=rewind, parking=ParkingPolicy(PLENTY))
    plain = runner_for_sessions(pipeline, 2, device=device, rewind=rewind)
    with_parking: list[float] = []
    without: list[float] = []
    # one pipeline serves both runners: their sessions need ids of their own (the pipeline keys its state by id)
    for index in range(args.warm + args.turns):
        for session in ("a", "b"):
            sides = [(turns, "turns-" + session, with_parking), (plain, "plain-" + session, without)]
            for side, session_id, times in sides if (index + (session == "b")) % 2 == 0 else sides[::-1]:
                elapsed = _timed(device, functools.partial(side.execute_tick, _tick(session_id, index)))
                if index >= args.warm:
                    times.append(elapsed)
    assert turns.stats().evictions_total == 0
    chunk_with, chunk_without = statistics.median(with_parking), statistics.median(without)
    return {
        "model": name,
        "kv_budget_bytes": kv_budget,
        "plan_per_session_bytes": plan.per_session_bytes,
        "parked_bytes_per_session": parked_bytes,
        "held_without_parking": plan.session_capacity,
        "held_with_parking_plan": plan.session_capacity + park_budget // plan.per_session_bytes,
        "held_with_parking_measured": plan.session_capacity + park_budget // max(parked_bytes, 1),
        "park_budget_bytes": park_budget,
        "park_ms_p50": round(percentile(parks, 50) * 1e3, 3),
        "park_ms_p99": round(percentile(parks, 99) * 1e3, 3),
        "restore_ms_p50": round(percentile(restores, 50) * 1e3, 3),
        "restore_ms_p99": round(percentile(restores, 99) * 1e3, 3),
        "chunk_ms_with_parking": round(chunk_with * 1e3, 3),
        "chunk_ms_without": round(chunk_without * 1e3, 3),
        "chunk_ratio": round(chunk_with / chunk_without, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["fake-kv", "tiny-world", "matrix-game-2-tiny"], choices=MODELS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-budget-mib", type=float, default=256.0, help="device KV budget (default: 256, the CPU default)")
    parser.add_argument("--park-gib", type=float, default=4.0, help="host memory for parked sessions (default 4)")
    parser.add_argument("--warm", type=int, default=12, help="chunks before timing (default 12)")
    parser.add_argument("--reps", type=int, default=40, help="park/restore pairs timed (default 40)")
    parser.add_argument("--turns", type=int, default=12, help="chunks per session timed taking turns (default 12)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", type=Path, help="write the JSON result here, with machine, command and date")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = []
    for name in args.models:
        model, options = MODELS[name]
        pipeline = load_pipeline(model, args.device, **options)
        assert isinstance(pipeline, ARPipeline)
        result = measure(name, pipeline, device, args)
        results.append(result)
        print(
            f"{name}: held {result['held_without_parking']} -> {result['held_with_parking_plan']} (plan) / "
            f"{result['held_with_parking_measured']} (measured {result['parked_bytes_per_session']} B parked); "
            f"restore {result['restore_ms_p50']} / {result['restore_ms_p99']} ms, park {result['park_ms_p50']} / "
            f"{result['park_ms_p99']} ms; chunk {result['chunk_ms_with_parking']} vs {result['chunk_ms_without']} ms "
            f"({result['chunk_ratio']}x)",
            flush=True,
        )
        del pipeline
    record = {
        "results": results,
        "device": args.device if device.type != "cuda" else torch.cuda.get_device_name(device),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.processor() or platform.system()}",
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(json.dumps(record))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
