"""``arstream client``: a scripted session that saves the frames it receives.

    arstream client ws://127.0.0.1:8000/v1/sessions --keys "d*20,w+d*10,-*5" --out frames/

This is also the reference for anyone writing their own client. One session,
one WebSocket, in this order (PROTOCOL.md has the details):

1. send ``start`` (optionally with the session's start image, ``--image``) and
   wait for ``ready`` (model size, fps, limits);
2. keep a few ``tick`` messages in flight: each asks for one chunk, and the
   server allows at most ``limits.max_pending_ticks`` queued or running;
3. when the held keys change, send an ``input`` event first; the server applies
   it at the next chunk that starts and lists its id in that chunk's
   ``applied_event_ids``;
4. for every tick, read one ``chunk`` message and then exactly ``chunk.frames``
   binary frame messages (20-byte header + JPEG or raw RGB payload);
5. send ``close`` and wait for ``closed``.

The key script is a comma-separated list of ``KEYS*COUNT``: KEYS are key names
joined by ``+`` (``w+d``), or ``-``/``none`` for no key; COUNT is how many ticks
(chunks) to hold them for, 1 when left out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from arstream.app import wire
from arstream.app.video import FrameDecoder
from arstream.cli import main_for
from arstream.measure import percentile

NO_KEYS = ("-", "none")
VIDEO_NAME = "video.mp4"
MAX_MESSAGE_BYTES = 16 * 2**20


# ---- the key script -----------------------------------------------------------------


class KeyScriptError(ValueError):
    """The ``--keys`` script is malformed; the message names the bad part."""


@dataclass(frozen=True)
class KeySegment:
    """Hold ``keys`` (possibly none) for ``ticks`` consecutive ticks."""

    keys: tuple[str, ...]
    ticks: int


def parse_key_script(script: str) -> list[KeySegment]:
    """Parse ``"d*20,w+d*5,-*3"`` into segments; raise :class:`KeyScriptError` on bad input."""
    segments: list[KeySegment] = []
    for part in script.split(","):
        part = part.strip()
        if not part:
            raise KeyScriptError(f"empty segment in key script {script!r}")
        keyspec, star, count_text = part.partition("*")
        if star:
            try:
                ticks = int(count_text.strip())
            except ValueError:
                raise KeyScriptError(f"count in {part!r} must be an integer, got {count_text!r}") from None
        else:
            ticks = 1
        if ticks < 1:
            raise KeyScriptError(f"count in {part!r} must be at least 1, got {ticks}")
        keyspec = keyspec.strip()
        if keyspec.lower() in NO_KEYS:
            keys: tuple[str, ...] = ()
        else:
            keys = tuple(k.strip() for k in keyspec.split("+"))
            if any(not k for k in keys):
                raise KeyScriptError(f"empty key name in {part!r} (use '-' or 'none' for no key)")
            if len(set(keys)) != len(keys):
                raise KeyScriptError(f"key repeated in {part!r}")
        segments.append(KeySegment(keys=keys, ticks=ticks))
    return segments


def keys_per_tick(segments: Sequence[KeySegment]) -> list[tuple[str, ...]]:
    """The held keys for each tick, in order."""
    return [segment.keys for segment in segments for _ in range(segment.ticks)]


# ---- latency figures --------------------------------------------------------------


def format_ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


# ---- one session ------------------------------------------------------------------


class ServerError(RuntimeError):
    """The server sent an ``error`` message."""

    def __init__(self, message: dict[str, Any]) -> None:
        self.code = str(message.get("code"))
        self.fatal = bool(message.get("fatal"))
        self.tick_id = message.get("tick_id")
        self.detail = str(message.get("message", ""))
        about = f" (tick {self.tick_id})" if self.tick_id is not None else ""
        kind = "fatal error" if self.fatal else "error"
        super().__init__(f"server {kind} {self.code}{about}: {self.detail}")


class SessionClosed(RuntimeError):
    """The session ended (``closed`` message or the WebSocket closed) while we expected more."""


class ConnectionDropped(SessionClosed):
    """The connection went away without a close frame (a network drop): the session may be resumable."""


class SessionMoved(SessionClosed):
    """The server moved the session to another replica (``moved``): reconnect with ``resume_token``."""

    def __init__(self, message: dict[str, Any]) -> None:
        self.resume_token = str(message["resume"])
        self.next_chunk_index = int(message["next_chunk_index"])
        super().__init__(f"the session moved to replica {self.resume_token.partition('.')[0]!r}")


@dataclass(frozen=True)
class ResumeGap:
    """What a drop and resume cost: time without a connection, and chunks that ran but never arrived."""

    session_id: str
    seconds: float
    last_chunk_index: int | None  # the last chunk received before the drop
    next_chunk_index: int  # the resumed ticket's

    @property
    def chunks_lost(self) -> int:
        return max(0, self.next_chunk_index - (-1 if self.last_chunk_index is None else self.last_chunk_index) - 1)

    def describe(self) -> str:
        after = "before any chunk" if self.last_chunk_index is None else f"after chunk {self.last_chunk_index}"
        return (
            f"connection dropped {after}; resumed session {self.session_id} in {self.seconds * 1000:.0f} ms at "
            f"chunk {self.next_chunk_index} ({self.chunks_lost} chunk(s) generated but never received)"
        )


@dataclass
class Chunk:
    """One chunk as received: the ``chunk`` message, its frames and when things happened.

    Times are ``time.perf_counter()`` seconds. ``frames`` holds decoded
    ``[H, W, 3]`` arrays, or the raw payload bytes when decoding is off.
    """

    message: dict[str, Any]
    tick_sent_at: float
    message_at: float
    first_frame_at: float = math.nan
    last_frame_at: float = math.nan
    frames: list[Any] = field(default_factory=list)

    @property
    def tick_id(self) -> int:
        return int(self.message["tick_id"])

    @property
    def applied_event_ids(self) -> list[int]:
        return list(self.message.get("applied_event_ids") or [])

    @property
    def latency_s(self) -> float:
        """Tick sent -> chunk message received."""
        return self.message_at - self.tick_sent_at


class SessionClient:
    """Protocol bookkeeping for one session over an open WebSocket.

    It numbers ticks and events, remembers when each was sent, and turns the
    server's messages back into :class:`Chunk` objects and latency figures.
    Any ``error`` message is raised as :class:`ServerError`.
    """

    def __init__(self, websocket: Any, *, decode: bool = True) -> None:
        self.ws = websocket
        self.decode = decode
        self._decoder = FrameDecoder()  # h264 frames decode in order, from the stream's keyframe
        self.ready: dict[str, Any] = {}
        self.next_tick_id = 0
        self.next_event_id = 0
        self.tick_sent_at: dict[int, float] = {}  # ticks sent and not yet answered by a chunk
        self.event_sent_at: dict[int, float] = {}  # events not yet seen in applied_event_ids
        self.chunk_latencies_s: list[float] = []
        self.action_to_frame_s: list[float] = []
        self.first_frame_at = math.nan
        self.frames_received = 0
        self.last_chunk_index: int | None = None

    @property
    def model(self) -> dict[str, Any]:
        return self.ready["model"]

    @property
    def max_pending_ticks(self) -> int:
        return int(self.ready["limits"]["max_pending_ticks"])

    @property
    def ticks_in_flight(self) -> int:
        return len(self.tick_sent_at)

    async def start(
        self,
        *,
        codec: str = "jpeg",
        seed: int | None = None,
        prompt: str | None = None,
        resume: str | None = None,
        image: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Send ``start`` (``resume``: a ticket's token; ``image``: ``start.image``); return the ``ready`` message."""
        await self._send(wire.start_message(codec=codec, seed=seed, prompt=prompt, resume=resume, image=image))
        message = await self._next_control_message()
        if message["type"] != "ready":
            raise wire.WireError(f"expected 'ready' after 'start', got {message['type']!r}")
        if message.get("protocol") != wire.PROTOCOL_VERSION:
            raise wire.WireError(f"server speaks protocol {message.get('protocol')}, this client {wire.PROTOCOL_VERSION}")
        self.ready = message
        return message

    async def resume(self, url: str, *, token: str | None = None, resume_token: str | None = None) -> ResumeGap:
        """After a :class:`ConnectionDropped` (or :class:`SessionMoved`, with its ``resume_token``): resume.

        Reconnects through ``url`` with the session's ticket (a moved session's
        token names its new replica, which the balancer routes to). Ticks in
        flight at the drop are gone (their chunks never come); tick and event
        ids keep counting past them. A ticket the server cannot honour raises
        :class:`ServerError` (``resume_failed``).
        """
        if resume_token is None:
            ticket = self.ready.get("resume")
            if not ticket:
                raise SessionClosed("the connection dropped and the server offered no resume ticket")
            resume_token = str(ticket["token"])
        dropped_at = time.perf_counter()
        await self.ws.close()
        self.ws = await connect(wire.session_url(url, token=token, resume=resume_token))
        self.tick_sent_at.clear()
        ready = await self.start(codec=self.ready["codec"], resume=resume_token)
        return ResumeGap(
            session_id=ready["session_id"],
            seconds=time.perf_counter() - dropped_at,
            last_chunk_index=self.last_chunk_index,
            next_chunk_index=int(ready["resume"]["next_chunk_index"]),
        )

    async def send_tick(self, **fields: Any) -> int:
        """Ask for one chunk (``tick_message`` fields: controls, prompt, reset, close); return its id."""
        tick_id = self.next_tick_id
        self.next_tick_id += 1
        self.tick_sent_at[tick_id] = time.perf_counter()
        await self._send(wire.tick_message(tick_id, **fields))
        return tick_id

    async def send_input(self, *, controls: dict[str, Any] | None = None, prompt: str | None = None) -> int:
        """Send an ``input`` event; return its id."""
        event_id = self.next_event_id
        self.next_event_id += 1
        self.event_sent_at[event_id] = time.perf_counter()
        await self._send(wire.input_message(event_id, controls=controls, prompt=prompt))
        return event_id

    async def receive_chunk(self) -> Chunk:
        """Read the next ``chunk`` message and all of its frames."""
        message = await self._next_control_message()
        if message["type"] != "chunk":
            raise wire.WireError(f"expected 'chunk', got {message['type']!r}")
        tick_id = int(message["tick_id"])
        if tick_id not in self.tick_sent_at:
            raise wire.WireError(f"chunk for tick {tick_id}, which is not in flight")
        chunk = Chunk(message=message, tick_sent_at=self.tick_sent_at.pop(tick_id), message_at=time.perf_counter())
        for index in range(int(message["frames"])):
            data = await self._recv()
            if not isinstance(data, bytes):
                raise wire.WireError(f"expected binary frame {index} of tick {tick_id}, got text: {data[:200]}")
            header, payload = wire.parse_frame(data)
            if (header.tick_id, header.frame_index) != (tick_id, index):
                raise wire.WireError(
                    f"frame header says tick {header.tick_id} frame {header.frame_index}, expected {tick_id} {index}"
                )
            chunk.frames.append(self._decoder.decode(header, payload) if self.decode else bytes(payload))
            chunk.last_frame_at = time.perf_counter()
            if index == 0:
                chunk.first_frame_at = chunk.last_frame_at
        self._record(chunk)
        return chunk

    async def close(self) -> str:
        """Send ``close``; skip what is still in flight; return the ``closed`` reason."""
        try:
            await self.ws.send(wire.close_message())
        except websockets.ConnectionClosed:
            pass  # already closed by the server: read what it said before closing
        while True:
            try:
                data = await self._recv()
            except SessionClosed:
                return "connection closed without a 'closed' message"
            if isinstance(data, str):
                message = json.loads(data)
                if message.get("type") == "closed":
                    return str(message.get("reason"))

    def _record(self, chunk: Chunk) -> None:
        self.chunk_latencies_s.append(chunk.latency_s)
        self.frames_received += len(chunk.frames)
        self.last_chunk_index = int(chunk.message["chunk_index"])
        if chunk.frames and math.isnan(self.first_frame_at):
            self.first_frame_at = chunk.first_frame_at
        for event_id in chunk.applied_event_ids:
            sent_at = self.event_sent_at.pop(event_id, None)
            if sent_at is not None:
                self.action_to_frame_s.append(chunk.first_frame_at - sent_at)

    async def _send(self, text: str) -> None:
        try:
            await self.ws.send(text)
        except websockets.ConnectionClosed:
            # The server may have refused the session (an ``error``, then the close) before this
            # message went out; that reason is still queued for reading, so report it instead.
            while True:
                data = await self._recv()  # raises SessionClosed once nothing is left to read
                if isinstance(data, str):
                    message = json.loads(data)
                    if message.get("type") == "error":
                        raise ServerError(message) from None
                    if message.get("type") == "moved":
                        raise SessionMoved(message) from None
                    if message.get("type") == "closed":
                        raise SessionClosed(f"server closed the session (reason {message.get('reason')!r})") from None

    async def _recv(self) -> str | bytes:
        try:
            return await self.ws.recv()
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is None:
                raise ConnectionDropped(f"connection dropped without a close frame ({exc})") from None
            raise SessionClosed(f"connection closed (code {exc.code}, reason {exc.reason!r})") from None

    async def _next_control_message(self) -> dict[str, Any]:
        """The next JSON message that is not an ``ack``/``pong``; ``error`` and ``closed`` raise."""
        while True:
            data = await self._recv()
            if isinstance(data, bytes):
                raise wire.WireError(f"unexpected binary message of {len(data)} bytes between chunks")
            message = json.loads(data)
            kind = message.get("type")
            if kind in ("ack", "pong"):
                continue
            if kind == "error":
                raise ServerError(message)
            if kind == "moved":
                raise SessionMoved(message)
            if kind == "closed":
                raise SessionClosed(f"server closed the session (reason {message.get('reason')!r})")
            return message


# ---- the scripted run ---------------------------------------------------------------


async def connect(url: str) -> Any:
    """Open a session WebSocket (frames may be large: a raw chunk is several MB)."""
    return await websockets.connect(url, max_size=MAX_MESSAGE_BYTES)


@dataclass
class RunResult:
    """What a scripted run received, and its timing figures in seconds."""

    frames: list[np.ndarray]
    model: dict[str, Any]
    time_to_first_frame_s: float
    chunk_latencies_s: list[float]
    action_to_frame_s: list[float]
    streaming_s: float
    closed_reason: str


async def run_script(
    url: str,
    plan: Sequence[tuple[str, ...]],
    *,
    codec: str = "jpeg",
    seed: int | None = None,
    prompt: str | None = None,
    token: str | None = None,
    resume_on_drop: bool = False,
    image: dict[str, str] | None = None,
) -> RunResult:
    """One session that holds ``plan[i]`` keys during tick ``i``; returns every frame it got.

    ``image`` is the session's ``start.image`` (:func:`start_image_choice`); a resume keeps it.

    A session the server moves to another replica (``moved``) is followed: the
    client resumes it there and sends again the ticks whose chunks did not come.
    With ``resume_on_drop``, a dropped connection is resumed the same way (the
    gap is printed); when it cannot be (its replica was killed), a new session
    starts on a replica that answers, with the same seed, start image and held
    keys, and the client says so.
    """
    connect_started = time.perf_counter()
    session = SessionClient(await connect(wire.session_url(url, token=token)))
    try:
        await session.start(codec=codec, seed=seed, prompt=prompt, image=image)
        # Enough ticks queued to keep the model busy, with one credit spare for a reset or close tick
        # that an interactive client may need to send at any moment.
        in_flight_limit = max(1, session.max_pending_ticks - 1)
        frames: list[np.ndarray] = []
        held: tuple[str, ...] | None = ()
        next_tick = 0
        chunks_received = 0
        ticking_started = time.perf_counter()
        while chunks_received < len(plan):
            try:
                while next_tick < len(plan) and session.ticks_in_flight < in_flight_limit:
                    if plan[next_tick] != held:
                        held = plan[next_tick]
                        await session.send_input(controls={"keys": list(held)})
                    await session.send_tick()
                    next_tick += 1
                chunk = await session.receive_chunk()
            except SessionMoved as moved:
                gap = await session.resume(url, token=token, resume_token=moved.resume_token)
                print(f"{moved}; followed it: {gap.describe().replace('connection dropped', 'moved')}", flush=True)
                next_tick, held = chunks_received, None
                continue
            except ConnectionDropped:
                if not resume_on_drop:
                    raise
                try:
                    gap = await session.resume(url, token=token)
                    print(gap.describe(), flush=True)
                except (ServerError, websockets.InvalidHandshake, OSError) as exc:
                    # Its replica is gone (killed, host lost): the world cannot come back, so begin it again.
                    await session.ws.close()
                    session = SessionClient(await connect(wire.session_url(url, token=token)))
                    await session.start(codec=codec, seed=seed, prompt=prompt, image=image)
                    print(
                        f"the server holding the session is gone ({type(exc).__name__}); started a new session "
                        f"{session.ready['session_id']} with the same seed, start image and keys: the world starts over",
                        flush=True,
                    )
                # Ask again for the chunks that were lost; resend the keys (an input may have been lost too).
                next_tick, held = chunks_received, None
                continue
            chunks_received += 1
            frames.extend(chunk.frames)
            if chunk.message.get("restarted") == "evicted":
                # The server reclaimed this session's KV (it was idle and the pool was full): a new rollout began.
                print(f"note: tick {chunk.tick_id} started a new rollout after the session was evicted", file=sys.stderr)
        streaming_s = time.perf_counter() - ticking_started
        closed_reason = await session.close()
    finally:
        await session.ws.close()
    return RunResult(
        frames=frames,
        model=session.model,
        time_to_first_frame_s=session.first_frame_at - connect_started,
        chunk_latencies_s=session.chunk_latencies_s,
        action_to_frame_s=session.action_to_frame_s,
        streaming_s=streaming_s,
        closed_reason=closed_reason,
    )


def start_image_choice(value: str) -> dict[str, str]:
    """``--image``: a file that exists is sent as data (PNG, JPEG or WebP); anything else is an offered name."""
    path = Path(value)
    if path.is_file():
        return wire.start_image_field(data=path.read_bytes())
    return wire.start_image_field(name=value)


def save_pngs(frames: Sequence[np.ndarray], out_dir: Path) -> list[Path]:
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, frame in enumerate(frames):
        path = out_dir / f"frame_{index:06d}.png"
        Image.fromarray(frame).save(path)
        paths.append(path)
    return paths


VIDEO_LONG_SIDE_PX = 512  # a small model's video is scaled up to about this (whole factors, hard pixel edges)


def video_scale(width: int, height: int) -> int:
    """The whole factor that brings the longer side near VIDEO_LONG_SIDE_PX (64x64 tiny-world: 8); at least 1."""
    return max(1, VIDEO_LONG_SIDE_PX // max(width, height))


def save_mp4(frames: Sequence[np.ndarray], path: Path, fps: int, scale: int = 1) -> bool:
    """Write an H.264 (or MPEG-4) video when PyAV is installed, each pixel ``scale`` x ``scale``; whether it did."""
    try:
        import av
    except ImportError:
        return False
    if scale > 1:  # nearest neighbour: the model's pixels stay sharp squares
        frames = [frame.repeat(scale, axis=0).repeat(scale, axis=1) for frame in frames]
    height, width = frames[0].shape[:2]
    with av.open(str(path), mode="w") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        # yuv420p needs even sizes; pad by repeating the last row/column when the model's are odd.
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            padded = np.pad(frame, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")
            container.mux(stream.encode(av.VideoFrame.from_ndarray(padded, format="rgb24")))
        container.mux(stream.encode())
    return True


def report(result: RunResult) -> str:
    chunk = result.chunk_latencies_s
    action = result.action_to_frame_s
    fps = len(result.frames) / result.streaming_s if result.streaming_s > 0 else math.nan
    return "\n".join(
        [
            f"time to first frame: {format_ms(result.time_to_first_frame_s)} (connect -> first frame)",
            f"chunk latency (tick sent -> chunk message, n={len(chunk)}): p50 {format_ms(percentile(chunk, 50))}, "
            f"p90 {format_ms(percentile(chunk, 90))}, p99 {format_ms(percentile(chunk, 99))}",
            f"action-to-frame (input sent -> first frame of the chunk that applied it, n={len(action)}): "
            f"p50 {format_ms(percentile(action, 50))}, p99 {format_ms(percentile(action, 99))}",
            f"frames/s: {fps:.1f} ({len(result.frames)} frames in {result.streaming_s:.2f} s; "
            f"model plays at {result.model['fps']} fps)",
        ]
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("url", help="ws://HOST:PORT/v1/sessions, or http://HOST:PORT")
    parser.add_argument("--keys", default="-*10", help='key script, e.g. "d*20,w+d*5,-*3" (default: "-*10")')
    parser.add_argument("--out", type=Path, required=True, help="directory for frame_NNNNNN.png (and video.mp4)")
    parser.add_argument(
        "--video-scale",
        type=int,
        default=None,
        help=f"video.mp4's pixels per model pixel (default: the whole factor that brings the longer side near "
        f"{VIDEO_LONG_SIDE_PX} px, so tiny-world's 64x64 becomes 512x512; the PNGs keep the model's size)",
    )
    parser.add_argument("--codec", choices=wire.CODEC_NAMES, default="jpeg")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--prompt")
    parser.add_argument("--token", help="auth token, sent as ?token=")
    parser.add_argument(
        "--image",
        metavar="NAME|PATH",
        help="the session's start image: one the model offers (ready.model.start_images) by name, or a PNG, JPEG "
        "or WebP file to send (a path that exists is a file)",
    )
    parser.add_argument(
        "--resume-on-drop",
        action="store_true",
        help="when the connection drops, reconnect and resume the session with its ticket (prints the gap); "
        "if its server is gone, start a new session with the same seed and keys (and say so)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        plan = keys_per_tick(parse_key_script(args.keys))
        wire.session_url(args.url)  # reject a malformed URL before connecting
        image = start_image_choice(args.image) if args.image is not None else None
    except (ValueError, OSError) as exc:
        print(f"arstream client: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(
            run_script(
                args.url,
                plan,
                codec=args.codec,
                seed=args.seed,
                prompt=args.prompt,
                token=args.token,
                resume_on_drop=args.resume_on_drop,
                image=image,
            )
        )
    except ServerError as exc:
        hint = " (check the --keys names against the model's controls)" if exc.code == "invalid_controls" else ""
        print(f"arstream client: {exc}{hint}", file=sys.stderr)
        return 1
    except (SessionClosed, wire.WireError, websockets.InvalidHandshake, OSError) as exc:
        print(f"arstream client: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    paths = save_pngs(result.frames, args.out)
    model = result.model
    print(f"model {model['name']}: {model['width']}x{model['height']}, {model['frames_per_chunk']} frames per chunk")
    print(f"saved {len(paths)} frames to {args.out}/ ({paths[0].name} .. {paths[-1].name})")
    scale = args.video_scale or video_scale(int(model["width"]), int(model["height"]))
    if save_mp4(result.frames, args.out / VIDEO_NAME, fps=int(model["fps"]), scale=scale):
        print(f"saved video to {args.out / VIDEO_NAME} ({model['width'] * scale}x{model['height'] * scale})")
    else:
        print("no video written: install PyAV (pip install 'arstream[video]') for an MP4")
    print(report(result))
    print(f"session closed: {result.closed_reason}")
    return 0


main = main_for("client")
