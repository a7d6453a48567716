"""An honest player's tick-to-chunk latency alone and beside N viewers of its session, side by side.

The player ticks, waits for its chunk's last frame, and ticks again, for
``--seconds``: alone, and while ``--viewers`` connections watch its
session (``start.watch`` with its share token) and read everything they are
sent. The viewers run in another process at nice 19, so their reading takes
neither the player's interpreter nor, where cores are short, the server's. Also printed: the server's CPU seconds per second
(utime + stime from /proc) alone and with the viewers, and from the
difference, spectators per core (how many viewers one core of server time
serves at this chunk rate). ``--viewer-codec`` other than the player's makes
the server encode a second format once per chunk for all of them. Each of
``--repeat`` repetitions measures both windows, in alternating order; the
figures are the medians of the per-repetition ratios. The last line is JSON.

    .venv/bin/python scripts/bench-viewers.py --viewers 50 --seconds 5 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

from websockets.asyncio.client import connect as async_connect
from websockets.sync.client import connect

from arstream.programs.bench import ServerProcess


def player_latencies(ws: Any, seconds: float, first_tick: int) -> tuple[list[float], int]:
    """Round trips (s) of tick -> the chunk's last frame, one tick at a time, for ``seconds``."""
    latencies = []
    deadline = time.perf_counter() + seconds
    tick_id = first_tick
    while time.perf_counter() < deadline:
        sent = time.perf_counter()
        ws.send(json.dumps({"type": "tick", "tick_id": tick_id}))
        while True:
            message = json.loads(ws.recv(timeout=60))
            if message["type"] == "chunk":
                break  # `viewers` counts may come before it
        for _ in range(message["frames"]):
            ws.recv(timeout=60)
        latencies.append(time.perf_counter() - sent)
        tick_id += 1
    return latencies, tick_id


def watchers(url: str, token: str, count: int, codec: str, joined: Any, stop: Any, chunks: Any) -> None:
    """``count`` viewers reading everything until ``stop`` (in their own process, at the lowest CPU priority:
    they stand for clients on other machines, and on a small box they would otherwise take the server's cores)."""
    os.nice(19)

    async def one() -> None:
        async with async_connect(url, compression=None, max_size=None, proxy=None, open_timeout=60) as ws:
            await ws.send(json.dumps({"type": "start", "watch": token, "codec": codec}))
            ready = json.loads(await ws.recv())
            assert ready["type"] == "ready" and ready["role"] == "viewer", ready
            with joined.get_lock():
                joined.value += 1
            while not stop.is_set():
                try:
                    message = await asyncio.wait_for(ws.recv(), 0.5)
                except TimeoutError:
                    continue
                if isinstance(message, str) and json.loads(message)["type"] == "chunk":
                    with chunks.get_lock():
                        chunks.value += 1

    async def everyone() -> None:
        await asyncio.gather(*(one() for _ in range(count)))

    asyncio.run(everyone())


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "chunks": len(ordered),
        "median_ms": round(statistics.median(ordered) * 1e3, 2),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 2),
    }


class Crowd:
    """``count`` viewers of the session in another process, while the context lasts."""

    def __init__(self, url: str, token: str, count: int, codec: str) -> None:
        self.joined, self.stop, self.chunks = multiprocessing.Value("i", 0), multiprocessing.Event(), multiprocessing.Value("i", 0)
        self.count = count
        self.process = multiprocessing.Process(
            target=watchers, args=(url, token, count, codec, self.joined, self.stop, self.chunks)
        )

    def __enter__(self) -> Crowd:
        self.process.start()
        while self.joined.value < self.count:
            if not self.process.is_alive():
                raise RuntimeError("the viewers' process ended before they all joined")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.process.join()


def window(ws: Any, pid: int, seconds: float, tick_id: int) -> tuple[list[float], float, float, int]:
    """The player's latencies over ``seconds``, the server's CPU seconds per second, the wall time, next tick id."""
    cpu_before, wall_before = cpu_seconds(pid), time.perf_counter()
    latencies, tick_id = player_latencies(ws, seconds, tick_id)
    wall = time.perf_counter() - wall_before
    return latencies, (cpu_seconds(pid) - cpu_before) / wall, wall, tick_id


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` repetitions, each a window alone and one beside the viewers, in alternating order; the
    figures are medians of the per-repetition ratios (benchmarks.md: drift cancels within a repetition)."""
    serve = ["--model", args.model, "--log-level", "warning", "--max-connections-per-client", str(args.viewers + 8)]
    if args.model_options:
        serve += ["--model-options", args.model_options]
    repetitions = []
    with ServerProcess(serve) as server:
        pid = server._process.pid  # type: ignore[union-attr]
        with connect(server.sessions_url, compression=None, max_size=None, proxy=None, open_timeout=60) as ws:
            ws.send(json.dumps({"type": "start", "codec": args.player_codec}))
            token = json.loads(ws.recv(timeout=60))["share"]["token"]
            url = f"{server.sessions_url}?share={token}"
            _, tick_id = player_latencies(ws, 1.0, 0)  # warm
            for repetition in range(args.repeat):
                result: dict[str, Any] = {}
                for phase in (("alone", "beside") if repetition % 2 == 0 else ("beside", "alone")):
                    if phase == "alone":
                        latencies, cpu, _, tick_id = window(ws, pid, args.seconds, tick_id)
                        result["alone"] = {**summary(latencies), "server_cpu_per_s": round(cpu, 3)}
                        continue
                    with Crowd(url, token, args.viewers, args.viewer_codec) as crowd:
                        _, tick_id = player_latencies(ws, 0.5, tick_id)  # settle
                        chunks_before = crowd.chunks.value
                        latencies, cpu, wall, tick_id = window(ws, pid, args.seconds, tick_id)
                        viewer_chunks = (crowd.chunks.value - chunks_before) / wall
                    result["beside"] = {
                        **summary(latencies),
                        "server_cpu_per_s": round(cpu, 3),
                        "viewer_chunks_per_s": round(viewer_chunks, 1),
                        "player_chunks_per_s": round(len(latencies) / wall, 1),
                    }
                alone, beside = result["alone"], result["beside"]
                result["median_ratio"] = round(beside["median_ms"] / alone["median_ms"], 3)
                extra_cpu = max(beside["server_cpu_per_s"] - alone["server_cpu_per_s"], 1e-9)
                result["spectators_per_core"] = round(args.viewers / extra_cpu, 1)
                repetitions.append(result)
                print(
                    f"repetition {repetition + 1}: player alone {alone['median_ms']} ms (p90 {alone['p90_ms']}), "
                    f"beside {args.viewers} viewers {beside['median_ms']} ms (p90 {beside['p90_ms']})  "
                    f"x{result['median_ratio']}; server CPU s/s {alone['server_cpu_per_s']} -> "
                    f"{beside['server_cpu_per_s']}; viewer chunks {beside['viewer_chunks_per_s']}/s; "
                    f"spectators per core {result['spectators_per_core']}",
                    flush=True,
                )
            ws.send(json.dumps({"type": "close"}))
    return {
        "viewers": args.viewers,
        "viewer_codec": args.viewer_codec,
        "median_ratio": statistics.median(r["median_ratio"] for r in repetitions),
        "spectators_per_core": statistics.median(r["spectators_per_core"] for r in repetitions),
        "repetitions": repetitions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--viewers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0, help="each window's length")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="fake-kv")
    parser.add_argument(
        "--model-options",
        default='{"width": 256, "height": 256, "compute_delay_s": 0.05}',
        help="JSON for the pipeline (default: fake-kv with 256x256 frames and a 50 ms forward)",
    )
    parser.add_argument("--player-codec", default="jpeg")
    parser.add_argument("--viewer-codec", default="jpeg")
    args = parser.parse_args()
    result = measure(args)
    print(f"median of {args.repeat}: x{result['median_ratio']}; spectators per core {result['spectators_per_core']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
