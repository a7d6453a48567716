"""``arstream bench serve``: end-to-end load test of the server against the bare runner.

    arstream bench serve --sessions 4 --model fake-kv --chunks 64 --model-options '{"compute_delay_s": 0.02}'

It starts a real server (``python -m arstream serve --port 0``) as a
subprocess, opens N concurrent sessions over loopback that pace themselves like
real clients (at most two ticks in flight, an ``input`` every few ticks; all
of them connect and start before the first tick, so the rate is that of N
sessions ticking, not of connections being made), and
then, with the server idle, runs the same number of chunks of the same model
through a bare :class:`arstream.runner.runner.ARRunner` built in this process. The ratio
of the two chunk throughputs is the server's overhead in one number: 1.0 means
the transport costs nothing. Repetitions alternate server and runner phases so
that drift (thermal, other load) hits both alike.

Clients here parse frame headers but do not decode frames, so the load generator
takes as little CPU as possible from the server it measures. ``--codec`` picks
the frame codec (jpeg, raw, h264); the summary gives its bytes per frame and
the server's encode milliseconds per frame (from each chunk's ``timings``), and
the mean number of sessions per worker round on the server (``/v1/stats``)
beside the bare runner's, which always runs every session in one call.

The last line printed is one JSON object with the figures (medians over
repetitions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import websockets

from arstream.app import wire
from arstream.app.cli import main_for
from arstream.app.memory import keep_freed_memory
from arstream.measure import compare, percentile, print_summary
from arstream.models.bench_model import control_keys
from arstream.app.client import MAX_MESSAGE_BYTES, SessionClient
from arstream.app.settings import default_max_batch_sessions
from arstream.runner.threads import default_torch_threads

LISTENING_MARKER = "ARSTREAM_LISTENING "
SERVER_START_TIMEOUT_S = 600.0
TICKS_IN_FLIGHT = 2
WARMUP_CHUNKS = 8
# Both sides get the same explicit budget, so that on a GPU the two pools fit side by side.
DEFAULT_KV_BUDGET_BYTES = 256 * 2**20


# ---- the server subprocess ----------------------------------------------------------


class ServerStartError(RuntimeError):
    """The server subprocess exited or timed out before printing its listening line."""


class ServerProcess:
    """``python -m arstream serve ... --port 0`` as a context manager; ``base_url`` once it listens.

    The server's output is drained by a thread (so a chatty server never blocks
    on a full pipe) and the last lines are kept for error messages.
    """

    def __init__(
        self, serve_args: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None
    ) -> None:
        self.command = [sys.executable, "-m", "arstream", "serve", "--port", "0", *serve_args]
        self.env = env
        # Another checkout's directory runs that checkout's server (its `arstream` package comes first).
        self.cwd = cwd or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.base_url = ""
        self.output: deque[str] = deque(maxlen=200)
        self._listening = threading.Event()
        self._process: subprocess.Popen[str] | None = None
        self._drainer: threading.Thread | None = None

    def __enter__(self) -> ServerProcess:
        self._process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=self.cwd,
        )
        self._drainer = threading.Thread(target=self._drain, name="server-output", daemon=True)
        self._drainer.start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not self._listening.wait(0.1):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                tail = "\n".join(self.output)
                raise ServerStartError(f"server did not start ({' '.join(self.command)}); its output:\n{tail}")
        return self

    def _drain(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self.output.append(line.rstrip("\n"))
            if LISTENING_MARKER in line and not self._listening.is_set():
                self.base_url = line.split(LISTENING_MARKER, 1)[1].split()[0]
                self._listening.set()

    @property
    def sessions_url(self) -> str:
        return wire.session_url(self.base_url)

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.base_url + path, timeout=30) as response:
            return json.load(response)

    def __exit__(self, *exc_info: object) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        # The drainer ends at EOF once the process is gone; only then is the pipe closed.
        if self._drainer is not None:
            self._drainer.join(timeout=10)
        if process.stdout is not None and (self._drainer is None or not self._drainer.is_alive()):
            process.stdout.close()
        self._process = None


# ---- server phase: N paced sessions -------------------------------------------------


@dataclass
class SessionFigures:
    """One benchmark session's measurements (seconds, perf_counter clock)."""

    chunks: int
    frames: int
    first_tick_at: float
    last_frame_at: float
    time_to_first_frame_s: float
    chunk_latencies_s: list[float]
    action_to_frame_s: list[float]
    payload_bytes: int = 0  # frame payloads, headers excluded
    encode_s: float = 0.0  # the server's encode time for these frames (chunk timings)

    @property
    def fps(self) -> float:
        return self.frames / (self.last_frame_at - self.first_tick_at)


async def paced_session(
    url: str, *, chunks: int, input_every: int, codec: str, all_started: asyncio.Barrier | None = None
) -> SessionFigures:
    """Run ``chunks`` ticks with at most two in flight; press a different key every ``input_every`` ticks.

    With ``all_started``, the session waits there after its ``start`` until every
    session of the phase has started, so that throughput is measured with all
    of them ticking (connecting is in ``time_to_first_frame_s``, not in chunks/s).
    """
    connect_started = time.perf_counter()
    async with websockets.connect(url, max_size=MAX_MESSAGE_BYTES) as ws:
        session = SessionClient(ws, decode=False)
        await session.start(codec=codec)
        keys = control_keys(session.model)
        started_after = time.perf_counter() - connect_started
        if all_started is not None:
            await all_started.wait()
        in_flight_limit = min(TICKS_IN_FLIGHT, session.max_pending_ticks)
        first_tick_at = time.perf_counter()
        sent = received = frames = payload_bytes = 0
        encode_ms = 0.0
        last_frame_at = first_tick_at
        while received < chunks:
            while sent < chunks and session.ticks_in_flight < in_flight_limit:
                if keys and input_every and sent % input_every == 0:
                    # Cycle through single keys and "no key", so every input really changes the controls.
                    press = (keys + [None])[(sent // input_every) % (len(keys) + 1)]
                    await session.send_input(controls={"keys": [press] if press else []})
                await session.send_tick()
                sent += 1
            chunk = await session.receive_chunk()
            received += 1
            frames += len(chunk.frames)
            payload_bytes += sum(len(frame) for frame in chunk.frames)
            encode_ms += float(chunk.message.get("timings", {}).get("encode_ms", 0.0))
            last_frame_at = chunk.last_frame_at
        await session.close()
    return SessionFigures(
        chunks=received,
        frames=frames,
        first_tick_at=first_tick_at,
        last_frame_at=last_frame_at,
        # connect and start, then the first tick to its first frame (the wait for the other sessions left out)
        time_to_first_frame_s=started_after + session.first_frame_at - first_tick_at,
        chunk_latencies_s=session.chunk_latencies_s,
        action_to_frame_s=session.action_to_frame_s,
        payload_bytes=payload_bytes,
        encode_s=encode_ms / 1e3,
    )


async def server_phase(url: str, *, sessions: int, chunks: int, input_every: int, codec: str) -> list[SessionFigures]:
    """``sessions`` paced sessions that connect and start, then tick together (like the bare runner's rounds)."""
    all_started = asyncio.Barrier(sessions)
    return list(
        await asyncio.gather(
            *(
                paced_session(url, chunks=chunks, input_every=input_every, codec=codec, all_started=all_started)
                for _ in range(sessions)
            )
        )
    )


def server_chunks_per_s(figures: Sequence[SessionFigures]) -> float:
    """All sessions' chunks over the wall time from the first tick sent to the last frame received.

    Every session has started before the first tick (``server_phase``), so this is the
    steady rate of a full server, as the bare runner's is of its full rounds.
    """
    started = min(f.first_tick_at for f in figures)
    ended = max(f.last_frame_at for f in figures)
    return sum(f.chunks for f in figures) / (ended - started)


# ---- runner phase: the same chunks without the server --------------------------------


class BareRunner:
    """The same model in this process, driven straight through ARRunner.execute, one call per chunk boundary."""

    def __init__(
        self, model: str, options: dict[str, Any], *, device: str, kv_budget_bytes: int, max_batch_sessions: int
    ) -> None:
        from arstream.models.registry import load_pipeline
        from arstream.runner.runner import ARRunner

        self.runner = ARRunner(
            load_pipeline(model, device, **options),
            device=device,
            kv_budget_bytes=kv_budget_bytes,
            max_batch_sessions=max_batch_sessions,
        )
        self.runner.warmup()
        self.keys = control_keys(self.runner.model_card())
        self._next_request = 0

    def chunks_per_s(self, *, sessions: int, chunks: int, input_every: int) -> float:
        """Run ``sessions * chunks`` chunks, each session's next tick in one call (as the worker does); chunks/s."""
        from arstream.runner.types import ChunkResult, TickRequest

        if self.runner.session_capacity < sessions:
            raise RuntimeError(
                f"the bare runner's KV budget holds {self.runner.session_capacity} sessions, the bench needs {sessions}"
            )
        session_ids = [f"bench-{i}" for i in range(sessions)]
        started = time.perf_counter()
        for step in range(chunks):
            press = (self.keys + [None])[(step // input_every) % (len(self.keys) + 1)] if self.keys else None
            controls = {"keys": [press] if press else []} if self.keys else {}
            ticks = []
            for session_id in session_ids:
                self._next_request += 1
                ticks.append(TickRequest(session_id=session_id, request_id=self._next_request, controls=controls))
            for result in self.runner.execute(ticks):
                if not isinstance(result, ChunkResult):
                    raise RuntimeError(f"bare runner chunk failed: {result.error!r}")
        elapsed = time.perf_counter() - started
        for session_id in session_ids:
            self.runner.close_session(session_id)
        return sessions * chunks / elapsed


# ---- the command --------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1000, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("--sessions", type=int, default=1, help="concurrent sessions (default 1)")
    parser.add_argument("--model", default="tiny-world")
    parser.add_argument("--chunks", type=int, default=64, help="chunks per session per repetition (default 64)")
    parser.add_argument("--model-options", default="{}", help="JSON options for the model, given to both sides")
    parser.add_argument("--repeat", type=int, default=3, help="alternating server/runner repetitions (default 3)")
    parser.add_argument("--input-every", type=int, default=4, help="send an input every N ticks (default 4)")
    parser.add_argument("--codec", choices=wire.CODEC_NAMES, default="jpeg")
    parser.add_argument("--device", default="cpu", help="torch device for the server and the bare runner")
    parser.add_argument(
        "--kv-budget-bytes",
        type=int,
        default=DEFAULT_KV_BUDGET_BYTES,
        help="KV pool budget for the server and the bare runner alike (default 256 MiB)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads on both sides (default: the server's default, CPU cores - 1, at least 1)",
    )
    parser.add_argument(
        "--max-batch-sessions",
        type=int,
        help="sessions per batched forward, for the server and the bare runner alike (default: the server's)",
    )
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="extra argument for `arstream serve` (repeatable)"
    )


def run(args: argparse.Namespace) -> int:
    options = json.loads(args.model_options)
    if args.max_batch_sessions is None:
        args.max_batch_sessions = default_max_batch_sessions(args.device)
    if min(args.sessions, args.chunks, args.repeat, args.input_every, args.threads or 1, args.max_batch_sessions) < 1:
        print("arstream bench serve: counts must be >= 1", file=sys.stderr)
        return 2
    # A busy machine makes torch's spinning thread pool very slow when it has more threads than free
    # cores, so a fair comparison pins both sides to the same count.
    threads = args.threads or default_torch_threads()
    torch.set_num_threads(threads)
    serve_args = [
        "--torch-threads", str(threads),
        "--model", args.model,
        "--model-options", json.dumps(options),
        "--device", args.device,
        "--kv-budget-bytes", str(args.kv_budget_bytes),
        "--max-batch-sessions", str(args.max_batch_sessions),
        "--log-level", "warning",
        *args.serve_arg,
    ]  # fmt: skip
    all_figures: list[SessionFigures] = []
    rounds = sessions_in_rounds = 0
    # The bare runner gets the server's allocator policy (app/memory.py), so the ratio compares like with like.
    keep_freed_memory()
    with ServerProcess(serve_args) as server:
        url = server.sessions_url
        print(f"server: {server.base_url} ({' '.join(serve_args)})")
        bare = BareRunner(
            args.model,
            options,
            device=args.device,
            kv_budget_bytes=args.kv_budget_bytes,
            max_batch_sessions=args.max_batch_sessions,
        )
        # One untimed round on each side first, at full concurrency, so neither pays for first-use costs.
        warmup = dict(sessions=args.sessions, chunks=WARMUP_CHUNKS, input_every=args.input_every, codec=args.codec)
        asyncio.run(server_phase(url, **warmup))
        bare.chunks_per_s(sessions=args.sessions, chunks=WARMUP_CHUNKS, input_every=args.input_every)

        def measure(repetition: int, order: tuple[str, str]) -> dict[str, float]:
            rates = {}
            for side in order:  # each side runs alone: the server is idle while the bare runner works
                if side == "server":
                    nonlocal rounds, sessions_in_rounds
                    phase = dict(sessions=args.sessions, chunks=args.chunks, input_every=args.input_every, codec=args.codec)
                    before = server.get_json("/v1/stats")["chunks"]
                    figures = asyncio.run(server_phase(url, **phase))
                    after = server.get_json("/v1/stats")["chunks"]
                    rates["server"] = server_chunks_per_s(figures)
                    all_figures.extend(figures)
                    rounds += after["rounds_total"] - before["rounds_total"]
                    sessions_in_rounds += after["round_sessions_total"] - before["round_sessions_total"]
                else:
                    rates["runner"] = bare.chunks_per_s(
                        sessions=args.sessions, chunks=args.chunks, input_every=args.input_every
                    )
            print(
                f"repetition {repetition + 1}/{args.repeat}: server {rates['server']:.1f} chunks/s, "
                f"bare runner {rates['runner']:.1f} chunks/s, ratio {rates['server'] / rates['runner']:.3f}"
            )
            for index, f in enumerate(all_figures[-args.sessions :]):
                print(
                    f"  session {index}: {f.fps:.1f} fps, ttff {f.time_to_first_frame_s * 1000:.1f} ms, "
                    f"chunk p50 {percentile(f.chunk_latencies_s, 50) * 1000:.1f} ms "
                    f"p99 {percentile(f.chunk_latencies_s, 99) * 1000:.1f} ms, "
                    f"action-to-frame p50 {percentile(f.action_to_frame_s, 50) * 1000:.1f} ms "
                    f"p99 {percentile(f.action_to_frame_s, 99) * 1000:.1f} ms"
                )
            return rates

        result = compare(("server", "runner"), args.repeat, measure)
    chunk_latencies = [x for f in all_figures for x in f.chunk_latencies_s]
    action_latencies = [x for f in all_figures for x in f.action_to_frame_s]
    frames = sum(f.frames for f in all_figures)
    summary = {
        "model": args.model,
        "model_options": options,
        "sessions": args.sessions,
        "chunks_per_session": args.chunks,
        "repetitions": args.repeat,
        "threads": threads,
        "max_batch_sessions": args.max_batch_sessions,
        "server_chunks_per_s": round(result.median("server"), 2),
        "runner_chunks_per_s": round(result.median("runner"), 2),
        "server_vs_runner_ratio": round(result.median_ratio, 4),
        "server_vs_runner_ratios": [round(r, 4) for r in result.ratios],
        "fps_per_session": round(_median([f.fps for f in all_figures]), 2),
        "ttff_ms": _ms(_median([f.time_to_first_frame_s for f in all_figures])),
        "chunk_ms_p50": _ms(percentile(chunk_latencies, 50)),
        "chunk_ms_p99": _ms(percentile(chunk_latencies, 99)),
        "action_to_frame_ms_p50": _ms(percentile(action_latencies, 50)),
        "action_to_frame_ms_p99": _ms(percentile(action_latencies, 99)),
        "codec": args.codec,
        "bytes_per_frame": round(sum(f.payload_bytes for f in all_figures) / frames, 1),
        "encode_ms_per_frame": round(sum(f.encode_s for f in all_figures) / frames * 1e3, 3),
        # a worker round is one runner call; the bare runner always puts min(sessions, batch) in one
        "server_sessions_per_round": round(sessions_in_rounds / rounds, 2) if rounds else None,
        "full_round_sessions": min(args.sessions, args.max_batch_sessions),
    }
    print_summary(summary)
    return 0


main = main_for("bench", "serve")
