#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian machine, then runs them.
# Used by the README's test command and by CI (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

# chromium: browser tests; haproxy: the local cluster; prometheus: promtool for the deploy/ checks;
# dnsmasq-base: the DNS a Kubernetes pod sees, on loopback, for tests/test_kubernetes_rollout.py (the binary
# only: Debian's dnsmasq package would also start a system-wide resolver).
if [ ! -x /usr/bin/chromium ] || ! command -v haproxy >/dev/null || ! command -v promtool >/dev/null \
    || [ ! -x /usr/sbin/dnsmasq ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends haproxy prometheus \
        dnsmasq-base >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
# torch pinned first so pip takes the local CPU build rather than a CUDA one.
.venv/bin/pip install -q "torch==2.13.0"
# setuptools warns at length about every editable install from a checkout with an arstream/ folder; it is expected.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/pip install -q -e ".[test]"

# The whole suite (no arguments, as CI runs it) starts with the type check and the linter over the whole
# tree, as configured in pyproject.toml ([tool.mypy], [tool.ruff]).
if [ $# -eq 0 ]; then
    .venv/bin/python -m mypy
    .venv/bin/python -m ruff check --quiet .
fi
exec .venv/bin/python -m pytest -q "$@"
