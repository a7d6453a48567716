"""An honest session's chunk latency alone and beside each connection-level attack, side by side.

For each attack the same honest client (tick, wait for its chunk, repeat) runs
for ``--seconds`` alone and then beside the attacker, on a fresh server. The
attackers use raw sockets and reconnect whenever the server drops them:

- ``fragments``: a text message's 1-byte continuation fragments, as fast as the server takes them;
- ``pongs``: empty pongs, as fast as the server takes them;
- ``fragments-no-token``: the fragments, from a client without the server's ``--auth-token``;
- ``idle-upgrades``: WebSocket upgrades that never send ``start``, from 250 loopback addresses
  (127.0.1.1-250) in turn, each held until the server drops it (at most 1000 held);
- ``reconnect``: the control: upgrade and hang up, as fast as possible, no frames at all (what any
  connection costs; per-address connection limits belong in front, see docs/public.md);
- ``branch-burst``, ``viewer-zombies``, ``pass-control``, ``viewer-encodings``: attacks on branch, watch and
  pass_control (scripts/share_attacks.py), each with what it got (``effect``) beside the latency.

``--fronts direct haproxy`` measures each attack against the server alone
and behind HAProxy running the shipped configuration (deploy/haproxy, rendered
by each tree's own render.py), where per-source limits come first.

``--without-rate-bounds`` adds the same runs with the per-address connection
rate bounds lifted (the replica's ``--connection-rate-per-client`` and
HAProxy's ``--per-source-connection-rate``), side by side.

``--before-tree DIR`` runs the same attacks against the server of another
checkout (e.g. ``git worktree add /tmp/before HEAD~1``, with its own venv in
``DIR/.venv`` holding an editable install of it) in the same run, so the
table compares before and after. ``--rss`` adds the memory of 16 sessions that
send 60 KB bad messages and never read their error replies. The last line is JSON.

    .venv/bin/python scripts/attack_latency.py --seconds 6 --before-tree /tmp/before --rss --fronts direct haproxy
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

from arstream.app.bench import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from raw_clients import RawWebSocket, open_files, rss_bytes  # noqa: E402 - the attack tests' raw client, reused
from share_attacks import BYSTANDERS, SERVE_ARGS, run_attack  # noqa: E402
from share_attacks import ATTACKS as SHARE_ATTACKS  # noqa: E402

TOKEN = "bench-token"
ATTACKS = ("fragments", "pongs", "fragments-no-token", "idle-upgrades", "reconnect", *SHARE_ATTACKS)
IDLE_ADDRESSES = [f"127.0.1.{i}" for i in range(1, 251)]
IDLE_HELD = 1000
FLOOD_FRAMES = 4096  # frames per send: the attacker writes as fast as the server reads
# Another loopback address than the honest client's: per-address bounds tell them apart.
ATTACKER_HOST = "127.0.0.2"
TICK_IDS = itertools.count()  # strictly increasing across the honest session's phases
UNBOUNDED = 10**9  # a connection rate no client reaches: the rate bounds lifted


def honest_latencies(ws: ClientConnection, seconds: float) -> list[float]:
    """Round trips (s) of tick -> the chunk's last frame on a started session, one tick at a time, for ``seconds``."""
    latencies = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sent = time.perf_counter()
        ws.send(json.dumps({"type": "tick", "tick_id": next(TICK_IDS)}))
        chunk = json.loads(ws.recv(timeout=60))
        while chunk["type"] != "chunk":  # a shared session also hears how many watch it
            chunk = json.loads(ws.recv(timeout=60))
        for _ in range(chunk["frames"]):
            ws.recv(timeout=60)
        latencies.append(time.perf_counter() - sent)
    return latencies


def attacker(port: int, kind: str, stop: Any, connections: Any, token: str = "", effect: Any = None) -> None:
    """Flood tiny frames; reconnect whenever the server drops the connection (in its own process: in the
    honest client's, its busy loop would hold the GIL and slow the honest client itself)."""
    if kind in SHARE_ATTACKS:
        run_attack(kind, port, token, stop, connections, effect)
        return
    if kind == "idle-upgrades":
        idle_upgrades(port, stop, connections)
        return
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


def idle_upgrades(port: int, stop: Any, connections: Any) -> None:
    """Upgrade and say nothing, from many addresses (per-address caps alone do not stop it), holding each."""
    held: list[RawWebSocket] = []
    index = 0
    try:
        while not stop.is_set():
            index += 1
            try:
                held.append(RawWebSocket(port, source_host=IDLE_ADDRESSES[index % len(IDLE_ADDRESSES)]))
            except OSError:
                continue
            connections.value += 1
            if len(held) > IDLE_HELD:
                held.pop(0).close()
    finally:
        for client in held:
            client.close()


def summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "chunks": len(ordered),
        "median_ms": round(statistics.median(ordered) * 1e3, 2) if ordered else None,
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 2) if ordered else None,
    }


def server_of(serve: list[str], tree: str | None) -> ServerProcess:
    """This checkout's server, or another checkout's run by that checkout's own venv (``TREE/.venv``, an
    editable install of it): the server runs with ``python -P``, so the working directory alone selects nothing."""
    server = ServerProcess(serve, cwd=tree)
    if tree is not None:
        python = Path(tree) / ".venv" / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"{python} is missing: give the other checkout its own venv (pip install -e .)")
        server.command[0] = str(python)
    return server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def haproxy_in_front(replica_port: int, tree: Path, rate_bounds: bool) -> Iterator[int]:
    """HAProxy with ``tree``'s shipped configuration in front of one replica; yields its port."""
    port, stats_port = free_port(), free_port()
    render = tree / "deploy" / "haproxy" / "render.py"
    config_text = subprocess.run(
        [sys.executable, str(render), "--replica", f"r0=127.0.0.1:{replica_port}/8", "--check-interval", "1s",
         "--bind", f"127.0.0.1:{port}", "--stats-bind", f"127.0.0.1:{stats_port}",
         *([] if rate_bounds else ["--per-source-connection-rate", str(UNBOUNDED)])],
        check=True, capture_output=True, text=True,
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".cfg") as config:
        config.write(config_text)
        config.flush()
        process = subprocess.Popen(["haproxy", "-db", "-f", config.name], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not _ready(f"http://127.0.0.1:{port}/readyz"):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("HAProxy did not start serving the replica")
                time.sleep(0.2)
            yield port
        finally:
            process.terminate()
            process.wait(10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def measure_attack(
    kind: str, *, seconds: float, model: str, cwd: str | None, front: str, rate_bounds: bool = True
) -> dict[str, Any]:
    # Direct: no trusted proxy, so the loopback attacker is a client like any other (trusted addresses are exempt
    # from the per-address bounds, as a proxy's own address stands for everyone). Behind HAProxy: the default,
    # which trusts HAProxy's loopback address and reads the client's from X-Forwarded-For.
    serve = ["--model", model, "--log-level", "warning"] + (["--forwarded-allow-ips", ""] if front == "direct" else [])
    if kind.endswith("no-token"):
        serve += ["--auth-token", TOKEN]
    if not rate_bounds:
        serve += ["--connection-rate-per-client", str(UNBOUNDED)]
    serve += SERVE_ARGS.get(kind, [])
    tree = Path(cwd) if cwd else Path(__file__).resolve().parent.parent
    with server_of(serve, cwd) as server, _front(front, server, tree, rate_bounds) as port:
        url = f"ws://127.0.0.1:{port}/v1/sessions" + (f"?token={TOKEN}" if kind.endswith("no-token") else "")
        # One honest session, started before the attack: what the attack does to sessions already running
        # (a flood of idle upgrades from many addresses refuses new ones while it holds the waiting cap).
        with connect(url, compression=None, max_size=None, proxy=None, open_timeout=60) as honest, \
                ExitStack() as bystanders:
            honest.send(json.dumps({"type": "start"}))
            token = json.loads(honest.recv(timeout=60)).get("share", {}).get("token", "")
            for _ in range(BYSTANDERS.get(kind, 0)):  # idle sessions that have run a chunk (resident)
                bystander = bystanders.enter_context(connect(url, compression=None, proxy=None, open_timeout=60))
                bystander.send(json.dumps({"type": "start"}))
                bystander.recv(timeout=60)
                bystander.send(json.dumps({"type": "tick", "tick_id": 0}))
                for _ in range(json.loads(bystander.recv(timeout=60))["frames"]):
                    bystander.recv(timeout=60)
            honest_latencies(honest, 1.0)  # warm
            alone = summary(honest_latencies(honest, seconds))
            server_pid = server._process.pid  # type: ignore[union-attr]
            files_before = open_files(server_pid)
            stop = multiprocessing.Event()
            connections = multiprocessing.Value("i", 0)
            effect = multiprocessing.Value("i", 0)
            attack = kind.removesuffix("-no-token")
            flood = multiprocessing.Process(target=attacker, args=(port, attack, stop, connections, token, effect))
            flood.start()
            try:
                time.sleep(0.5)
                beside = summary(honest_latencies(honest, seconds))
                files_grown = open_files(server_pid) - files_before
            finally:
                stop.set()
                flood.join()
            evictions = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["sessions"]["evictions_total"]
            honest.send(json.dumps({"type": "close"}))
    ratio = beside["median_ms"] / alone["median_ms"] if beside["median_ms"] and alone["median_ms"] else None
    median_ratio = None if ratio is None else round(ratio, 2)
    return {
        "alone": alone, "beside": beside, "median_ratio": median_ratio, "connections": connections.value,
        # what the attack got: sessions evicted from under connections, server files held, and its own report
        "evictions": evictions, "server_files_grown": files_grown, "effect": effect.value,
    }


@contextmanager
def _front(front: str, server: ServerProcess, tree: Path, rate_bounds: bool) -> Iterator[int]:
    """The port clients connect to: the server's own, or HAProxy's in front of it."""
    replica_port = int(server.base_url.rsplit(":", 1)[1])
    if front == "direct":
        yield replica_port
    else:
        with haproxy_in_front(replica_port, tree, rate_bounds) as port:
            yield port


def measure_rss(*, model: str, cwd: str | None) -> float:
    """MB the server grows by with 16 sessions that send 60 KB bad messages and never read."""
    bad = json.dumps({"type": "é" * 30_000}, ensure_ascii=False)
    with server_of(["--model", model, "--log-level", "warning"], cwd) as server:
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
    parser.add_argument("--fronts", nargs="*", default=["direct"], choices=("direct", "haproxy"))
    parser.add_argument("--without-rate-bounds", action="store_true", help="also with the connection rate bounds lifted")
    parser.add_argument("--rss", action="store_true", help="also the 16 non-reading sessions' memory")
    args = parser.parse_args()
    trees = {"after": None} if args.before_tree is None else {"before": args.before_tree, "after": None}
    variants = [(label, cwd, True) for label, cwd in trees.items()]
    if args.without_rate_bounds:
        variants.append(("no-rate", None, False))
    results: dict[str, Any] = {}
    for front in args.fronts:
        for kind in args.attacks:
            for label, cwd, bounded in variants:
                result = measure_attack(
                    kind, seconds=args.seconds, model=args.model, cwd=cwd, front=front, rate_bounds=bounded
                )
                results[f"{front}/{kind}/{label}"] = result
                print(
                    f"{front:8s} {kind:20s} {label:6s} alone {result['alone']['median_ms']} ms ({result['alone']['chunks']} chunks)"
                    f"  beside {result['beside']['median_ms']} ms ({result['beside']['chunks']} chunks)"
                    f"  x{result['median_ratio']}  attacker: {result['connections']} connections (refused included)"
                    f"  evictions {result['evictions']} server files +{result['server_files_grown']}"
                    f" effect {result['effect']}",
                    flush=True,
                )
    if args.rss:
        for label, cwd in trees.items():
            results[f"rss-16-non-readers/{label}"] = measure_rss(model=args.model, cwd=cwd)
            print(f"16 non-reading sessions, bad messages: {label} +{results[f'rss-16-non-readers/{label}']} MB")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
