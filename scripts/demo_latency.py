"""Key-to-frame latency of the demo page before and after its rewrite, side by side in one run.

Starts a server (tiny-world by default) and alternates rounds of two pages, one
page at a time: "after" is the page in static/ now; "before" is the page as it
was at ``--before-rev`` (git), served in place of static/ through Playwright's
request routing. Each round presses and releases a key at random moments
through real Chromium keyboard events (the same sequence for both pages), then
reads key-to-frame as the page's HUD measures it: an `input` sent until the
first frame of the chunk that applied it is drawn. The old page only shows a
median (of its last 30 samples, so of this round's events), so both pages are
summarised as the median of their round medians. The last line is JSON.

    .venv/bin/python scripts/demo_latency.py --rounds 3 --presses 12
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import sync_playwright

from arstream.programs.bench import ServerProcess

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# A routed (fulfilled) page counts as outside the local network: let it reach the loopback server.
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-features=LocalNetworkAccessChecks"]
BEFORE_REV = "4f23193"  # the last commit with the single-closure page
STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def old_file(rev: str, name: str) -> str | None:
    result = subprocess.run(
        ["git", "show", f"{rev}:static/{name}"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return result.stdout if result.returncode == 0 else None


def serve_old_page(page: Any, rev: str) -> None:
    """Answer the page's own files (not the API) from ``rev``'s static/."""

    def handle(route: Any) -> None:
        path = route.request.url.split("://", 1)[1].split("/", 1)[1].split("?", 1)[0] or "index.html"
        body = old_file(rev, path) if "/" not in path else None
        if body is None:
            route.continue_()
        else:
            route.fulfill(status=200, body=body, content_type=STATIC_TYPES.get(Path(path).suffix, "text/plain"))

    page.route(re.compile(r"^http://[^/]+/(index\.html|app\.js|style\.css)?(\?.*)?$"), handle)


def run_round(browser: Any, base_url: str, mode: str, rev: str, pattern: list[tuple[float, float]]) -> dict[str, Any]:
    page = browser.new_page(viewport={"width": 1280, "height": 800}, bypass_csp=True)
    try:
        if mode == "before":
            serve_old_page(page, rev)
        page.goto(f"{base_url}/?seed=1")
        page.wait_for_function("window.arstreamDebug.framesDrawn > 16", timeout=0)
        drawn = page.evaluate("window.arstreamDebug.framesDrawn")
        started = time.monotonic()
        for hold, gap in pattern:
            page.keyboard.down("d")
            time.sleep(hold)
            page.keyboard.up("d")
            time.sleep(gap)
        time.sleep(1.0)  # the last release reaches the screen
        elapsed = time.monotonic() - started
        fps = (page.evaluate("window.arstreamDebug.framesDrawn") - drawn) / elapsed
        hud = page.inner_text("#hud-action") if mode == "before" else ""
        samples = page.evaluate("window.arstreamDebug.samples ? window.arstreamDebug.samples.action : null")
        chunk_text = page.text_content("#hud-chunk") or ""
    finally:
        page.close()
    if mode == "before":
        found = re.search(r"median (\d+) ms", hud)
        median = float(found.group(1)) if found else float("nan")
    else:
        median = statistics.median(samples)
    found = re.search(r"median (\d+) ms", chunk_text)
    return {"median": median, "fps": fps, "chunk_median": float(found.group(1)) if found else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--model-options", default=None, help="JSON, e.g. fake-kv's compute_delay_s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--presses", type=int, default=12, help="key presses (and releases) per round, at most 15")
    parser.add_argument("--before-rev", default=BEFORE_REV)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rnd = random.Random(args.seed)
    serve = ["--model", args.model, "--log-level", "warning"]
    if args.model_options:
        serve += ["--model-options", args.model_options]
    medians: dict[str, list[float]] = {"before": [], "after": []}
    chunk: dict[str, list[float]] = {"before": [], "after": []}
    with ServerProcess(serve) as server, sync_playwright() as playwright:
        card = httpx.get(server.base_url + "/v1/model", timeout=30).json()
        duration = 1000 * card["frames_per_chunk"] / card["fps"]
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for round_index in range(args.rounds):
            pattern = [(rnd.uniform(0.3, 0.8), rnd.uniform(0.3, 0.8)) for _ in range(min(args.presses, 15))]
            order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
            for mode in order:
                result = run_round(browser, server.base_url, mode, args.before_rev, pattern)
                medians[mode].append(result["median"])
                chunk[mode].append(result["chunk_median"])
                print(
                    f"round {round_index + 1} {mode:>6}: key->frame median {result['median']:.0f} ms, "
                    f"chunk latency median {result['chunk_median']:.0f} ms, {result['fps']:.1f} fps drawn",
                    flush=True,
                )
        browser.close()
    summary = {
        "model": args.model,
        "chunk_duration_ms": duration,
        "key_to_frame_median_ms": {mode: statistics.median(values) for mode, values in medians.items()},
        "key_to_frame_in_chunks": {
            mode: round(statistics.median(values) / duration, 2) for mode, values in medians.items()
        },
        "chunk_latency_median_ms": {mode: statistics.median(values) for mode, values in chunk.items()},
        "ratio_after_over_before": round(statistics.median(medians["after"]) / statistics.median(medians["before"]), 3),
        "rounds": args.rounds,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
