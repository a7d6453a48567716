"""The copyable clients in docs/examples/ work as their comments say: the Python one from a shell,
the HTML one served by the server itself (/examples/client.html) and from another site, opened in Chromium."""

from __future__ import annotations

import functools
import re
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from browser_helpers import CHROMIUM, free_port
from servers import REPO_ROOT, fake_settings, running_server

EXAMPLES = REPO_ROOT / "docs" / "examples"  # client.html there is a link to static/examples/client.html
EXIT_GUARD_S = 120


def test_the_python_example_saves_every_frame(tmp_path: Path) -> None:
    with running_server(fake_settings()) as server:
        result = subprocess.run(
            [sys.executable, str(EXAMPLES / "client.py"), server.ws_url, "d", "6", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=EXIT_GUARD_S,
        )
        frames_per_chunk = server.get("/v1/model").json()["frames_per_chunk"]
        assert result.returncode == 0, result.stderr
        saved = sorted(tmp_path.glob("*.jpg"))
        assert len(saved) == 6 * frames_per_chunk, result.stdout
        assert all(path.read_bytes()[:2] == b"\xff\xd8" for path in saved)  # JPEG files, headers stripped
        assert f"{len(saved)} frames" in result.stdout
        server.settled(server.stats()["kv"]["blocks_total"])  # the session ended and gave back its KV


def test_the_python_example_takes_the_address_serve_prints_and_refuses_another_scheme_in_words(
    tmp_path: Path,
) -> None:
    with running_server(fake_settings()) as server:
        result = subprocess.run(
            [sys.executable, str(EXAMPLES / "client.py"), server.base_url + "/", "d", "2", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=EXIT_GUARD_S,
        )
        assert result.returncode == 0, result.stderr
        assert len(list(tmp_path.glob("*.jpg"))) > 0
    refused = subprocess.run(
        [sys.executable, str(EXAMPLES / "client.py"), "ftp://127.0.0.1:9/", "d", "2", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=EXIT_GUARD_S,
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "URL must start with ws://, wss://, http:// or https://" in refused.stderr


def test_every_page_the_server_serves_names_its_icon() -> None:
    # Without one a desktop browser asks for /favicon.ico, which 404s into the console of a copied example too.
    pages = sorted((REPO_ROOT / "static").rglob("*.html"))
    assert len(pages) >= 4
    assert [page.name for page in pages if '<link rel="icon"' not in page.read_text()] == []


@pytest.fixture
def example_site() -> Iterator[str]:
    """docs/examples/ on its own port: another origin than the ARStream server, as a user's site is."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(EXAMPLES))
    site = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()


BLUE = "document.getElementById('screen').getContext('2d').getImageData(0, 0, 1, 1).data[2]"


def _streams_and_steers(browser: Any, url: str) -> None:
    """The page draws frames and a held key comes back drawn; checked from outside the page, with its CSP on
    (Playwright's wait_for_function evaluates strings, which the server's Content-Security-Policy forbids)."""
    from playwright.sync_api import expect

    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("response", lambda response: errors.append(response.url) if response.status == 404 else None)
    try:
        page.goto(url)
        expect(page.locator("#status")).to_have_text(re.compile(r"frames: [2-9][0-9]"), timeout=30_000)
        page.keyboard.down("d")
        # fake-kv paints held keys into blue (d = 8): the key reached the model and came back drawn.
        for _ in range(300):  # bounded: at most 300 polls of 0.1 s
            if page.evaluate(BLUE) > 4:
                break
            page.wait_for_timeout(100)
        assert page.evaluate(BLUE) > 4, "the held key never came back drawn"
        page.keyboard.up("d")
    finally:
        page.close()
    assert not errors, errors


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's Chromium is not installed at /usr/bin/chromium")
def test_the_html_example_streams_and_steers_from_another_site(browser: Any, example_site: str) -> None:
    options = {"compute_delay_s": 0.01}
    with running_server(fake_settings(allowed_origins=example_site, model_options=options)) as server:
        _streams_and_steers(browser, f"{example_site}/client.html?server={server.ws_url}")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's Chromium is not installed at /usr/bin/chromium")
@pytest.mark.parametrize("allowed", ["", "https://another.example"])
def test_the_html_example_served_by_the_server_itself_needs_no_flag(browser: Any, allowed: str) -> None:
    # README's path: open http://127.0.0.1:8000/examples/client.html (with or without an allow list)
    options = {"compute_delay_s": 0.01}
    with running_server(fake_settings(allowed_origins=allowed, model_options=options)) as server:
        _streams_and_steers(browser, f"{server.base_url}/examples/client.html")
