#!/usr/bin/env bash
# The compiled-forward lane (--compile; docs/server.md): torch's inductor on the CPU, which builds its kernels with
# a C++ compiler (minutes on two cores), so the main suite (scripts/test.sh) skips these tests. Uses the main
# suite's venv. Called by CI (.ci/run) after the main suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v g++ >/dev/null; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi
ARSTREAM_COMPILE_LANE=1 exec .venv/bin/python -m pytest -q --timeout 1800 tests/compile_lane "$@"
