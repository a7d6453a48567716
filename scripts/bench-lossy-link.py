"""The demo page over a lossy link: WebSocket JPEG, WebSocket H.264 and WebRTC side by side, at each loss rate.

The server runs in one network namespace and headless Chromium in another, joined by programs/lossy_link.py
(a relay that delays each packet ``--delay-ms`` each way and drops ``--loss`` of them, both directions; real
kernel TCP and UDP). For each model, and each loss rate (changed on the running link), the page plays one
session per path in turn, in an order that rotates from one rate to the next: ``?delivery=webrtc`` for the
track (JPEG on the WebSocket until it connects), the codec menu for the other two. Each session warms up,
then is measured for ``--seconds`` while keys go down and up at seeded moments (the same for every path).

Figures, from the page (``window.arstreamDebug``), one definition for both paths:
- key-to-frame: an ``input`` sent until the first frame of the chunk that applied it is shown (drawn on the
  canvas, or shown by the video element: ``requestVideoFrameCallback``, its frame mapped to its chunk by the
  RTP timestamp); median and 90th percentile.
- frames shown per second.
- stalls per minute: gaps between two frames shown longer than two frame intervals (a frame more than one
  interval late: the canvas player's own definition of a stall).
- server CPU: the server process's user + system seconds per second over the window, one session alone.

Ratios are against WebSocket JPEG at the same model and loss. Needs root, /dev/net/tun and Chromium; the
last line is JSON.

    sudo .venv/bin/python scripts/bench-lossy-link.py --seconds 25
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright

from arstream.programs.bench import ServerProcess
from arstream.programs.lossy_link import LinkRates, LossyLink

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required"]
PATHS = ["ws-jpeg", "ws-h264", "webrtc"]
MODELS = {
    "tiny-world": [],
    "fake-kv-640x352": ["--model", "fake-kv", "--model-options",
                        json.dumps({"compute_delay_s": 0.05, "width": 640, "height": 352})],
}
PORT = 8000  # the server namespace is new: nothing else holds a port there
WARMUP_FRAMES = 32
SETTLE_S = 2.0  # after the warm-up frames: the track connected, the pacer's buffer found
WAIT_GUARD_S = 60.0


def chromium_in(namespace: str, folder: Path) -> str:
    """A Chromium that starts inside ``namespace`` (Playwright drives it over pipes, from this namespace)."""
    wrapper = folder / "chromium"
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {namespace} {CHROMIUM} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def until(page: Any, expression: str) -> None:
    deadline = time.monotonic() + WAIT_GUARD_S
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise TimeoutError(f"never true: {expression}")
        time.sleep(0.05)


def start_session(page: Any, url: str, path: str) -> float:
    """Start a session on ``path``; the model's frame interval (ms) once it plays."""
    query = "autoconnect=0&seed=1" + ("&delivery=webrtc" if path == "webrtc" else "")
    page.goto(f"{url}/?{query}")
    codec = "h264" if path == "ws-h264" else "jpeg"
    until(page, f"!!document.querySelector('#codec option[value={codec}]')")
    page.click("#details summary")
    page.select_option("#codec", codec)
    page.click("#overlay-action")  # Play
    if path == "webrtc":
        until(page, "window.arstreamDebug.delivery === 'webrtc'")
    until(page, f"window.arstreamDebug.framesDrawn > {WARMUP_FRAMES}")
    time.sleep(SETTLE_S)
    return float(1000 / page.evaluate("fetch('/v1/model').then((response) => response.json()).then((c) => c.fps)"))


def measure(page: Any, server_pid: int, path: str, seconds: float, presses: list[tuple[float, float]],
            frame_ms: float) -> dict[str, Any]:
    before = page.evaluate("({samples: window.arstreamDebug.samples.action.length, "
                           "track: window.arstreamDebug.trackFramesShown, errors: window.arstreamDebug.errors.length, "
                           "received: window.arstreamDebug.framesReceived})")
    cpu0, started = cpu_seconds(server_pid), time.monotonic()
    shown: list[float] = []
    page_started = page.evaluate("performance.now()")

    def collect() -> None:  # the page keeps its last 1000: read them as they come
        newest = shown[-1] if shown else page_started
        shown.extend(page.evaluate(f"window.arstreamDebug.shownAt.filter((t) => t > {newest})"))

    held = False
    for at, _ in presses:
        while time.monotonic() - started < at:
            time.sleep(0.02)
        if held:
            page.keyboard.up("d")
        else:
            page.keyboard.down("d")
        held = not held
        collect()
    while time.monotonic() - started < seconds:
        time.sleep(0.1)
    collect()
    elapsed, cpu = time.monotonic() - started, cpu_seconds(server_pid) - cpu0
    if held:
        page.keyboard.up("d")
    after = page.evaluate("({samples: window.arstreamDebug.samples.action, "
                          "track: window.arstreamDebug.trackFramesShown, errors: window.arstreamDebug.errors, "
                          "delivery: window.arstreamDebug.delivery, received: window.arstreamDebug.framesReceived})")
    samples = after["samples"][before["samples"]:]
    gaps = [b - a for a, b in zip(shown, shown[1:])]
    window_s = (shown[-1] - shown[0]) / 1000 if len(shown) > 1 else elapsed
    stalls = sum(1 for gap in gaps if gap > 2 * frame_ms)
    return {
        "path": path,
        "key_to_frame_ms": statistics.median(samples) if samples else float("nan"),
        "key_to_frame_p90_ms": quantile(samples, 0.9),
        "samples": len(samples),
        "fps": (len(shown) - 1) / window_s if len(shown) > 1 else 0.0,
        # frames arrived (WebSocket) or announced by their chunk message (WebRTC): the rate the server kept up
        "fps_arrived": (after["received"] - before["received"]) / elapsed,
        "load_average": os.getloadavg()[0],
        "stalls_per_min": 60 * stalls / window_s,
        "longest_gap_ms": max(gaps, default=float("nan")),
        "cpu_per_s": cpu / elapsed,
        "on_track": after["track"] - before["track"],
        "delivery": after["delivery"],
        "errors": [error.get("code") for error in after["errors"][before["errors"]:]],
    }


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_path(browser: Any, url: str, server_pid: int, path: str, seconds: float,
             presses: list[tuple[float, float]]) -> dict[str, Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = context.new_page()
        frame_ms = start_session(page, url, path)
        result = measure(page, server_pid, path, seconds, presses, frame_ms)
        page.click("#play")  # Stop: the session ends before the next path's starts
        time.sleep(0.5)
        return result
    except (TimeoutError, PlaywrightError) as error:  # one path that never played does not end the run
        nan = float("nan")
        return {"path": path, "key_to_frame_ms": nan, "key_to_frame_p90_ms": nan, "samples": 0, "fps": 0.0,
                "fps_arrived": 0.0, "load_average": os.getloadavg()[0],
                "stalls_per_min": nan, "longest_gap_ms": nan, "cpu_per_s": nan, "on_track": 0,
                "delivery": "none", "errors": [str(error).splitlines()[0]]}
    finally:
        context.close()


def print_row(model: str, loss: float, result: dict[str, Any], base: dict[str, Any]) -> None:
    def ratio(key: str) -> str:
        return f"{result[key] / base[key]:.2f}" if base[key] else "-"

    print(
        f"{model:<16} {100 * loss:>4.0f}% {result['path']:<8} "
        f"{result['key_to_frame_ms']:>6.0f} ({ratio('key_to_frame_ms')}) p90 {result['key_to_frame_p90_ms']:>5.0f} "
        f"| {result['fps']:>5.1f} fps ({ratio('fps')}) | {result['stalls_per_min']:>5.1f} stalls/min "
        f"(longest gap {result['longest_gap_ms']:.0f} ms) | CPU {result['cpu_per_s']:.3f} s/s ({ratio('cpu_per_s')}) "
        f"| arrived {result['fps_arrived']:.1f} fps | load {result['load_average']:.1f}"
        f"{'' if result['delivery'] == ('webrtc' if result['path'] == 'webrtc' else 'websocket') else ' FELL BACK'}"
        f"{' errors ' + str(result['errors']) if result['errors'] else ''}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"some of {', '.join(MODELS)}")
    parser.add_argument("--losses", default="0,0.01,0.03", help="fractions of packets dropped, each way")
    parser.add_argument("--delay-ms", type=float, default=40.0, help="one way, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=25.0, help="measured per path and setting")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    losses = [float(value) for value in args.losses.split(",")]
    rnd = random.Random(args.seed)
    # key down / up at seeded moments, the same for every path
    presses: list[tuple[float, float]] = []
    at = 0.5
    while at < args.seconds - 1.5:
        presses.append((at, 0.0))
        at += rnd.uniform(0.6, 1.4)
    results: list[dict[str, Any]] = []
    with LossyLink(LinkRates(args.delay_ms / 1000, args.jitter_ms / 1000), seed=args.seed) as link, \
            tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        url = f"http://{link.server_address}:{PORT}"
        # WebCodecs (the page's H.264 on the WebSocket) needs a secure context, as over HTTPS to a real server.
        browser = playwright.chromium.launch(executable_path=chromium_in(link.client_namespace, Path(folder)),
                                             args=[*ARGS, f"--unsafely-treat-insecure-origin-as-secure={url}"])
        for model in args.models.split(","):
            serve = [*(MODELS[model] or ["--model", model]), "--host", "0.0.0.0", "--port", str(PORT), "--webrtc", "--log-level",
                     "warning"]
            server = ServerProcess(serve)
            server.command = link.run_in(link.server_namespace, server.command)
            with server:
                assert server._process is not None
                for index, loss in enumerate(losses):
                    link.set_rates(LinkRates(args.delay_ms / 1000, args.jitter_ms / 1000, loss))
                    order = PATHS[index % 3:] + PATHS[:index % 3]
                    by_path = {}
                    for path in order:
                        by_path[path] = run_path(browser, url, server._process.pid, path, args.seconds, presses)
                    for path in PATHS:
                        print_row(model, loss, by_path[path], by_path["ws-jpeg"])
                        results.append({"model": model, "loss": loss, **by_path[path]})
        browser.close()
        print(f"link packets: {link.counts()}", flush=True)
    print(json.dumps({"delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms, "seconds": args.seconds,
                      "results": results}))


if __name__ == "__main__":
    main()
