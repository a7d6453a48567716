#!/usr/bin/env bash
# matrix-game-2 at full size (1.3b config, random weights, bf16) on one CUDA GPU: bench model, JSON last.
#
# Here (with network), once:   scripts/gpu-check-matrix-game.sh --fetch-wheels
#   downloads diffusers and its pure-Python dependencies (Python 3.12 wheels) into build/gpu-wheels/
#   (git-ignored: carry it to the GPU machine).
# There (no network, a stock CUDA PyTorch image):   scripts/gpu-check-matrix-game.sh
#   installs the carried wheels into a scratch folder (nothing system-wide), lays out the `arstream`
#   namespace over this checkout, and runs `bench model` on cuda. Output is tee'd to $OUT (or out/).
# Knobs: CHUNKS (default 12), REPEATS (3), STREAMS (2), DTYPE (bfloat16); DEVICE=cpu CONFIG=tiny DTYPE=float32
# dry-runs the script's mechanics on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/gpu-wheels

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p "$WHEELS"
    # diffusers and its dependency closure (as resolved here) except numpy, pillow and safetensors.
    .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$WHEELS" \
        "diffusers==0.42.1" huggingface-hub hf-xet httpx2 httpcore2 truststore lazy-importer click \
        regex importlib_metadata zipp filelock fsspec packaging pyyaml tqdm typing-extensions \
        anyio h11 idna certifi requests urllib3 charset-normalizer
    ls "$WHEELS"
    exit 0
fi

OUT_DIR="${OUT:-out}"
mkdir -p "$OUT_DIR"
SITE="$(mktemp -d)"
if ! python3 -c "import diffusers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
fi
# The installed package maps app/, runner/, models/ under `arstream`; from a checkout, symlinks do.
mkdir -p "$SITE/arstream"
for entry in __init__.py __main__.py measure.py; do ln -s "$PWD/arstream/$entry" "$SITE/arstream/$entry"; done
for folder in app runner models static; do ln -s "$PWD/$folder" "$SITE/arstream/$folder"; done

export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
python3 - "$OUT_DIR" <<'PY' 2>&1 | tee "$OUT_DIR/gpu-check-matrix-game.txt"
import argparse, json, os, sys, torch
from arstream.models.bench_model import add_arguments, run

device = os.environ.get("DEVICE", "cuda")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if device == 'cuda' else device}", flush=True)
parser = argparse.ArgumentParser()
add_arguments(parser)
config = os.environ.get("CONFIG", "1.3b")
options = {"config": config, "random_init": True, "dtype": os.environ.get("DTYPE", "bfloat16")}
args = parser.parse_args([
    "--model", "matrix-game-2", "--model-options", json.dumps(options), "--device", device,
    "--chunks", os.environ.get("CHUNKS", "12"), "--repeats", os.environ.get("REPEATS", "3"),
    "--streams", os.environ.get("STREAMS", "2"), "--threads", "8",
])
sys.exit(run(args))  # its last line is the JSON summary
PY
