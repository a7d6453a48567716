"""Screenshots of the demo page for the README and docs/demo.md, taken from a live server.

    .venv/bin/python scripts/screenshots.py            # tiny-world, all sizes, into docs/images/
    .venv/bin/python scripts/screenshots.py --only demo-phone-390x844.png

Each shot opens the page in Debian's Chromium at its size (phones and tablets
with touch), lets the world stream, steers for a moment so the picture is a
played one, and saves a PNG. tests/browser/test_browser.py runs :func:`capture` so this
script keeps working.

The badge on the picture is what the page measured: on a busy machine it
shows a stuttering demo. So the script prints the load average before it
starts (take the shots when it is under ``QUIET_LOAD``; it says so when it
is not) and, per shot, what the badge read when it was taken: say those
conditions beside the pictures (docs/demo.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
STEER_S = 1.5  # how long the shot steers before it is taken
QUIET_LOAD = 1.5  # a 1-minute load average under which the badge shows the page's own pace


class Shot(NamedTuple):
    width: int
    height: int
    touch: bool = False
    details: bool = False  # the details panel open (the developer numbers)


SHOTS = {
    "demo-desktop.png": Shot(1280, 800),
    "demo-1920x1080.png": Shot(1920, 1080, details=True),
    "demo-phone-390x844.png": Shot(390, 844, touch=True),
    "demo-tablet-768x1024.png": Shot(768, 1024, touch=True),
    "demo-phone-landscape-844x390.png": Shot(844, 390, touch=True),  # a phone on its side: the pad beside the world
}


def capture(browser: Any, base_url: str, path: Path, shot: Shot, *, seed: int = 7) -> str:
    """Open the page at ``shot``'s size, stream, steer, and save a PNG at ``path``; what the badge read."""
    context = browser.new_context(
        viewport={"width": shot.width, "height": shot.height},
        is_mobile=shot.touch,
        has_touch=shot.touch,
        bypass_csp=True,  # Playwright's waits use eval; the page itself needs no exception
    )
    try:
        page = context.new_page()
        page.goto(f"{base_url}/?seed={seed}")
        page.wait_for_function("window.arstreamDebug.framesDrawn > 8", timeout=0)
        if shot.details:
            page.click("#details summary")
        # Steer through the page's own input (the pad works for mouse and touch alike).
        page.keyboard.down("d")
        page.keyboard.down("w")
        time.sleep(STEER_S)
        page.keyboard.up("w")
        time.sleep(STEER_S / 2)
        page.keyboard.up("d")
        page.wait_for_function("window.arstreamDebug.samples.action.length >= 2", timeout=0)
        drawn = page.evaluate("window.arstreamDebug.framesDrawn")
        page.wait_for_function(f"window.arstreamDebug.framesDrawn > {drawn + 4}", timeout=0)
        if shot.details:
            page.wait_for_function("/^\\d+ \\/ \\d+/.test(document.getElementById('hud-kv').textContent)", timeout=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(path))
        return str(page.text_content("#badge") or "").strip()
    finally:
        context.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--only", action="append", choices=sorted(SHOTS), help="just this file (repeatable)")
    args = parser.parse_args(argv)

    from playwright.sync_api import sync_playwright

    from arstream.programs.bench import ServerProcess

    names = args.only or list(SHOTS)
    load = os.getloadavg()[0]
    quiet = "quiet" if load < QUIET_LOAD else f"busy: over {QUIET_LOAD}, the badge will show it"
    print(f"load average {load:.2f} on {os.cpu_count()} cores ({quiet})", flush=True)
    with ServerProcess(["--model", args.model, "--log-level", "warning"]) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            for name in names:
                badge = capture(browser, server.base_url, args.out / name, SHOTS[name])
                print(f"wrote {args.out / name} (badge: {badge}; load average {os.getloadavg()[0]:.2f})", flush=True)
        finally:
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
