"""``arstream eval tiny-world``: responsiveness, drift and picture quality of the shipped model, through the runner.

* Responsiveness: for each of ``w``, ``a``, ``s``, ``d`` held from the first
  frame, the share of consecutive frame pairs whose content moves the right
  way by at least half a pixel (phase correlation); with no key held, the mean
  shift.
* Drift: a walk in a square (``d``, ``s``, ``a``, ``w``, a quarter each);
  total variation between the 8x8x8 colour histograms of the first and last
  quarter, and contrast, pixel noise, palette share and motion of the last
  quarter against the first (no collapse to grey, noise or a frozen pattern).
* Picture quality, next to the ground truth of the same key
  sequences rendered by the procedural world: palette share, class
  coherence, grid peak and class shares against the map's, over every frame
  of the rollouts above plus an idle rollout per seed (move, then hold no
  key), whose idle change is the share of pixels that change class while the
  camera stands still. Contact sheets (ground truth above generated frames)
  go to ``--out`` as PNG, with the figures as ``metrics.json``.

The same checks, shortened, are the tests in ``tests/models/test_tiny_world_quality.py``.
Prints a table and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from ...cli import main_for
from .metrics import (
    MIN_SHIFT_PX,
    color_histogram,
    drift_report,
    idle_change,
    picture_quality,
    responsiveness,
    total_variation,
)
from ...models.tiny_world.pipeline import TinyWorldPipeline, load_tiny_world
from ...models.tiny_world.world import CLASS_NAMES, CLASS_SHARES, ProceduralWorld
from ...runner.runner import ARRunner, runner_for_sessions
from ...runner.threads import default_torch_threads
from ...runner.types import TickRequest

RESPONSIVE_SHARE = 0.8
MAX_TV = 0.35
# a healthy last quarter keeps at least this share of the first quarter's contrast,
# stays mostly on the world's palette, is not much noisier, and still moves
MIN_CONTRAST_RATIO = 0.5
MIN_PALETTE_FRACTION = 0.7
MAX_NOISE_RATIO = 2.0
# the targets for the picture-quality figures: (comparison, bound)
QUALITY_TARGETS: dict[str, tuple[str, float]] = {
    "palette_share": (">=", 0.95),
    "coherence": (">=", 0.88),
    "grid_peak": ("<=", 1.8),
    "class_tv": ("<=", 0.10),
    "idle_change": ("<=", 0.02),
}
# the idle rollout: move right then down, then stand still; idle change compares the frame
# IDLE_SETTLE frames after the release with the one IDLE_SPAN frames later
IDLE_MOVE_FRAMES = 16
IDLE_SETTLE = 8
IDLE_SPAN = 64

# a recorded rollout: name, seed, held keys per chunk, generated frames
Recorded = tuple[str, int, list[list[str]], np.ndarray]


def make_runner(pipeline: TinyWorldPipeline, sessions: int = 4) -> ARRunner:
    """A runner on the pipeline's device with room for exactly ``sessions`` resident sessions."""
    return runner_for_sessions(pipeline, sessions, device=pipeline.device)


def rollout(runner: ARRunner, keys_per_chunk: Sequence[Sequence[str]], seed: int, session_id: str = "eval") -> np.ndarray:
    """Frames ``[chunks * F, H, W, 3]`` of one fresh session driven chunk by chunk; the session is closed after."""
    frames = []
    last = len(keys_per_chunk) - 1
    for i, keys in enumerate(keys_per_chunk):
        tick = TickRequest(
            session_id=session_id,
            request_id=i,
            controls={"keys": list(keys)},
            seed=seed,
            reset=i == 0,
            close=i == last,
        )
        frames.append(runner.execute_tick(tick).frames)
    return np.concatenate(frames)


@functools.lru_cache(maxsize=8)
def world(seed: int) -> ProceduralWorld:
    return ProceduralWorld(seed)


def truth_rollout(keys_per_chunk: Sequence[Sequence[str]], seed: int, frames_per_chunk: int) -> np.ndarray:
    """The ground-truth frames of a rollout: the same held keys on the procedural world of ``seed``."""
    keys = [list(k) for k in keys_per_chunk for _ in range(frames_per_chunk)]
    return world(seed).rollout(0, 0, keys)[0]


def hold(keys: Sequence[str], frames: int, frames_per_chunk: int) -> list[list[str]]:
    return [list(keys)] * (-(-frames // frames_per_chunk))


def square_walk(frames: int, frames_per_chunk: int) -> list[list[str]]:
    side = frames // 4
    return [k for key in ("d", "s", "a", "w") for k in hold([key], side, frames_per_chunk)]


def idle_walk(frames_per_chunk: int) -> tuple[list[list[str]], int]:
    """Keys per chunk of the idle rollout (right, down, then no key) and the frame at which the keys let go."""
    move = hold(["d"], IDLE_MOVE_FRAMES, frames_per_chunk) + hold(["s"], IDLE_MOVE_FRAMES, frames_per_chunk)
    still = hold([], IDLE_SETTLE + IDLE_SPAN + 1, frames_per_chunk)
    return move + still, len(move) * frames_per_chunk


def recorded_rollout(
    runner: ARRunner, name: str, keys_per_chunk: list[list[str]], seed: int, record: list[Recorded] | None
) -> np.ndarray:
    """:func:`rollout`, kept in ``record`` (when given) for the picture-quality figures and contact sheets."""
    frames = rollout(runner, keys_per_chunk, seed)
    if record is not None:
        record.append((name, seed, keys_per_chunk, frames))
    return frames


def evaluate_responsiveness(
    runner: ARRunner, frames: int, seeds: Sequence[int], record: list[Recorded] | None = None
) -> dict[str, Any]:
    fpc = runner.spec.frames_per_chunk
    out: dict[str, Any] = {}
    for key in ("w", "a", "s", "d"):
        runs = [
            responsiveness(recorded_rollout(runner, f"hold {key}", hold([key], frames, fpc), seed, record), [key])
            for seed in seeds
        ]
        out[key] = {
            "fraction_right_way": float(np.mean([r["fraction_right_way"] for r in runs])),
            "mean_along_px": float(np.mean([r["mean_along"] for r in runs])),
        }
    still = [
        responsiveness(recorded_rollout(runner, "no key", hold([], frames, fpc), seed, record), []) for seed in seeds
    ]
    out["none"] = {"mean_shift_px": float(np.mean([r["mean_shift"] for r in still]))}
    out["min_fraction_right_way"] = min(out[k]["fraction_right_way"] for k in ("w", "a", "s", "d"))
    out["pass"] = bool(out["min_fraction_right_way"] >= RESPONSIVE_SHARE and out["none"]["mean_shift_px"] < MIN_SHIFT_PX)
    return out


def drift_checks(report: dict[str, float]) -> dict[str, bool]:
    """Named pass/fail checks for one :func:`drift_report`."""
    return {
        "histogram": report["tv_first_last_quarter"] <= MAX_TV,
        "contrast": report["last_contrast"] >= MIN_CONTRAST_RATIO * report["first_contrast"],
        "palette": report["last_palette_fraction"] >= MIN_PALETTE_FRACTION,
        "not_noise": report["last_pixel_noise"] <= MAX_NOISE_RATIO * max(report["first_pixel_noise"], 1.0),
        "not_frozen": report["last_mean_shift"] >= MIN_SHIFT_PX,
    }


def ground_truth_walks(frames: int, seeds: Sequence[int], frames_per_chunk: int) -> list[np.ndarray]:
    """The same square walk rendered by the procedural world (held-out seeds), for reference figures."""
    keys = [k for k in square_walk(frames, frames_per_chunk) for _ in range(frames_per_chunk)]
    return [ProceduralWorld(seed).rollout(0, 0, keys)[0] for seed in seeds]


def evaluate_drift(
    runner: ARRunner, frames: int, seeds: Sequence[int], record: list[Recorded] | None = None
) -> dict[str, Any]:
    fpc = runner.spec.frames_per_chunk
    truth = ground_truth_walks(frames, seeds, fpc)
    truth_hist = color_histogram(np.concatenate(truth))
    runs = []
    for seed in seeds:
        generated = recorded_rollout(runner, "square walk", square_walk(frames, fpc), seed, record)
        report: dict[str, Any] = dict(drift_report(generated))
        report["checks"] = drift_checks(report)
        # how far the generated colours are from the real world's (reported, not a pass/fail check)
        report["tv_vs_ground_truth"] = total_variation(color_histogram(generated), truth_hist)
        runs.append(report)
    keys = [k for k in runs[0] if k != "checks"]
    summary: dict[str, Any] = {k: float(np.mean([r[k] for r in runs])) for k in keys}
    summary["max_tv"] = float(max(r["tv_first_last_quarter"] for r in runs))
    summary["runs_passing"] = sum(all(r["checks"].values()) for r in runs)
    summary["runs"] = len(runs)
    summary["failed_checks"] = sorted({k for r in runs for k, ok in r["checks"].items() if not ok})
    summary["pass"] = summary["runs_passing"] == len(runs)
    reference = [drift_report(t) for t in truth]
    summary["ground_truth"] = {k: float(np.mean([r[k] for r in reference])) for k in reference[0]}
    return summary


def evaluate_quality(runner: ARRunner, seeds: Sequence[int], record: list[Recorded]) -> dict[str, Any]:
    """Picture-quality figures of the recorded rollouts plus one idle rollout per seed, and of their ground truth.

    Appends the idle rollouts to ``record``.
    """
    fpc = runner.spec.frames_per_chunk
    keys, release = idle_walk(fpc)
    idle = [
        idle_change(recorded_rollout(runner, "idle", keys, seed, record), release, IDLE_SETTLE, IDLE_SPAN)
        for seed in seeds
    ]
    truths = [truth_rollout(k, seed, fpc) for _name, seed, k, _frames in record]
    generated = picture_quality(frames for *_, frames in record)
    generated["idle_change"] = float(np.mean(idle))
    truth = picture_quality(truths)
    truth["idle_change"] = float(np.mean([idle_change(truth_rollout(keys, s, fpc), release) for s in seeds]))
    meets = {
        name: bool(generated[name] >= bound if op == ">=" else generated[name] <= bound)
        for name, (op, bound) in QUALITY_TARGETS.items()
    }
    return {
        "generated": generated,
        "ground_truth": truth,
        "meets_target": meets,
        "frames": int(sum(len(frames) for *_, frames in record)),
    }


def contact_sheet(truth: np.ndarray, generated: np.ndarray, indices: Sequence[int], scale: int = 2) -> Image.Image:
    """Ground-truth frames (top row) above the generated ones (bottom row) at ``indices``, labelled by frame."""
    size = truth.shape[1] * scale
    gap, label_w, label_h = 4, 92, 14
    sheet = Image.new("RGB", (label_w + len(indices) * (size + gap), label_h + 2 * (size + gap)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for row, (name, frames) in enumerate((("ground truth", truth), ("tiny-world", generated))):
        top = label_h + row * (size + gap)
        draw.text((4, top + size // 2 - 5), name, fill=(0, 0, 0))
        for col, index in enumerate(indices):
            left = label_w + col * (size + gap)
            if row == 0:
                draw.text((left, 1), f"frame {index}", fill=(0, 0, 0))
            image = Image.fromarray(np.ascontiguousarray(frames[index])).resize((size, size), Image.Resampling.NEAREST)
            sheet.paste(image, (left, top))
    return sheet


def write_contact_sheets(out: Path, record: list[Recorded], frames_per_chunk: int, columns: int = 8) -> list[Path]:
    """One PNG per kind of rollout (its first seed): ground truth above generated, ``columns`` frames apart evenly."""
    out.mkdir(parents=True, exist_ok=True)
    paths, seen = [], set()
    for name, seed, keys, frames in record:
        if name in seen:
            continue
        seen.add(name)
        indices = np.linspace(0, len(frames) - 1, columns).round().astype(int).tolist()
        if name == "idle":
            _keys, release = idle_walk(frames_per_chunk)
            indices = sorted({0, release - 1, release + IDLE_SETTLE, release + IDLE_SETTLE + IDLE_SPAN} | set(indices))
        path = out / f"contact_{name.replace(' ', '_')}_seed{seed}.png"
        contact_sheet(truth_rollout(keys, seed, frames_per_chunk), frames, indices).save(path)
        paths.append(path)
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--weights", default=None, help="safetensors file (default: the shipped weights)")
    p.add_argument("--hold-frames", type=int, default=64, help="frames per held-key rollout")
    p.add_argument("--square-frames", type=int, default=320, help="frames of the square walk")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the cores free now, less one; at least 1: two threads on a busy 2-core "
        "machine ran ten times slower than one)",
    )
    p.add_argument("--device", default="cpu", help="torch device for the model and its KV pool (default cpu)")
    p.add_argument(
        "--out", type=Path, default=Path("out/tiny_world_eval"), help="folder for contact sheets and metrics.json"
    )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or default_torch_threads())
    started = time.perf_counter()
    pipeline = load_tiny_world(torch.device(args.device), args.weights)
    runner = make_runner(pipeline)
    record: list[Recorded] = []
    resp = evaluate_responsiveness(runner, args.hold_frames, args.seeds, record)
    drift = evaluate_drift(runner, args.square_frames, args.seeds, record)
    quality = evaluate_quality(runner, args.seeds, record)
    sheets = write_contact_sheets(args.out, record, runner.spec.frames_per_chunk)
    print(f"responsiveness ({args.hold_frames} frames held, seeds {args.seeds}):")
    for key in ("w", "a", "s", "d"):
        r = resp[key]
        print(f"  {key}: right way {r['fraction_right_way']:.1%}  mean shift along {r['mean_along_px']:+.2f} px")
    print(f"  none: mean shift {resp['none']['mean_shift_px']:.2f} px")
    print(f"drift ({args.square_frames}-frame square walk, {drift['runs']} seeds):")
    print(f"  histogram TV first vs last quarter: mean {drift['tv_first_last_quarter']:.3f} max {drift['max_tv']:.3f}")
    print(
        f"  contrast {drift['first_contrast']:.1f} -> {drift['last_contrast']:.1f}, "
        f"pixel noise {drift['first_pixel_noise']:.2f} -> {drift['last_pixel_noise']:.2f}, "
        f"palette share {drift['first_palette_fraction']:.2f} -> {drift['last_palette_fraction']:.2f}, "
        f"last-quarter motion {drift['last_mean_shift']:.2f} px/frame"
    )
    print(f"  runs passing every check: {drift['runs_passing']}/{drift['runs']} (failed: {drift['failed_checks']})")
    truth = drift["ground_truth"]
    print(
        f"  ground truth, same walk: TV {truth['tv_first_last_quarter']:.3f}, contrast {truth['last_contrast']:.1f}, "
        f"pixel noise {truth['last_pixel_noise']:.2f}, palette share {truth['last_palette_fraction']:.2f}; "
        f"generated colours vs ground truth: TV {drift['tv_vs_ground_truth']:.3f}"
    )
    print(
        f"picture quality ({quality['frames']} frames of the rollouts above + idle rollouts; "
        "class = nearest palette colour):"
    )
    print(f"  {'metric':<14} {'ground truth':>12} {'tiny-world':>10}  target")
    for name, (op, bound) in QUALITY_TARGETS.items():
        met = "met" if quality["meets_target"][name] else "not met"
        print(
            f"  {name:<14} {quality['ground_truth'][name]:>12.3f} {quality['generated'][name]:>10.3f}"
            f"  {op} {bound} ({met})"
        )
    shares = ", ".join(f"{name} {share:.0%}" for name, share in zip(CLASS_NAMES, quality["generated"]["class_shares"]))
    print(f"  class shares (map: {', '.join(f'{n} {s:.0%}' for n, s in zip(CLASS_NAMES, CLASS_SHARES))}): {shares}")
    print(f"  contact sheets: {', '.join(str(p) for p in sheets)}")
    result = {
        "responsiveness": resp,
        "drift": drift,
        "quality": quality,
        "pass": bool(resp["pass"] and drift["pass"]),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (args.out / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


main = main_for("eval", "tiny-world")

if __name__ == "__main__":
    sys.exit(main())
