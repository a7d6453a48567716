"""The shared end-of-test checks: a failing check is the test's FAIL (not a teardown ERROR)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_a_failing_end_check_fails_the_test_and_a_failing_body_keeps_its_own_failure(
    pytester: pytest.Pytester,
) -> None:
    pytester.syspathinsert(str(CONFTEST.parent))  # conftest imports the shared helpers
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(
        """
        def leak():
            raise AssertionError("2 KV blocks never came back")

        def test_leaks(check_at_end):
            check_at_end(leak)

        def test_clean(check_at_end):
            check_at_end(lambda: None)

        def test_body_fails_first(check_at_end):
            check_at_end(leak)
            assert 1 == 2, "the body's own failure"
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2, errors=0)
    result.stdout.fnmatch_lines(["*_ test_leaks _*", "*AssertionError: 2 KV blocks never came back"])
    result.stdout.fnmatch_lines(["*_ test_body_fails_first _*", "*AssertionError: the body's own failure"])
    # Only test_leaks reports the leak: no check runs after a failed body. (Counted in the
    # failure sections, not the summary, whose lines pytest cuts to the terminal width unless CI is set.)
    output = result.stdout.str()
    body_failure = output.split("_ test_body_fails_first _", 1)[1].split("short test summary info", 1)[0]
    assert "the body's own failure" in body_failure
    assert "2 KV blocks never came back" not in body_failure
