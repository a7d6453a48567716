"""Two hostile-media attacks, each beside an honest session against that session alone, on this tree and another.

- ``hidden-scans``: fake-kv (64x48, offering a start image) and two attackers that each send, once a second
  from 16 loopback addresses in turn, a ``start`` whose image is a progressive JPEG of 6,000 tiny scans
  (1024x1024, 77 KiB) with one 0x00 after its frame header (libjpeg skips it and decodes on, about 9 s of a
  core), and hang up at once. Its effect: an
  honest 64x64 PNG upload's answer and time to it, and the server's CPU seconds (its process and children).
- ``long-prompts``: LongLive (tiny config, random weights, one torch thread) and two attacker sessions that
  tick and read their chunks, started with a prompt of 32,000 newlines; where that is refused, with the
  costliest prompt allowed (2,000 non-ASCII characters on 64 lines), a new one on every tick. Its effect: the
  attacker's own round trip (what its prompts cost the model thread).
- ``prompt-flood`` (a residual, measured): LongLive and two sessions that send ``input`` messages, each with
  a new costliest allowed prompt, as fast as the server reads them; each is cleaned as it arrives, on the
  event loop. Its effect: the prompts the server took.

For each: ``--rounds`` rounds (3), each the honest session alone for ``--seconds``, then (long-prompts) beside
a control of two sessions under an ordinary prompt (on a CPU three sessions share the model's cores, prompts or
not), then beside the attack, interleaved; the figure is the median over rounds of each window's median
tick-to-chunk round trip, and the ratios attack / alone and attack / control. ``--before-tree DIR`` runs the
same against another checkout's code (PYTHONPATH), in the same run. The last line is JSON.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench-hostile-media.py --before-tree /tmp/before
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image
from websockets.sync.client import ClientConnection, connect

from arstream.programs.bench import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from raw_clients import jpeg_scan_bomb  # noqa: E402 - the attack tests' own file

IMAGE_MODEL = ["--model", "fake-kv", "--model-options", json.dumps({"width": 64, "height": 48, "start_images": ["m"]})]
LONGLIVE = ["--model", "longlive", "--model-options", json.dumps({"config": "tiny", "random_init": True}),
            "--torch-threads", "1"]  # fmt: skip


def ws_url(server: ServerProcess) -> str:
    return server.base_url.replace("http://", "ws://", 1) + "/v1/sessions"


def png_64() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 120, 200)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def tick_round_trips(ws: ClientConnection, seconds: float, *, prompts: Callable[[int], str | None] | None = None,
                     stop: Any = None) -> list[float]:  # fmt: skip
    """Tick, read the chunk and its frames, again, for ``seconds`` (or until ``stop``): each round trip."""
    times, tick_id, end = [], NEXT_TICK.get(id(ws), 0), time.monotonic() + seconds
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        prompt = prompts(tick_id) if prompts is not None else None
        began = time.perf_counter()
        ws.send(json.dumps({"type": "tick", "tick_id": tick_id, "controls": {}, "prompt": prompt}))
        while True:
            message = json.loads(ws.recv())
            if message["type"] == "chunk":
                break
            if message["type"] == "error":
                raise RuntimeError(f"the tick was refused: {message}")
        for _ in range(message["frames"]):
            ws.recv()
        times.append(time.perf_counter() - began)
        tick_id += 1
    NEXT_TICK[id(ws)] = tick_id
    return times


NEXT_TICK: dict[int, int] = {}  # a connection's next tick id (ids only go up)


def session(url: str, start: dict[str, Any], host: str = "127.0.0.1") -> tuple[ClientConnection, dict[str, Any]]:
    ws = connect(url, max_size=None, compression=None, proxy=None, source_address=(host, 0))  # closed by the caller
    ws.send(json.dumps({"type": "start", "codec": "jpeg", **start}))
    return ws, json.loads(ws.recv())


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its live children (the decode workers), from /proc."""
    total, ticks = 0.0, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat.parent.name) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


# ---- the attacks ------------------------------------------------------------------------------------


def hidden_scan_bombs(url: str, stop: Any, offset: int, _figures: Any) -> None:
    bomb = base64.b64encode(jpeg_scan_bomb(1024, 1024, 6000, junk_after_frame=b"\x00")).decode()
    start = json.dumps({"type": "start", "image": {"data": bomb}})
    for n in range(10**9):
        if stop.is_set():
            return
        try:
            with connect(url, max_size=None, compression=None, proxy=None,
                         source_address=(f"127.0.2.{1 + (2 * n + offset) % 16}", 0)) as ws:  # fmt: skip
                ws.send(start)  # and hang up at once
        except Exception:  # noqa: BLE001 - refused (a per-address bound): the next address
            pass
        stop.wait(BOMB_EVERY_S)


BOMB_EVERY_S = 1.0  # per attacker: before the fix two bombs a few seconds apart held both decode threads


def costly_prompt(n: int) -> str:
    """2,000 characters on 64 lines, none plain ASCII: what costs Wan's cleaning most within the bounds."""
    return "\n".join(["é" * 29 + str(n % 10)] * 64)[:2000]


def prompt_flood(url: str, stop: Any, offset: int, figures: Any) -> None:
    """A session that sends ``input`` messages, each with a new costliest prompt, as fast as the server reads them
    (the message rate bounds it): each prompt is cleaned as it arrives, on the event loop."""
    ws, first = session(url, {"prompt": "a quiet meadow"}, host=f"127.0.4.{offset + 1}")
    assert first["type"] == "ready", first
    sent = taken = 0
    with ws:
        while not stop.is_set():
            ws.send(json.dumps({"type": "input", "event_id": sent + 1, "prompt": costly_prompt(sent) + f" {sent}"}))
            sent += 1
            while (reply := json.loads(ws.recv()))["type"] not in ("ack", "error"):
                pass  # a chunk's news, not the answer
            taken += reply["type"] == "ack"
    figures.put([float(sent), float(taken)])


def ordinary_sessions(url: str, stop: Any, offset: int, figures: Any) -> None:
    long_prompt_sessions(url, stop, offset, figures, hostile=False)


def long_prompt_sessions(url: str, stop: Any, offset: int, figures: Any, hostile: bool = True) -> None:
    """Two sessions ticking as fast as their chunks come; ``hostile``: under a prompt of 32,000 newlines or, where
    that is refused, the costliest prompt allowed, sent again with every tick (before, each chunk cleaned it)."""
    host = f"127.0.3.{offset + 1}"
    ws, first = session(url, {"prompt": "\n" * 32000 if hostile else "a quiet meadow"}, host=host)
    prompts: Callable[[int], str | None] | None = None
    if first["type"] != "ready":  # refused (the bound)
        ws.close()
        ws, first = session(url, {"prompt": costly_prompt(offset)}, host=host)
        prompts = lambda _tick: costly_prompt(offset)  # noqa: E731
    assert first["type"] == "ready", first
    with ws:
        figures.put([t * 1e3 for t in tick_round_trips(ws, 3600, prompts=prompts, stop=stop)])


# ---- a run ------------------------------------------------------------------------------------------


def honest_upload(url: str) -> tuple[str, float]:
    began = time.perf_counter()
    ws, first = session(url, {"image": {"data": png_64()}}, host="127.0.1.9")
    with ws:
        return first.get("code", first["type"]), time.perf_counter() - began


def beside(url: str, ws: ClientConnection, target: Callable[..., None], seconds: float, pid: int,
           upload: bool) -> tuple[float, dict[str, Any]]:  # fmt: skip
    """The honest session's median round trip beside two ``target`` processes, and what they did."""
    # Attackers in processes of their own: the honest client's round trips never wait for their GIL.
    stop = multiprocessing.Event()
    figures: multiprocessing.Queue[list[float]] = multiprocessing.Queue()
    attackers = [multiprocessing.Process(target=target, args=(url, stop, i, figures)) for i in range(2)]
    cpu_before = cpu_seconds(pid)
    for process in attackers:
        process.start()
    time.sleep(1.0)  # under way
    times = tick_round_trips(ws, seconds / 2)
    upload_beside = honest_upload(url) if upload else None
    times += tick_round_trips(ws, seconds / 2)
    effect: dict[str, Any] = {"server_cpu_s": round(cpu_seconds(pid) - cpu_before, 2)}
    stop.set()
    if target is prompt_flood:
        counts = [figures.get(timeout=120) for _ in attackers]
        effect["prompts_sent"], effect["prompts_taken"] = (int(sum(c[i] for c in counts)) for i in (0, 1))
    elif target is not hidden_scan_bombs:
        theirs = [t for _ in attackers for t in figures.get(timeout=120)]
        effect["their_round_trip_median_ms"] = round(statistics.median(theirs), 1)
    for process in attackers:
        process.join(30)
    if upload_beside is not None:
        effect["honest_upload"] = [upload_beside[0], round(upload_beside[1] * 1e3, 1)]
    return statistics.median(times), effect


def measure(tree: str, attack: str, rounds: int, seconds: float) -> dict[str, Any]:
    """Rounds of: the honest session alone, beside the control (long-prompts: two ordinary sessions), beside
    the attack."""
    serve = IMAGE_MODEL if attack == "hidden-scans" else LONGLIVE
    env = {**os.environ, "PYTHONPATH": tree}
    windows: dict[str, list[float]] = {"alone": [], "control": [], "attack": []}
    effects: dict[str, list[dict[str, Any]]] = {"alone": [], "control": [], "attack": []}
    with ServerProcess([*serve, "--log-level", "warning"], env=env, cwd=tree) as server:
        url = ws_url(server)
        pid = server._process.pid if server._process is not None else 0  # noqa: SLF001 - its /proc entry
        ws, ready = session(url, {"prompt": "a quiet meadow"})
        assert ready["type"] == "ready", ready
        tick_round_trips(ws, 2.0)  # warm
        for _ in range(rounds):
            windows["alone"].append(statistics.median(tick_round_trips(ws, seconds)))
            if attack == "hidden-scans":
                code, took = honest_upload(url)
                effects["alone"].append({"honest_upload": [code, round(took * 1e3, 1)]})
            elif attack == "long-prompts":
                median, effect = beside(url, ws, ordinary_sessions, seconds, pid, upload=False)
                windows["control"].append(median)
                effects["control"].append(effect)
            attacks: dict[str, Callable[..., None]] = {
                "hidden-scans": hidden_scan_bombs, "long-prompts": long_prompt_sessions, "prompt-flood": prompt_flood
            }
            target = attacks[attack]
            median, effect = beside(url, ws, target, seconds, pid, upload=attack == "hidden-scans")
            windows["attack"].append(median)
            effects["attack"].append(effect)
            time.sleep(6.0 if attack == "hidden-scans" else 1.0)  # what the attack left running settles
        ws.close()
    medians = {name: round(statistics.median(w) * 1e3, 2) for name, w in windows.items() if w}
    result: dict[str, Any] = {f"{name}_ms": value for name, value in medians.items()}
    result["attack_over_alone"] = round(medians["attack"] / medians["alone"], 2)
    if "control" in medians:
        result["attack_over_control"] = round(medians["attack"] / medians["control"], 2)
    result["rounds_ms"] = {name: [round(v * 1e3, 2) for v in w] for name, w in windows.items() if w}
    result["effects"] = {name: e for name, e in effects.items() if e}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", nargs="+", default=["hidden-scans", "long-prompts"])
    parser.add_argument("--before-tree", help="another checkout, run the same way (PYTHONPATH) in the same run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"now": here, **({"before": args.before_tree} if args.before_tree else {})}
    results: dict[str, dict[str, Any]] = {}
    for attack in args.attacks:
        for name, tree in trees.items():
            result = measure(tree, attack, args.rounds, args.seconds)
            results[f"{attack}/{name}"] = result
            print(f"{attack} {name}: {json.dumps(result)}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
