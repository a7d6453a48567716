"""Shared pieces of the browser tests (tests/test_browser*.py): Debian's Chromium through Playwright.

The servers are real (``servers.running_server``) and run the fake-kv
pipeline, whose 8x8 frames are one flat colour: G is the frame's absolute
position (so the picture changes every frame) and B has a bit per held key
(w=1, a=2, s=4, d=8), so a test can see a key press reach the screen. The page
exposes ``window.arstreamDebug`` (state, sent and applied ids, frames drawn,
errors, the last close, held keys) for these checks.

Playwright's string predicates run through ``eval``, which the server's
Content-Security-Policy forbids, so test contexts bypass the CSP; one test
loads the page under the real CSP (:func:`open_context` bypasses it for the rest). The ``browser``,
``errors``, ``viewport``, ``context`` and ``page`` fixtures are in conftest.py.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY_BITS = {"w": 1, "a": 2, "s": 4, "d": 8}
DESKTOP = {"width": 1280, "height": 800}  # a laptop's window: the viewport of every test that names none
# Waits have no wall-clock limit (0 = none): pytest-timeout is the hang guard.
WAIT_MS = 0

browser_marks = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's Chromium is not installed at /usr/bin/chromium"),
]


class PageErrors:
    """Collects JavaScript errors of every page opened in a context; assert none at the end."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def watch(self, page: Any, *, console: bool = False) -> Any:
        """Collect ``page``'s uncaught errors; with ``console``, the errors it logs to the console too."""
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        if console:
            page.on("console", lambda message: self.errors.append(message.text) if message.type == "error" else None)
        return page

    def check(self) -> None:
        assert not self.errors, f"JavaScript errors on the page: {self.errors}"


def open_context(browser: Any, viewport: dict[str, int] | None = DESKTOP, **options: Any) -> Any:
    """A browser context for the test pages (CSP bypassed, see above); the caller closes it.

    ``viewport`` None keeps Playwright's default window; ``options`` go to ``new_context`` as they are.
    """
    if viewport is not None:
        options["viewport"] = viewport
    return browser.new_context(bypass_csp=True, **options)


def new_page(context: Any, errors: PageErrors) -> Any:
    return errors.watch(context.new_page())


@contextmanager
def two_windows(browser: Any, errors: PageErrors, viewport: dict[str, int] = DESKTOP) -> Iterator[tuple[Any, Any]]:
    """A player's page and a viewer's, each in a window (context) of its own: a background tab is throttled."""
    first, second = open_context(browser, viewport), open_context(browser, viewport)
    try:
        yield new_page(first, errors), new_page(second, errors)
    finally:
        first.close()
        second.close()


@contextmanager
def page_at(browser: Any, url: str, *, console_errors: bool = False) -> Iterator[Any]:
    """A page in a context of its own, under the server's real CSP, at ``url``, for a module's tests to share.

    Closed afterwards; then it fails if the page raised a JavaScript error (or, with ``console_errors``, logged one).
    """
    errors = PageErrors()
    page = errors.watch(browser.new_page(), console=console_errors)
    page.goto(url)
    yield page
    page.close()
    errors.check()


def debug(page: Any) -> dict[str, Any]:
    return page.evaluate("() => JSON.parse(JSON.stringify(window.arstreamDebug))")


def wait(page: Any, predicate: str) -> None:
    page.wait_for_function(predicate, timeout=WAIT_MS)


UNTIL_GUARD_S = 60.0  # hang guard only


def until(page: Any, expression: str) -> None:
    """Poll an expression with ``evaluate`` (the page's CSP forbids the ``eval`` that ``wait_for_function`` uses)."""
    deadline = time.monotonic() + UNTIL_GUARD_S
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"never true: {expression}"
        time.sleep(0.05)


def wait_frames_drawn(page: Any, more_than: int) -> None:
    wait(page, f"window.arstreamDebug.framesDrawn > {more_than}")


def wait_state(page: Any, state: str) -> None:
    wait(page, f"window.arstreamDebug.state === {state!r}")


def corner_blue(page: Any) -> int:
    return page.evaluate(
        "() => document.getElementById('screen').getContext('2d').getImageData(0, 0, 1, 1).data[2]"
    )


def wait_blue(page: Any, value: int, tolerance: int = 3) -> None:
    """Wait until the drawn frame carries these key bits in blue (JPEG shifts flat colours a little)."""
    wait(
        page,
        f"""() => {{
            const c = document.getElementById('screen');
            return Math.abs(c.getContext('2d').getImageData(0, 0, 1, 1).data[2] - {value}) <= {tolerance};
        }}""",
    )


def overlay_text(page: Any) -> str:
    return page.evaluate(
        "document.getElementById('overlay').hidden ? '' : document.getElementById('overlay-text').textContent"
    )


def set_hidden(page: Any, hidden: bool) -> None:
    """Play the tab being hidden or shown: headless Chromium never hides a tab by itself."""
    page.evaluate(
        """(hidden) => {
            window.__testHidden = hidden;
            if (!window.__testVisibility) {
                window.__testVisibility = true;
                Object.defineProperty(document, 'hidden', {configurable: true, get: () => window.__testHidden});
                Object.defineProperty(document, 'visibilityState', {
                    configurable: true, get: () => (window.__testHidden ? 'hidden' : 'visible')});
            }
            document.dispatchEvent(new Event('visibilitychange'));
        }""",
        hidden,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
