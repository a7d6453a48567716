"""Key-to-frame latency of the demo page, adaptive buffer vs the old two-chunk buffer, side by side.

Starts a server (tiny-world by default), then alternates rounds of the page
with its adaptive buffer (the default) and with ``?buffer=2`` (two chunks
ahead, as the page used to), one page at a time, pressing and releasing a key
at random moments through real Chromium keyboard events. Prints per-round
medians and, last, one JSON line with the medians over all rounds and their
ratio. Key-to-frame is what the page's HUD shows: a key event sent until the
first frame of the chunk that applied it is drawn.

    .venv/bin/python scripts/demo_latency.py --rounds 3 --presses 20
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from playwright.sync_api import sync_playwright

from arstream.app.bench import ServerProcess

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-timer-throttling"]
MODES = {"adaptive": "", "two-chunk": "&buffer=2"}


def run_round(browser: Any, base_url: str, query: str, presses: int, rnd: random.Random) -> dict[str, Any]:
    page = browser.new_page(viewport={"width": 1280, "height": 800}, bypass_csp=True)
    try:
        page.goto(f"{base_url}/?seed=1{query}")
        page.wait_for_function("window.arstreamDebug.framesDrawn > 16", timeout=0)
        start_drawn = page.evaluate("window.arstreamDebug.framesDrawn")
        start_stalls = page.evaluate("window.arstreamDebug.stalls")
        started = time.monotonic()
        for _ in range(presses):
            page.keyboard.down("d")
            time.sleep(rnd.uniform(0.3, 0.8))
            page.keyboard.up("d")
            time.sleep(rnd.uniform(0.3, 0.8))
        time.sleep(1.0)  # the last release reaches the screen
        state = page.evaluate("JSON.parse(JSON.stringify(window.arstreamDebug))")
        model = page.evaluate("fetch('/v1/model').then(r => r.json())")
    finally:
        page.close()
    elapsed = time.monotonic() - started
    return {
        "action_ms": state["samples"]["action"],
        "chunk_ms": state["samples"]["chunk"],
        "fps": (state["framesDrawn"] - start_drawn) / elapsed,
        "stalls": state["stalls"] - start_stalls,
        "chunk_duration_ms": 1000 * model["frames_per_chunk"] / model["fps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--presses", type=int, default=20, help="key presses (and releases) per round")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rnd = random.Random(args.seed)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    chunk: dict[str, list[float]] = {mode: [] for mode in MODES}
    duration = 0.0
    with ServerProcess(["--model", args.model, "--log-level", "warning"]) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for round_index in range(args.rounds):
            for mode, query in MODES.items():
                result = run_round(browser, server.base_url, query, args.presses, rnd)
                duration = result["chunk_duration_ms"]
                samples[mode] += result["action_ms"]
                chunk[mode] += result["chunk_ms"]
                print(
                    f"round {round_index + 1} {mode:>9}: key->frame median {statistics.median(result['action_ms']):.0f} ms "
                    f"({len(result['action_ms'])} events), chunk latency median {statistics.median(result['chunk_ms']):.0f} ms, "
                    f"{result['fps']:.1f} fps drawn, {result['stalls']} stalls",
                    flush=True,
                )
        browser.close()
    medians = {mode: statistics.median(values) for mode, values in samples.items()}
    summary = {
        "model": args.model,
        "chunk_duration_ms": duration,
        "key_to_frame_median_ms": {mode: round(value, 1) for mode, value in medians.items()},
        "key_to_frame_in_chunks": {mode: round(value / duration, 2) for mode, value in medians.items()},
        "chunk_latency_median_ms": {mode: round(statistics.median(values), 1) for mode, values in chunk.items()},
        "ratio_adaptive_over_two_chunk": round(medians["adaptive"] / medians["two-chunk"], 3),
        "events": {mode: len(values) for mode, values in samples.items()},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
