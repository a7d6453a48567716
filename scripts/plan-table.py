"""The tables in docs/models.md ("Will it fit"): `arstream plan`'s figures for each planned model at 24, 48, 80 and
141 GB, on one GPU and over P devices (serve's --devices).

    python scripts/plan-table.py > table.md            # both tables
    python scripts/plan-table.py --table devices        # the per-P one only

Each model is built once per weights option (and per P) on the meta device (nothing read), then planned at each
memory size with serve's defaults on a GPU (the 30 s rewind horizon within 24 MiB a session) and the session cap
raised, so the figures show what memory holds; each cell is the sessions with 4 sessions a forward (serve's default
on a GPU) and with `--max-batch-sessions 1`. GB are 10^9 bytes, as cards are sold. tests/project/test_plan_doc.py
checks rows of the doc's tables against these functions.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from arstream.app.plan import PlanError, fit_plan, gib
from arstream.app.settings import Settings
from arstream.models.registry import load_pipeline

SIZES_GB = (24, 48, 80, 141)
WEIGHTS = (None, "int8", "fp8")
MODELS = (
    ("matrix-game-2", {"config": "1.3b"}, "matrix-game-2 1.3b", WEIGHTS),
    ("longlive", {"config": "1.3b"}, "longlive 1.3b", WEIGHTS),
    ("longlive", {"config": "1.3b", "text_encoder_device": "cpu"}, "longlive 1.3b, umT5 on the CPU", WEIGHTS),
    ("longlive", {"config": "self-forcing-1.3b", "text_encoder_device": "cpu"}, "self-forcing 1.3b, umT5 on the CPU",
     WEIGHTS),
    ("krea-realtime", {"config": "14b"}, "krea-realtime 14b", WEIGHTS),
    ("krea-realtime", {"config": "14b", "text_encoder_device": "cpu"}, "krea-realtime 14b, umT5 on the CPU", WEIGHTS),
    # w8a8 holds the same bytes as int8 (its activations are quantized on the fly); fp8 too
    ("waypoint-1.5", {"config": "1.5"}, "waypoint-1.5 720p", (None, "int8")),
    ("waypoint-1.5", {"config": "1.5-360p"}, "waypoint-1.5 360p", (None, "int8")),
)
# The per-P table: the models that span devices; P = 8 shows the refusal for the 1.3B models' 12 heads.
DEVICE_COUNTS = (1, 2, 4, 8)
DEVICE_MODELS = (
    ("matrix-game-2", {"config": "1.3b"}, "matrix-game-2 1.3b", (None,)),
    ("longlive", {"config": "1.3b"}, "longlive 1.3b", (None,)),
    ("krea-realtime", {"config": "14b"}, "krea-realtime 14b", WEIGHTS),
    ("krea-realtime", {"config": "14b", "text_encoder_device": "cpu"}, "krea-realtime 14b, umT5 on the CPU", ("int8",)),
)


GPU_HEADER = "| model | weights | on the GPU | per session | " + " | ".join(f"{gb} GB" for gb in SIZES_GB) + " |"
DEVICE_HEADER = (
    "| model | weights | P | weights on each device | heads on each | KV a session, each device | "
    "a session, each device | activations a session, each device (estimate) | "
    + " | ".join(f"{gb} GB" for gb in SIZES_GB) + " |"
)


def chosen_options(options: dict[str, Any], weights: str | None) -> dict[str, Any]:
    return {**options, "session_capacity": 256, **({"weights": weights} if weights else {})}


def gpu_row(model: str, options: dict[str, Any], label: str, weights: str | None) -> str:
    """One row of the one-GPU table."""
    chosen = chosen_options(options, weights)
    pipeline = load_pipeline(model, "meta", **chosen)
    cells = []
    for gb in SIZES_GB:
        held = [
            fit_plan(Settings(model=model, model_options=chosen, max_batch_sessions=batch),
                     gpu_memory_bytes=gb * 10**9, pipeline=pipeline)
            for batch in (4, 1)
        ]  # fmt: skip
        cells.append(" / ".join(str(p.session_capacity) for p in held))
    last = held[0]
    return (f"| {label} | {weights or 'bf16'} | {gib(last.gpu_weights_bytes)} | {gib(last.per_session_bytes)} | "
            + " | ".join(cells) + " |")  # fmt: skip


def device_row(model: str, options: dict[str, Any], label: str, weights: str | None, world: int) -> str:
    """One row of the per-P table: each device's figures for one replica over ``world`` devices."""
    chosen = chosen_options(options, weights)
    devices = ",".join(f"cuda:{i}" for i in range(world)) if world > 1 else None
    pipeline: Any = load_pipeline(model, "meta", **chosen)  # given each P's share in place by the plan
    head = f"| {label} | {weights or 'bf16'} | {world} |"
    cells, held = [], []
    for gb in SIZES_GB:
        try:
            held = [
                fit_plan(Settings(model=model, model_options=chosen, max_batch_sessions=batch, devices=devices),
                         gpu_memory_bytes=gb * 10**9, pipeline=pipeline)
                for batch in (4, 1)
            ]  # fmt: skip
        except PlanError:
            heads = pipeline.kv_cache_spec().num_kv_heads
            return f"{head} refused: {world} does not divide its {heads} heads |" + " |" * (4 + len(SIZES_GB))
        cells.append(" / ".join(str(p.session_capacity) for p in held))
    plan = held[1]  # one session a forward: its per-session figures are the same at every size that fits
    kv = plan.resident_frames * plan.branches * plan.block_bytes
    activations = "" if plan.activation_bytes is None else gib(plan.activation_bytes)
    return (f"{head} {gib(plan.gpu_weights_bytes)} | {plan.device_kv_heads} of {plan.kv_heads} | {gib(kv)} | "
            f"{gib(plan.per_session_bytes) if plan.per_session_bytes else 'does not fit'} | {activations} | "
            + " | ".join(cells) + " |")  # fmt: skip


def gpu_table() -> list[str]:
    lines = [GPU_HEADER, "|---|---|---|---|" + "---|" * len(SIZES_GB)]
    for model, options, label, offered in MODELS:
        lines += [gpu_row(model, options, label, weights) for weights in offered]
    return lines


def device_table() -> list[str]:
    lines = [DEVICE_HEADER, "|---|---|---|---|---|---|---|---|" + "---|" * len(SIZES_GB)]
    for model, options, label, offered in DEVICE_MODELS:
        lines += [device_row(model, options, label, weights, world) for weights in offered for world in DEVICE_COUNTS]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=("gpu", "devices", "both"), default="both")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the runner's notes on rewind, once per plan
    if args.table in ("gpu", "both"):
        print("\n".join(gpu_table()) + "\n", flush=True)
    if args.table in ("devices", "both"):
        print("\n".join(device_table()), flush=True)


if __name__ == "__main__":
    main()
