"""scripts/test.sh (the README's test command) says each step as it starts, and ``--plan`` shows them without
running any: what it installs (Debian packages with apt-get, a pip upgrade, torch, the test extra), the type
check and the linter, then pytest."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_test_script_names_every_step_and_its_plan_runs_nothing() -> None:
    before = sorted(p.name for p in REPO.iterdir())
    done = subprocess.run(
        ["bash", str(REPO / "scripts/test.sh"), "--plan"], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert done.stdout == "", "the steps go to stderr: pytest's output stays as it was"
    steps = [line for line in done.stderr.splitlines() if line.startswith("scripts/test.sh: step ")]
    said = "\n".join(steps)
    for what in ("Debian packages", "chromium, haproxy, prometheus", "torch 2.13.0", "pip upgraded",
                 "test extra", "type check of the whole tree (mypy", "lint (ruff)", "the tests (pytest)"):
        assert what in said, (what, done.stderr)
    assert "pip install -q -e .[test]" in done.stderr and "-m pytest -q" in done.stderr
    assert sorted(p.name for p in REPO.iterdir()) == before, "--plan creates nothing (no .venv)"
    # arguments go to pytest, and skip the whole-tree checks
    one = subprocess.run(["bash", str(REPO / "scripts/test.sh"), "--plan", "tests/runner"], capture_output=True,
                         text=True, cwd=REPO, check=True)
    assert "mypy" not in one.stderr and "the tests (pytest tests/runner)" in one.stderr
