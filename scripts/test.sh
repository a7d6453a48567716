#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian machine, then runs them.
# Used by the README's test command and by CI (.ci/run).
#
#   bash scripts/test.sh [pytest arguments]     set up, then mypy and ruff (no arguments only), then pytest
#   bash scripts/test.sh --plan [...]           say each step and its command, run nothing
#
# Each step says what it does as it starts, and how long the whole took so far.
set -euo pipefail
cd "$(dirname "$0")/.."

plan=0
if [ "${1:-}" = "--plan" ]; then plan=1; shift; fi
step=0
step() {  # WHAT: announce the next step (to stderr, so pytest's own output stays as it is)
    step=$((step + 1))
    echo "scripts/test.sh: step $step ($((SECONDS))s so far): $*" >&2
}
run() {  # COMMAND...: run it, or with --plan only show it
    if [ "$plan" = 1 ]; then echo "    $*" >&2; else "$@"; fi
}

# chromium: browser tests; haproxy: the local cluster; prometheus: promtool for the deploy/ checks;
# dnsmasq-base: the DNS a Kubernetes pod sees, on loopback, for tests/cluster/test_kubernetes_rollout.py (the binary
# only: Debian's dnsmasq package would also start a system-wide resolver); coturn: the TURN relay's test
# (tests/server/test_webrtc_turn.py starts its own turnserver on loopback; the package's system service is stopped
# and disabled where systemd runs, so that no relay listens on 3478 with Debian's default configuration).
if [ ! -x /usr/bin/chromium ] || ! command -v haproxy >/dev/null || ! command -v promtool >/dev/null \
    || [ ! -x /usr/sbin/dnsmasq ] || ! command -v turnserver >/dev/null; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    step "Debian packages chromium, haproxy, prometheus, dnsmasq-base, coturn (apt-get${SUDO:+, with sudo})"
    run $SUDO apt-get update -qq
    run env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
    run env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends haproxy prometheus \
        dnsmasq-base coturn >/dev/null
    if [ -d /run/systemd/system ]; then
        run $SUDO systemctl disable --now coturn >/dev/null 2>&1 || true
    fi
else
    step "Debian packages: chromium, haproxy, prometheus, dnsmasq-base and coturn are already installed"
fi

if [ ! -x .venv/bin/python ]; then
    step "a virtual environment in .venv"
    run python3 -m venv .venv
fi
step "pip upgraded, torch 2.13.0, then this checkout with its test extra (pip install -e '.[test]')"
run .venv/bin/pip install -q --upgrade pip
# torch pinned first so pip takes the local CPU build rather than a CUDA one.
run .venv/bin/pip install -q "torch==2.13.0"
# setuptools warns at length about every editable install from a checkout with an arstream/ folder; it is expected.
run env PYTHONWARNINGS="ignore:Editable installation" .venv/bin/pip install -q -e ".[test]"

# The whole suite (no arguments, as CI runs it) starts with the type check and the linter over the whole
# tree, as configured in pyproject.toml ([tool.mypy], [tool.ruff]).
if [ $# -eq 0 ]; then
    step "type check of the whole tree (mypy; a few minutes on 2 cores, silent until it ends)"
    run .venv/bin/python -m mypy
    step "lint (ruff)"
    run .venv/bin/python -m ruff check --quiet .
fi
step "the tests (pytest${*:+ $*})"
if [ "$plan" = 1 ]; then echo "    .venv/bin/python -m pytest -q $*" >&2; exit 0; fi
exec .venv/bin/python -m pytest -q "$@"
