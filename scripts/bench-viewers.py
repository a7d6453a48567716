"""An honest player's tick-to-chunk latency alone and beside N viewers of its session, side by side (issue 27).

The player ticks, waits for its chunk's last frame, and ticks again, for
``--seconds``: first alone, then while ``--viewers`` connections watch its
session (``start.watch`` with its share token) and read everything they are
sent. The viewers run in another process at nice 19, so their reading takes
neither the player's interpreter nor, where cores are short, the server's. Also printed: the server's CPU seconds per second
(utime + stime from /proc) alone and with the viewers, and from the
difference, spectators per core (how many viewers one core of server time
serves at this chunk rate). ``--viewer-codec`` other than the player's makes
the server encode a second format once per chunk for all of them. The last
line is JSON.

    .venv/bin/python scripts/bench-viewers.py --viewers 50 --seconds 8
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

from arstream.app.bench import ServerProcess


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


def measure(args: argparse.Namespace) -> dict[str, Any]:
    serve = ["--model", args.model, "--log-level", "warning", "--max-connections-per-client", str(args.viewers + 8)]
    if args.model_options:
        serve += ["--model-options", args.model_options]
    with ServerProcess(serve) as server:
        pid = server._process.pid  # type: ignore[union-attr]
        with connect(server.sessions_url, compression=None, max_size=None, proxy=None, open_timeout=60) as ws:
            ws.send(json.dumps({"type": "start", "codec": args.player_codec}))
            ready = json.loads(ws.recv(timeout=60))
            token = ready["share"]["token"]
            _, tick_id = player_latencies(ws, 1.0, 0)  # warm
            cpu_before, wall_before = cpu_seconds(pid), time.perf_counter()
            alone, tick_id = player_latencies(ws, args.seconds, tick_id)
            cpu_alone = (cpu_seconds(pid) - cpu_before) / (time.perf_counter() - wall_before)
            joined, stop, chunks = multiprocessing.Value("i", 0), multiprocessing.Event(), multiprocessing.Value("i", 0)
            url = f"{server.sessions_url}?share={token}"
            crowd = multiprocessing.Process(
                target=watchers, args=(url, token, args.viewers, args.viewer_codec, joined, stop, chunks)
            )
            crowd.start()
            try:
                while joined.value < args.viewers:
                    if not crowd.is_alive():
                        raise RuntimeError("the viewers' process ended before they all joined")
                    time.sleep(0.05)
                _, tick_id = player_latencies(ws, 0.5, tick_id)  # settle
                cpu_before, wall_before = cpu_seconds(pid), time.perf_counter()
                chunks_before = chunks.value
                beside, tick_id = player_latencies(ws, args.seconds, tick_id)
                wall = time.perf_counter() - wall_before
                cpu_beside = (cpu_seconds(pid) - cpu_before) / wall
                viewer_chunks = chunks.value - chunks_before
            finally:
                stop.set()
                crowd.join()
            ws.send(json.dumps({"type": "close"}))
    alone_s, beside_s = summary(alone), summary(beside)
    extra_cpu = max(cpu_beside - cpu_alone, 1e-9)
    return {
        "viewers": args.viewers,
        "alone": alone_s,
        "beside": beside_s,
        "median_ratio": round(beside_s["median_ms"] / alone_s["median_ms"], 3),
        "server_cpu_per_s": {"alone": round(cpu_alone, 3), "beside": round(cpu_beside, 3)},
        "viewer_chunks_per_s": round(viewer_chunks / wall, 1),
        "player_chunks_per_s": round(beside_s["chunks"] / wall, 1),
        "spectators_per_core": round(args.viewers / extra_cpu, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--viewers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=8.0)
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
    print(
        f"player alone {result['alone']['median_ms']} ms (p90 {result['alone']['p90_ms']}, "
        f"{result['alone']['chunks']} chunks)  beside {args.viewers} viewers {result['beside']['median_ms']} ms "
        f"(p90 {result['beside']['p90_ms']}, {result['beside']['chunks']} chunks)  x{result['median_ratio']}"
    )
    print(
        f"server CPU s/s alone {result['server_cpu_per_s']['alone']} beside {result['server_cpu_per_s']['beside']}; "
        f"viewer chunks {result['viewer_chunks_per_s']}/s; spectators per core {result['spectators_per_core']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
