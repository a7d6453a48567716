#!/usr/bin/env bash
# One CUDA GPU, one command, a few minutes: `bench model` and `bench serve` at 1, 4 and 16 sessions, JSON lines.
#
# Here (with network), once:   scripts/gpu-check.sh --fetch-wheels
#   downloads the server's pure-Python and manylinux wheels for Python 3.12 into build/gpu-check-wheels/
#   (git-ignored: name it in `carry`). The GPU image has CUDA PyTorch, numpy, safetensors, httpx,
#   prometheus-client and pillow (docs: /work/shared/GPU.md); PyAV is not carried, so h264 is not measured.
# There (no network, a stock CUDA PyTorch image):   scripts/gpu-check.sh
#   installs the carried wheels into a scratch folder (nothing system-wide), lays out the `arstream`
#   namespace over this checkout with symlinks, and runs, each printing its JSON summary last:
#     bench model --streams 16 (16 tiny-world streams batched vs round robin),
#     bench serve --sessions N --max-batch-sessions N for N in 1 4 16 (server vs bare runner, side by side).
#   Everything is tee'd to $OUT/gpu-check.txt ($OUT, else out/), and the JSON lines alone to
#   $OUT/gpu-check.jsonl, so a run cut short by a timeout still returns what it measured.
# Knobs: DEVICE (cuda), MODEL (tiny-world), SESSIONS ("1 4 16"), CHUNKS (48), REPEAT (3), STREAMS (16).
# DEVICE=cpu SESSIONS=1 CHUNKS=4 REPEAT=1 STREAMS=2 dry-runs the mechanics on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/gpu-check-wheels

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p "$WHEELS"
    # What the server imports beyond the image's packages (GPU.md), with their own dependencies.
    .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --platform any -d "$WHEELS" \
        fastapi starlette "uvicorn>=0.54" websockets httptools python-dotenv pyyaml pydantic pydantic-core \
        pydantic-settings annotated-types typing-inspection typing-extensions simplejpeg jsonschema \
        jsonschema-specifications referencing rpds-py attrs opentelemetry-api importlib-metadata zipp \
        anyio sniffio h11 click idna
    ls "$WHEELS"
    exit 0
fi

DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-tiny-world}"
SESSIONS="${SESSIONS:-1 4 16}"
CHUNKS="${CHUNKS:-48}"
REPEAT="${REPEAT:-3}"
STREAMS="${STREAMS:-16}"
OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu-check.txt"
JSONL="$OUT_DIR/gpu-check.jsonl"
: > "$LOG"
: > "$JSONL"

SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
if ! python3 -c "import fastapi, uvicorn, websockets, pydantic_settings, simplejpeg, jsonschema" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
fi
# The installed package maps app/, runner/, models/, static/ under `arstream`; from a checkout, symlinks do.
mkdir -p "$SITE/arstream"
for entry in arstream/*.py; do ln -s "$PWD/$entry" "$SITE/$entry"; done
for folder in app runner models static; do ln -s "$PWD/$folder" "$SITE/arstream/$folder"; done
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1

# Runs one command, keeps its output, and copies its last line (the JSON summary) to the .jsonl file.
run() {
    echo "== arstream $*" | tee -a "$LOG"
    python3 -m arstream "$@" 2>&1 | tee -a "$LOG" | tail -n 1 | tee -a "$JSONL"
}

python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if '$DEVICE' == 'cuda' else '$DEVICE')" \
    | tee -a "$LOG"
run bench model --model "$MODEL" --device "$DEVICE" --streams "$STREAMS" --chunks "$CHUNKS" --repeats "$REPEAT"
for sessions in $SESSIONS; do
    run bench serve --model "$MODEL" --device "$DEVICE" --sessions "$sessions" --max-batch-sessions "$sessions" \
        --chunks "$CHUNKS" --repeat "$REPEAT"
done
echo "JSON summaries: $JSONL" | tee -a "$LOG"
