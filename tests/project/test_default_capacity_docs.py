"""The capacity the docs promise at the default settings is what a server started with them reports.

README.md, docs/models.md and docs/rewind.md say how many tiny-world sessions a CPU server holds with the default
rewind horizon (and docs/models.md how many without rewind); a real server with the defaults (tiny-world on CPU)
reports its ``/v1/stats`` ``kv.session_capacity``. A change of a default or of the pool's arithmetic that moves the
figure fails here until the docs say the new one.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from servers import fake_settings, running_server

from arstream.app.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/models.md", "docs/rewind.md")
WITH_REWIND = re.compile(r"(\d+)\s+(?:tiny-world\s+)?sessions\s+with\s+the\s+default\s+(\d+)\s+s\s+rewind\s+horizon")
WITHOUT_REWIND = re.compile(r"(\d+) with `--rewind-seconds 0`")


def _reported_capacity(**overrides: object) -> int:
    # Only the address and the model are set (fake_settings: a free loopback port); the pool and rewind are defaults.
    with running_server(fake_settings(model="tiny-world", **overrides)) as server:
        stats = httpx.get(server.base_url + "/v1/stats", timeout=30).json()
    return int(stats["kv"]["session_capacity"])


def test_the_docs_capacity_at_the_default_settings_is_what_the_server_reports() -> None:
    default_horizon = Settings().rewind_seconds
    claims = {doc: WITH_REWIND.findall((REPO / doc).read_text()) for doc in DOCS}
    assert all(claims.values()), f"each of {DOCS} states the default capacity: {claims}"
    capacity = _reported_capacity()
    for doc, found in claims.items():
        for sessions, seconds in found:
            assert float(seconds) == default_horizon, f"{doc} names a {seconds} s default horizon"
            assert int(sessions) == capacity, f"{doc} says {sessions} sessions; the server reports {capacity}"

    without = WITHOUT_REWIND.findall((REPO / "docs/models.md").read_text())
    assert without, "docs/models.md states the capacity without rewind"
    capacity_without = _reported_capacity(rewind_seconds=0)
    assert {int(n) for n in without} == {capacity_without}, f"docs/models.md: {without}; reported {capacity_without}"
