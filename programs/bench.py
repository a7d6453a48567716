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

``--dialect realtime-video`` runs the server phase over vLLM-Omni's
``WS /v1/realtime/video`` instead (PROTOCOL.md): each session sends one
``session.start`` for ``chunks`` chunks (after all have connected) and the
server ticks for it, its ``max_pending_ticks`` credits in flight; every
``input_every`` chunks it sends a ``session.interaction`` camera velocity that
presses the next key. The frames are fMP4 (``--codec`` does not apply; compare
with ``--codec h264``), a chunk's latency is the time since the previous
chunk arrived, and action-to-frame runs from an interaction to the first
chunk that starts it.

The last line printed is one JSON object with the figures (medians over
repetitions), among them ``fps_total`` (all sessions' frames per second
through the server) and, for pipelines that time them, the bare runner's DiT
and VAE milliseconds per round. :class:`ServeBench` keeps the server and the
bare runner for several session counts in turn (``arstream bench gpu-check``).
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
from dataclasses import dataclass, field
from typing import Any

import torch
import websockets

from ..app.codecs import CODEC_NAMES
from ..app.memory import keep_freed_memory
from ..app.realtime_video import PATH as REALTIME_VIDEO_PATH
from ..cli import main_for
from ..measure import compare, percentile, print_summary
from .bench_model import control_keys, forward_split_s
from ..app.settings import Settings, default_max_batch_sessions
from . import client_lib
from .client_lib import MAX_MESSAGE_BYTES, Session
from ..runner.threads import default_torch_threads

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
        # -P: the working directory is not put on sys.path, so a checkout's `arstream/` folder there can never
        # shadow the installed package (how the first GPU scripts failed).
        self.command = [sys.executable, "-P", "-m", "arstream", "serve", "--port", "0", *serve_args]
        self.env = env
        # Another checkout's directory runs that checkout's server (its `arstream` package comes first).
        self.cwd = cwd or os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the checkout root
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
        return client_lib.session_url(self.base_url)

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
    # per input: the index of the chunk that applied it less the last chunk index the client had when it sent it
    action_to_frame_chunks: list[int] = field(default_factory=list)
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
        session = Session(ws, decode=False)
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
        action_to_frame_chunks=session.action_to_frame_chunks,
        payload_bytes=payload_bytes,
        encode_s=encode_ms / 1e3,
    )


# A camera velocity per key, in vLLM-Omni's SE3 (Unity axes: +X right, +Z forward), for the realtime video dialect.
KEY_TRANSLATIONS = {"w": [0.0, 0.0, 0.05], "s": [0.0, 0.0, -0.05], "a": [-0.05, 0.0, 0.0], "d": [0.05, 0.0, 0.0]}


async def realtime_video_session(
    url: str, card: dict[str, Any], *, chunks: int, input_every: int, all_started: asyncio.Barrier | None = None
) -> SessionFigures:
    """One ``/v1/realtime/video`` session of ``chunks`` chunks; a camera interaction every ``input_every`` chunks."""
    keys = [k for k in control_keys(card) if k in KEY_TRANSLATIONS]
    num_frames = chunks * int(card["frames_per_chunk"])
    start = {"type": "session.start", "model": card["name"], "prompt": "bench", "num_frames": num_frames}
    connect_started = time.perf_counter()
    async with websockets.connect(url, max_size=MAX_MESSAGE_BYTES) as ws:
        connected_after = time.perf_counter() - connect_started
        if all_started is not None:
            await all_started.wait()
        first_tick_at = last_at = time.perf_counter()
        await ws.send(json.dumps(start))
        figures = SessionFigures(0, 0, first_tick_at, first_tick_at, 0.0, [], [])
        sent_at: dict[str, tuple[float, int]] = {}  # event_id -> (when, the last chunk index the client had)
        metadata: dict[str, Any] = {}
        while True:
            message = await ws.recv()
            now = time.perf_counter()
            if isinstance(message, bytes):
                if figures.chunks == 0:
                    figures.time_to_first_frame_s = connected_after + now - first_tick_at
                else:
                    figures.chunk_latencies_s.append(now - last_at)
                last_at = figures.last_frame_at = now
                figures.chunks += 1
                figures.frames += int(metadata["num_frames"])
                figures.payload_bytes += len(message)
                figures.encode_s += float(metadata["timings"]["encode_ms"]) / 1e3
                for event_id in metadata["started_event_ids"]:
                    when, had = sent_at.pop(event_id)
                    figures.action_to_frame_s.append(now - when)
                    figures.action_to_frame_chunks.append(int(metadata["generation_chunk_index"]) - had)
                if keys and input_every and figures.chunks % input_every == 0 and figures.chunks < chunks:
                    press = (keys + [None])[(figures.chunks // input_every) % (len(keys) + 1)]
                    translation = KEY_TRANSLATIONS[press] if press else [0.0, 0.0, 0.0]
                    event_id = f"bench-{figures.chunks}"
                    camera = {"mode": "velocity", "data": {"translation": translation, "rotation": [0, 0, 0, 1]}}
                    interaction = {"event_id": event_id, "event": {"multi_modal_data": {"camera": camera}}}
                    sent_at[event_id] = (time.perf_counter(), int(metadata["generation_chunk_index"]))
                    await ws.send(json.dumps({"type": "session.interaction", "interaction": interaction}))
                continue
            event = json.loads(message)
            if event["type"] == "video.chunk_metadata":
                metadata = event
            elif event["type"] == "error":
                raise RuntimeError(f"the realtime video session failed: {event}")
            elif event["type"] == "session.done":
                return figures


async def server_phase(
    url: str, *, sessions: int, chunks: int, input_every: int, codec: str, dialect: str = "sessions"
) -> list[SessionFigures]:
    """``sessions`` paced sessions that connect and start, then tick together (like the bare runner's rounds)."""
    all_started = asyncio.Barrier(sessions)
    if dialect == "realtime-video":
        with urllib.request.urlopen(client_lib.http_base_url(url) + "/v1/model", timeout=30) as response:
            card = json.load(response)
        url = url.replace("/v1/sessions", REALTIME_VIDEO_PATH)
        phase = (
            realtime_video_session(url, card, chunks=chunks, input_every=input_every, all_started=all_started)
            for _ in range(sessions)
        )
    else:
        phase = (
            paced_session(url, chunks=chunks, input_every=input_every, codec=codec, all_started=all_started)
            for _ in range(sessions)
        )
    return list(await asyncio.gather(*phase))


def phase_wall_s(figures: Sequence[SessionFigures]) -> float:
    """The wall time from the first tick any session sent to the last frame any session received."""
    return max(f.last_frame_at for f in figures) - min(f.first_tick_at for f in figures)


def server_chunks_per_s(figures: Sequence[SessionFigures]) -> float:
    """All sessions' chunks over :func:`phase_wall_s`.

    Every session has started before the first tick (``server_phase``), so this is the
    steady rate of a full server, as the bare runner's is of its full rounds.
    """
    return sum(f.chunks for f in figures) / phase_wall_s(figures)


def server_frames_per_s(figures: Sequence[SessionFigures]) -> float:
    """All sessions' video frames over :func:`phase_wall_s`: the aggregate frame rate."""
    return sum(f.frames for f in figures) / phase_wall_s(figures)


# ---- runner phase: the same chunks without the server --------------------------------


class BareRunner:
    """The same model in this process, driven straight through the runtime's execute, one call per chunk boundary."""

    def __init__(
        self, pipeline: Any, *, device: str, kv_budget_bytes: int, max_batch_sessions: int, settings: Settings
    ) -> None:
        from ..runner.runtimes import build_runtime

        self.pipeline = pipeline
        self.runner = build_runtime(
            "arstream",
            pipeline,
            device=device,
            kv_budget_bytes=kv_budget_bytes,
            max_batch_sessions=max_batch_sessions,
            rewind_seconds=settings.rewind_seconds,
            rewind_budget_bytes=settings.rewind_budget_bytes(),
        )
        self.runner.warmup()
        self.keys = control_keys(self.runner.model_card())
        self._next_request = 0
        # (DiT s, VAE s) of each measured call's forward, for pipelines that time them (ChunkTimings)
        self.forward_splits: list[tuple[float, float]] = []

    def chunks_per_s(self, *, sessions: int, chunks: int, input_every: int) -> float:
        """Run ``sessions * chunks`` chunks, each session's next tick in one call (as the worker does); chunks/s."""
        from ..runner.types import ChunkResult, TickRequest

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
            split = forward_split_s(self.pipeline)
            if split is not None:
                self.forward_splits.append(split)
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
    parser.add_argument(
        "--warmup-chunks",
        type=int,
        default=WARMUP_CHUNKS,
        help=f"untimed chunks per session on each side before the first repetition (default {WARMUP_CHUNKS})",
    )
    parser.add_argument("--codec", choices=CODEC_NAMES, default="jpeg")
    parser.add_argument(
        "--dialect",
        choices=["sessions", "realtime-video"],
        default="sessions",
        help="the server phase's wire: protocol 1 (default) or vLLM-Omni's /v1/realtime/video (fMP4)",
    )
    parser.add_argument("--device", default="cpu", help="torch device for the server and the bare runner")
    parser.add_argument(
        "--kv-budget-bytes",
        type=int,
        help="KV pool budget for the server and the bare runner alike "
        "(default: 256 MiB, or room for --sessions sessions where that needs more)",
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


class ServeBench:
    """A server subprocess and a bare runner of one model, for side-by-side phases of up to ``args.sessions`` sessions.

    Both are built once (model load, warm-up at every batch size), so one
    instance can measure several session counts in turn (``arstream bench
    gpu-check`` sweeps 1, 2, 4 and 8 sessions this way).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.options = json.loads(args.model_options)
        if args.max_batch_sessions is None:
            args.max_batch_sessions = default_max_batch_sessions(args.device)
        # A busy machine makes torch's spinning thread pool very slow when it has more threads than free
        # cores, so a fair comparison pins both sides to the same count.
        self.threads = args.threads or default_torch_threads()
        self._server: ServerProcess | None = None

    def __enter__(self) -> ServeBench:
        from ..models.registry import load_pipeline
        from ..runner.pool import budget_for_sessions
        from ..runner.contract import ARPipeline
        from ..runner.runner import rewind_for

        args = self.args
        torch.set_num_threads(self.threads)
        # The bare runner gets the server's allocator policy (app/memory.py), so the ratio compares like with like.
        keep_freed_memory()
        # The bare runner's model is loaded first: its KV spec sizes the budget both sides get.
        pipeline = load_pipeline(args.model, args.device, **self.options)
        if not isinstance(pipeline, ARPipeline):  # the bare side is ARStream's own runner, driven directly
            raise SystemExit(f"arstream bench serve: {args.model} runs only on the vllm-omni runtime, which it cannot drive bare")
        # Both sides keep the server's default rewind horizon (a boundary taken per chunk, counted in the budget).
        defaults = Settings()
        rewind = rewind_for(pipeline, seconds=defaults.rewind_seconds, budget_bytes=defaults.rewind_budget_bytes())
        spec = pipeline.kv_cache_spec()
        needed = budget_for_sessions(spec, args.sessions, max_batch_sessions=args.max_batch_sessions, rewind=rewind)
        self.kv_budget_bytes = args.kv_budget_bytes or max(DEFAULT_KV_BUDGET_BYTES, needed)
        self.bare = BareRunner(
            pipeline,
            device=args.device,
            kv_budget_bytes=self.kv_budget_bytes,
            max_batch_sessions=args.max_batch_sessions,
            settings=defaults,
        )
        self.serve_args = [
            "--torch-threads", str(self.threads),
            "--model", args.model,
            "--model-options", json.dumps(self.options),
            "--device", args.device,
            "--kv-budget-bytes", str(self.kv_budget_bytes),
            "--max-batch-sessions", str(args.max_batch_sessions),
            "--log-level", "warning",
            *args.serve_arg,
        ]  # fmt: skip
        self._server = ServerProcess(self.serve_args).__enter__()
        print(f"server: {self._server.base_url} ({' '.join(self.serve_args)})")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.__exit__(*exc_info)
            self._server = None

    def measure(self, sessions: int, *, chunks: int) -> dict[str, Any]:
        """Alternating server and bare-runner phases of ``sessions`` sessions; the summary the command prints."""
        args, server, bare = self.args, self._server, self.bare
        assert server is not None, "ServeBench.measure runs inside its with block"
        url = server.sessions_url
        # One untimed round on each side first, at full concurrency, so neither pays for first-use costs.
        if args.warmup_chunks > 0:
            warmup = dict(sessions=sessions, chunks=args.warmup_chunks, input_every=args.input_every)
            asyncio.run(server_phase(url, codec=args.codec, dialect=args.dialect, **warmup))
            bare.chunks_per_s(**warmup)
        figures_from = len(bare.forward_splits)
        all_figures: list[SessionFigures] = []
        frames_per_s: list[float] = []
        rounds = sessions_in_rounds = 0

        def measure(repetition: int, order: tuple[str, str]) -> dict[str, float]:
            nonlocal rounds, sessions_in_rounds
            rates = {}
            for side in order:  # each side runs alone: the server is idle while the bare runner works
                if side == "server":
                    phase = dict(sessions=sessions, chunks=chunks, input_every=args.input_every)
                    before = server.get_json("/v1/stats")["chunks"]
                    figures = asyncio.run(server_phase(url, codec=args.codec, dialect=args.dialect, **phase))
                    after = server.get_json("/v1/stats")["chunks"]
                    rates["server"] = server_chunks_per_s(figures)
                    frames_per_s.append(server_frames_per_s(figures))
                    all_figures.extend(figures)
                    rounds += after["rounds_total"] - before["rounds_total"]
                    sessions_in_rounds += after["round_sessions_total"] - before["round_sessions_total"]
                else:
                    rates["runner"] = bare.chunks_per_s(sessions=sessions, chunks=chunks, input_every=args.input_every)
            print(
                f"repetition {repetition + 1}/{args.repeat}: server {rates['server']:.1f} chunks/s, "
                f"bare runner {rates['runner']:.1f} chunks/s, ratio {rates['server'] / rates['runner']:.3f}"
            )
            for index, f in enumerate(all_figures[-sessions:]):
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
        action_chunks = [float(x) for f in all_figures for x in f.action_to_frame_chunks]
        frames = sum(f.frames for f in all_figures)
        splits = bare.forward_splits[figures_from:]
        return {
            "model": args.model,
            "model_options": self.options,
            "sessions": sessions,
            "chunks_per_session": chunks,
            "repetitions": args.repeat,
            "threads": self.threads,
            "max_batch_sessions": args.max_batch_sessions,
            "kv_budget_bytes": self.kv_budget_bytes,
            "server_chunks_per_s": round(result.median("server"), 2),
            "runner_chunks_per_s": round(result.median("runner"), 2),
            "server_vs_runner_ratio": round(result.median_ratio, 4),
            "server_vs_runner_ratios": [round(r, 4) for r in result.ratios],
            # all sessions' video frames per second through the server (median over repetitions)
            "fps_total": round(_median(frames_per_s), 2),
            "fps_per_session": round(_median([f.fps for f in all_figures]), 2),
            "ttff_ms": _ms(_median([f.time_to_first_frame_s for f in all_figures])),
            "chunk_ms_p50": _ms(percentile(chunk_latencies, 50)),
            "chunk_ms_p99": _ms(percentile(chunk_latencies, 99)),
            "action_to_frame_ms_p50": _ms(percentile(action_latencies, 50)),
            "action_to_frame_ms_p99": _ms(percentile(action_latencies, 99)),
            # chunks from the last one the client had when it sent an input to the one that applied it
            "action_to_frame_chunks_p50": percentile(action_chunks, 50) if action_chunks else None,
            "action_to_frame_chunks_max": max(action_chunks) if action_chunks else None,
            # the bare runner's forwards (one per round of all sessions), for pipelines that time DiT and VAE
            "dit_ms_per_round_p50": _ms(percentile([dit for dit, _ in splits], 50)),
            "vae_ms_per_round_p50": _ms(percentile([vae for _, vae in splits], 50)),
            "dialect": args.dialect,
            "codec": "fmp4" if args.dialect == "realtime-video" else args.codec,
            "bytes_per_frame": round(sum(f.payload_bytes for f in all_figures) / frames, 1),
            "encode_ms_per_frame": round(sum(f.encode_s for f in all_figures) / frames * 1e3, 3),
            # a worker round is one runner call; the bare runner always puts min(sessions, batch) in one
            "server_sessions_per_round": round(sessions_in_rounds / rounds, 2) if rounds else None,
            "full_round_sessions": min(sessions, args.max_batch_sessions),
        }


def counts_are_valid(args: argparse.Namespace) -> bool:
    """Every count a bench serve run takes is at least 1 (the warm-up may be 0); says why on stderr if not."""
    counts = (args.sessions, args.chunks, args.repeat, args.input_every)
    optional = (args.threads, args.max_batch_sessions)  # None: the server's default
    if min(counts) < 1 or any(c is not None and c < 1 for c in optional) or args.warmup_chunks < 0:
        print("arstream bench serve: counts must be >= 1 (--warmup-chunks >= 0)", file=sys.stderr)
        return False
    return True


def run(args: argparse.Namespace) -> int:
    if not counts_are_valid(args):
        return 2
    with ServeBench(args) as bench:
        summary = bench.measure(args.sessions, chunks=args.chunks)
    print_summary(summary)
    return 0


main = main_for("bench", "serve")
