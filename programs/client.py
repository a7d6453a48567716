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

Sharing (PROTOCOL.md, "Rewind, branch and watch"): the client prints the share
token its session got; ``--watch TOKEN`` watches that session as a viewer (saves
``--chunks`` chunks of it, sends no ticks), ``--branch TOKEN [--chunk B]`` plays the
key script in a new session that starts from the shared session's chunk boundary
B, and ``--rewind-to B`` sends the key script's tick ``--rewind-after`` with
``rewind_to: B`` (the session goes back to boundary B and plays on from there).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from ..app import wire
from ..app.codecs import CODEC_NAMES
from .client_lib import (
    ConnectionDropped,
    ControlPassed,
    KeyNotTaken,
    ServerError,
    Session,
    SessionClosed,
    SessionMoved,
    connect,
    http_base_url,
    key_input,
    session_url,
    start_image_field,
    takes_keys,
)
from .client_webrtc import TrackReceiver
from ..cli import main_for
from ..measure import percentile

NO_KEYS = ("-", "none")
WATCH_CHUNKS = 10  # chunks a viewer saves when --chunks is left out
VIDEO_NAME = "video.mp4"
# A new session refused by a draining replica tries again: the balancer stops routing there at its next check.
FRESH_START_ATTEMPTS = 20
FRESH_START_RETRY_S = 0.5
# --webrtc: how long a connection waits for its offered track before ticking (then the WebSocket carries the frames)
TRACK_WAIT_S = 10.0


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


# ---- sharing: the watch and pass-control message fields ---------------------------------------------


@dataclass(frozen=True)
class Rewind:
    """Send tick number ``after`` (0-based, in the key script) with ``rewind_to: to``."""

    to: int
    after: int


def rewind_plan(to: int | None, after: int | None, ticks: int) -> Rewind | None:
    """``--rewind-to``/``--rewind-after`` as a :class:`Rewind`, checked against the key script's length.

    ``after`` defaults to half the script. Boundary ``to`` must be one the session has reached by then
    (``to <= after``; ``to == after`` rewinds to where it is, a no-op); whether it is still held (the
    server keeps its last ``ready.rewind_points`` boundaries) only the server can say.
    """
    if to is None:
        if after is not None:
            raise ValueError("--rewind-after needs --rewind-to")
        return None
    after = ticks // 2 if after is None else after
    if to < 0 or after < 0:
        raise ValueError(f"--rewind-to and --rewind-after must be at least 0, got {to} and {after}")
    if after >= ticks:
        raise ValueError(f"--rewind-after {after} is past the key script's {ticks} ticks")
    if to > after:
        raise ValueError(f"--rewind-to {to} is a chunk the session has not reached after {after} ticks")
    return Rewind(to=to, after=after)


# ---- a model that takes no keys ---------------------------------------------------


class NoKeysModel(ValueError):
    """The key script holds keys, and the server's model takes none (it is steered by its prompt)."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"{model} takes no keys (its controls name none): it is steered by its prompt. "
            'Leave out --keys (or hold none, e.g. "-*20") and send prompts with --prompt and --prompt-at TICK TEXT'
        )


# ---- latency figures --------------------------------------------------------------


def format_ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


# ---- the scripted run ---------------------------------------------------------------


def draining_refusal(error: ServerError) -> bool:
    """A replica that is draining (being restarted) refused the session: another replica will take it."""
    return error.code == "over_capacity" and "draining" in error.detail


def afresh_reason(error: SessionClosed | ServerError) -> str | None:
    """Why the session cannot go on, in words, when a new one should begin (``--resume-on-drop``); else None."""
    if isinstance(error, SessionClosed) and error.reason == "server_shutdown":
        return "the server ended the session as it shut down (server_shutdown) and could not move it"
    if isinstance(error, ServerError) and draining_refusal(error):
        return "the server is restarting (draining) and refused the session"
    return None



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
    ready: dict[str, Any] = field(default_factory=dict)  # the session's (last) ready message
    chunk_indexes: list[int] = field(default_factory=list)  # chunk_index of every chunk, in order
    restarts: list[tuple[int, str]] = field(default_factory=list)  # (chunk_index, restarted) of new rollouts
    skipped_chunks: int = 0  # a viewer's chunks the server skipped because it fell behind
    viewers: int = 0  # viewers of the session at the end (the last `viewers` message)
    delivery: str = "WebSocket"  # where the frames came: the WebSocket, or the WebRTC track (and its codec)
    track_frames: int = 0  # frames that came on the WebRTC track (saved after the WebSocket's)


def say_ready(session: Session) -> None:
    """One line on the session just started: its id, how it began, and its share token (watch/branch it)."""
    ready = session.ready
    if session.role == "viewer":
        print(f"watching session {ready['session_id']} as viewer {ready.get('viewer_id')}", flush=True)
        return
    line = f"session {ready['session_id']}"
    branched = ready.get("branched_from")
    if isinstance(branched, dict):
        line += f" (branched from chunk {branched.get('chunk')})"
    if session.share_token:
        points = ready.get("rewind_points") or 0
        seconds = ready.get("rewind_seconds") or 0
        line += f"; share token {session.share_token} (--watch TOKEN, or --branch TOKEN to branch from now"
        # an older server gives no seconds, only how many chunks back its boundaries reach
        held = f"of the last {seconds:g} s" if seconds else f"within the last {points} chunks"
        line += f", --chunk B for a boundary {held})" if points else "; rewind is off on this server)"
    print(line, flush=True)


def earliest(times: list[float]) -> float:
    """The earliest of these times, NaN (never) left out; NaN when all are."""
    return min((t for t in times if not math.isnan(t)), default=math.nan)


async def run_script(
    url: str,
    plan: Sequence[tuple[str, ...]],
    *,
    codec: str = "jpeg",
    seed: int | None = None,
    prompt: str | None = None,
    token: str | None = None,
    resume_on_drop: bool = False,
    record: bool = False,
    image: dict[str, str] | None = None,
    rewind: Rewind | None = None,
    branch: tuple[str, int | None] | None = None,
    prompts_at: Sequence[tuple[int, str]] = (),
    webrtc: bool = False,
    webrtc_relay_only: bool = False,
) -> RunResult:
    """One session that holds ``plan[i]`` keys during tick ``i``; returns every frame it got.

    ``prompts_at`` (tick, prompt): an ``input`` with that prompt goes just before that tick; the chunk that
    applied it is printed (the model's world follows the prompt from that chunk on).

    ``image`` is the session's ``start.image`` (:func:`start_image_choice`); a resume keeps it.
    ``rewind``: tick ``rewind.after`` carries ``rewind_to`` (its chunk is ``rewind.to`` again).
    ``branch`` (share token, boundary): the session starts from that boundary of the shared session.
    ``webrtc``: each connection offers a WebRTC track (client_webrtc.py) and waits for it before ticking; the
    frames that came on a track follow the WebSocket's in the result. ``webrtc_relay_only``: its ICE offers relay
    candidates only, through the TURN relay of ``ready.webrtc.ice_servers`` (a check of the relay from here).

    A session the server moves to another replica (``moved``) is followed: the
    client resumes it there and sends again the ticks whose chunks did not come.
    With ``resume_on_drop``, a dropped connection is resumed the same way (the
    gap is printed); when it cannot be (its replica was killed), or the server
    ended the session as it shut down (``server_shutdown``: no peer could take
    it) or refused it while draining, a new session starts on a replica that
    answers, with the same seed, start image and held keys, and the client
    says so.
    """
    connect_started = time.perf_counter()
    first_url = session_url(url, token=token, share=branch[0] if branch else None)

    async def fresh_session() -> Session:
        """A new session through ``url``; with ``resume_on_drop``, one a draining replica refused tries again."""
        for attempt in range(FRESH_START_ATTEMPTS):
            client = Session(await connect(first_url))
            try:
                await client.start(codec=codec, seed=seed, prompt=prompt, image=image, branch=branch, record=record)
                return client
            except ServerError as exc:
                await client.ws.close()
                if not (resume_on_drop and draining_refusal(exc)) or attempt == FRESH_START_ATTEMPTS - 1:
                    raise
            await asyncio.sleep(FRESH_START_RETRY_S)
        raise AssertionError("unreachable")

    async def start_over(why: str) -> Session:
        await session.ws.close()
        fresh = await fresh_session()
        print(
            f"{why}; started a new session {fresh.ready['session_id']} with the same seed, start image and keys: "
            "the world starts over",
            flush=True,
        )
        return fresh

    receivers: list[TrackReceiver] = []

    async def offer_track(client: Session) -> None:
        """With ``webrtc``: offer a track on this connection (a resumed one offers again) and wait for it."""
        if not webrtc:
            return
        fps = float(client.model.get("fps") or 30)
        receiver = TrackReceiver(fps, ice_servers=client.ice_servers, relay_only=webrtc_relay_only)
        receivers.append(receiver)
        await client.offer_webrtc(receiver)
        state = await client.wait_for_track(TRACK_WAIT_S)
        through = ", relay only" if webrtc_relay_only else ""
        detail = f"WebRTC ({receiver.codec}{through})" if state == "connected" else f"WebSocket (WebRTC {state})"
        print(f"frames by {detail}" + (f": {receiver.refused}" if receiver.refused else ""), flush=True)

    session = await fresh_session()
    keys = key_input(session.model)  # where held keys go in this model's controls, from its card
    try:
        if any(plan) and not takes_keys(session.model):
            # Every input with keys would be refused: say what this model takes instead, before any tick.
            raise NoKeysModel(str(session.model.get("name")))
        for held_keys in set(plan):
            keys.controls(held_keys)  # a key the model does not take: said before any tick
    except (NoKeysModel, KeyNotTaken):
        await session.close()
        await session.ws.close()
        raise
    chunk_indexes: list[int] = []
    restarts: list[tuple[int, str]] = []
    try:
        say_ready(session)
        await offer_track(session)
        # Enough ticks queued to keep the model busy, with one credit spare for a reset or close tick
        # that an interactive client may need to send at any moment.
        in_flight_limit = max(1, session.max_pending_ticks - 1)
        frames: list[np.ndarray] = []
        held: tuple[str, ...] | None = ()
        prompt_events: dict[int, str] = {}  # event id of an input with a prompt -> the prompt
        next_tick = 0
        chunks_received = 0
        ticking_started = time.perf_counter()
        while chunks_received < len(plan):
            try:
                while next_tick < len(plan) and session.ticks_in_flight < in_flight_limit:
                    if plan[next_tick] != held:
                        held = plan[next_tick]
                        await session.send_input(controls=keys.controls(held))
                    for _, text in (entry for entry in prompts_at if entry[0] == next_tick):
                        prompt_events[await session.send_input(prompt=text)] = text
                    rewind_to = rewind.to if rewind is not None and next_tick == rewind.after else None
                    await session.send_tick(rewind_to=rewind_to)
                    next_tick += 1
                chunk = await session.receive_chunk()
            except SessionMoved as moved:
                gap = await session.resume(url, token=token, resume_token=moved.resume_token)
                print(f"{moved}; followed it: {gap.describe().replace('connection dropped', 'moved')}", flush=True)
                await offer_track(session)
                next_tick, held = chunks_received, None
                continue
            except ConnectionDropped:
                if not resume_on_drop:
                    raise
                try:
                    gap = await session.resume(url, token=token)
                    print(gap.describe(), flush=True)
                except (ServerError, SessionClosed, websockets.InvalidHandshake, OSError) as exc:
                    # Its replica is gone (killed, host lost): the world cannot come back, so begin it again.
                    session = await start_over(f"the server holding the session is gone ({type(exc).__name__})")
                await offer_track(session)
                # Ask again for the chunks that were lost; resend the keys (an input may have been lost too).
                next_tick, held = chunks_received, None
                continue
            except (SessionClosed, ServerError) as exc:
                why = afresh_reason(exc)
                if not resume_on_drop or why is None:
                    raise
                session = await start_over(why)
                await offer_track(session)
                next_tick, held = chunks_received, None
                continue
            chunks_received += 1
            frames.extend(chunk.frames)
            chunk_indexes.append(chunk.chunk_index)
            for event_id in chunk.applied_event_ids:
                if event_id in prompt_events:
                    print(f"prompt {prompt_events.pop(event_id)!r} applied at chunk {chunk_indexes[-1]}", flush=True)
            if chunk.restarted:
                restarts.append((chunk_indexes[-1], chunk.restarted))
            if chunk.restarted == "rewind":
                print(f"tick {chunk.tick_id} went back: chunk {chunk_indexes[-1]} again", flush=True)
            if chunk.restarted == "evicted":
                # The server reclaimed this session's KV (it was idle and the pool was full): a new rollout began.
                print(f"note: tick {chunk.tick_id} started a new rollout after the session was evicted", file=sys.stderr)
        if receivers:
            await receivers[-1].wait_shown()  # frames still on the track when the session closes are not sent
        streaming_s = time.perf_counter() - ticking_started
        closed_reason = await session.close()
    finally:
        await session.ws.close()
        track_frames = [frame for receiver in receivers for frame in await receiver.close()]
    codecs = sorted({str(receiver.codec) for receiver in receivers if receiver.frames})
    return RunResult(
        frames=frames + track_frames,
        delivery=f"WebRTC ({', '.join(codecs)})" if codecs else "WebSocket",
        track_frames=len(track_frames),
        model=session.model,
        # the first frame on either path: with the track connected early, the WebSocket may carry none
        time_to_first_frame_s=earliest([session.first_frame_at, *(r.first_shown_at for r in receivers)])
        - connect_started,
        chunk_latencies_s=session.chunk_latencies_s,
        action_to_frame_s=[*session.action_to_frame_s, *(t for r in receivers for t in r.action_to_frame_s)],
        streaming_s=streaming_s,
        closed_reason=closed_reason,
        ready=session.ready,
        chunk_indexes=chunk_indexes,
        restarts=restarts,
        viewers=int(session.viewers.get("count", 0)),
    )


async def run_watch(
    url: str, share: str, *, chunks: int = WATCH_CHUNKS, codec: str = "jpeg", token: str | None = None
) -> RunResult:
    """Watch a shared session as a viewer: save the frames of its next ``chunks`` chunks (fewer if it ends).

    A viewer sends no ticks: the chunks come as the player asks for them. A viewer that reads
    too slowly has whole chunks skipped (``skipped_before``), counted in the result. Handed the
    controls (``role``), it asks for the rest of its chunks itself, holding no keys.
    """
    connect_started = time.perf_counter()
    session = Session(await connect(session_url(url, token=token, share=share)))
    frames: list[np.ndarray] = []
    chunk_indexes: list[int] = []
    try:
        await session.start(codec=codec, watch=share)
        say_ready(session)
        watching_started = time.perf_counter()
        closed_reason = ""
        while len(chunk_indexes) < chunks:
            if session.role == "controller" and session.ticks_in_flight == 0:
                # The player passed control to this client: the chunks come only if it asks for them.
                await session.send_tick()
            try:
                chunk = await session.receive_chunk()
            except ControlPassed as passed:
                print(f"{passed}: it asks for the rest of its chunks itself, holding no keys", flush=True)
                continue
            except SessionClosed as ended:  # the watched session ended (closed: session_ended)
                closed_reason = str(ended)
                break
            frames.extend(chunk.frames)
            chunk_indexes.append(chunk.chunk_index)
        watching_s = time.perf_counter() - watching_started
        if not closed_reason:
            closed_reason = await session.close()
    finally:
        await session.ws.close()
    return RunResult(
        frames=frames,
        model=session.model,
        time_to_first_frame_s=session.first_frame_at - connect_started,
        chunk_latencies_s=[],
        action_to_frame_s=[],
        streaming_s=watching_s,
        closed_reason=closed_reason,
        ready=session.ready,
        chunk_indexes=chunk_indexes,
        skipped_chunks=session.skipped_chunks,
        viewers=int(session.viewers.get("count", 0)),
    )


def start_image_choice(value: str) -> dict[str, str]:
    """``--image``: a file that exists is sent as data (PNG, JPEG or WebP); anything else is an offered name."""
    path = Path(value)
    if path.is_file():
        return start_image_field(data=path.read_bytes())
    return start_image_field(name=value)


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
        assert isinstance(stream, av.VideoStream)  # a video codec's stream (PyAV types it as any stream)
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
    lines = [f"time to first frame: {format_ms(result.time_to_first_frame_s)} (connect -> first frame)"]
    if result.ready.get("role") != "viewer":  # a viewer sends no ticks or inputs: it has no latency of its own
        lines += [
            f"chunk latency (tick sent -> chunk message, n={len(chunk)}): p50 {format_ms(percentile(chunk, 50))}, "
            f"p90 {format_ms(percentile(chunk, 90))}, p99 {format_ms(percentile(chunk, 99))}",
            f"action-to-frame (input sent -> first frame of the chunk that applied it, n={len(action)}): "
            f"p50 {format_ms(percentile(action, 50))}, p99 {format_ms(percentile(action, 99))}",
        ]
    if result.track_frames:
        lines.append(f"delivery: {result.delivery}, {result.track_frames} frames on the track")
    lines.append(
        f"frames/s: {fps:.1f} ({len(result.frames)} frames in {result.streaming_s:.2f} s; "
        f"model plays at {result.model['fps']} fps)"
    )
    return "\n".join(lines)


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
    parser.add_argument("--codec", choices=CODEC_NAMES, default="jpeg")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--prompt", help="the session's prompt from its first chunk (models that read one: longlive)")
    parser.add_argument(
        "--prompt-at",
        nargs=2,
        action="append",
        default=[],
        metavar=("N", "PROMPT"),
        help="switch to PROMPT with tick N (an input event sent just before it, applied by the next chunk that "
        "starts: N or a queued earlier one; repeatable); prints the chunk that applied it",
    )
    parser.add_argument("--token", help="auth token, sent as ?token=")
    parser.add_argument(
        "--webrtc",
        action="store_true",
        help="receive the frames on a WebRTC video track (a server with --webrtc; needs the webrtc extra, aiortc): "
        "the client offers after ready and waits for the track; refused or unconnected, they come on the WebSocket",
    )
    parser.add_argument(
        "--webrtc-relay-only",
        action="store_true",
        help="--webrtc with relay candidates only: the track goes through the TURN relay the server names in "
        "ready.webrtc.ice_servers (checks that the relay works from where the client runs)",
    )
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
        "if its server is gone, ended it at shutdown (server_shutdown) or is draining and refuses it, start a "
        "new session with the same seed, start image and keys (and say so)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="ask the server to record the session (start.record; a server with --record-dir): the recording's "
        "list is printed, GET /v1/recordings?share=TOKEN",
    )
    share = parser.add_argument_group("rewind, branch and watch (a session prints its share token when it starts)")
    share.add_argument(
        "--rewind-to",
        type=int,
        metavar="B",
        help="go back to chunk boundary B (the state after chunks 0..B-1) at one tick of the key script: that tick's "
        "chunk is chunk B again, and the script plays on from there (the server keeps its last ready.rewind_points)",
    )
    share.add_argument(
        "--rewind-after", type=int, metavar="N", help="the tick that rewinds: after N ticks (default: half the script)"
    )
    share.add_argument(
        "--watch", metavar="TOKEN", help="watch the session with this share token as a viewer (no ticks, no keys)"
    )
    share.add_argument(
        "--chunks",
        type=int,
        metavar="N",
        help=f"with --watch: how many of its chunks to save (default {WATCH_CHUNKS}; fewer if the session ends)",
    )
    share.add_argument(
        "--branch",
        metavar="TOKEN",
        help="play the key script in a new session that starts from the session with this share token: where it "
        "is now, or at chunk boundary --chunk",
    )
    share.add_argument(
        "--chunk", type=int, metavar="B", help="with --branch: the chunk boundary to start from (default: the latest)"
    )


def share_choice(args: argparse.Namespace, ticks: int) -> tuple[Rewind | None, tuple[str, int | None] | None]:
    """The rewind and branch options checked together (watch excludes what only a player does)."""
    if args.watch is not None:
        if args.branch is not None or args.rewind_to is not None or args.rewind_after is not None:
            raise ValueError("--watch only watches: it takes no --branch or --rewind-to")
        if args.seed is not None or args.prompt is not None or args.image is not None or args.prompt_at:
            raise ValueError("--watch shows the watched session's world: it takes no --seed, --prompt(-at) or --image")
        if args.chunks is not None and args.chunks < 1:
            raise ValueError(f"--chunks must be at least 1, got {args.chunks}")
    elif args.chunks is not None:
        raise ValueError("--chunks is for --watch (a player's chunks are its key script's ticks)")
    if args.chunk is not None and args.branch is None:
        raise ValueError("--chunk B is for --branch TOKEN (the boundary to branch from)")
    if args.chunk is not None and args.chunk < 0:
        raise ValueError(f"--chunk must be at least 0, got {args.chunk}")
    branch = (args.branch, args.chunk) if args.branch is not None else None
    return rewind_plan(args.rewind_to, args.rewind_after, ticks), branch


def prompt_switches(entries: Sequence[Sequence[str]], ticks: int) -> list[tuple[int, str]]:
    """``--prompt-at N PROMPT`` pairs, checked: N a tick of the key script."""
    switches = []
    for tick, text in entries:
        if not tick.isdigit() or not 0 <= int(tick) < ticks:
            raise ValueError(f"--prompt-at takes a tick 0..{ticks - 1} of the key script, got {tick!r}")
        switches.append((int(tick), text))
    return switches


def run(args: argparse.Namespace) -> int:
    try:
        plan = keys_per_tick(parse_key_script(args.keys))
        session_url(args.url)  # reject a malformed URL before connecting
        rewind, branch = share_choice(args, len(plan))
        image = start_image_choice(args.image) if args.image is not None else None
        prompts_at = prompt_switches(args.prompt_at, len(plan))
        args.webrtc = args.webrtc or args.webrtc_relay_only
        if args.webrtc and (args.watch is not None or importlib.util.find_spec("aiortc") is None):
            raise ValueError("--webrtc is for a player, and needs aiortc (pip install 'arstream[webrtc]')")
    except (ValueError, OSError) as exc:
        print(f"arstream client: {exc}", file=sys.stderr)
        return 2
    try:
        if args.watch is not None:
            chunks = WATCH_CHUNKS if args.chunks is None else args.chunks
            result = asyncio.run(run_watch(args.url, args.watch, chunks=chunks, codec=args.codec, token=args.token))
        else:
            result = asyncio.run(
                run_script(
                    args.url,
                    plan,
                    codec=args.codec,
                    seed=args.seed,
                    prompt=args.prompt,
                    token=args.token,
                    resume_on_drop=args.resume_on_drop,
                    record=args.record,
                    image=image,
                    rewind=rewind,
                    branch=branch,
                    prompts_at=prompts_at,
                    webrtc=args.webrtc,
                    webrtc_relay_only=args.webrtc_relay_only,
                )
            )
    except NoKeysModel as exc:
        print(f"arstream client: {exc}", file=sys.stderr)
        return 2
    except KeyNotTaken as exc:
        print(f"arstream client: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        hint = " (check the --keys names against the model's controls)" if exc.code == "invalid_controls" else ""
        print(f"arstream client: {exc}{hint}", file=sys.stderr)
        return 1
    except ConnectionRefusedError:
        print(f"arstream client: nothing listens at {args.url}: start the server there (arstream serve), or check "
              "the host and port it printed", file=sys.stderr)  # fmt: skip
        return 1
    except (SessionClosed, wire.WireError, websockets.InvalidHandshake, OSError) as exc:
        print(f"arstream client: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not result.frames:
        print(f"arstream client: no frames came (session closed: {result.closed_reason})", file=sys.stderr)
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
    print(share_report(result))
    share = result.ready.get("share")
    if args.record and isinstance(share, dict):
        print(f"recordings: {http_base_url(args.url)}/v1/recordings?share={share['token']}")
    print(f"session closed: {result.closed_reason}")
    return 0


def share_report(result: RunResult) -> str:
    """Chunk indexes received (a rewind or branch shows in them), rewinds, and what a viewer saw."""
    lines = [f"chunk indexes: {compact_ranges(result.chunk_indexes)}"]
    rewinds = [chunk for chunk, why in result.restarts if why == "rewind"]
    if rewinds:
        lines.append(f"rewound to chunk {', '.join(map(str, rewinds))}")
    if result.ready.get("role") == "viewer":
        lines.append(f"viewers at the end: {result.viewers}; chunks skipped for this viewer: {result.skipped_chunks}")
    return "\n".join(lines)


def compact_ranges(values: Sequence[int]) -> str:
    """``[3, 4, 5, 2, 3]`` as ``"3-5, 2-3"``: consecutive runs joined, so a jump back stands out."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


main = main_for("client")
