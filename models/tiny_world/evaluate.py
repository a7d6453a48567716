"""``arstream eval tiny-world``: responsiveness and drift of the shipped model, through the runner.

* Responsiveness: for each of ``w``, ``a``, ``s``, ``d`` held from the first
  frame, the share of consecutive frame pairs whose content moves the right
  way by at least half a pixel (phase correlation); with no key held, the mean
  shift.
* Drift: a walk in a square (``d``, ``s``, ``a``, ``w``, a quarter each);
  total variation between the 8x8x8 colour histograms of the first and last
  quarter, and contrast, pixel noise, palette share and motion of the last
  quarter against the first (no collapse to grey, noise or a frozen pattern).

The same checks, shortened, are the tests in ``tests/test_tiny_world_quality.py``.
Prints a table and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from arstream.app.cli import main_for
from arstream.models.tiny_world.metrics import (
    MIN_SHIFT_PX,
    color_histogram,
    drift_report,
    responsiveness,
    total_variation,
)
from arstream.models.tiny_world.pipeline import TinyWorldPipeline, load_tiny_world
from arstream.models.tiny_world.world import ProceduralWorld
from arstream.runner.pool import budget_for_sessions
from arstream.runner.runner import ARRunner
from arstream.runner.types import TickRequest

RESPONSIVE_SHARE = 0.8
MAX_TV = 0.35
# a healthy last quarter keeps at least this share of the first quarter's contrast,
# stays mostly on the world's palette, is not much noisier, and still moves
MIN_CONTRAST_RATIO = 0.5
MIN_PALETTE_FRACTION = 0.7
MAX_NOISE_RATIO = 2.0


def make_runner(pipeline: TinyWorldPipeline, sessions: int = 4) -> ARRunner:
    """A runner whose KV pool has room for exactly ``sessions`` resident sessions."""
    budget = budget_for_sessions(pipeline.kv_cache_spec(), sessions)
    return ARRunner(pipeline, device=pipeline.device, kv_budget_bytes=budget)


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


def hold(keys: Sequence[str], frames: int, frames_per_chunk: int) -> list[list[str]]:
    return [list(keys)] * (-(-frames // frames_per_chunk))


def square_walk(frames: int, frames_per_chunk: int) -> list[list[str]]:
    side = frames // 4
    return [k for key in ("d", "s", "a", "w") for k in hold([key], side, frames_per_chunk)]


def evaluate_responsiveness(runner: ARRunner, frames: int, seeds: Sequence[int]) -> dict[str, Any]:
    fpc = runner.spec.frames_per_chunk
    out: dict[str, Any] = {}
    for key in ("w", "a", "s", "d"):
        runs = [responsiveness(rollout(runner, hold([key], frames, fpc), seed), [key]) for seed in seeds]
        out[key] = {
            "fraction_right_way": float(np.mean([r["fraction_right_way"] for r in runs])),
            "mean_along_px": float(np.mean([r["mean_along"] for r in runs])),
        }
    still = [responsiveness(rollout(runner, hold([], frames, fpc), seed), []) for seed in seeds]
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


def evaluate_drift(runner: ARRunner, frames: int, seeds: Sequence[int]) -> dict[str, Any]:
    fpc = runner.spec.frames_per_chunk
    truth = ground_truth_walks(frames, seeds, fpc)
    truth_hist = color_histogram(np.concatenate(truth))
    runs = []
    for seed in seeds:
        generated = rollout(runner, square_walk(frames, fpc), seed)
        report = drift_report(generated)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--weights", default=None, help="safetensors file (default: the shipped weights)")
    p.add_argument("--hold-frames", type=int, default=64, help="frames per held-key rollout")
    p.add_argument("--square-frames", type=int, default=320, help="frames of the square walk")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--threads", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    pipeline = load_tiny_world(torch.device("cpu"), args.weights)
    runner = make_runner(pipeline)
    resp = evaluate_responsiveness(runner, args.hold_frames, args.seeds)
    drift = evaluate_drift(runner, args.square_frames, args.seeds)
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
    result = {
        "responsiveness": resp,
        "drift": drift,
        "pass": bool(resp["pass"] and drift["pass"]),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))
    return 0


main = main_for("eval", "tiny-world")

if __name__ == "__main__":
    sys.exit(main())
