#!/usr/bin/env python3
"""What HAProxy and a resume cost, measured side by side on a running cluster (scripts/local-cluster.sh).

    scripts/local-cluster.sh 2 --model tiny-world &     # prints ARSTREAM_LB URL and ARSTREAM_REPLICA lines
    .venv/bin/python scripts/bench-lb.py --lb http://127.0.0.1:PORT --replica http://127.0.0.1:PORT0

Alternates a session through the balancer and one straight to a replica, ROUNDS times, each
running CHUNKS ticks one at a time (tick sent -> last frame received), and reports the median
per-chunk latency of each and their ratio. Then it drops a session's TCP connection through the
balancer and times the resume (drop noticed -> `ready` with `resumed: true`), ROUNDS times.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from arstream.programs import client_lib
from arstream.programs.client_lib import Session, connect


async def chunk_latencies(url: str, chunks: int) -> list[float]:
    session = Session(await connect(client_lib.session_url(url)), decode=False)
    try:
        await session.start(codec="jpeg")
        times = []
        for _ in range(chunks):
            started = time.perf_counter()
            await session.send_tick()
            await session.receive_chunk()
            times.append(time.perf_counter() - started)
        await session.close()
        return times
    finally:
        await session.ws.close()


async def resume_time(lb: str) -> float:
    session = Session(await connect(client_lib.session_url(lb)), decode=False)
    try:
        await session.start(codec="jpeg")
        await session.send_tick()
        await session.receive_chunk()
        session.ws.transport.abort()  # the TCP connection goes, no close frame
        started = time.perf_counter()
        await session.resume(lb)
        elapsed = time.perf_counter() - started
        await session.close()
        return elapsed
    finally:
        await session.ws.close()


async def main_async(args: argparse.Namespace) -> None:
    direct: list[float] = []
    balanced: list[float] = []
    for _ in range(args.rounds):
        balanced += await chunk_latencies(args.lb, args.chunks)
        direct += await chunk_latencies(args.replica, args.chunks)
    p_direct, p_lb = statistics.median(direct), statistics.median(balanced)
    print(f"chunk latency, median of {len(direct)}: direct {p_direct * 1e3:.2f} ms, "
          f"through HAProxy {p_lb * 1e3:.2f} ms")
    print(f"ratio through HAProxy / direct: {p_lb / p_direct:.3f}")
    resumes = [await resume_time(args.lb) for _ in range(args.rounds)]
    median_ms = statistics.median(resumes) * 1e3
    print(f"resume through HAProxy (drop -> ready), median of {len(resumes)}: {median_ms:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lb", required=True, help="the balancer, http://127.0.0.1:PORT")
    parser.add_argument("--replica", required=True, help="one replica behind it, http://127.0.0.1:PORT")
    parser.add_argument("--chunks", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
