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
  pass_control (scripts/share_attacks.py), each with what it got (``effect``) beside the latency;
- ``scan-bombs``: `start` with a progressive JPEG of 4300 tiny scans (a 235 KiB 16 MP file; the red team's
  were 145 KiB), then hang up at once, from 16 addresses in turn (the first hostile-client finding). Its effect: an honest upload's
  time to `ready` (a 64x64 PNG on a new connection, halfway through) and the server's CPU time;
- ``huge-pixels``: 12 sessions (3 addresses x 4) each started with a flat 16 MP PNG (56 KiB), held (finding 8);
- ``huge-event-ids``: a ``/v1/realtime/video`` session sending interactions with 60 KB event_ids and
  reading everything (finding 3).
- ``snapshot-headers``: a peer with the cluster secret posting session snapshots whose JSON header is
  15 MiB of small numbers to ``/v1/cluster/import``, one after another (direct only: HAProxy never
  forwards ``/v1/cluster/``).

Every attack also reports the server's RSS growth during it (from /proc), and the image and dialect attacks run
against fake-kv at 64x48 offering a start image.

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
import base64
import io
import itertools
import json
import multiprocessing
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from arstream.programs.bench import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from raw_clients import RawWebSocket, jpeg_scan_bomb, open_files, rss_bytes, tcp_connect  # noqa: E402 - the attack tests'
from share_attacks import BYSTANDERS, SERVE_ARGS, run_attack  # noqa: E402
from share_attacks import ATTACKS as SHARE_ATTACKS  # noqa: E402

TOKEN = "bench-token"
IMAGE_ATTACKS = ("scan-bombs", "huge-pixels", "huge-event-ids")
ATTACKS = (
    "fragments", "pongs", "fragments-no-token", "idle-upgrades", "reconnect", "snapshot-headers", *IMAGE_ATTACKS,
    *SHARE_ATTACKS,
)
IMAGE_MODEL_OPTIONS = {"width": 64, "height": 48, "start_images": ["meadow"]}
BOMB_ADDRESSES = [f"127.0.2.{i}" for i in range(1, 17)]
PIXEL_ADDRESSES = [f"127.0.3.{i}" for i in range(1, 4)]
UPLOAD_GUARD_S = 60.0
CLUSTER_SECRET = "bench-cluster-secret"
SNAPSHOT_HEADER_BYTES = 15 * 2**20
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
    if kind in IMAGE_ATTACKS:
        {"scan-bombs": scan_bombs, "huge-pixels": huge_pixels, "huge-event-ids": huge_event_ids}[kind](
            port, stop, connections
        )
        return
    if kind == "snapshot-headers":
        snapshot_headers(port, stop, connections)
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


def start_with_image(picture: bytes) -> str:
    return json.dumps({"type": "start", "image": {"data": base64.b64encode(picture).decode()}})


def scan_bombs(port: int, stop: Any, connections: Any) -> None:
    """Send a scan bomb in `start` and hang up at once, from many addresses (an abandoned decode each)."""
    bomb = RawWebSocket.text_frame(start_with_image(jpeg_scan_bomb(4096, 4096, 4300)))
    for index in itertools.count():
        if stop.is_set():
            return
        try:
            client = RawWebSocket(port, source_host=BOMB_ADDRESSES[index % len(BOMB_ADDRESSES)])
        except OSError:
            continue
        connections.value += 1
        client.try_send(bomb)
        client.close()
        time.sleep(0.01)


def huge_pixels(port: int, stop: Any, connections: Any) -> None:
    """Sessions each holding a flat 16 MP start image (a few tens of KB as PNG), never ticking."""
    buffer = io.BytesIO()
    Image.new("RGB", (4096, 4096), (90, 90, 90)).save(buffer, format="PNG")
    start = RawWebSocket.text_frame(start_with_image(buffer.getvalue()))
    held: list[RawWebSocket] = []

    def open_session(host: str) -> None:
        client = RawWebSocket(port, source_host=host)
        held.append(client)
        client.try_send(start)
        if json.loads(client.read_text())["type"] == "ready":
            connections.value += 1

    # At once, as a crowd would: 4 from each address (max_sessions_per_client).
    openers = [threading.Thread(target=open_session, args=(host,)) for host in PIXEL_ADDRESSES for _ in range(4)]
    try:
        for opener in openers:
            opener.start()
        for opener in openers:
            opener.join()
        stop.wait()
    finally:
        for client in held:
            client.close()


def huge_event_ids(port: int, stop: Any, connections: Any) -> None:
    """A realtime video session whose interactions carry 60 KB event_ids; it reads everything it is sent."""
    huge = "z" * 60_000
    sock = tcp_connect(port, receive_buffer=None, source_host=ATTACKER_HOST)
    with connect(f"ws://127.0.0.1:{port}/v1/realtime/video", sock=sock, compression=None, max_size=None) as ws:
        connections.value += 1
        ws.send(json.dumps({"type": "session.start", "prompt": "p", "width": 64, "height": 48}))
        for index in itertools.count():
            if stop.is_set():
                return
            event = {"event_id": f"{index}-{huge}", "event": {"prompt": f"p{index}"}}
            ws.send(json.dumps({"type": "session.interaction", "interaction": event}))
            try:
                while True:
                    ws.recv(timeout=0)
            except TimeoutError:
                pass


def honest_upload(port: int) -> dict[str, Any]:
    """A new session with a 64x64 PNG start image: seconds to its first reply, and what that was."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(buffer, format="PNG")
    sent = time.perf_counter()
    try:
        with connect(f"ws://127.0.0.1:{port}/v1/sessions", compression=None, proxy=None, open_timeout=60) as ws:
            ws.send(start_with_image(buffer.getvalue()))
            reply = json.loads(ws.recv(timeout=UPLOAD_GUARD_S))
            outcome = reply["type"] if reply["type"] == "ready" else reply.get("code")
    except TimeoutError:
        outcome = f"no answer in {UPLOAD_GUARD_S:g} s"
    except Exception as exc:  # noqa: BLE001 - a refused upgrade (503) is an outcome to report
        outcome = f"{type(exc).__name__}: {exc}"[:120]
    return {"seconds": round(time.perf_counter() - sent, 3), "outcome": outcome}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

def snapshot_headers(port: int, stop: Any, connections: Any) -> None:
    """Post snapshots whose header is ``SNAPSHOT_HEADER_BYTES`` of JSON numbers (slow to parse), one at a time."""
    inner = '{"format_version":1,"model":[' + ",".join(["1"] * (SNAPSHOT_HEADER_BYTES // 2)) + "]}"
    outer = json.dumps({"__metadata__": {"arstream_session": inner}}).encode()
    body = struct.pack("<Q", len(outer)) + outer
    headers = {"authorization": f"Bearer {CLUSTER_SECRET}", "content-type": "application/octet-stream"}
    with httpx.Client(timeout=60.0) as client:
        while not stop.is_set():
            try:
                client.post(f"http://127.0.0.1:{port}/v1/cluster/import", content=body, headers=headers)
            except httpx.TransportError:
                continue
            connections.value += 1


def summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {
        "chunks": len(ordered),
        "median_ms": round(statistics.median(ordered) * 1e3, 2) if ordered else None,
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 2) if ordered else None,
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 2) if ordered else None,
    }


def server_of(serve: list[str], tree: str | None, env: dict[str, str] | None = None) -> ServerProcess:
    """This checkout's server, or another checkout's run by that checkout's own venv (``TREE/.venv``, an
    editable install of it): the server runs with ``python -P``, so the working directory alone selects nothing."""
    server = ServerProcess(serve, cwd=tree, env=None if env is None else {**os.environ, **env})
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
    if kind == "snapshot-headers":
        serve += ["--cluster-secret", CLUSTER_SECRET]
    if not rate_bounds:
        serve += ["--connection-rate-per-client", str(UNBOUNDED)]
    if kind in IMAGE_ATTACKS:
        serve += ["--model-options", json.dumps(IMAGE_MODEL_OPTIONS)]
    serve += SERVE_ARGS.get(kind, [])
    tree = Path(cwd) if cwd else Path(__file__).resolve().parent.parent
    # One malloc arena for the image attacks: a decode's freed memory (kept by the server, app/memory.py) is reused
    # by the next decode on either thread, so the RSS growth is what is held, not each decode thread's own peak.
    env = {"MALLOC_ARENA_MAX": "1"} if kind in IMAGE_ATTACKS else None
    with server_of(serve, cwd, env) as server, _front(front, server, tree, rate_bounds) as port:
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
            stop = multiprocessing.Event()
            connections = multiprocessing.Value("i", 0)
            effect = multiprocessing.Value("i", 0)
            attack = kind.removesuffix("-no-token")
            pid = server._process.pid  # type: ignore[union-attr]
            rss_before, cpu_before, files_before = rss_bytes(pid), cpu_seconds(pid), open_files(pid)
            flood = multiprocessing.Process(target=attacker, args=(port, attack, stop, connections, token, effect))
            flood.start()
            upload: dict[str, Any] = {}
            try:
                time.sleep(0.5)
                uploader = None
                if kind == "scan-bombs":
                    uploader = threading.Timer(seconds / 2, lambda: upload.update(honest_upload(port)))
                    uploader.start()
                beside = summary(honest_latencies(honest, seconds))
                rss_grown = (rss_bytes(pid) - rss_before) / 2**20
                cpu_used = cpu_seconds(pid) - cpu_before
                files_grown = open_files(pid) - files_before
                if uploader is not None:
                    uploader.join()
            finally:
                stop.set()
                flood.join()
            evictions = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["sessions"]["evictions_total"]
            try:
                honest.send(json.dumps({"type": "close"}))
            except ConnectionClosed:
                pass  # idle while an honest upload was waited for (a minute, before the bounds)
    ratio = beside["median_ms"] / alone["median_ms"] if beside["median_ms"] and alone["median_ms"] else None
    median_ratio = None if ratio is None else round(ratio, 2)
    return {
        "alone": alone,
        "beside": beside,
        "median_ratio": median_ratio,
        "connections": connections.value,
        "rss_grown_mb": round(rss_grown, 1),
        "server_cpu_s": round(cpu_used, 2),
        # what the attack got: sessions evicted from under connections, server files held, and its own report
        "evictions": evictions,
        "server_files_grown": files_grown,
        "effect": effect.value,
        **({"honest_upload": upload} if upload else {}),
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
                    f"{front:8s} {kind:20s} {label:6s} alone {result['alone']['median_ms']} ms ({result['alone']['chunks']} chunks,"
                    f" mean {result['alone']['mean_ms']} ms)  beside {result['beside']['median_ms']} ms"
                    f" ({result['beside']['chunks']} chunks, mean {result['beside']['mean_ms']} ms)"
                    f"  x{result['median_ratio']}  attacker: {result['connections']} connections (refused included)"
                    f"  server RSS +{result['rss_grown_mb']} MB, CPU {result['server_cpu_s']} s"
                    f"  evictions {result['evictions']}, server files +{result['server_files_grown']},"
                    f" effect {result['effect']}"
                    + (f"  honest upload: {result['honest_upload']}" if "honest_upload" in result else ""),
                    flush=True,
                )
    if args.rss:
        for label, cwd in trees.items():
            results[f"rss-16-non-readers/{label}"] = measure_rss(model=args.model, cwd=cwd)
            print(f"16 non-reading sessions, bad messages: {label} +{results[f'rss-16-non-readers/{label}']} MB")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
