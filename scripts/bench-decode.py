#!/usr/bin/env python3
"""The decode path, side by side: decode overlapped with the next forward vs serial, and TAEHV vs the Wan VAE.

    .venv/bin/python scripts/bench-decode.py                       # every scenario below, 1 session
    .venv/bin/python scripts/bench-decode.py --scenarios split-phase --sessions 1 2 --chunks 32

Serving (``--scenarios``): two servers of the same model, one with ``--decode-overlap`` and
one with ``--no-decode-overlap``, both up at once and measured in alternating order
(``arstream.measure.compare``), each with N paced sessions (``bench serve``'s clients);
the figure is served chunks/s, overlapped over serial, and the overlapped server's
/v1/stats phases (DiT, decode and overlap ms per round).

- ``split-phase``: fake-kv whose forward sleeps 40 ms and whose decode sleeps 30 ms,
  neither holding the GIL (a GPU's forward and decode wait the same way): at most
  (40 + 30) / 40 = 1.75x.
- ``matrix-game-2-taehv``, ``matrix-game-2-vae``: tiny matrix-game-2 (random weights) with
  the TAEHV decoder or the Wan VAE; on a CPU both phases need the same cores.

Decoders (``--decoders``): the tiny matrix-game-2's two decoders on the same latents, one
steady-state chunk (3 latent frames, 12 video frames) at a time, alternating: ms per chunk
and the Wan VAE's time over TAEHV's.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import torch

from arstream.programs.bench import ServerProcess, server_chunks_per_s, server_phase
from arstream.measure import compare, print_summary
from arstream.models.matrix_game.pipeline import MatrixGamePipeline
from arstream.models.registry import load_pipeline

TINY = {"config": "tiny", "random_init": True}
SCENARIOS: dict[str, tuple[str, dict[str, Any]]] = {
    "split-phase": ("fake-kv", {"compute_delay_s": 0.04, "decode_delay_s": 0.03, "session_capacity": 8}),
    "matrix-game-2-taehv": ("matrix-game-2", {**TINY, "decoder": "taehv"}),
    "matrix-game-2-vae": ("matrix-game-2", TINY),
}
SIDES = ("overlapped", "serial")


def serve_args(model: str, options: dict[str, Any], overlap: bool, threads: int, rewind_seconds: float) -> list[str]:
    return [
        "--model", model, "--model-options", json.dumps(options), "--torch-threads", str(threads),
        "--decode-overlap" if overlap else "--no-decode-overlap", "--log-level", "warning",
        "--rewind-seconds", str(rewind_seconds),
    ]


def bench_serving(name: str, sessions: int, chunks: int, repeats: int, threads: int, rewind_seconds: float) -> dict[str, Any]:
    model, options = SCENARIOS[name]
    servers = {
        side: ServerProcess(serve_args(model, options, side == "overlapped", threads, rewind_seconds)) for side in SIDES
    }
    with servers["overlapped"], servers["serial"]:

        def measure(_repetition: int, order: tuple[str, str]) -> dict[str, float]:
            figures = {}
            for side in order:
                run = server_phase(servers[side].sessions_url, sessions=sessions, chunks=chunks, input_every=4, codec="raw")
                figures[side] = server_chunks_per_s(asyncio.run(run))
            return figures

        def report(repetition: int, figures: Any, ratio: float) -> None:
            print(f"  {name} x{sessions} rep {repetition}: overlapped {figures['overlapped']:.2f} chunks/s, "
                  f"serial {figures['serial']:.2f} chunks/s, ratio {ratio:.3f}", flush=True)

        comparison = compare(SIDES, repeats, measure, report)
        phases = {side: servers[side].get_json("/v1/stats")["phases"] for side in SIDES}
    return {
        "scenario": name,
        "sessions": sessions,
        "rewind_seconds": rewind_seconds,
        "overlapped_chunks_per_s": round(comparison.median("overlapped"), 3),
        "serial_chunks_per_s": round(comparison.median("serial"), 3),
        "overlapped_vs_serial_ratio": round(comparison.median_ratio, 3),
        "phases": phases,
    }


def bench_decoders(repeats: int, chunks: int) -> dict[str, Any]:
    pipelines = {}
    for name, decoder in (("taehv", "taehv"), ("wan-vae", "wan-vae")):
        pipeline = load_pipeline("matrix-game-2", "cpu", **TINY, decoder=decoder)
        assert isinstance(pipeline, MatrixGamePipeline)
        pipelines[name] = pipeline
    cfg = pipelines["taehv"].cfg
    generator = torch.Generator().manual_seed(0)
    latents = [torch.randn(1, cfg.out_dim, cfg.frames_per_chunk, cfg.latent_height, cfg.latent_width,
                           generator=generator) for _ in range(chunks + 1)]
    caches: dict[str, Any] = {}
    for name, pipeline in pipelines.items():  # past the first chunk: the steady state
        _, caches[name] = pipeline.decoder.decode_rows(latents[0], [None])

    def measure(repetition: int, order: tuple[str, str]) -> dict[str, float]:
        figures = {}
        for name in order:
            decoder = pipelines[name].decoder
            started = time.perf_counter()
            cache = caches[name]
            for chunk in latents[1:]:
                _, cache = decoder.decode_rows(chunk, cache)
            figures[name] = (time.perf_counter() - started) / chunks * 1e3
        return figures

    comparison = compare(("wan-vae", "taehv"), repeats, measure)
    state = {name: p.vae_cache_bytes for name, p in pipelines.items()}
    return {
        "wan_vae_ms_per_chunk": round(comparison.median("wan-vae"), 3),
        "taehv_ms_per_chunk": round(comparison.median("taehv"), 3),
        "wan_vae_vs_taehv_ratio": round(comparison.median_ratio, 3),
        "state_bytes_per_session": state,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--sessions", nargs="+", type=int, default=[1])
    parser.add_argument("--chunks", type=int, default=24, help="chunks per session per repetition (default 24)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating repetitions (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server (default 1)")
    parser.add_argument("--rewind-seconds", type=float, default=30.0, help="each server's --rewind-seconds (default 30)")
    parser.add_argument("--decoders", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    summary: dict[str, Any] = {"serving": []}
    for name in args.scenarios:
        for sessions in args.sessions:
            result = bench_serving(name, sessions, args.chunks, args.repeat, args.threads, args.rewind_seconds)
            print(f"{name} x{sessions}: overlapped/serial {result['overlapped_vs_serial_ratio']}", flush=True)
            summary["serving"].append(result)
    if args.decoders:
        summary["decoders"] = bench_decoders(args.repeat, 8)
        print(f"decoders: {summary['decoders']}", flush=True)
    print_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
