#!/usr/bin/env bash
# The GPU check: one command on a lent GPU machine, one JSON object (docs/benchmarks.md, "The GPU check").
#
# Here (with network), once:   scripts/gpu-check.sh --fetch-wheels
#   downloads, as CPython 3.12 manylinux wheels, every distribution the server, PyAV (h264) and diffusers
#   (matrix-game-2's VAE) need beyond the GPU image's torch, numpy, pillow and safetensors, pinned to the
#   versions installed here (`arstream bench gpu-check --carried-requirements`), into build/gpu-check-wheels/
#   (git-ignored: name it in the device tool's `carry`; it says its size, the carry limit is 64 MiB).
# There (no network, stock CUDA PyTorch on Python 3.12):   scripts/gpu-check.sh
#   installs this checkout into a scratch folder (pip --target; never importing it from the checkout, whose
#   `arstream/` folder would shadow the package), installs the carried wheels beside it only if the server's
#   imports fail without them, and runs `arstream bench gpu-check`: h264 encode cost, one replica over
#   P = 1, 2, 4 GPUs (as many as there are) for Krea 14B's shape and matrix-game-2 1.3b, Waypoint-1.5 at 720p
#   and 360p (one session and four batched), tiny-world and
#   matrix-game-2 1.3b (bf16, random weights) through the real server at 1, 2, 4 and 8 sessions, and more
#   (docs/benchmarks.md, "The GPU check").
#   Everything is tee'd to $OUT/gpu-check.txt ($OUT, else ./out) and the JSON, rewritten after every
#   phase, is $OUT/gpu-check.json, so a run cut short by a timeout still returns what it measured.
#   Its last line is the JSON object; the exit status is 0 only when every phase ran.
# On a CPU:   scripts/gpu-check.sh --cpu   (or DEVICE=cpu): tiny configs, the same code path and JSON keys, with
#   the checkout's .venv unless PYTHON is given;
#   tests/programs/test_gpu_check.py runs it so from a fresh clone.
# Knobs: PYTHON (python3), DEVICE (cuda), OUT (./out), WHEELS (build/gpu-check-wheels), DEADLINE_S.
set -euo pipefail
CHECKOUT="$(cd "$(dirname "$0")/.." && pwd)"
WHEELS="${WHEELS:-$CHECKOUT/build/gpu-check-wheels}"
PYTHON_GIVEN="${PYTHON:-}"
PYTHON="${PYTHON:-python3}"
CARRY_LIMIT_MIB=64
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    HERE_PYTHON="${PYTHON_HERE:-$CHECKOUT/.venv/bin/python}"
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS/build"
    mapfile -t requirements < <(cd / && "$HERE_PYTHON" -P -m arstream bench gpu-check --carried-requirements)
    download=("$HERE_PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp
        --python-version "${WHEEL_PYTHON_VERSION:-3.12}" --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any)
    "${download[@]}" -d "$WHEELS" "${requirements[@]}"
    # Builds this checkout there (pip install --no-build-isolation) where the image's setuptools is older.
    "${download[@]}" -d "$WHEELS/build" "setuptools>=77"
    ls "$WHEELS" "$WHEELS/build"
    size_kib=$(du -sk "$WHEELS" | cut -f1)
    echo "$WHEELS: $(( size_kib / 1024 )) MiB ($(ls "$WHEELS"/*.whl | wc -l) wheels; the carry limit is ${CARRY_LIMIT_MIB} MiB)"
    if (( size_kib > CARRY_LIMIT_MIB * 1024 )); then
        echo "too large to carry" >&2
        exit 1
    fi
    exit 0
fi

DEVICE="${DEVICE:-cuda}"
[[ "${1:-}" == "--cpu" ]] && DEVICE=cpu
# On a CPU machine the bare python3 has none of the server's packages and there are no carried wheels: the
# checkout's own venv (the README's set-up makes it) is what a CPU rehearsal runs with, unless PYTHON names one.
if [[ "$DEVICE" == cpu && -z "$PYTHON_GIVEN" && -x "$CHECKOUT/.venv/bin/python" ]]; then
    PYTHON="$CHECKOUT/.venv/bin/python"
fi
OUT_DIR="${OUT:-$PWD/out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
PACKAGE="$SCRATCH/package"  # this checkout, installed
DEPS="$SCRATCH/deps"        # the carried wheels, installed only when needed
# Python runs from here, with PYTHONSAFEPATH (-P) set too: the checkout is never on sys.path.
cd "$SCRATCH"

# The third-party modules the server, the check and its phases import beyond the GPU image's (cheap to try:
# none of them imports torch); if one is missing, every carried wheel is installed. After that the server's
# own must import (nothing runs without them); diffusers (matrix-game-2) and av (h264) fail only their phases.
SERVER_IMPORTS="fastapi, starlette, uvicorn, uvloop, websockets, httptools, pydantic_settings, simplejpeg, jsonschema"
PHASE_IMPORTS="diffusers, av, torchao"

# The carried wheels in $1 (a folder), or a message saying how to bring them.
wheels_in() {
    if ! ls "$1"/*.whl >/dev/null 2>&1; then
        echo "no wheels in $1: run scripts/gpu-check.sh --fetch-wheels where there is network, and carry" \
            "build/gpu-check-wheels" >&2
        return 1
    fi
    echo "$1"/*.whl
}

# Runs pip quietly, showing its output only when it fails.
quiet_pip() {
    local log
    if ! log=$("$PYTHON" -m pip "$@" 2>&1); then
        echo "$log"
        return 1
    fi
}

check() {
    echo "== $(date -u +%H:%M:%S) $PYTHON: $("$PYTHON" -c 'import sys; print(sys.version.split()[0])'), device $DEVICE, checkout $CHECKOUT"
    # This checkout, built by its own pyproject: with the image's setuptools if new enough, else the carried one.
    local build_path=""
    if ! "$PYTHON" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
        setuptools_wheel=$(wheels_in "$WHEELS/build")
        quiet_pip install --no-index --no-deps --target "$SCRATCH/build" $setuptools_wheel
        build_path="$SCRATCH/build"
    fi
    # Built from a copy, so the checkout gets no build/lib or egg-info (a stale build/lib would go into the wheel).
    mkdir "$SCRATCH/source"
    tar -C "$CHECKOUT" --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./out -cf - . | tar -C "$SCRATCH/source" -xf -
    PYTHONPATH="$build_path" quiet_pip install --no-index --no-deps --no-compile --no-build-isolation --target "$PACKAGE" "$SCRATCH/source"
    export PYTHONPATH="$PACKAGE"
    if ! "$PYTHON" -c "import $SERVER_IMPORTS, $PHASE_IMPORTS" 2>/dev/null; then
        echo "== $(date -u +%H:%M:%S) installing the carried wheels ($WHEELS)"
        carried=$(wheels_in "$WHEELS")
        quiet_pip install --no-index --no-deps --no-compile --target "$DEPS" $carried
        export PYTHONPATH="$PACKAGE:$DEPS"
        "$PYTHON" -c "import $SERVER_IMPORTS"  # fails here, naming the missing module
    fi
    echo "== $(date -u +%H:%M:%S) installed; arstream bench gpu-check"
    "$PYTHON" -m arstream bench gpu-check --device "$DEVICE" --out "$OUT_DIR" ${DEADLINE_S:+--deadline-s "$DEADLINE_S"}
}

check 2>&1 | tee "$OUT_DIR/gpu-check.txt"
