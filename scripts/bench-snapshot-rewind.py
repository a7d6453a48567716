#!/usr/bin/env python3
"""What carrying a session's rewind points adds to its move: the snapshot's bytes with them and without.

    .venv/bin/python scripts/bench-snapshot-rewind.py                      # fake-kv and tiny-world, 2 s and 30 s
    .venv/bin/python scripts/bench-snapshot-rewind.py --models tiny-world --played-s 5 30

Per model, one session runs with the server's rewind schedule (``rewind_for``: ``--seconds`` of
play within ``--budget-mib``, what ``arstream serve`` builds) and, after each ``--played-s`` of
play, its streamed snapshot (runner/snapshot_stream.py, what a drain sends) is planned and its
bytes split: the live session's (KV, model state, header) and its rewind points'
(``rewind/kv``, ``rewind/model/N``, runner/snapshot_rewind.py). Both come from the same
snapshot of the same session, so the ratio is side by side. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from arstream.app.settings import Settings
from arstream.models.registry import load_pipeline
from arstream.runner.contract import ARPipeline
from arstream.runner.runner import rewind_for, runner_for_sessions
from arstream.runner.snapshot_rewind import REWIND_KV, REWIND_MODEL_PREFIX
from arstream.runner.snapshot_stream import plan_export
from arstream.runner.types import TickRequest

SESSION = "s-bench-snapshot-rewind"
KEYS = [["w"], ["w", "d"], ["d"], ["s"], ["a"], ["w", "a"]]


def measure(model: str, played_s: list[float], seconds: float, budget_mib: float) -> list[dict[str, Any]]:
    pipeline = load_pipeline(model, "cpu")
    assert isinstance(pipeline, ARPipeline)
    schedule = rewind_for(pipeline, seconds=seconds, budget_bytes=int(budget_mib * 2**20))
    assert schedule is not None, "rewind is off for this model and budget"
    runner = runner_for_sessions(pipeline, 1, rewind=schedule)
    card = pipeline.model_card()
    chunks_per_second = float(card["fps"]) / float(card["frames_per_chunk"])
    rows, played = [], 0
    for target_s in sorted(played_s):
        while played < round(target_s * chunks_per_second):
            runner.execute_tick(TickRequest(session_id=SESSION, request_id=played, controls={"keys": KEYS[played % 6]}))
            played += 1
        plan = plan_export(runner, SESSION, protocol_version=1)
        rewind = sum(t.nbytes for t in plan.tensors if t.name == REWIND_KV or t.name.startswith(REWIND_MODEL_PREFIX))
        total = plan.nbytes
        held = runner.sessions.rewind_held(SESSION) or ()
        rows.append({
            "model": model,
            "played_s": played / chunks_per_second,
            "points": len(held) - 1,
            "snapshot_bytes": total,
            "session_bytes": total - rewind,
            "rewind_bytes": rewind,
            "ratio_with_to_without": round(total / (total - rewind), 3),
        })
        row = rows[-1]
        print(
            f"{model:>10} after {row['played_s']:5.1f} s: {row['points']:3d} points; snapshot {total:>11,} bytes = "
            f"session {total - rewind:>10,} + points {rewind:>10,} ({row['ratio_with_to_without']}x)",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["fake-kv", "tiny-world"])
    parser.add_argument("--played-s", nargs="+", type=float, default=[2.0, 30.0])
    parser.add_argument("--seconds", type=float, default=defaults.rewind_seconds)
    parser.add_argument("--budget-mib", type=float, default=defaults.rewind_budget_mib)
    args = parser.parse_args(argv)
    rows = [row for model in args.models for row in measure(model, args.played_s, args.seconds, args.budget_mib)]
    print(json.dumps({"rewind_seconds": args.seconds, "budget_mib": args.budget_mib, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
