"""One replica over two devices against one device, side by side: round time and the collective's bytes a chunk.

Builds, in one run, a one-device runner and a two-rank replica (runner/distributed/: gloo on CPU, NCCL on CUDA)
over the same model and seed, then runs one session's chunks on each in turn (round k on P = 1, then round k on
P = 2, so the machine's load falls on both alike) and prints each one's median round time, the ratio, and the
bytes rank 0's collectives sent per chunk (every rank sends as much: what a GPU link will carry).

    PYTHONPATH=. python scripts/bench-devices.py --model longlive --model-options '{"config": "tiny", "random_init": true}'
    PYTHONPATH=. python scripts/bench-devices.py --devices cuda:0,cuda:1 --model krea-realtime ...
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

from arstream.models.registry import load_pipeline
from arstream.runner.distributed.runtime import DistributedRuntime
from arstream.runner.runner import ARRunner
from arstream.runner.types import RuntimeOptions, TickFailure, TickRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="matrix-game-2")
    parser.add_argument("--model-options", type=json.loads, default={"config": "tiny", "random_init": True})
    parser.add_argument("--devices", default="cpu,cpu")
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--kv-budget-mib", type=int, default=256)
    args = parser.parse_args()
    devices = tuple(args.devices.split(","))
    model_options: dict[str, Any] = args.model_options
    loader = functools.partial(load_pipeline, args.model, **model_options)
    options = RuntimeOptions(device=devices[0], kv_budget_bytes=args.kv_budget_mib * 2**20)
    one = ARRunner.for_pipeline(load_pipeline(args.model, devices[0], **model_options), options)
    two = DistributedRuntime.for_pipeline(
        load_pipeline(args.model, devices[0], **model_options), RuntimeOptions(**{**options.__dict__, "devices": devices, "load_pipeline": loader})
    )
    times: dict[str, list[float]] = {"P=1": [], f"P={len(devices)}": []}
    sent: list[int] = []
    try:
        for index in range(args.chunks):
            tick = TickRequest(session_id="s", request_id=index, controls={"keys": ["d"]}, seed=1)
            runtimes: tuple[ARRunner | DistributedRuntime, ...] = (one, two)
            for name, runtime in zip(times, runtimes):
                before = two.parallel.bytes_sent
                started = time.perf_counter()
                (result,) = runtime.execute([tick])
                times[name].append(time.perf_counter() - started)
                if isinstance(result, TickFailure):
                    raise result.error
                if runtime is two:
                    sent.append(two.parallel.bytes_sent - before)
    finally:
        two.shutdown()
    # the first chunk has the shortest history and the first-touch costs: the medians skip it
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name}: median round {median * 1000:.1f} ms over {len(times[name]) - 1} chunks")
    p1, p2 = medians.values()
    print(f"ratio P={len(devices)} / P=1: {p2 / p1:.2f}")
    print(f"collective bytes per chunk, sent by each rank: {statistics.median(sent[1:]) / 2**10:.1f} KiB")


if __name__ == "__main__":
    main()
