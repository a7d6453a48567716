"""The README's set-up says what its two commands do: the Debian packages scripts/test.sh installs, the CPU-only
torch install for a stock machine, and the /v1/stats fields it names for room in memory versus sessions at full
speed, which a served server reports."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from servers import fake_settings, running_server

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _quick_start() -> str:
    return README[README.index("## Quick start") : README.index("\n## ", README.index("## Quick start") + 1)]


def test_the_quick_start_keeps_exactly_two_set_up_commands() -> None:
    assert len(re.findall(r"^```bash$", _quick_start(), re.M)) == 2


def test_the_readme_names_every_debian_package_the_test_script_installs() -> None:
    script = (REPO / "scripts/test.sh").read_text().replace("\\\n", " ")  # continued lines joined
    installs = " ".join(re.findall(r"apt-get install [^\n]*", script))
    packages = set(re.findall(r"\b(chromium|haproxy|prometheus|dnsmasq-base|coturn)\b", installs))
    assert packages == {"chromium", "haproxy", "prometheus", "dnsmasq-base", "coturn"}, installs
    section = _quick_start()
    for package in packages:
        assert f"`{package}`" in section, package
    assert "apt-get" in section and "sudo" in section and "--plan" in section


def test_the_readme_gives_the_cpu_only_torch_install_for_a_stock_machine() -> None:
    assert "pip install\ntorch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in _quick_start()


def test_the_stats_fields_the_readme_names_are_what_a_server_reports() -> None:
    named = re.findall(r"`(kv|sessions)\.(\w+)`", _quick_start())
    assert ("kv", "session_capacity") in named and ("sessions", "realtime_capacity") in named, named
    with running_server(fake_settings()) as server:
        stats = httpx.get(server.base_url + "/v1/stats", timeout=30).json()
    for group, field in named:
        assert field in stats[group], (group, field)
