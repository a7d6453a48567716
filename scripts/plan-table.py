"""The table in docs/models.md ("Will it fit"): `arstream plan`'s figures for each planned model at 24, 48, 80 and
141 GB.

    python scripts/plan-table.py > table.md

Each model is built once per weights option on the meta device (nothing read), then planned at each memory size
with serve's defaults on a GPU (the 30 s rewind horizon within 24 MiB a session) and the session cap raised, so
the figures show what memory holds; each cell is the sessions with 4 sessions a forward (serve's default on a GPU)
and with `--max-batch-sessions 1`. GB are 10^9 bytes, as cards are sold.
"""

from __future__ import annotations

import logging

from arstream.app.plan import fit_plan, gib
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
    # no quantized weights offered (the `weights` option is the Wan models')
    ("waypoint-1.5", {"config": "1.5"}, "waypoint-1.5 (stand-in shape)", (None,)),
)


def main() -> None:
    logging.disable(logging.WARNING)  # the runner's notes on rewind, once per plan
    print("| model | weights | on the GPU | per session | " + " | ".join(f"{gb} GB" for gb in SIZES_GB) + " |")
    print("|---|---|---|---|" + "---|" * len(SIZES_GB))
    for model, options, label, offered in MODELS:
        for weights in offered:
            chosen = {**options, "session_capacity": 256, **({"weights": weights} if weights else {})}
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
            print(
                f"| {label} | {weights or 'bf16'} | {gib(last.gpu_weights_bytes)} | {gib(last.per_session_bytes)} | "
                + " | ".join(cells)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
