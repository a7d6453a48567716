"""``arstream bench gpu-check``: the one measurement a lent GPU runs (``scripts/gpu-check.sh``), and its CPU rehearsal.

    arstream bench gpu-check --device cuda --out "$OUT"   # matrix-game-2 1.3b, bf16, 1/2/4/8 sessions
    arstream bench gpu-check --device cpu                 # the same code path with tiny configs (CI)

Phases, in this order, each written into ``OUT/gpu-check.json`` as soon as it
ends (so a run cut short by a timeout still returns what it measured):

1. ``h264``: libx264 (app/video.py's encoder) on a synthetic 640x352 panning
   scene: milliseconds per frame, and what one session's stream costs per
   second of video at the model's frame rate.
1b. ``devices``: one session of Krea Realtime 14B's shape (random weights,
   480x832) and of matrix-game-2 1.3b through one replica over P = 1, 2 and 4
   devices (``--devices``; runner/distributed/), as many as the machine has
   GPUs (NCCL runs one rank a GPU; on a CPU P = 1 and 2 with gloo and the tiny
   configs): ms per chunk, the collective's share of rank 0's chunk (the
   profiler's NCCL kernel time, gloo's op time on a CPU) and the speedup over
   P = 1. Never measured before, so it runs second; Krea at P = 1 first, the
   figure sequence parallelism must divide. Variants past
   ``--devices-deadline-s`` are skipped, and named.
1c. ``waypoint``: Waypoint-1.5 (random weights, bf16) at 720p, at 720p with
   ``w8a8`` weights (int8 weights and activations), and at 360p, one session
   and a batch, through bench serve's bare runner: ms per chunk (one latent
   frame, four video frames) once the local window is full, frames per second
   against the published 56 fps (BF16) and 72 fps (w8a8) at 720p on an RTX
   5090, w8a8's fps beside bf16's (``side_by_side``), and the peak GPU memory
   against ``arstream plan``'s figure. Never measured either, so it runs
   third, 720p first; a variant past ``--waypoint-deadline-s`` is skipped,
   and named (on a CPU: ``tiny-1.5`` and ``tiny-1.5/w8a8``).
2. ``tiny_world``: ``bench serve`` at 16 batched sessions (2 on a CPU):
   server_vs_runner.
3. ``matrix_game``: ``bench serve`` of matrix-game-2 (random weights, SDPA
   attention) through the real server over loopback, at 1, 2, 4 and 8
   sessions (1 and 2 on a CPU) with one server and one bare runner built for
   the largest count. A session count whose projected time would pass
   ``--deadline-s`` is skipped (and says so), so the run ends in time.
4. ``decode_path``: matrix-game-2 served with the Wan VAE and with the TAEHV
   decoder, each serial and with the decode overlapped with the next forward
   (``--decode-overlap``): DiT and decode ms per round (/v1/stats phases),
   overlap, and fps per session at 1, 2 and 4 sessions (1 and 2 on a CPU).
   A variant that would start past the deadline is skipped (and says so).

5. ``longlive``: one LongLive session, normal chunks and prompt switches.
6. ``fit``: matrix-game-2 and LongLive (1.3b on a GPU, tiny on a CPU) with
   weights bf16 / int8 / fp8, eager and ``--compile``d: load and warm-up time
   (compilation included: the time to ready), video fps of one session, and
   memory: the plan's weights (``arstream plan``, the meta device) against the
   allocator's figure after loading (on a CPU the tensors' storage), and the
   peak over the chunks. Variants run in :data:`FIT_VARIANTS`' order until
   ``--fit-deadline-s`` would pass (the rest skipped, and named); on a CPU the
   compiled ones are left to the compile lane (scripts/test-compile.sh, which
   runs this phase's compiled variant) and skipped here.

The last line printed is one JSON object: these phases, ``aims`` (the GPU
targets, checked), ``errors`` (a phase that failed, with its message; the
others still run) and where the ``arstream`` package was imported from.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

import arstream
from . import bench
from ..cli import main_for
from ..measure import percentile, print_summary
from ..models.matrix_game.config import get_config
from ..runner.threads import default_torch_threads

H264_WIDTH, H264_HEIGHT = 640, 352  # matrix-game-2 1.3b's frames
H264_QUALITY = 80  # the server's JPEG/H.264 default (crf 23)
# Distributions the GPU image has (docs: /work/shared/GPU.md); everything else the server needs is carried.
IMAGE_DISTRIBUTIONS = frozenset({"torch", "triton", "numpy", "pillow", "safetensors", "sympy", "mpmath", "networkx"})
# Needed by no code path the check runs, and 4.6 MiB of the 64 MiB the device tool carries: hf-xet (hub
# downloads; huggingface_hub imports it only to download) and watchfiles (uvicorn's --reload).
NOT_CARRIED = frozenset({"hf-xet", "watchfiles"})
# PyAV for h264, diffusers for the Wan VAE. Not (yet) the longlive extra: transformers and tokenizers would
# push the carry past its 64 MiB (54 MiB without them), so on a GPU the longlive phase reports its ImportError.
CARRIED_EXTRAS = ("video", "wan", "quant")


@dataclass(frozen=True)
class Profile:
    """What one run measures: full size on a GPU; the same phases, keys and code path with tiny configs on a CPU."""

    matrix_game_options: dict[str, Any]
    matrix_game_sessions: tuple[int, ...]
    longlive_options: dict[str, Any]
    longlive_chunks: int  # normal chunks, and as many switch chunks
    # chunks per session per repetition: this many over all sessions together, at least min each
    matrix_game_total_chunks: int
    matrix_game_min_chunks: int
    matrix_game_repeat: int
    tiny_world_sessions: int
    tiny_world_chunks: int
    tiny_world_repeat: int
    warmup_chunks: int
    h264_frames: int
    decode_sessions: tuple[int, ...]
    decode_chunks: int
    deadline_s: float
    fit_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per model, beside "weights"
    fit_chunks: int = 2
    fit_deadline_s: float = math.inf
    fit_compiles: bool = True
    # the devices phase: (model, options) in the order they run, device counts, chunks timed per variant
    devices_models: tuple[tuple[str, dict[str, Any]], ...] = ()
    devices_counts: tuple[int, ...] = (1, 2, 4)
    devices_chunks: int = 6
    devices_deadline_s: float = math.inf
    # the waypoint phase: (config, dtype, weights) in the order they run, session counts, untimed and timed chunks
    waypoint_configs: tuple[tuple[str, str, str | None], ...] = ()
    waypoint_sessions: tuple[int, ...] = (1, 4)
    waypoint_fill_chunks: int = 16
    waypoint_chunks: int = 8
    waypoint_deadline_s: float = math.inf
    threads: int = field(default_factory=default_torch_threads)

    def matrix_game_chunks(self, sessions: int) -> int:
        return max(self.matrix_game_min_chunks, self.matrix_game_total_chunks // sessions)

    def matrix_game_work(self, sessions: int) -> int:
        """Session-chunks one session count runs on both sides, warm-up included (for the deadline's projection)."""
        return 2 * sessions * (self.matrix_game_chunks(sessions) * self.matrix_game_repeat + self.warmup_chunks)


def profile_for(device: str) -> Profile:
    if device.startswith("cuda"):
        return Profile(
            matrix_game_options={"config": "1.3b", "random_init": True, "dtype": "bfloat16"},
            matrix_game_sessions=(1, 2, 4, 8),
            longlive_options={"config": "1.3b", "random_init": True, "dtype": "bfloat16"},
            longlive_chunks=6,
            matrix_game_total_chunks=24,
            matrix_game_min_chunks=6,
            matrix_game_repeat=2,
            tiny_world_sessions=16,
            tiny_world_chunks=32,
            tiny_world_repeat=3,
            warmup_chunks=2,
            h264_frames=100,
            decode_sessions=(1, 2, 4),
            decode_chunks=8,
            deadline_s=400.0,
            fit_options={
                "matrix-game-2": {"config": "1.3b", "random_init": True, "dtype": "bfloat16"},
                "longlive": {"config": "1.3b", "random_init": True, "dtype": "bfloat16"},
            },
            fit_chunks=8,
            fit_deadline_s=300.0,
            devices_models=(
                ("krea-realtime", {"config": "14b", "random_init": True, "dtype": "bfloat16"}),
                ("matrix-game-2", {"config": "1.3b", "random_init": True, "dtype": "bfloat16"}),
            ),
            devices_chunks=6,
            devices_deadline_s=240.0,
            waypoint_configs=(("1.5", "bfloat16", None), ("1.5", "bfloat16", "w8a8"), ("1.5-360p", "bfloat16", None)),
            # 16 untimed chunks fill the local layers' window (the steady state's cost), then 8 are timed
            waypoint_sessions=(1, 4),
            waypoint_fill_chunks=16,
            waypoint_chunks=8,
            # each variant: about 10 s of drawing 1.28 B random weights on the CPU, warm-up, 2 x 24 rounds
            waypoint_deadline_s=90.0,
        )
    return Profile(
        matrix_game_options={"config": "tiny", "random_init": True, "dtype": "float32"},
        matrix_game_sessions=(1, 2),
        longlive_options={"config": "tiny", "random_init": True, "dtype": "float32"},
        longlive_chunks=2,
        matrix_game_total_chunks=2,
        matrix_game_min_chunks=2,
        matrix_game_repeat=1,
        tiny_world_sessions=2,
        tiny_world_chunks=4,
        tiny_world_repeat=1,
        warmup_chunks=1,
        h264_frames=12,
        decode_sessions=(1, 2),
        decode_chunks=2,
        deadline_s=math.inf,  # CI must see every phase
        threads=1,
        fit_options={
            "matrix-game-2": {"config": "tiny", "random_init": True, "dtype": "float32"},
            "longlive": {"config": "tiny", "random_init": True, "dtype": "float32"},
        },
        fit_chunks=2,
        fit_compiles=False,  # inductor on the CPU takes minutes: the compile lane runs the compiled variant
        devices_models=(
            ("krea-realtime", {"config": "tiny", "random_init": True, "dtype": "float32"}),
            ("matrix-game-2", {"config": "tiny", "random_init": True, "dtype": "float32"}),
        ),
        devices_counts=(1, 2),  # two gloo ranks on the CPU
        devices_chunks=2,
        waypoint_configs=(("tiny-1.5", "float32", None), ("tiny-1.5", "float32", "w8a8")),
        waypoint_sessions=(1, 2),
        waypoint_fill_chunks=1,
        waypoint_chunks=2,
    )


# ---- phase 1: H.264 encode cost -------------------------------------------------------------


def panning_scene(width: int, height: int, frames: int, *, step_px: int = 4, seed: int = 0) -> Iterator[np.ndarray]:
    """uint8 frames of a textured scene panning ``step_px`` a frame (a camera turning): motion and detail to encode.

    Synthetic (no model's output): smooth colour blobs, a horizon, fine grain.
    """
    generator = torch.Generator().manual_seed(seed)
    wide = width + step_px * frames
    blobs = torch.rand(1, 3, height // 24 + 2, wide // 24 + 2, generator=generator)
    scene = torch.nn.functional.interpolate(blobs, size=(height, wide), mode="bicubic", align_corners=False)[0]
    horizon = (torch.arange(height) > height * 0.45).float()[None, :, None]
    scene = 0.6 * scene + 0.3 * horizon + 0.05 * torch.rand(3, height, wide, generator=generator)
    pixels = (scene.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    for index in range(frames):
        yield np.ascontiguousarray(pixels[:, index * step_px : index * step_px + width])


def h264_figures(*, frames: int, fps: int, width: int = H264_WIDTH, height: int = H264_HEIGHT) -> dict[str, Any]:
    """One libx264 stream (the server's settings) over ``frames`` frames: ms and bytes per frame, cost per session."""
    from ..app.video import H264Stream, VideoUnavailable, h264_available

    if not h264_available():
        raise VideoUnavailable("PyAV with libx264 is not importable here (carry the `av` wheel)")
    stream = H264Stream(width, height, quality=H264_QUALITY, fps=fps)
    encode_ms: list[float] = []
    sizes: list[int] = []
    keyframe_bytes = 0
    for picture in panning_scene(width, height, frames):
        started = time.perf_counter()
        payload, keyframe = stream.encode(picture)
        encode_ms.append((time.perf_counter() - started) * 1000)
        if keyframe and not keyframe_bytes:
            keyframe_bytes = len(payload)
        else:
            sizes.append(len(payload))
    stream.close()
    p50 = percentile(encode_ms, 50)
    return {
        "width": width,
        "height": height,
        "frames": frames,
        "quality": H264_QUALITY,
        "encode_ms_per_frame_p50": round(p50, 3),
        "encode_ms_per_frame_p99": round(percentile(encode_ms, 99), 3),
        "keyframe_bytes": keyframe_bytes,
        "bytes_per_frame": round(sum(sizes) / max(len(sizes), 1), 1),
        "fps": fps,
        # one session's stream at the model's frame rate: encoder milliseconds per second of video, and
        # how many such streams one core keeps up with
        "encode_ms_per_session_second": round(p50 * fps, 2),
        "sessions_per_core": round(1000 / (p50 * fps), 2),
    }


# ---- phases 2 and 3: bench serve --------------------------------------------------------------


def serve_bench_args(
    model: str, options: dict[str, Any], *, device: str, sessions: int, chunks: int, repeat: int, profile: Profile,
    codec: str,
) -> argparse.Namespace:  # fmt: skip
    """``arstream bench serve``'s own arguments for one phase: batching up to ``sessions`` on both sides."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([
        "--model", model, "--model-options", json.dumps(options), "--device", device,
        "--sessions", str(sessions), "--max-batch-sessions", str(sessions), "--chunks", str(chunks),
        "--repeat", str(repeat), "--warmup-chunks", str(profile.warmup_chunks), "--threads", str(profile.threads),
        "--codec", codec,
    ])  # fmt: skip


def video_codec() -> str:
    """h264 where PyAV can encode it (what the demo streams at 640x352), else jpeg; the JSON says which."""
    from ..app.video import h264_available

    return "h264" if h264_available() else "jpeg"


def tiny_world_figures(profile: Profile, device: str) -> dict[str, Any]:
    args = serve_bench_args(
        "tiny-world", {}, device=device, sessions=profile.tiny_world_sessions, chunks=profile.tiny_world_chunks,
        repeat=profile.tiny_world_repeat, profile=profile, codec="jpeg",
    )  # fmt: skip
    with bench.ServeBench(args) as serve:
        return serve.measure(profile.tiny_world_sessions, chunks=profile.tiny_world_chunks)


def matrix_game_sweep(
    profile: Profile, device: str, report: dict[str, Any], *, time_left_s: Callable[[], float], save: Callable[[], None]
) -> None:
    """bench serve of matrix-game-2 at each session count, into ``report`` (``sessions``, ``skipped``) as it goes."""
    largest = max(profile.matrix_game_sessions)
    codec = video_codec()
    report.update(options=profile.matrix_game_options, codec=codec, attention="sdpa", sessions={}, skipped={})
    args = serve_bench_args(
        "matrix-game-2", profile.matrix_game_options, device=device, sessions=largest,
        chunks=profile.matrix_game_chunks(largest), repeat=profile.matrix_game_repeat, profile=profile, codec=codec,
    )  # fmt: skip
    started = time.perf_counter()
    with bench.ServeBench(args) as serve:
        report["setup_s"] = round(time.perf_counter() - started, 1)
        pace_s: float | None = None  # seconds per session-chunk at the last count measured
        for sessions in profile.matrix_game_sessions:
            work = profile.matrix_game_work(sessions)
            if pace_s is not None and pace_s * work > time_left_s():
                report["skipped"][str(sessions)] = (
                    f"projected {pace_s * work:.0f} s at the last count's pace, {max(time_left_s(), 0):.0f} s left"
                )
                save()
                continue
            print(f"== matrix-game-2: {sessions} session(s), {profile.matrix_game_chunks(sessions)} chunks each", flush=True)
            measured = time.perf_counter()
            report["sessions"][str(sessions)] = serve.measure(sessions, chunks=profile.matrix_game_chunks(sessions))
            pace_s = (time.perf_counter() - measured) / work
            save()


# ---- phase 4: the decode path -------------------------------------------------------------------

DECODE_VARIANTS = (("wan-vae", False), ("wan-vae", True), ("taehv", False), ("taehv", True))


def _phase_totals(stats: dict[str, Any]) -> tuple[int, float, float, float]:
    """(rounds, DiT ms, decode ms, overlap ms) summed since start-up, from /v1/stats' per-round means."""
    phases = stats["phases"]
    rounds = int(phases["rounds_total"])
    return rounds, *(phases[key] * rounds for key in ("dit_ms_mean", "decode_ms_mean", "overlap_ms_mean"))


def decode_variant_figures(profile: Profile, device: str, decoder: str, overlap: bool) -> dict[str, Any]:
    """One server (this decoder, overlapped or serial) at each of ``profile.decode_sessions``."""
    options = {**profile.matrix_game_options, "decoder": decoder}
    largest = max(profile.decode_sessions)
    serve_args = [
        "--model", "matrix-game-2", "--model-options", json.dumps(options), "--device", device,
        "--max-batch-sessions", str(largest), "--torch-threads", str(profile.threads), "--rewind-seconds", "0",
        "--decode-overlap" if overlap else "--no-decode-overlap", "--log-level", "warning",
    ]  # fmt: skip
    figures: dict[str, Any] = {}
    with bench.ServerProcess(serve_args) as server:
        for sessions in profile.decode_sessions:
            before = _phase_totals(server.get_json("/v1/stats"))
            run = bench.server_phase(
                server.sessions_url, sessions=sessions, chunks=profile.decode_chunks, input_every=4, codec="raw"
            )
            measured = asyncio.run(run)
            after = _phase_totals(server.get_json("/v1/stats"))
            rounds = max(after[0] - before[0], 1)
            figures[str(sessions)] = {
                "fps_per_session": round(bench.server_frames_per_s(measured) / sessions, 3),
                "dit_ms_per_round": round((after[1] - before[1]) / rounds, 3),
                "decode_ms_per_round": round((after[2] - before[2]) / rounds, 3),
                "overlap_ms_per_round": round((after[3] - before[3]) / rounds, 3),
                "rounds": rounds,
            }
    return figures


def decode_path_sweep(
    profile: Profile, device: str, report: dict[str, Any], *, time_left_s: Callable[[], float], save: Callable[[], None]
) -> None:
    """Each decoder serial and overlapped, into ``report`` (``variants``, ``skipped``) as it goes."""
    report.update(options=profile.matrix_game_options, sessions=list(profile.decode_sessions), variants={}, skipped={})
    pace_s: float | None = None  # seconds the last variant took
    for decoder, overlap in DECODE_VARIANTS:
        name = f"{decoder}/{'overlapped' if overlap else 'serial'}"
        left = time_left_s()
        if left <= 0 or (pace_s is not None and pace_s > left):
            took = "nothing measured yet" if pace_s is None else f"the last variant took {pace_s:.0f} s"
            report["skipped"][name] = f"{took}, {max(left, 0):.0f} s left"
            save()
            continue
        print(f"== decode path: {name}", flush=True)
        started = time.perf_counter()
        report["variants"][name] = decode_variant_figures(profile, device, decoder, overlap)
        pace_s = time.perf_counter() - started
        save()


# ---- phase 5: LongLive, a normal chunk and a prompt switch ------------------------------------------


def longlive_figures(profile: Profile, device: str) -> dict[str, Any]:
    """One LongLive session through the runner: normal chunks, then chunks that each switch the prompt (re-cache).

    p50/p95 of each kind's compute time, the re-cache's own share, the text
    encoder's time for a new prompt, and the video fps one session gets
    against the rate it plays at.
    """
    from ..models.longlive.loading import load_longlive
    from ..runner.runner import runner_for_sessions
    from ..runner.types import TickRequest

    pipeline = load_longlive(device, **profile.longlive_options)
    runner = runner_for_sessions(pipeline, 1, device=device)
    runner.warmup()
    normal: list[float] = []
    switch: list[float] = []
    recache: list[float] = []
    encode: list[float] = []
    tick = 0
    for _ in range(profile.warmup_chunks + profile.longlive_chunks):  # the first chunks (and warm-up) are normal
        result = runner.execute_tick(TickRequest(session_id="longlive", request_id=tick, controls={}, prompt="a lake"))
        normal.append(result.compute_s)
        tick += 1
    for i in range(profile.longlive_chunks):
        prompt = f"a city street at night, scene {i}"
        started = time.perf_counter()
        pipeline.text.encode(prompt)  # the encoder alone; the chunk below encodes the prompt again for its cache
        encode.append(time.perf_counter() - started)
        result = runner.execute_tick(TickRequest(session_id="longlive", request_id=tick, controls={}, prompt=prompt))
        switch.append(result.compute_s)
        recache.append(pipeline.counters.recache_s)
        tick += 1
    runner.close_session("longlive")
    normal = normal[profile.warmup_chunks :]
    frames = pipeline.cfg.video_frames_per_chunk
    p50 = percentile(normal, 50)
    return {
        "options": profile.longlive_options,
        "normal_chunk_ms_p50": round(1000 * p50, 2),
        "normal_chunk_ms_p95": round(1000 * percentile(normal, 95), 2),
        "switch_chunk_ms_p50": round(1000 * percentile(switch, 50), 2),
        "switch_chunk_ms_p95": round(1000 * percentile(switch, 95), 2),
        "recache_ms_p50": round(1000 * percentile(recache, 50), 2),
        "text_encode_ms_p50": round(1000 * percentile(encode, 50), 2),
        "fps": round(frames / p50, 2),
        "plays_at_fps": pipeline.cfg.fps,
        "recaches": pipeline.counters.recaches,
    }


# ---- phase 1b: one replica over several devices -----------------------------------------------------------

# What a collective is called in the profiler: NCCL's kernels on a GPU, c10d's and gloo's ops on a CPU.
COLLECTIVE_EVENTS = ("nccl", "alltoall", "all_to_all", "allgather", "all_gather")


def replica_devices(device: str, world: int) -> tuple[str, ...]:
    """``cuda:0,...,cuda:P-1`` on a GPU machine; ``cpu`` P times on a CPU (gloo ranks)."""
    if device.startswith("cuda"):
        return tuple(f"cuda:{rank}" for rank in range(world))
    return ("cpu",) * world


def device_count(device: str) -> int:
    """How many ranks this machine runs: its GPUs (NCCL refuses two ranks on one GPU), or any number on a CPU."""
    return torch.cuda.device_count() if device.startswith("cuda") else 2


def collective_share(profiler: Any, wall_s: float) -> float:
    """The part of ``wall_s`` rank 0 spent in collectives: the union of the profiled collective events' times
    (kernels on a GPU, ops on a CPU; nested events counted once)."""
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in profiler.events()
        if any(name in event.name.lower() for name in COLLECTIVE_EVENTS)
    )
    covered_us, reach = 0.0, -math.inf
    for start, end in spans:
        if end > reach:
            covered_us += end - max(start, reach)
            reach = end
    return round(covered_us / 1e6 / wall_s, 4)


def devices_variant_figures(profile: Profile, device: str, model: str, world: int) -> dict[str, Any]:
    """One session of ``model`` on a replica over ``world`` devices: ms per chunk (the round, as the server waits
    for it), the forward's own ms, and the collective's share of one more chunk, profiled."""

    from torch.profiler import ProfilerActivity, profile as profiled

    from ..models.registry import load_pipeline
    from ..runner.distributed.runtime import DistributedRuntime
    from ..runner.pool import budget_for_sessions
    from ..runner.runner import ARRunner
    from ..runner.types import RuntimeOptions, TickFailure, TickRequest

    options = dict(next(o for m, o in profile.devices_models if m == model))
    devices = replica_devices(device, world)
    started = time.perf_counter()
    pipeline: Any = load_pipeline(model, devices[0], **options)
    # room for the one session (every head: a rank over a share of them has more than it needs)
    budget = budget_for_sessions(pipeline.kv_cache_spec(), 1, max_batch_sessions=1)
    runtime_options = RuntimeOptions(device=devices[0], kv_budget_bytes=budget)
    runtime: ARRunner | DistributedRuntime
    if world == 1:
        runtime = ARRunner.for_pipeline(pipeline, runtime_options)
    else:
        loader = functools.partial(load_pipeline, model, **options)
        runtime = DistributedRuntime.for_pipeline(
            pipeline, replace(runtime_options, devices=devices, load_pipeline=loader)
        )
    try:
        loaded_s = time.perf_counter() - started
        runtime.warmup()
        controls = {"keys": ["w"]} if model == "matrix-game-2" else {}
        rounds: list[float] = []
        compute: list[float] = []
        frames = 0

        def chunk(index: int) -> float:
            nonlocal frames
            tick = TickRequest(session_id="devices", request_id=index, controls=controls, seed=1)
            began = time.perf_counter()
            (result,) = runtime.execute([tick])
            took = time.perf_counter() - began
            if isinstance(result, TickFailure):
                raise result.error
            compute.append(result.compute_s)
            frames += result.frames.shape[0]
            return took

        for index in range(profile.devices_chunks):
            rounds.append(chunk(index))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        sent_before = runtime.parallel.bytes_sent if isinstance(runtime, DistributedRuntime) else 0
        with profiled(activities=activities) as profiler:
            profiled_s = chunk(profile.devices_chunks)
        sent = runtime.parallel.bytes_sent - sent_before if isinstance(runtime, DistributedRuntime) else 0
        runtime.close_session("devices")
    finally:
        if isinstance(runtime, DistributedRuntime):
            runtime.shutdown()
    timed = rounds[1:] or rounds  # the first chunk has the shortest history and the first-touch costs
    return {
        "model": model,
        "options": options,
        "devices": list(devices),
        "load_s": round(loaded_s, 2),
        "chunk_ms_p50": round(1000 * percentile(timed, 50), 2),
        "chunk_ms_max": round(1000 * max(timed), 2),
        "forward_ms_p50": round(1000 * percentile(compute[1 : len(rounds)] or compute, 50), 2),
        "chunks": len(timed),
        "video_fps": round(frames / (sum(rounds) + profiled_s) if rounds else 0.0, 2),
        "collective_share": 0.0 if world == 1 else collective_share(profiler, profiled_s),
        "collective_bytes_per_chunk": sent,  # sent by rank 0 (every rank sends as much)
    }


def run_variant(report: dict[str, Any], name: str, measure: Callable[[], dict[str, Any]], phase: str) -> float:
    """One variant of a capped phase into ``report["variants"]``, or its error into ``report["errors"]`` (a variant
    that fails, out of memory or NCCL, says why and the next still runs); then its memory freed. Its seconds: the
    pace the phase's next variant is judged by against the time left."""
    print(f"== {phase}: {name}", flush=True)
    started = time.perf_counter()
    try:
        report["variants"][name] = measure()
    except Exception as error:  # noqa: BLE001 - reported in the JSON beside the variants that ran
        report["errors"][name] = f"{type(error).__name__}: {error}"[-1000:]
    pace_s = time.perf_counter() - started
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return pace_s


class Sweep(Protocol):
    """A phase with a deadline of its own (devices, waypoint): variants in order while time is left."""

    def __call__(
        self, profile: Profile, device: str, report: dict[str, Any], *, time_left_s: Callable[[], float],
        save: Callable[[], None],
    ) -> None: ...


def devices_sweep(
    profile: Profile, device: str, report: dict[str, Any], *, time_left_s: Callable[[], float], save: Callable[[], None]
) -> None:
    """Each model over each device count the machine has, in order, until the phase's deadline (``variants``,
    ``skipped``, ``errors``), and each model's ``speedup`` over P = 1."""
    report.update(variants={}, skipped={}, errors={}, speedup={}, ranks_here=device_count(device))
    pace_s: float | None = None
    for model, _options in profile.devices_models:
        for world in profile.devices_counts:
            name = f"{model}/P={world}"
            left = time_left_s()
            if world > report["ranks_here"]:
                report["skipped"][name] = f"{report['ranks_here']} GPU(s) here (NCCL runs one rank a GPU)"
            elif left <= 0 or (pace_s is not None and pace_s > left):
                report["skipped"][name] = f"{max(left, 0):.0f} s left of --devices-deadline-s"
            else:
                measure = functools.partial(devices_variant_figures, profile, device, model, world)
                pace_s = run_variant(report, name, measure, "devices")
                one = report["variants"].get(f"{model}/P=1")
                this = report["variants"].get(name)
                if one and this and world > 1:
                    report["speedup"][name] = round(one["chunk_ms_p50"] / this["chunk_ms_p50"], 3)
            save()
    if report["errors"]:
        raise RuntimeError(f"{len(report['errors'])} devices variant(s) failed: {sorted(report['errors'])}")


# ---- phase 1c: Waypoint-1.5 at 720p and 360p ----------------------------------------------------------------

# Overworld's published figures, for one session at 720p on an RTX 5090 (another card than the check's), by variant
WAYPOINT_PUBLISHED_FPS = {"1.5": 56.0, "1.5/w8a8": 72.0}
WAYPOINT_PUBLISHED_ON = "RTX 5090, 720p, one session: 56 fps BF16, 72 fps w8a8 (Overworld's Waypoint-1.5 release)"


def waypoint_variant_name(config: str, weights: str | None) -> str:
    """``1.5`` (the model's dtype) or ``1.5/w8a8``."""
    return config if weights is None else f"{config}/{weights}"


def waypoint_pipeline(device: str, config: str, dtype: str, weights: str | None = None) -> Any:
    """Waypoint at ``config``'s shape with seeded random weights, on ``device`` in ``dtype``.

    The loader draws random weights for the tiny configs only (at the published
    scale they are no use to a user); the check wants the published shape's
    cost, so it builds the pipeline from the loader's own parts, on a CPU and a
    GPU alike.
    """
    from ..models.waypoint.config import get_config as waypoint_config
    from ..models.waypoint.loading import quantize_dit, random_weights
    from ..models.waypoint.pipeline import WaypointPipeline

    held = getattr(torch, dtype)
    model, decoder = random_weights(waypoint_config(config))
    model = quantize_dit(model.to(held), weights, torch.device(device))  # as the loader does with its ``weights``
    pipeline = WaypointPipeline(model, decoder.to(held), torch.device(device), random_weights=True)
    pipeline.weights = weights
    return pipeline


def waypoint_variant_figures(
    profile: Profile, device: str, config: str, dtype: str, weights: str | None = None
) -> dict[str, Any]:
    """One config through bench serve's bare runner at each of ``profile.waypoint_sessions`` (all batched in one
    forward): ms a chunk once the window has filled, video fps, and the peak memory against the plan's."""
    from ..app.plan import fit_plan
    from ..app.settings import Settings
    from ..models.waypoint.pipeline import key_codes
    from ..runner.pool import budget_for_sessions
    from ..runner.runner import rewind_for
    from ..runner.types import ChunkResult, TickRequest

    where = torch.device(device)
    largest = max(profile.waypoint_sessions)
    options = {"config": config, "dtype": dtype, **({"weights": weights} if weights else {})}
    # what `arstream plan` says the runner below holds: the server's defaults, every session in one forward
    plan = fit_plan(
        Settings(model="waypoint-1.5", model_options=options, max_batch_sessions=largest), gpu_memory_bytes=80 * 10**9
    )
    before = _allocated_bytes(where)
    if where.type == "cuda":
        torch.cuda.reset_peak_memory_stats(where)
    started = time.perf_counter()
    pipeline = waypoint_pipeline(device, config, dtype, weights)
    loaded_s = time.perf_counter() - started
    defaults = Settings()
    rewind = rewind_for(pipeline, seconds=defaults.rewind_seconds, budget_bytes=defaults.rewind_budget_bytes())
    budget = budget_for_sessions(pipeline.kv_cache_spec(), largest, max_batch_sessions=largest, rewind=rewind)
    started = time.perf_counter()
    bare = bench.BareRunner(
        pipeline, device=device, kv_budget_bytes=budget, max_batch_sessions=largest, settings=defaults
    )  # warmed up at every batch size
    warmup_s = time.perf_counter() - started
    controls = {"buttons": [key_codes(pipeline.cfg.n_buttons)["KeyW"]], "mouse": [0.1, 0.0]}  # walking, turning
    published = WAYPOINT_PUBLISHED_FPS.get(waypoint_variant_name(config, weights))
    counts: dict[str, Any] = {}
    for sessions in profile.waypoint_sessions:
        session_ids = [f"waypoint-{row}" for row in range(sessions)]
        rounds: list[float] = []
        frames = 0
        for index in range(profile.waypoint_fill_chunks + profile.waypoint_chunks):
            ticks = [
                TickRequest(session_id=session_id, request_id=index, controls=controls, seed=row + 1)
                for row, session_id in enumerate(session_ids)
            ]
            began = time.perf_counter()
            results = bare.runner.execute(ticks)  # frames come back decoded, on the host: the round is done
            took = time.perf_counter() - began
            chunks = [result for result in results if isinstance(result, ChunkResult)]
            if len(chunks) < len(results):
                failed = next(result for result in results if not isinstance(result, ChunkResult))
                raise RuntimeError(f"waypoint {config}: a chunk failed: {failed.error!r}")
            if index >= profile.waypoint_fill_chunks:
                rounds.append(took)
                frames += sum(chunk.frames.shape[0] for chunk in chunks)
        for session_id in session_ids:
            bare.runner.close_session(session_id)
        fps_total = frames / sum(rounds)
        counts[str(sessions)] = {
            "chunk_ms_p50": round(1000 * percentile(rounds, 50), 2),  # one round: a chunk of every session
            "chunk_ms_max": round(1000 * max(rounds), 2),
            "chunks": len(rounds),
            "history_frames": profile.waypoint_fill_chunks,  # latent frames each session had before the timed chunks
            "fps_total": round(fps_total, 2),
            "fps_per_session": round(fps_total / sessions, 2),
            "fps_per_session_vs_published": None if published is None else round(fps_total / sessions / published, 3),
        }
    cfg = pipeline.cfg
    del bare, pipeline
    plan_bytes = plan.gpu_weights_bytes + plan.fixed_bytes + largest * plan.per_session_bytes
    peak = None if before is None else torch.cuda.max_memory_allocated(where) - before
    return {
        "options": options,
        "weights": "random",
        "video_frames_per_chunk": cfg.temporal_compression,  # a chunk is one latent frame
        "tokens_per_frame": cfg.tokens_per_frame,
        "picture": [cfg.image_height, cfg.image_width],
        "load_s": round(loaded_s, 2),
        "warmup_s": round(warmup_s, 2),
        "sessions": counts,
        "published_fps": published,
        # what the allocator held at its peak over load, warm-up and every count, beyond what was there before
        "peak_allocated_bytes": peak,
        # the plan's weights, what it pays once, and its per-session bytes for the runner's sessions
        "plan_bytes": plan_bytes,
        "plan_weights_bytes": plan.gpu_weights_bytes,
        "plan_per_session_bytes": plan.per_session_bytes,
        "kv_budget_bytes": budget,  # the runner's pool: the plan's once-paid and per-session bytes for these sessions
        "peak_over_plan": None if peak is None else round(peak / plan_bytes, 3),
        "plan_sessions_on_80_gb": plan.session_capacity,
    }


def waypoint_sweep(
    profile: Profile, device: str, report: dict[str, Any], *, time_left_s: Callable[[], float], save: Callable[[], None]
) -> None:
    """Each config of ``profile.waypoint_configs`` in order until the phase's deadline (``variants``, ``skipped``,
    ``errors``)."""
    report.update(
        sessions=list(profile.waypoint_sessions), published_on=WAYPOINT_PUBLISHED_ON, variants={}, skipped={}, errors={}
    )
    pace_s: float | None = None
    for config, dtype, weights in profile.waypoint_configs:
        name = waypoint_variant_name(config, weights)
        left = time_left_s()
        if left <= 0 or (pace_s is not None and pace_s > left):
            report["skipped"][name] = f"{max(left, 0):.0f} s left of --waypoint-deadline-s"
        else:
            measure = functools.partial(waypoint_variant_figures, profile, device, config, dtype, weights)
            pace_s = run_variant(report, name, measure, "waypoint")
        report["side_by_side"] = waypoint_side_by_side(profile, report["variants"])
        save()
    if report["errors"]:
        raise RuntimeError(f"{len(report['errors'])} waypoint config(s) failed: {sorted(report['errors'])}")


def waypoint_side_by_side(profile: Profile, variants: dict[str, Any]) -> dict[str, Any]:
    """Each quantized variant's fps per session beside its config's unquantized one, at each session count both
    measured, and the published figures for both (measured on another card: the ratios are what compare)."""
    pairs: dict[str, Any] = {}
    for config, _dtype, weights in profile.waypoint_configs:
        name = waypoint_variant_name(config, weights)
        if weights is None or name not in variants or config not in variants:
            continue
        mine, plain = variants[name]["sessions"], variants[config]["sessions"]
        published, published_plain = WAYPOINT_PUBLISHED_FPS.get(name), WAYPOINT_PUBLISHED_FPS.get(config)
        pairs[name] = {
            "sessions": {
                count: {
                    "fps_per_session": mine[count]["fps_per_session"],
                    "unquantized_fps_per_session": plain[count]["fps_per_session"],
                    "speedup": round(mine[count]["fps_per_session"] / plain[count]["fps_per_session"], 3),
                }
                for count in mine.keys() & plain.keys()
            },
            "published_fps": published,
            "published_unquantized_fps": published_plain,
            "published_speedup": (
                None if published is None or published_plain is None else round(published / published_plain, 3)
            ),
        }
    return pairs


# ---- phase 6: what fits, and what quantized weights and compiled forwards give --------------------------

# In the order they run until the phase's deadline: each model eager in each precision first, then compiled.
FIT_VARIANTS: tuple[tuple[str, str | None, bool], ...] = tuple(
    (model, weights, compiled)
    for compiled in (False, True)
    for model in ("matrix-game-2", "longlive")
    for weights in (None, "int8", "fp8")
)


def fit_variant_name(profile: Profile, model: str, weights: str | None, compiled: bool) -> str:
    """``matrix-game-2/int8/eager``; unquantized variants are named by their dtype (bfloat16 on a GPU)."""
    return f"{model}/{weights or profile.fit_options[model]['dtype']}/{'compiled' if compiled else 'eager'}"


def _allocated_bytes(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def fit_variant_figures(profile: Profile, device: str, model: str, weights: str | None, compiled: bool) -> dict[str, Any]:
    """One variant: the plan's weights, the allocator's after loading, time to ready, fps and peak of one session."""
    from ..app.plan import fit_plan
    from ..app.settings import Settings
    from ..models.registry import load_pipeline
    from ..runner.runner import runner_for_sessions
    from ..runner.types import TickRequest

    where = torch.device(device)
    options = {**profile.fit_options[model], **({"weights": weights} if weights else {})}
    # the plan is for a GPU, where the dtype is the one asked for; on the CPU its figure is checked against float32
    plan = fit_plan(Settings(model=model, model_options=options), gpu_memory_bytes=80 * 10**9)
    before = _allocated_bytes(where)
    started = time.perf_counter()
    pipeline: Any = load_pipeline(model, device, **options)
    loaded_s = time.perf_counter() - started
    card = pipeline.model_card()
    on_device = sum(c["bytes"] for c in card["components"] if c["device"] == str(where))
    after = _allocated_bytes(where)
    if compiled:
        pipeline.compile_forward()
    runner = runner_for_sessions(pipeline, 1, device=device)
    if where.type == "cuda":
        torch.cuda.reset_peak_memory_stats(where)
    started = time.perf_counter()
    runner.warmup()
    ready_s = time.perf_counter() - started
    compute: list[float] = []
    frames = 0
    for chunk in range(profile.fit_chunks):
        controls = {"keys": ["w"]} if model == "matrix-game-2" else {}
        result = runner.execute_tick(TickRequest(session_id="fit", request_id=chunk, controls=controls, seed=1))
        compute.append(result.compute_s)
        frames += result.frames.shape[0]
    runner.close_session("fit")
    return {
        "options": options,
        "load_s": round(loaded_s, 2),
        "warmup_to_ready_s": round(ready_s, 2),  # compilation included when compiled
        "fps": round(frames / sum(compute), 3),
        "chunk_ms_p50": round(1000 * percentile(compute, 50), 2),
        "plan_weights_bytes": plan.gpu_weights_bytes,
        "card_weights_bytes_on_device": on_device,
        # what the allocator says the load took (CUDA), against the plan's figure
        "allocated_by_load_bytes": None if after is None or before is None else after - before,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(where) if where.type == "cuda" else None,
        "plan_sessions_on_80_gb": plan.session_capacity,
    }


def fit_sweep(
    profile: Profile, device: str, report: dict[str, Any], *, time_left_s: Callable[[], float], save: Callable[[], None]
) -> None:
    """Every variant of :data:`FIT_VARIANTS` that fits the time left, into ``report`` (``variants``, ``skipped``)."""
    report.update(variants={}, skipped={}, errors={})
    pace_s: float | None = None
    for model, weights, compiled in FIT_VARIANTS:
        name = fit_variant_name(profile, model, weights, compiled)
        left = time_left_s()
        if compiled and not profile.fit_compiles:
            report["skipped"][name] = "inductor on the CPU takes minutes: scripts/test-compile.sh runs it"
        elif left <= 0 or (pace_s is not None and pace_s * (3 if compiled else 1) > left):
            report["skipped"][name] = f"{max(left, 0):.0f} s left of --fit-deadline-s"
        else:
            measure = functools.partial(fit_variant_figures, profile, device, model, weights, compiled)
            pace_s = run_variant(report, name, measure, "fit")
        save()
    if report["errors"]:
        raise RuntimeError(f"{len(report['errors'])} fit variant(s) failed: {sorted(report['errors'])}")


# ---- the targets ---------------------------------------------------------------------------------


def aims(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 19's aims for one H200, checked against the figures (None where a figure is missing)."""
    runs = (result.get("matrix_game") or {}).get("sessions", {})
    one = runs.get("1")
    ratios = [run["server_vs_runner_ratio"] for run in runs.values()]
    if result.get("tiny_world"):
        ratios.append(result["tiny_world"]["server_vs_runner_ratio"])
    scaling = {n: round(run["fps_total"] / one["fps_total"], 3) for n, run in runs.items() if one and n != "1"}
    a2f_p99 = one and one["action_to_frame_ms_p99"]
    return {
        "one_session_fps_at_least_25": None if not one else one["fps_per_session"] >= 25,
        "one_session_action_to_frame_p99_under_300_ms": None if a2f_p99 is None else a2f_p99 < 300,
        "four_sessions_aggregate_at_least_1_5x_one": None if "4" not in scaling else scaling["4"] >= 1.5,
        "server_vs_runner_at_least_0_95_everywhere": None if not ratios else min(ratios) >= 0.95,
        "aggregate_fps_vs_one_session": scaling,
        "server_vs_runner_min": min(ratios) if ratios else None,
    }


# ---- the run -------------------------------------------------------------------------------------


def machine(device: str) -> dict[str, Any]:
    if device.startswith("cuda"):
        # without a usable CUDA device every phase but h264 fails and says why; the JSON still comes out
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no usable CUDA device"
    else:
        name = platform.machine()
    return {
        "device": device,
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        # the package actually imported: an installed copy, never a checkout's folder shadowing it
        "arstream_package": str(Path(arstream.__file__).resolve().parent),
    }


def modules_elsewhere() -> list[str]:
    """``arstream.*`` modules loaded from outside the ``arstream`` package's folder.

    Empty for an installed copy; a module listed here came from somewhere else
    (an editable install's finder filling in what the copy lacks, say), which
    would hide a packaging bug.
    """
    # Absolute, not resolved: in a checkout arstream/app is a symlink to ../app, still inside the package.
    package = Path(os.path.abspath(arstream.__file__)).parent
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "arstream"
        and (path := getattr(module, "__file__", None))
        and not Path(os.path.abspath(path)).is_relative_to(package)
    )


def write_atomically(path: Path, result: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result, indent=1) + "\n")
    partial.replace(path)


def run(args: argparse.Namespace) -> int:
    if args.carried_requirements:
        print("\n".join(carried_requirements()))
        return 0
    started = time.perf_counter()
    profile = profile_for(args.device)
    if args.deadline_s is not None:
        profile = replace(profile, deadline_s=args.deadline_s)
    if args.fit_deadline_s is not None:
        profile = replace(profile, fit_deadline_s=args.fit_deadline_s)
    if args.devices_deadline_s is not None:
        profile = replace(profile, devices_deadline_s=args.devices_deadline_s)
    if args.waypoint_deadline_s is not None:
        profile = replace(profile, waypoint_deadline_s=args.waypoint_deadline_s)
    torch.set_num_threads(profile.threads)
    out_file = Path(args.out) / "gpu-check.json" if args.out else None
    result: dict[str, Any] = {
        "check": "arstream bench gpu-check",
        **machine(args.device),
        "complete": False,
        "elapsed_s": 0.0,
        "h264": None,
        "devices": None,
        "waypoint": None,
        "tiny_world": None,
        "matrix_game": None,
        "decode_path": None,
        "fit": None,
        "aims": None,
        "errors": {},
        "arstream_modules_elsewhere": [],
    }

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        try:
            result["aims"] = aims(result)
        except (KeyError, TypeError, ZeroDivisionError) as error:  # a figure missing: the JSON still comes out
            result["aims"] = {"error": repr(error)}
        result["arstream_modules_elsewhere"] = modules_elsewhere()
        if out_file is not None:
            write_atomically(out_file, result)

    def phase(name: str, measure: Callable[[], Any]) -> None:
        print(f"== {name} ({time.perf_counter() - started:.0f} s in)", flush=True)
        try:
            outcome = measure()
            if outcome is not None:
                result[name] = outcome
        except Exception as error:  # noqa: BLE001 - a failed phase is reported and the others still run
            traceback.print_exc()
            result["errors"][name] = f"{type(error).__name__}: {error}"[-2000:]
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            save()

    save()
    fps = get_config(profile.matrix_game_options["config"]).fps  # a session's stream plays at the model's rate
    phase("h264", lambda: h264_figures(frames=profile.h264_frames, fps=fps))
    def capped_phase(name: str, sweep: Sweep, deadline_s: float) -> None:
        """A phase that runs variants until its own deadline, saving after each (its figures in ``result[name]``)."""
        result[name] = {}
        phase_started = time.perf_counter()

        def time_left_s() -> float:
            return deadline_s - (time.perf_counter() - phase_started)

        phase(name, lambda: sweep(profile, args.device, result[name], time_left_s=time_left_s, save=save))

    capped_phase("devices", devices_sweep, profile.devices_deadline_s)
    capped_phase("waypoint", waypoint_sweep, profile.waypoint_deadline_s)
    phase("tiny_world", lambda: tiny_world_figures(profile, args.device))
    result["matrix_game"] = {}
    phase(
        "matrix_game",
        lambda: matrix_game_sweep(
            profile,
            args.device,
            result["matrix_game"],
            time_left_s=lambda: profile.deadline_s - (time.perf_counter() - started),
            save=save,
        ),
    )
    result["decode_path"] = {}
    phase(
        "decode_path",
        lambda: decode_path_sweep(
            profile,
            args.device,
            result["decode_path"],
            time_left_s=lambda: profile.deadline_s - (time.perf_counter() - started),
            save=save,
        ),
    )
    phase("longlive", lambda: longlive_figures(profile, args.device))
    result["fit"] = {}
    fit_started = time.perf_counter()
    phase(
        "fit",
        lambda: fit_sweep(
            profile,
            args.device,
            result["fit"],
            time_left_s=lambda: profile.fit_deadline_s - (time.perf_counter() - fit_started),
            save=save,
        ),
    )
    result["complete"] = not result["errors"]
    save()
    print_summary(result)
    return 0 if result["complete"] else 1


# ---- what the GPU machine lacks -----------------------------------------------------------------


def carried_requirements() -> list[str]:
    """``name==version`` of every distribution the server and the extras it measures need, beyond the GPU image's.

    Walks the installed ``arstream`` distribution's requirements (with the
    ``video`` and ``wan`` extras) through this environment's installed
    distributions, with markers evaluated for CPython 3.12 on x86-64 Linux,
    and pins what is installed here (the versions the tests ran with).
    """
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    environment = {
        "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
        "implementation_name": "cpython", "platform_python_implementation": "CPython",
    }  # fmt: skip

    def needed(distribution: str, extras: tuple[str, ...]) -> list[Requirement]:
        requirements = [Requirement(text) for text in metadata.requires(distribution) or []]
        return [
            r
            for r in requirements
            if r.marker is None or any(r.marker.evaluate({**environment, "extra": extra}) for extra in ("", *extras))
        ]

    pinned: dict[str, str] = {}
    pending = needed("arstream", CARRIED_EXTRAS)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in IMAGE_DISTRIBUTIONS | NOT_CARRIED or name.startswith("nvidia-") or name in pinned:
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:  # needed on 3.12 only: the newest fitting wheel
            pinned[name] = f"{name}{requirement.specifier}"
            continue
        pinned[name] = f"{name}=={version}"
        pending += needed(name, tuple(requirement.extras))
    return sorted(pinned.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--device", default="cuda", help="cuda: full size; cpu: tiny configs, same code path")
    parser.add_argument("--out", help="folder for gpu-check.json, rewritten after every phase")
    parser.add_argument(
        "--deadline-s",
        type=float,
        help="skip matrix-game session counts projected to end after this many seconds (default: 400 on cuda)",
    )
    parser.add_argument(
        "--fit-deadline-s",
        type=float,
        help="seconds the fit phase may take; variants that would pass it are skipped (default: 300 on cuda)",
    )
    parser.add_argument(
        "--devices-deadline-s",
        type=float,
        help="seconds the devices phase may take; variants that would pass it are skipped (default: 240 on cuda)",
    )
    parser.add_argument(
        "--waypoint-deadline-s",
        type=float,
        help="seconds the waypoint phase may take; configs that would pass it are skipped (default: 90 on cuda)",
    )
    parser.add_argument(
        "--carried-requirements",
        action="store_true",
        help="print the pinned distributions a GPU image lacks (scripts/gpu-check.sh --fetch-wheels) and exit",
    )


main = main_for("bench", "gpu-check")
