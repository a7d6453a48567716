#!/usr/bin/env python3
"""What moving a live session costs: a drain's time to the first frame on the peer, and the bytes moved.

    .venv/bin/python scripts/bench-drain.py --model tiny-world --sessions 4 --rounds 3 [--trigger sigterm]

Each round starts two replicas (``arstream serve``, real processes on loopback, a shared
cluster secret), streams SESSIONS sessions on r0 (one tick at a time, each waiting for its
chunk, at most one chunk per chunk period of the model's fps, as a player's page asks), then drains r0 to r1: ``POST /v1/cluster/drain``,
or with ``--trigger sigterm`` a SIGTERM to r0 alone (r0 started with ``--cluster-peers`` r1). Every client follows its ``moved``
message straight to r1 (``arstream client``'s own code: Session.resume with the token),
sends its next tick and takes the chunk. Reported per model, over all sessions of all rounds:

- drain start -> first frame on r1 (p50, p99): what a player sees, including waiting for
  the sessions moved before it (the worker exports one session at a time);
- ``moved`` received -> first frame on r1 (p50, p99): the client's reconnect, resume and chunk;
- the snapshot's bytes per session, and the replica's own move time (export + POST + import).

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

import httpx

from arstream.programs import client_lib
from arstream.programs.client_lib import Session, SessionMoved, connect
from arstream.measure import percentile

SECRET = "bench-drain-cluster-secret"
CHUNKS_BEFORE_DRAIN = 3


def start_replica(
    name: str, model: str, options: dict[str, Any], stack: ExitStack, peers: str = ""
) -> tuple[str, subprocess.Popen[str]]:
    """An ``arstream serve`` process and its URL, once it prints that it is listening."""
    process = subprocess.Popen(
        [sys.executable, "-m", "arstream", "serve", "--port", "0", "--replica-id", name, "--model", model,
         "--model-options", json.dumps(options), "--resume-grace-s", "60", "--log-level", "warning",
         "--cluster-peers", peers],
        env={**os.environ, "ARSTREAM_CLUSTER_SECRET": SECRET, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    stack.callback(process.wait, 30)  # callbacks run last-in first-out: terminate, then wait
    stack.callback(process.terminate)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("ARSTREAM_LISTENING"):
            return line.split()[1], process
    raise RuntimeError(f"replica {name} did not start")


def sigterm_report(process: subprocess.Popen[str]) -> dict[str, Any]:
    """SIGTERM the replica; the drain report it prints (``ARSTREAM_DRAIN_REPORT``) before exiting."""
    process.send_signal(signal.SIGTERM)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("ARSTREAM_DRAIN_REPORT"):
            return dict(json.loads(line.split(" ", 1)[1]))
    raise RuntimeError("the replica exited without a drain report")


async def one_session(r0: str, r1: str, streaming: asyncio.Event, drain_started: list[float]) -> dict[str, float]:
    session = Session(await connect(client_lib.session_url(r0)), decode=False)
    await session.start(codec="jpeg", seed=1)
    # Paced like a player's page: a chunk per chunk period at most (the model's fps), not as fast as it goes.
    period_s = session.model["frames_per_chunk"] / session.model["fps"]
    chunks = 0
    try:
        while True:
            due = time.perf_counter() + period_s
            await session.send_tick(controls={"keys": ["d"]})
            await session.receive_chunk()
            chunks += 1
            if chunks == CHUNKS_BEFORE_DRAIN:
                streaming.set()
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
    except SessionMoved as moved:
        moved_at = time.perf_counter()
        await session.resume(r1, resume_token=moved.resume_token)
        await session.send_tick(controls={"keys": ["d"]})
        chunk = await session.receive_chunk()
        await session.close()
        await session.ws.close()
        return {
            "from_drain_s": chunk.first_frame_at - drain_started[0],
            "from_moved_s": chunk.first_frame_at - moved_at,
        }


async def one_round(
    r0: str, r1: str, sessions: int, r0_process: subprocess.Popen[str] | None
) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """``r0_process``: drain by SIGTERM to it; None: by ``POST /v1/cluster/drain``."""
    events = [asyncio.Event() for _ in range(sessions)]
    drain_started: list[float] = []
    tasks = [asyncio.create_task(one_session(r0, r1, event, drain_started)) for event in events]
    for event in events:
        await event.wait()
    if r0_process is not None:
        drain_started.append(time.perf_counter())
        report = await asyncio.to_thread(sigterm_report, r0_process)
        return await asyncio.gather(*tasks), report
    async with httpx.AsyncClient(timeout=120.0) as client:
        drain_started.append(time.perf_counter())
        response = await client.post(
            r0 + "/v1/cluster/drain", json={"peers": [r1], "exit": False}, headers={"authorization": f"Bearer {SECRET}"}
        )
    report = response.json()
    return await asyncio.gather(*tasks), report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="fake-kv")
    parser.add_argument("--model-options", default="{}", help="JSON, e.g. '{\"session_capacity\": 8}'")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trigger", choices=("http", "sigterm"), default="http", help="how r0 is told to drain")
    args = parser.parse_args()
    options = json.loads(args.model_options)
    samples: list[dict[str, float]] = []
    reports: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        with ExitStack() as stack:
            r1, _ = start_replica("r1", args.model, options, stack)
            r0, r0_process = start_replica("r0", args.model, options, stack, peers=r1)
            trigger = r0_process if args.trigger == "sigterm" else None
            got, report = asyncio.run(one_round(r0, r1, args.sessions, trigger))
            if report["moved"] != args.sessions:
                raise SystemExit(f"not every session moved: {report}")
            samples += got
            reports.append(report)
    moves = [s for r in reports for s in r["sessions"]]
    from_drain = [s["from_drain_s"] * 1e3 for s in samples]
    from_moved = [s["from_moved_s"] * 1e3 for s in samples]
    sizes = [m["snapshot_bytes"] for m in moves]
    server_ms = [m["move_ms"] for m in moves]
    result = {
        "model": args.model,
        "trigger": args.trigger,
        "sessions": len(samples),
        "drain_to_first_frame_ms_p50": round(percentile(from_drain, 50), 1),
        "drain_to_first_frame_ms_p99": round(percentile(from_drain, 99), 1),
        "moved_to_first_frame_ms_p50": round(percentile(from_moved, 50), 1),
        "moved_to_first_frame_ms_p99": round(percentile(from_moved, 99), 1),
        "replica_move_ms_p50": round(percentile(server_ms, 50), 1),
        "replica_export_ms_p50": round(percentile([m["export_ms"] for m in moves], 50), 1),
        "snapshot_bytes_per_session": round(statistics.median(sizes)),
    }
    print(
        f"{args.model}: {len(samples)} sessions moved ({args.trigger}); drain start -> first frame on the peer "
        f"p50 {result['drain_to_first_frame_ms_p50']} ms, p99 {result['drain_to_first_frame_ms_p99']} ms; "
        f"'moved' -> first frame p50 {result['moved_to_first_frame_ms_p50']} ms; "
        f"{result['snapshot_bytes_per_session']} bytes per session"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
