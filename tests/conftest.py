"""Shared fixtures. Plain helpers live beside them: ``servers`` (live servers, ``LiveServer.settled``),
``runner_fakes`` (spec and runner builders, ticks, runner fakes) and ``browser_helpers`` (the page checks
behind the ``browser`` and ``errors`` fixtures here).

Checks that belong to every test of a kind, like "every session's KV blocks
came back", run as the last step of the test itself (:func:`check_at_end`),
so a leak is that test's FAIL with the test's name, not an ERROR in teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import torch

from browser_helpers import CHROMIUM, CHROMIUM_ARGS, DESKTOP, PageErrors, new_page, open_context
from servers import LiveServer

END_CHECKS = pytest.StashKey[list[Callable[[], object]]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """Run the checks registered with :func:`check_at_end` after the test body, as part of the test."""
    result = yield  # a test that already failed keeps its own failure
    for check in item.stash.get(END_CHECKS, []):
        check()
    return result


@pytest.fixture
def check_at_end(request: pytest.FixtureRequest) -> Callable[[Callable[[], object]], None]:
    """Register a check (a callable that raises AssertionError) to run when the test body has passed."""
    return request.node.stash.setdefault(END_CHECKS, []).append


@pytest.fixture
def baseline(server: LiveServer, check_at_end: Callable[[Callable[[], object]], None]) -> int:
    """Free KV blocks before the test; the test fails unless every session's blocks are back after it.

    Uses the module's ``server`` fixture (a :class:`LiveServer`).
    """
    start_free = int(server.stats()["kv"]["blocks_free"])
    check_at_end(lambda: server.settled(start_free))
    return start_free


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Two shared cores: one torch thread per process avoids oversubscription (heavy model tests ask for it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium through Playwright, one per test module (browser tests, ``browser_marks``)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def errors() -> Iterator[PageErrors]:
    """A test's PageErrors; the test fails if any watched page raised a JavaScript error."""
    errors = PageErrors()
    yield errors
    errors.check()


@pytest.fixture
def viewport() -> dict[str, int]:
    """The window size of the ``context`` fixture; a module overrides this fixture to test at another size."""
    return DESKTOP


@pytest.fixture
def context(browser: Any, viewport: dict[str, int]) -> Iterator[Any]:
    """A fresh browser context (:func:`browser_helpers.open_context`) at ``viewport``, closed after the test."""
    context = open_context(browser, viewport)
    yield context
    context.close()


@pytest.fixture
def page(context: Any, errors: PageErrors) -> Any:
    """A page of ``context`` whose JavaScript errors fail the test (``errors``)."""
    return new_page(context, errors)
