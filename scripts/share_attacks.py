"""The attacks on branch, watch and pass_control that ``attack_latency.py`` runs (the hostile-client findings on sharing).

Each runs in the attacker's own process until ``stop`` is set, from loopback addresses other than the honest
client's, and reports what it got in ``effect`` (what the attack is after, so the table can say it before and
after):

- ``branch-burst``: its own source session, then bursts of 3 ``start.branch`` at once while the server has
  one free slot (the server is started with room for the honest session, 2 idle bystanders, the source and
  one more); the effect is the server's ``evictions_total`` (sessions evicted that connections held), read
  by the caller.
- ``viewer-zombies``: rounds of a session with 20 viewers that never read, from 20 addresses; the session
  closes after 4 chunks and its viewers' sockets stay open; the effect is the server's open files at the
  end over those before (from /proc), read by the caller.
- ``pass-control``: address A opens sessions and passes each to a viewer from address B, which already
  holds ``max_sessions_per_client`` (4) of its own; the effect is how many sessions B ends up controlling.
- ``viewer-encodings``: 32 viewers of the honest session, each asking for another H.264 quality, that
  never read; its effect is the honest session's latency itself (the server needs PyAV).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from websockets.sync.client import ClientConnection, connect

from raw_clients import RawWebSocket

ATTACKS = ("branch-burst", "viewer-zombies", "pass-control", "viewer-encodings")
# Server options each attack needs (the same for both trees): room for exactly one more session for a
# branch burst, larger frames where encoding and sockets must cost something.
SERVE_ARGS = {
    "branch-burst": ["--model-options", json.dumps({"session_capacity": 5})],
    "viewer-zombies": ["--model-options", json.dumps({"width": 256, "height": 256}), "--close-timeout-s", "1"],
    "pass-control": [],
    "viewer-encodings": ["--model-options", json.dumps({"width": 256, "height": 256})],
}
BYSTANDERS = {"branch-burst": 2}  # idle honest sessions beside the measured one (what a burst evicted)
VIEWER_HOSTS = [f"127.0.2.{i}" for i in range(1, 33)]
SOURCE_HOST, HELPER_HOST = "127.0.0.2", "127.0.0.3"


def session(port: int, host: str, path: str = "/v1/sessions") -> ClientConnection:
    """A ``websockets`` client from loopback address ``host``."""
    return connect(
        f"ws://127.0.0.1:{port}{path}", compression=None, max_size=None, proxy=None, open_timeout=30,
        close_timeout=1, source_address=(host, 0),
    )


def started(ws: ClientConnection, **fields: Any) -> dict[str, Any]:
    ws.send(json.dumps({"type": "start", **fields}))
    return next_of(ws, ("ready", "error"))


def next_of(ws: ClientConnection, kinds: tuple[str, ...]) -> dict[str, Any]:
    while True:
        message = ws.recv(timeout=30)
        if isinstance(message, str) and json.loads(message)["type"] in kinds:
            return json.loads(message)


def chunk(ws: ClientConnection, tick_id: int) -> dict[str, Any]:
    ws.send(json.dumps({"type": "tick", "tick_id": tick_id}))
    header = next_of(ws, ("chunk", "error"))
    for _ in range(header.get("frames", 0)):
        ws.recv(timeout=30)
    return header


def run_attack(kind: str, port: int, token: str, stop: Any, connections: Any, effect: Any) -> None:
    {"branch-burst": branch_burst, "viewer-zombies": viewer_zombies, "pass-control": pass_control,
     "viewer-encodings": viewer_encodings}[kind](port, token, stop, connections, effect)


def branch_burst(port: int, token: str, stop: Any, connections: Any, effect: Any) -> None:
    with session(port, SOURCE_HOST) as source:
        own = started(source)["share"]["token"]
        for tick_id in range(3):
            chunk(source, tick_id)
        ticks = itertools.count(3)
        hosts = itertools.cycle(VIEWER_HOSTS)  # each branch from another address: under the per-address bounds
        while not stop.is_set():
            burst = []
            for host in itertools.islice(hosts, 3):
                try:
                    burst.append(RawWebSocket(port, f"/v1/sessions?share={own}", source_host=host))
                except OSError:
                    continue
            connections.value += len(burst)
            for client in burst:
                client.send_text(json.dumps({"type": "start", "branch": {"share": own, "chunk": 1}}))
            for client in burst:
                try:
                    client.read_text()
                except (ConnectionError, OSError):
                    pass
                client.close()
            chunk(source, next(ticks))  # the source stays in use (the runner's LRU order)
            stop.wait(0.2)


def viewer_zombies(port: int, token: str, stop: Any, connections: Any, effect: Any) -> None:
    held: list[RawWebSocket] = []
    try:
        while not stop.is_set():
            with session(port, SOURCE_HOST) as ws:
                share = started(ws, codec="raw")["share"]["token"]
                for host in VIEWER_HOSTS[:20]:
                    try:
                        viewer = RawWebSocket(port, f"/v1/sessions?share={share}", source_host=host)
                    except OSError:
                        continue
                    viewer.send_text(json.dumps({"type": "start", "watch": share, "codec": "raw"}))
                    held.append(viewer)
                    connections.value += 1
                for tick_id in range(8):
                    chunk(ws, tick_id)
                ws.send(json.dumps({"type": "close"}))
            stop.wait(1.0)  # a round a second: what the zombies hold adds up
            if len(held) > 400:  # the attacker's own descriptors
                for viewer in held[:20]:
                    viewer.close()
                del held[:20]
    finally:
        for viewer in held:
            viewer.close()


def pass_control(port: int, token: str, stop: Any, connections: Any, effect: Any) -> None:
    own = [session(port, HELPER_HOST) for _ in range(4)]  # B at its cap
    for ws in own:
        started(ws)
    controlled: list[ClientConnection] = []
    try:
        while not stop.is_set() and len(controlled) < 12:
            with session(port, SOURCE_HOST) as player:
                share = started(player)["share"]["token"]
                viewer = session(port, HELPER_HOST, f"/v1/sessions?share={share}")
                connections.value += 2
                viewer_id = started(viewer, watch=share)["viewer_id"]
                player.send(json.dumps({"type": "pass_control", "to": viewer_id}))
                answer = next_of(player, ("role", "error"))
                if answer["type"] == "role":
                    controlled.append(viewer)
                    effect.value = len(own) + len(controlled)
                else:
                    viewer.close()
                    effect.value = max(effect.value, len(own))
                    stop.wait(0.5)
    finally:
        for ws in own + controlled:
            ws.close()


def viewer_encodings(port: int, token: str, stop: Any, connections: Any, effect: Any) -> None:
    viewers: list[RawWebSocket] = []
    # H.264 costs the most: a viewer's stream starts again at every chunk, so each format is a new encoder
    asked = [("h264", quality) for quality in range(50, 82)]
    try:
        for index, (codec, quality) in enumerate(asked):
            host = VIEWER_HOSTS[index % len(VIEWER_HOSTS)]
            viewer = RawWebSocket(port, f"/v1/sessions?share={token}", source_host=host)
            viewer.send_text(json.dumps({"type": "start", "watch": token, "codec": codec, "quality": quality}))
            viewer.read_text()  # its ready, and nothing more
            connections.value += 1
            viewers.append(viewer)
        stop.wait()
    finally:
        for viewer in viewers:
            viewer.close()
