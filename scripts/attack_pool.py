"""Attacks on what a replica holds for sessions, before and after in one run: parking, spill files, imports.

- ``park-full``: fake-kv with 2 resident slots and room to park 9; 10 attacking sessions (one address each)
  and one honest session hold all 11 places and tick as fast as they can. Effect: chunks that came back
  ``restarted: "evicted"`` (a world ended), all sessions' and the honest one's.
- ``slow-import``: 4 peers with the cluster secret upload session snapshots a byte every 0.5 s (never silent,
  never done), reconnecting whenever they are cut (after a 503, when its Retry-After says). Effect: session
  slots their imports hold (sampled from /v1/stats), uploads cut (408) and refused (503), and whether the
  pool is back at its baseline once they stop.
- ``spill-leftovers`` (no honest session): a server spills 4 parked sessions and is SIGKILLed, 3 times
  over one ``--park-spill-dir``; then one more starts. Effect: spill files and bytes in the directory once it
  is ready, against what it reports spilled.

For the first two, an honest session's tick-to-chunk round trip (median) alone and beside the attack, on a
fresh server each, alone and beside interleaved, ``--runs`` times; the ratio is the median over runs.
``--before-tree DIR`` runs the same against another checkout (e.g. ``git archive`` of the commit before,
extracted to DIR; run with this venv and ``PYTHONPATH=DIR``). The last line is JSON.

    PYTHONPATH=$PWD .venv/bin/python scripts/attack_pool.py --seconds 8 --runs 3 --before-tree /tmp/before
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

from arstream.app.settings import Settings
from arstream.models.fake import FakeKVPipeline
from arstream.programs.bench import ServerProcess
from arstream.runner.pool import budget_for_sessions
from arstream.runner.runner import rewind_for

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests" / d) for d in ("", "cluster")]
from test_migration import _snapshot_bytes  # noqa: E402 - the migration tests' snapshot

warnings.filterwarnings("ignore", category=DeprecationWarning)  # websockets' connect() outside a with block

SECRET = "attack-pool-cluster-secret"
MODEL_OPTIONS: dict[str, Any] = {"window_frames": 6}
SLOTS, PARKED = 2, 9
SLOW_SENDERS = 4
DRIBBLE_S = 0.5
TICK_IDS = itertools.count()


def serve(tree: str | None, args: list[str]) -> ServerProcess:
    env = {**os.environ, "PYTHONPATH": tree or str(Path(__file__).resolve().parent.parent)}
    base = ["--model", "fake-kv", "--model-options", json.dumps(MODEL_OPTIONS), "--log-level", "error"]
    return ServerProcess([*base, *args], env=env, cwd=tree)


def park_args(*, resident: bool = False) -> list[str]:
    """2 slots and 9 park places; ``resident``: the same 11 sessions all in the pool (no parking), the
    baseline of sharing the model with 10 others."""
    settings = Settings(model="fake-kv", model_options=MODEL_OPTIONS)
    pipeline = FakeKVPipeline(**MODEL_OPTIONS)
    rewind = rewind_for(pipeline, seconds=settings.rewind_seconds, budget_bytes=settings.rewind_budget_bytes())
    budget = [budget_for_sessions(pipeline.kv_cache_spec(), n, rewind=rewind) for n in (SLOTS, SLOTS + 1)]
    per_session = budget[1] - budget[0]
    if resident:
        return ["--kv-budget-bytes", str(budget[0] + PARKED * per_session), "--max-batch-sessions", "1"]
    return ["--kv-budget-bytes", str(budget[0]), "--park-budget-bytes", str(PARKED * per_session), "--max-batch-sessions", "1"]


def session(url: str, source: str) -> ClientConnection:
    ws = connect(url, max_size=None, compression=None, proxy=None, sock=_bound(url, source))
    ws.send(json.dumps({"type": "start", "codec": "raw"}))
    ready = json.loads(ws.recv(timeout=60))
    if ready["type"] != "ready":
        raise RuntimeError(f"not started: {ready}")
    return ws


def _bound(url: str, source: str) -> socket.socket:
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    return socket.create_connection((host, int(port)), source_address=(source, 0))


def tick(ws: ClientConnection) -> tuple[float, str | None]:
    """One tick's round trip to its chunk's last frame, and the chunk's ``restarted``."""
    sent = time.perf_counter()
    ws.send(json.dumps({"type": "tick", "tick_id": next(TICK_IDS) % 2**31}))
    chunk = json.loads(ws.recv(timeout=60))
    while chunk["type"] != "chunk":
        chunk = json.loads(ws.recv(timeout=60))
    for _ in range(chunk["frames"]):
        ws.recv(timeout=60)
    return time.perf_counter() - sent, chunk["restarted"]


def honest(url: str, seconds: float) -> tuple[list[float], int]:
    ws = session(url, "127.0.0.1")
    latencies, evicted = [], 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        took, restarted = tick(ws)
        latencies.append(took)
        evicted += restarted == "evicted"
    ws.send(json.dumps({"type": "close"}))  # ended, not detached (held for a resume)
    ws.close()
    return latencies, evicted


def park_full(url: str, stop: threading.Event, counts: dict[str, int], index: int) -> None:
    ws = session(url, f"127.0.1.{index + 1}")
    while not stop.is_set():
        _took, restarted = tick(ws)
        counts["evicted"] += restarted == "evicted"
    ws.close()


def slow_import(port: int, stop: threading.Event, counts: dict[str, int], index: int) -> None:
    from arstream.runner.snapshot_stream import parse_snapshot, snapshot_bytes

    for attempt in itertools.count():
        if stop.is_set():
            return
        snapshot = parse_snapshot(_snapshot_bytes(FakeKVPipeline(**MODEL_OPTIONS)))
        snapshot.header["session"]["id"] = f"s-{index:08x}{attempt:08x}"
        data = snapshot_bytes(snapshot)
        head = (
            f"POST /v1/cluster/import HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {SECRET}\r\n"
            f"content-length: {len(data)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port)) as sender:
            sender.sendall(head + data[:-64])
            sender.settimeout(DRIBBLE_S)
            for position in range(len(data) - 64, len(data) - 1):
                if stop.is_set():
                    return
                try:
                    sender.send(data[position : position + 1])
                    answer = sender.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    answer = b""
                if answer.startswith(b"HTTP/1.1 503"):  # the replica's import slots are taken: as it asks
                    counts["refused"] += 1
                    stop.wait(1.0)
                else:
                    counts["cut"] += 1
                break


def measure(kind: str, tree: str | None, seconds: float, beside: bool, resident: bool = False) -> dict[str, Any]:
    args = park_args(resident=resident) if kind == "park-full" else ["--cluster-secret", SECRET]
    with serve(tree, args) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        url = server.sessions_url
        stats = server.get_json("/v1/stats")
        free = stats["kv"]["blocks_free"]
        stop, counts = threading.Event(), {"evicted": 0, "cut": 0, "refused": 0}
        held: list[int] = []
        threads = []
        if beside:
            for index in range(SLOTS + PARKED - 1 if kind == "park-full" else SLOW_SENDERS):
                target = park_full if kind == "park-full" else slow_import
                where: Any = url if kind == "park-full" else port
                threads.append(threading.Thread(target=target, args=(where, stop, counts, index), daemon=True))
                threads[-1].start()
            time.sleep(1.0)

        def sample() -> None:
            while not stop.is_set():
                held.append(server.get_json("/v1/stats")["kv"]["sessions_resident"])
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        latencies, honest_evicted = honest(url, seconds)
        stop.set()
        for thread in (*threads, sampler):
            thread.join(30)
        back = False
        for _ in range(100):  # the pool back at its baseline once the attack stops
            stats = server.get_json("/v1/stats")
            if stats["kv"]["blocks_free"] == free:
                back = True
                break
            time.sleep(0.1)
    out: dict[str, Any] = {"median_ms": round(statistics.median(latencies) * 1e3, 2), "chunks": len(latencies)}
    if beside and kind == "park-full":
        out.update(evicted=counts["evicted"] + honest_evicted, honest_evicted=honest_evicted)
    if beside and kind == "slow-import":
        # the honest session is one of the resident sessions; the rest are imports being streamed
        imports = [max(n - 1, 0) for n in held]
        out.update(
            import_slots_max=max(imports), import_slots_mean=round(statistics.fmean(imports), 2),
            cut=counts["cut"], refused=counts["refused"], pool_back=back,
        )
    return out


def spill_leftovers(tree: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        args = ["--park-after-s", "0", "--park-spill-dir", directory, "--park-spill-budget-bytes", str(8 * 2**20)]
        for _kill in range(3):
            with serve(tree, args) as server:
                sockets = [session(server.sessions_url, f"127.0.2.{i + 1}") for i in range(4)]
                for ws in sockets:
                    tick(ws)
                for _ in range(200):
                    if server.get_json("/v1/stats")["parking"]["sessions_spilled"] == 4:
                        break
                    time.sleep(0.05)
                assert server._process is not None
                server._process.send_signal(signal.SIGKILL)
                server._process.wait()
        with serve(tree, args) as server:
            files = list(Path(directory).glob("parked-*"))
            reported = server.get_json("/v1/stats")["parking"]["spilled_bytes"]
        return {"files_left": len(files), "bytes_left": sum(f.stat().st_size for f in files), "reported": reported}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before-tree", default=None)
    parser.add_argument("--attacks", nargs="*", default=["park-full", "slow-import", "spill-leftovers"])
    options = parser.parse_args()
    trees = {"after": None} if options.before_tree is None else {"before": options.before_tree, "after": None}
    results: dict[str, Any] = {}
    for kind in options.attacks:
        for name, tree in trees.items():
            if kind == "spill-leftovers":
                results[f"{kind}/{name}"] = spill_leftovers(tree)
                print(kind, name, results[f"{kind}/{name}"], flush=True)
                continue
            runs = []
            for _run in range(options.runs):  # alone and beside interleaved
                alone = measure(kind, tree, options.seconds, beside=False)
                beside = measure(kind, tree, options.seconds, beside=True)
                runs.append({"alone": alone, "beside": beside, "ratio": beside["median_ms"] / alone["median_ms"]})
                if kind == "park-full":  # the same 11 sessions without parking: what sharing the model costs
                    shared = measure(kind, tree, options.seconds, beside=True, resident=True)
                    runs[-1].update(shared=shared, ratio_to_shared=beside["median_ms"] / shared["median_ms"])
                print(kind, name, runs[-1], flush=True)
            results[f"{kind}/{name}"] = summary = {
                "runs": runs, "ratio_median": round(statistics.median(r["ratio"] for r in runs), 2)
            }
            if kind == "park-full":
                summary["ratio_to_shared_median"] = round(statistics.median(r["ratio_to_shared"] for r in runs), 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
