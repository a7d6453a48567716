"""An honest session's chunk latency alone and beside each connection-level attack, side by side.

For each attack the same honest client (tick, wait for its chunk, repeat) runs
for ``--seconds`` alone and then beside the attacker, on a fresh server. The
attackers use raw sockets and reconnect whenever the server drops them:

- ``fragments``: a text message's 1-byte continuation fragments, as fast as the server takes them;
- ``pongs``: empty pongs, as fast as the server takes them;
- ``fragments-no-token``: the fragments, from a client without the server's ``--auth-token``;
- ``reconnect``: the control: upgrade and hang up, as fast as possible, no frames at all (what any
  connection costs; per-address connection limits belong in front, see docs/public.md).

``--before-tree DIR`` runs the same attacks against the server of another
checkout (e.g. ``git worktree add /tmp/before HEAD~1``) in the same run, so the
table compares before and after. ``--rss`` adds the memory of 16 sessions that
send 60 KB bad messages and never read their error replies. The last line is JSON.

    .venv/bin/python scripts/attack_latency.py --seconds 6 --before-tree /tmp/before --rss
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

from arstream.app.bench import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from raw_clients import RawWebSocket, rss_bytes  # noqa: E402 - the attack tests' raw client, reused

TOKEN = "bench-token"
ATTACKS = ("fragments", "pongs", "fragments-no-token", "reconnect")
FLOOD_FRAMES = 4096  # frames per send: the attacker writes as fast as the server reads
# Another loopback address than the honest client's: per-address bounds tell them apart.
ATTACKER_HOST = "127.0.0.2"


def honest_latencies(url: str, seconds: float) -> list[float]:
    """Round trips (s) of tick -> the chunk's last frame, one tick at a time, for ``seconds``."""
    latencies = []
    with connect(url, compression=None, max_size=None, proxy=None, open_timeout=60) as ws:
        ws.send(json.dumps({"type": "start"}))
        json.loads(ws.recv(timeout=60))
        deadline = time.perf_counter() + seconds
        tick_id = 0
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            ws.send(json.dumps({"type": "tick", "tick_id": tick_id}))
            chunk = json.loads(ws.recv(timeout=60))
            for _ in range(chunk["frames"]):
                ws.recv(timeout=60)
            latencies.append(time.perf_counter() - sent)
            tick_id += 1
        ws.send(json.dumps({"type": "close"}))
    return latencies


def attacker(port: int, kind: str, stop: Any, connections: Any) -> None:
    """Flood tiny frames; reconnect whenever the server drops the connection (in its own process: in the
    honest client's, its busy loop would hold the GIL and slow the honest client itself)."""
    while not stop.is_set():
        try:
            client = RawWebSocket(port, source_host=ATTACKER_HOST)
        except OSError:
            continue
        connections.value += 1
        if kind == "reconnect":
            client.close()
            continue
        client.sock.settimeout(1.0)
        if kind == "pongs":
            first = more = client.pong_frames(FLOOD_FRAMES)
        else:  # the message's first fragment once, then only continuations
            first = client.fragment_frames(FLOOD_FRAMES)
            more = first[len(first) // (FLOOD_FRAMES + 1) :]
        flood = first
        try:
            while not stop.is_set() and client.try_send(flood):
                flood = more
        finally:
            client.close()


def summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "chunks": len(ordered),
        "median_ms": round(statistics.median(ordered) * 1e3, 2) if ordered else None,
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 2) if ordered else None,
    }


def measure_attack(kind: str, *, seconds: float, model: str, cwd: str | None) -> dict[str, Any]:
    # No trusted proxy: the loopback attacker is a client like any other (trusted addresses are exempt from
    # the per-address bounds, as a proxy's own address stands for everyone).
    serve = ["--model", model, "--log-level", "warning", "--forwarded-allow-ips", ""]
    if kind.endswith("no-token"):
        serve += ["--auth-token", TOKEN]
    with ServerProcess(serve, cwd=cwd) as server:
        url = server.sessions_url + (f"?token={TOKEN}" if kind.endswith("no-token") else "")
        port = int(server.base_url.rsplit(":", 1)[1])
        honest_latencies(url, 1.0)  # warm
        alone = summary(honest_latencies(url, seconds))
        stop = multiprocessing.Event()
        connections = multiprocessing.Value("i", 0)
        flood = multiprocessing.Process(target=attacker, args=(port, kind.removesuffix("-no-token"), stop, connections))
        flood.start()
        try:
            time.sleep(0.5)
            beside = summary(honest_latencies(url, seconds))
        finally:
            stop.set()
            flood.join()
    ratio = beside["median_ms"] / alone["median_ms"] if beside["median_ms"] and alone["median_ms"] else None
    median_ratio = None if ratio is None else round(ratio, 2)
    return {"alone": alone, "beside": beside, "median_ratio": median_ratio, "connections": connections.value}


def measure_rss(*, model: str, cwd: str | None) -> float:
    """MB the server grows by with 16 sessions that send 60 KB bad messages and never read."""
    bad = json.dumps({"type": "é" * 30_000}, ensure_ascii=False)
    with ServerProcess(["--model", model, "--log-level", "warning"], cwd=cwd) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        pid = server._process.pid  # type: ignore[union-attr]
        before = rss_bytes(pid)
        clients = []
        for _ in range(16):
            client = RawWebSocket(port)
            client.send_text(json.dumps({"type": "start"}))
            client.read_text()
            client.sock.settimeout(2.0)
            client.try_send(client.text_frames([bad] * 100))
            clients.append(client)
        time.sleep(2.0)
        grown = rss_bytes(pid) - before
        for client in clients:
            client.close()
    return round(grown / 2**20, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--model", default="fake-kv")
    parser.add_argument("--attacks", nargs="*", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--before-tree", help="another checkout whose server is measured the same way")
    parser.add_argument("--rss", action="store_true", help="also the 16 non-reading sessions' memory")
    args = parser.parse_args()
    trees = {"after": None} if args.before_tree is None else {"before": args.before_tree, "after": None}
    results: dict[str, Any] = {}
    for kind in args.attacks:
        for label, cwd in trees.items():
            result = measure_attack(kind, seconds=args.seconds, model=args.model, cwd=cwd)
            results[f"{kind}/{label}"] = result
            print(
                f"{kind:20s} {label:6s} alone {result['alone']['median_ms']} ms ({result['alone']['chunks']} chunks)"
                f"  beside {result['beside']['median_ms']} ms ({result['beside']['chunks']} chunks)"
                f"  x{result['median_ratio']}  attacker: {result['connections']} connections (refused ones included)",
                flush=True,
            )
    if args.rss:
        for label, cwd in trees.items():
            results[f"rss-16-non-readers/{label}"] = measure_rss(model=args.model, cwd=cwd)
            print(f"16 non-reading sessions, bad messages: {label} +{results[f'rss-16-non-readers/{label}']} MB")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
