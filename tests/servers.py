"""Run a real ARStream server on a free loopback port, for tests.

``running_server(...)`` starts uvicorn in-process on a background thread
(fast: torch is already imported) and yields a :class:`LiveServer`;
``server_process(...)`` runs ``python -m arstream serve --port 0`` as a
subprocess and waits for its ``ARSTREAM_LISTENING`` line. Both stop the
server gracefully on exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from arstream.app.protocol import parse_server_message
from arstream.app.wire import SESSIONS_PATH, FrameHeader, decode_frame
from arstream.app.server import LISTENING_MARKER, ARStreamServer, build_server
from arstream.app.session import Session, SessionState
from arstream.app.settings import Settings
from arstream.app.worker import ModelWorker, TickOutcome
from arstream.models.fake import FakeKVPipeline
from arstream.runner.contract import ARPipeline
from arstream.runner.runner import WARMUP_SESSION_ID, ARRunner
from arstream.runner.runtimes import Runtime
from arstream.runner.types import TickRequest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Hang guards only: these bound waits on a broken server, they assert nothing about speed.
STARTUP_GUARD_S = 120.0
STOP_GUARD_S = 30.0
RECEIVE_GUARD_S = 30.0


@dataclass
class LiveServer:
    """A started server: its URLs, and (in-process) the uvicorn server object."""

    base_url: str
    server: ARStreamServer | None = None
    thread: threading.Thread | None = None
    process: subprocess.Popen[str] | None = None
    output: list[str] = field(default_factory=list)

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://", 1) + "/v1/sessions"

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=10.0, **kwargs)

    def stats(self) -> dict[str, Any]:
        response = self.get("/v1/stats")
        response.raise_for_status()
        return response.json()

    def agent_port(self) -> int:
        """The HAProxy agent check's port of a server started with ``agent_port=0``."""
        if self.server is None:  # a server process: the port it printed
            line = next(line for line in self.output if line.startswith("ARSTREAM_AGENT "))
            return int(line.rsplit(":", 1)[1])
        assert isinstance(self.server.config.app, FastAPI)
        return int(self.server.config.app.state.agent.sockets[0].getsockname()[1])

    def wait_ready(self, *, attempts: int = 2000, interval_s: float = 0.025) -> None:
        """Poll /readyz until it answers 200."""
        for _ in range(attempts):
            if self.get("/readyz").status_code == 200:
                return
            time.sleep(interval_s)
        raise AssertionError("/readyz never became ready")

    def wait_for_stats(self, predicate: Any, *, attempts: int = 400, interval_s: float = 0.025) -> dict[str, Any]:
        """Poll /v1/stats until ``predicate(stats)`` holds; returns the stats that satisfied it."""
        stats = self.stats()
        for _ in range(attempts):
            if predicate(stats):
                return stats
            time.sleep(interval_s)
            stats = self.stats()
        raise AssertionError(f"/v1/stats never satisfied the condition; last: {json.dumps(stats)}")

    def settled(self, blocks_free: int) -> dict[str, Any]:
        """Wait until every session is gone and its KV blocks are back (``blocks_free`` free); the stats then.

        Gone means: no session resident in the pool, connected or detached
        (awaiting resume), and no tick queued. A leak fails here with the last stats.
        """
        return self.wait_for_stats(
            lambda s: s["kv"]["blocks_free"] == blocks_free
            and s["kv"]["sessions_resident"] == 0
            and s["sessions"]["connected"] == 0
            and s["sessions"].get("detached", 0) == 0
            and s["queue"]["depth"] == 0
        )


def wait_until(predicate: Any, *, attempts: int = 800, interval_s: float = 0.025) -> None:
    """Poll PREDICATE until it holds (a hang guard of ATTEMPTS x INTERVAL_S, not a speed check)."""
    for _ in range(attempts):
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError("the condition never held")


def fake_settings(**overrides: Any) -> Settings:
    """Settings for a fake-kv server on a free loopback port (no environment leaks in)."""
    values: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "model": "fake-kv", "log_level": "warning"}
    # Resume off unless a test asks for it: tests that drop a connection expect its session released at once.
    values["resume_grace_s"] = 0.0
    values.update(overrides)
    return Settings(**values)


@contextmanager
def running_server(
    settings: Settings | None = None, pipeline: ARPipeline | None = None, *, wait_ready: bool = True
) -> Iterator[LiveServer]:
    """An in-process server on a background thread, stopped (gracefully) on exit.

    With ``wait_ready=False`` it returns once the port is bound, while the model may still be loading.
    """
    settings = settings or fake_settings()
    server = build_server(settings, pipeline, log_config=None)
    thread = threading.Thread(target=server.run, name="arstream-test-server", daemon=True)
    thread.start()
    hub = server.hub
    deadline = time.monotonic() + STARTUP_GUARD_S
    while not (server.started and (not wait_ready or hub.ready or hub.load_error is not None)):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    if hub.load_error is not None:
        server.should_exit = True
        thread.join(STOP_GUARD_S)
        raise RuntimeError(f"the test server's model did not load: {hub.load_error}")
    live = LiveServer(f"http://127.0.0.1:{server.bound_port}", server=server, thread=thread)
    try:
        yield live
    finally:
        server.should_exit = True
        thread.join(STOP_GUARD_S)
        if thread.is_alive():
            raise RuntimeError("the test server did not stop")


@contextmanager
def server_process(
    args: list[str], env: dict[str, str] | None = None, *, prefix: Sequence[str] = ()
) -> Iterator[LiveServer]:
    """``python -m arstream serve --port 0 ARGS`` as a subprocess; SIGINT (graceful) on exit.

    Resume is off unless ARGS turn it on (``--resume-grace-s``), as in :func:`fake_settings`: a
    session whose socket closes without `close` is then released at once, not kept for a resume.
    """
    serve = ["serve", "--port", "0", "--resume-grace-s", "0"]
    command = [*prefix, sys.executable, "-m", "arstream", *serve, *args]  # prefix: e.g. prlimit
    process_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=process_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert process.stdout is not None
    output: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            if LISTENING_MARKER in line and not url:
                url.append(line.split(LISTENING_MARKER, 1)[1].strip())
                found.set()
        found.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    found.wait(STARTUP_GUARD_S)
    if not url:
        process.kill()
        process.wait()
        raise RuntimeError("server did not start:\n" + "".join(output))
    live = LiveServer(url[0], process=process, output=output)
    try:
        yield live
    finally:
        stop_process(process, reader, signal.SIGINT)


def stop_process(process: subprocess.Popen[str], reader: threading.Thread, stop_signal: signal.Signals) -> None:
    """Stop PROCESS with STOP_SIGNAL (killed if it outlives the guard), then finish READER, its stdout pump."""
    if process.poll() is None:
        process.send_signal(stop_signal)
        try:
            process.wait(STOP_GUARD_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    reader.join(STOP_GUARD_S)
    assert process.stdout is not None
    process.stdout.close()


# ---- a ModelWorker without a server: sessions submitted straight to it ----------------------


def make_session(session_id: str) -> Session:
    """An ACTIVE raw-codec session, as the server would have after `start`."""
    session = Session(session_id, codec="raw", quality=80, seed=None, prompt=None, max_pending_ticks=4)
    session.transition(SessionState.ACTIVE)
    return session


async def with_worker(
    pipeline: ARPipeline,
    body: Callable[[ModelWorker, asyncio.Queue[TickOutcome]], Awaitable[Any]],
    runner_class: Callable[..., Runtime] = ARRunner,
    *,
    encode_threads: int | None = None,
    max_batch_sessions: int = 1,
    batch_wait_fraction: float = 0.0,
    warmup: bool = False,
) -> Any:
    """Run BODY(worker, outcomes) against a started ModelWorker over PIPELINE (1 MiB KV); stop it after.

    With ``warmup`` the runner is warmed up first, as the server's is.
    """
    loop = asyncio.get_running_loop()
    outcomes: asyncio.Queue[TickOutcome] = asyncio.Queue()
    loaded: asyncio.Future[BaseException | None] = loop.create_future()

    def build_runner() -> Runtime:
        runner = runner_class(pipeline, kv_budget_bytes=1 << 20, max_batch_sessions=max_batch_sessions)
        if warmup:
            runner.warmup()
        return runner

    worker = ModelWorker(
        build_runner,
        loop=loop,
        deliver=outcomes.put_nowait,
        on_ready=loaded.set_result,
        max_pending_ticks=4,
        encode_threads=encode_threads,
        batch_wait_fraction=batch_wait_fraction,
    )
    worker.start()
    try:
        assert await loaded is None
        return await body(worker, outcomes)
    finally:
        await asyncio.to_thread(worker.stop, 10)


# ---- a test fake that the test can hold at the chunk boundary ------------------------------


class GatedFakePipeline(FakeKVPipeline):
    """FakeKVPipeline whose forwards wait for :attr:`gate` (warm-up excepted) and log session order.

    With the gate closed a test can queue ticks deterministically, then open
    it and read :attr:`order` (the session id of every forward's rows, in
    order; a batched forward adds all its sessions) and :attr:`batches` (the
    session ids of each batched forward).
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.gate = threading.Event()
        self.order: list[str] = []
        self.batches: list[list[str]] = []
        self.waiting = threading.Event()

    def _wait_at_gate(self, session_ids: list[str]) -> None:
        if WARMUP_SESSION_ID in session_ids:
            return
        self.order.extend(session_ids)
        self.waiting.set()
        if not self.gate.wait(STOP_GUARD_S):
            raise RuntimeError("the test never opened the gate")
        self.waiting.clear()

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        self._wait_at_gate([tick.session_id])
        return super().generate_chunk(tick)

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        self._wait_at_gate([t.session_id for t in ticks])
        self.batches.append([t.session_id for t in ticks])
        return super().generate_chunks(ticks)


# ---- a WebSocket session client for tests ---------------------------------------------------


@dataclass
class ClosedBy:
    """How the server ended a connection: its close code and the text messages before it."""

    code: int | None
    messages: list[dict[str, Any]]


class ProbeClient:
    """A thin test client over a real ``websockets`` connection; every wait has a hang guard."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ready: dict[str, Any] | None = None
        # Protocol 1's socket: every text message the server sends must be its model's (the schema's) message.
        self.checks_messages = ws.request is not None and ws.request.path.startswith(SESSIONS_PATH)

    async def send(self, **message: Any) -> None:
        await self.ws.send(json.dumps(message))

    async def send_text(self, text: str) -> None:
        await self.ws.send(text)

    async def recv(self) -> str | bytes:
        message = await asyncio.wait_for(self.ws.recv(), RECEIVE_GUARD_S)
        if isinstance(message, str) and self.checks_messages:
            parse_server_message(json.loads(message))  # raises (pydantic's ValidationError) on a message off its model
        return message

    async def recv_json(self) -> dict[str, Any]:
        message = await self.recv()
        assert isinstance(message, str), f"expected a text message, got {len(message)} binary bytes"
        return json.loads(message)

    async def recv_chunk(self) -> tuple[dict[str, Any], list[tuple[FrameHeader, np.ndarray]]]:
        """A `chunk` message and exactly its frames (asserting nothing else comes in between)."""
        chunk = await self.recv_json()
        assert chunk["type"] == "chunk", f"expected a chunk, got {chunk}"
        frames = []
        for _ in range(chunk["frames"]):
            message = await self.recv()
            assert isinstance(message, bytes), f"expected a binary frame, got {message!r}"
            frames.append(decode_frame(message))
        return chunk, frames

    async def start(self, **fields: Any) -> dict[str, Any]:
        await self.send(type="start", **fields)
        self.ready = await self.recv_json()
        assert self.ready["type"] == "ready", self.ready
        return self.ready

    async def closed_by_server(self) -> ClosedBy:
        """Read text messages until the server closes; binary frames are skipped."""
        messages: list[dict[str, Any]] = []
        while True:
            try:
                message = await self.recv()
            except ConnectionClosed as closed:
                return ClosedBy(closed.rcvd.code if closed.rcvd else None, messages)
            if isinstance(message, str):
                messages.append(json.loads(message))

    def abort(self) -> None:
        """Drop the TCP connection without a close frame (an abrupt disconnect)."""
        self.ws.transport.abort()


@asynccontextmanager
async def session_client(
    url: str,
    *,
    start: dict[str, Any] | None = None,
    headers: Iterable[tuple[str, str]] | None = None,
    origin: str | None = None,
    max_queue: int | None = 16,
    source_host: str | None = None,
) -> AsyncIterator[ProbeClient]:
    """Connect (and, when ``start`` is given, send it and read `ready`); ``source_host`` (e.g. 127.0.0.2) is
    another client address."""
    source: dict[str, Any] = {} if source_host is None else {"local_addr": (source_host, 0)}  # to create_connection
    async with connect(
        url,
        **source,
        additional_headers=list(headers or []),
        origin=origin,  # type: ignore[arg-type]
        compression=None,
        proxy=None,
        max_queue=max_queue,
        max_size=None,
        open_timeout=RECEIVE_GUARD_S,
        close_timeout=5,
    ) as ws:
        client = ProbeClient(ws)
        if start is not None:
            await client.start(**start)
        yield client


def share_url(server: LiveServer, token: str) -> str:
    """The URL a viewer or a branch connects to (``?share=`` routes it to the replica holding the session)."""
    return f"{server.ws_url}?share={token}"


async def next_of(client: ProbeClient, kind: str) -> dict[str, Any]:
    """The next text message of type ``kind``; binary frames and other texts before it are passed over."""
    while True:
        message = await client.recv()
        if isinstance(message, str) and json.loads(message)["type"] == kind:
            return json.loads(message)
