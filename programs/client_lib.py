"""A typed async client for protocol 1 (docs/PROTOCOL.md), built on the server's own message models.

    async with await Session.connect("ws://127.0.0.1:8000/v1/sessions") as session:
        ready = await session.start(codec="jpeg", seed=1)
        for _ in range(10):
            await session.tick(keys=["d"])
        async for chunk in session.chunks():
            print(chunk.chunk_index, chunk.tick_id, len(chunk.frames))
        await session.close()

Messages out are checked against the models the server validates with (:mod:`arstream.app.protocol`), so a
bad id or field fails here as a ``ValueError``; messages in are parsed into the server's message models
(``ReadyMessage``, ``ChunkMessage``, ...). An ``error`` from the server is raised as :class:`ServerError`
carrying its :class:`~arstream.app.protocol.ErrorCode`; the session's end as :class:`SessionClosed` (a
drop without a close frame as :class:`ConnectionDropped`, a move to another replica as :class:`SessionMoved`).
Frames arrive decoded (``[H, W, 3]`` uint8 arrays; H.264 in order from its keyframe), or as payload bytes
with ``decode=False``. It needs no torch: numpy, pydantic, websockets, simplejpeg (and PyAV for H.264).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypedDict, Unpack
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import websockets
from pydantic import BaseModel, ValidationError

from ..app import wire
from ..app.codecs import FrameDecoder
from ..app.protocol import (
    ChunkMessage,
    CloseMessage,
    ClosedMessage,
    ErrorCode,
    ErrorMessage,
    InputMessage,
    MovedMessage,
    PassControlMessage,
    ReadyMessage,
    RecordingMessage,
    RecordMessage,
    RoleMessage,
    ServerMessage,
    StartMessage,
    TickMessage,
    ViewersMessage,
    WebRTCAnswerMessage,
    WebRTCOfferMessage,
    WebRTCStateMessage,
    parse_server_message,
)

if TYPE_CHECKING:
    from .client_webrtc import TrackReceiver

MAX_MESSAGE_BYTES = 16 * 2**20
MAX_MOVE_HOPS = 4  # a resume told `moved` follows at most this many replicas in a row


# ---- messages out: the server's models, checked before they go ---------------------


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that have a value (an absent field and a null one mean the same to the server)."""
    return {k: v for k, v in fields.items() if v is not None}


def _checked(model: type[BaseModel], fields: dict[str, Any]) -> str:
    """``fields`` as JSON text, once the server's model for it accepts them (a ``ValueError`` says why not)."""
    present = _present(fields)
    model.model_validate(present)  # pydantic's ValidationError is a ValueError naming the field
    # allow_nan=False: the server refuses NaN/Infinity, so fail here with a Python error instead.
    return json.dumps(present, allow_nan=False)


class StartFields(TypedDict, total=False):
    """What a ``start`` may say (:func:`start_message`, :meth:`Session.start`); each field is optional.

    ``codec`` (default ``jpeg``), ``seed``, ``prompt``, ``quality``; ``resume``, a ticket's token, resumes that
    session instead of starting one; ``image`` is ``start.image`` (:func:`start_image_field`); ``watch`` (a share
    token) starts a viewer of that session; ``branch`` (share token, chunk boundary) a new session from that
    boundary of the shared one (boundary None: its latest, where it is when the branch is made); ``record`` asks
    the server to record what the player sees (``GET /v1/recordings?share=TOKEN`` lists the files).
    """

    codec: str
    seed: int | None
    prompt: str | None
    quality: int | None
    resume: str | None
    image: dict[str, str] | None
    watch: str | None
    branch: tuple[str, int | None] | None
    record: bool


def start_message(**fields: Unpack[StartFields]) -> str:
    """``start`` with ``fields`` (:class:`StartFields`)."""
    branch = fields.get("branch")
    return _checked(
        StartMessage,
        {
            "type": "start", "codec": fields.get("codec", "jpeg"), "seed": fields.get("seed"),
            "prompt": fields.get("prompt"), "quality": fields.get("quality"), "resume": fields.get("resume"),
            "image": fields.get("image"), "watch": fields.get("watch"),
            "branch": _present({"share": branch[0], "chunk": branch[1]}) if branch is not None else None,
            "record": True if fields.get("record") else None,
        },
    )


def record_message(on: bool = True) -> str:
    """Record the session from its next chunk on (``on`` false: stop); answered by ``recording``."""
    return _checked(RecordMessage, {"type": "record", "on": on})


def start_image_field(*, name: str | None = None, data: bytes | None = None) -> dict[str, str]:
    """``start.image``: one the model offers by ``name`` (``ready.model.start_images``), or an image file's
    bytes (PNG, JPEG or WebP) as ``data``, sent base64."""
    if name is not None and data is None:
        return {"name": name}
    if data is not None and name is None:
        return {"data": base64.b64encode(data).decode("ascii")}
    raise ValueError("a start image is a name or a file's bytes: give exactly one")


def tick_message(
    tick_id: int,
    *,
    controls: dict[str, Any] | None = None,
    prompt: str | None = None,
    reset: bool = False,
    close: bool = False,
    rewind_to: int | None = None,
) -> str:
    """Ask for one chunk; ``controls``/``prompt`` (optional) update the session first, ``rewind_to`` first
    takes it back to that chunk boundary."""
    fields: dict[str, Any] = {
        "type": "tick", "tick_id": tick_id, "controls": controls, "prompt": prompt, "rewind_to": rewind_to
    }
    if reset:
        fields["reset"] = True
    if close:
        fields["close"] = True
    return _checked(TickMessage, fields)


def input_message(event_id: int, *, controls: dict[str, Any] | None = None, prompt: str | None = None) -> str:
    """Update controls and/or prompt without asking for a chunk; applied at the next chunk that starts."""
    return _checked(InputMessage, {"type": "input", "event_id": event_id, "controls": controls, "prompt": prompt})


def close_message() -> str:
    return _checked(CloseMessage, {"type": "close"})


def pass_control_message(viewer_id: str) -> str:
    """Hand the session's controls to one of its viewers (an id from the controller's ``viewers`` message)."""
    return _checked(PassControlMessage, {"type": "pass_control", "to": viewer_id})


def session_url(url: str, *, token: str | None = None, resume: str | None = None, share: str | None = None) -> str:
    """The ``ws(s)://host:port/v1/sessions`` URL for what a user typed.

    Accepts a full WebSocket URL, or an ``http(s)://host:port`` base URL (its
    scheme is swapped and, when it has no path, ``/v1/sessions`` is added). A
    token becomes the ``?token=`` query parameter, a resume ticket's token
    ``?resume=`` and a share token ``?share=`` (so a load balancer can route it to the replica that holds
    the session).
    """
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None:
        raise ValueError(f"URL scheme must be ws, wss, http or https, got {parts.scheme!r} in {url!r}")
    if not parts.netloc:
        raise ValueError(f"URL has no host: {url!r}")
    path = parts.path if parts.path not in ("", "/") else wire.SESSIONS_PATH
    query = parse_qsl(parts.query)
    for name, value in (("token", token), ("resume", resume), ("share", share)):
        if value is not None:
            query = [(k, v) for k, v in query if k != name] + [(name, value)]
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))


# Key names a key script may use beside KeyboardEvent codes ("KeyQ", "Digit1", "Space", "ArrowUp", ...).
KEY_NAME_CODES = {
    "space": "Space", "enter": "Enter", "esc": "Escape", "tab": "Tab", "shift": "ShiftLeft", "ctrl": "ControlLeft",
    "alt": "AltLeft", "up": "ArrowUp", "down": "ArrowDown", "left": "ArrowLeft", "right": "ArrowRight",
}


def key_code(name: str) -> str:
    """The KeyboardEvent code a key script's name stands for: ``w`` -> ``KeyW``, ``1`` -> ``Digit1``."""
    if len(name) == 1 and name.isalpha():
        return "Key" + name.upper()
    if len(name) == 1 and name.isdigit():
        return "Digit" + name
    return KEY_NAME_CODES.get(name.lower(), name)


class KeyNotTaken(ValueError):
    """A key script holds a key the model's controls do not take."""


# Mouse buttons a key script may hold, as names -> ``MouseEvent.button`` (how a card's ``mouse_buttons`` keys them).
MOUSE_BUTTON_NAMES = {"mouse_left": "0", "mouse_middle": "1", "mouse_right": "2"}


@dataclass(frozen=True)
class KeyInput:
    """Where held keys go in a model's controls, read from its card as the page reads it (static/input.js).

    A card's ``inputs`` entry of kind ``keys`` maps KeyboardEvent codes to the values its field takes (Waypoint's
    button ids), and its ``mouse_buttons`` the mouse buttons (``mouse_left``, ``mouse_middle``, ``mouse_right`` in a
    key script); without one, key names go as they are in ``keys`` (W A S D for the Wan world models)."""

    control: str = "keys"
    codes: dict[str, Any] | None = None
    mouse_buttons: dict[str, Any] = field(default_factory=dict)

    def controls(self, held: Sequence[str]) -> dict[str, Any]:
        """The controls of an `input` holding ``held``; raises :class:`KeyNotTaken` naming a key the model lacks."""
        if self.codes is None:
            return {self.control: list(held)}
        values = [self._value(name) for name in held]
        unknown = [name for name, value in zip(held, values, strict=True) if value is None]
        if unknown:
            taken = "w, space, 1, KeyQ, ArrowUp" + "".join(
                f", {name}" for name, button in MOUSE_BUTTON_NAMES.items() if button in self.mouse_buttons
            )
            raise KeyNotTaken(f"the model takes no key {unknown[0]!r} (it takes e.g. {taken})")
        return {self.control: values}

    def _value(self, name: str) -> Any:
        assert self.codes is not None
        button = MOUSE_BUTTON_NAMES.get(name.lower())
        if button is not None:
            return self.mouse_buttons.get(button)
        return self.codes.get(key_code(name))


def key_input(card: dict[str, Any]) -> KeyInput:
    """How ``card``'s model takes held keys and mouse buttons (:class:`KeyInput`)."""
    for control, spec in (card.get("inputs") or {}).items():
        if isinstance(spec, dict) and spec.get("kind") == "keys" and isinstance(spec.get("codes"), dict):
            mouse = spec.get("mouse_buttons")
            return KeyInput(control, spec["codes"], dict(mouse) if isinstance(mouse, dict) else {})
    return KeyInput()


def takes_keys(card: dict[str, Any]) -> bool:
    """Whether a model card's controls take held keys: its schema names the keys' field (:func:`key_input`) or
    leaves room for unnamed fields.

    A model steered by its prompt alone (LongLive) refuses every ``input`` that carries keys.
    """
    schema = card.get("controls")
    if not isinstance(schema, dict):
        return True  # no schema: nothing says keys are refused
    return key_input(card).control in (schema.get("properties") or {}) or schema.get("additionalProperties") is not False


def http_base_url(url: str) -> str:
    """``http(s)://host:port`` of the server behind a session URL (for /v1/stats and friends)."""
    parts = urlsplit(session_url(url))
    return urlunsplit(({"ws": "http", "wss": "https"}[parts.scheme], parts.netloc, "", "", ""))


# ---- what can go wrong ---------------------------------------------------------------


class ServerError(RuntimeError):
    """The server sent an ``error`` message; ``code`` is the protocol's :class:`ErrorCode`."""

    def __init__(self, message: ErrorMessage) -> None:
        self.code = message.code
        self.fatal = message.fatal
        self.tick_id = message.tick_id
        self.detail = message.message
        about = f" (tick {self.tick_id})" if self.tick_id is not None else ""
        kind = "fatal error" if self.fatal else "error"
        super().__init__(f"server {kind} {self.code}{about}: {self.detail}")


class SessionClosed(RuntimeError):
    """The session ended (``closed`` message or the WebSocket closed) while we expected more."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason  # the `closed` message's reason, when one came


class ConnectionDropped(SessionClosed):
    """The connection went away without a close frame (a network drop): the session may be resumable."""


class SessionMoved(SessionClosed):
    """The server moved the session to another replica (``moved``): reconnect with ``resume_token``."""

    def __init__(self, message: MovedMessage) -> None:
        self.resume_token = message.resume
        self.next_chunk_index = message.next_chunk_index
        super().__init__(f"the session moved to replica {self.resume_token.partition('.')[0]!r}")


class ControlPassed(RuntimeError):
    """A viewer was handed the controls (``role``): from now on its chunks come only for ticks it sends."""


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


# ---- one session ------------------------------------------------------------------


@dataclass
class Chunk:
    """One chunk as received: its ``chunk`` message, its frames and when things happened.

    Times are ``time.perf_counter()`` seconds. ``frames`` holds decoded
    ``[H, W, 3]`` arrays, or the raw payload bytes when decoding is off.
    """

    header: ChunkMessage
    tick_sent_at: float
    message_at: float
    first_frame_at: float = math.nan
    last_frame_at: float = math.nan
    frames: list[Any] = field(default_factory=list)

    @property
    def message(self) -> dict[str, Any]:
        """The ``chunk`` message as it came (a dict: fields this client does not model included)."""
        return self.header.wire()

    @property
    def tick_id(self) -> int:
        return self.header.tick_id

    @property
    def chunk_index(self) -> int:
        return self.header.chunk_index

    @property
    def restarted(self) -> str | None:
        return self.header.restarted

    @property
    def applied_event_ids(self) -> list[int]:
        return list(self.header.applied_event_ids)

    @property
    def latency_s(self) -> float:
        """Tick sent -> chunk message received."""
        return self.message_at - self.tick_sent_at


async def connect(url: str) -> Any:
    """Open a session WebSocket (frames may be large: a raw chunk is several MB)."""
    return await websockets.connect(url, max_size=MAX_MESSAGE_BYTES)


class Session:
    """One session over an open WebSocket: the verbs of protocol 1 and the bookkeeping they need.

    It numbers ticks and events, remembers when each was sent, and turns the
    server's messages back into :class:`Chunk` objects and latency figures.
    Any ``error`` message is raised as :class:`ServerError`.
    """

    def __init__(self, websocket: Any, *, decode: bool = True) -> None:
        self.ws = websocket
        self.decode = decode
        self._decoder = FrameDecoder()  # h264 frames decode in order, from the stream's keyframe
        self.ready: dict[str, Any] = {}  # the `ready` message as it came
        self.info: ReadyMessage | None = None  # the same, typed
        self.next_tick_id = 0
        self.next_event_id = 0
        self.tick_sent_at: dict[int, float] = {}  # ticks sent and not yet answered by a chunk
        self.event_sent_at: dict[int, float] = {}  # events not yet seen in applied_event_ids
        self.chunk_latencies_s: list[float] = []
        self.action_to_frame_s: list[float] = []
        # per applied event: its chunk's index less the last chunk index seen when it was sent (-1: none yet)
        self.action_to_frame_chunks: list[int] = []
        self._event_sent_after: dict[int, int] = {}
        self.first_frame_at = math.nan
        self.frames_received = 0
        self.last_chunk_index: int | None = None
        self.role = "controller"  # ready.role, then `role` messages: a viewer sends no ticks
        self.viewers: dict[str, Any] = {"count": 0}  # the last `viewers` message
        self.recording: bool | None = None  # ready.record, then `recording` answers (None: the server records none)
        self.skipped_chunks = 0  # chunks the server skipped for this viewer (chunk.skipped_before)
        self.inherited_ticks_up_to = -1  # given control: chunks of ticks up to this id were the last controller's
        self.track: TrackReceiver | None = None  # frames on a WebRTC track, once offered (client_webrtc.py)

    @classmethod
    async def connect(
        cls, url: str, *, token: str | None = None, share: str | None = None, decode: bool = True
    ) -> Session:
        """A session's WebSocket opened through ``url`` (``share``: to watch or branch that session)."""
        return cls(await connect(session_url(url, token=token, share=share)), decode=decode)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.ws.close()

    @property
    def model(self) -> dict[str, Any]:
        return self.ready["model"]

    @property
    def max_pending_ticks(self) -> int:
        return int(self.ready["limits"]["max_pending_ticks"])

    @property
    def ticks_in_flight(self) -> int:
        return len(self.tick_sent_at)

    async def start(self, **fields: Unpack[StartFields]) -> ReadyMessage:
        """Send ``start`` (:class:`StartFields`: ``resume``, a ticket's token; ``image``, ``start.image``; ...);
        return the ``ready`` message. Connect with ``share=TOKEN`` to ``watch`` or ``branch``."""
        await self._send(start_message(**fields))
        message = await self._next_control_message()
        if not isinstance(message, ReadyMessage):
            raise wire.WireError(f"expected 'ready' after 'start', got {message.type!r}")
        if message.protocol != wire.PROTOCOL_VERSION:
            raise wire.WireError(f"server speaks protocol {message.protocol}, this client {wire.PROTOCOL_VERSION}")
        self.info = message
        self.recording = message.record
        self.ready = message.wire()
        self.role = message.role
        return message

    @property
    def share_token(self) -> str | None:
        """``ready.share.token``: watch or branch this session with it (None from a server without sharing)."""
        share = None if self.info is None else self.info.share
        return share.token if share is not None and share.token else None

    async def resume(self, url: str, *, token: str | None = None, resume_token: str | None = None) -> ResumeGap:
        """After a :class:`ConnectionDropped` (or :class:`SessionMoved`, with its ``resume_token``): resume.

        Reconnects through ``url`` with the session's ticket (a moved session's
        token names its new replica, which the balancer routes to). Ticks in
        flight at the drop are gone (their chunks never come); tick and event
        ids keep counting past them. A ticket the server cannot honour raises
        :class:`ServerError` (``resume_failed``).
        """
        if resume_token is None:
            if self.info is None or self.info.resume is None:
                raise SessionClosed("the connection dropped and the server offered no resume ticket")
            resume_token = self.info.resume.token
        dropped_at = time.perf_counter()
        for _hop in range(MAX_MOVE_HOPS):
            await self.ws.close()
            self.ws = await connect(session_url(url, token=token, resume=resume_token))
            self.tick_sent_at.clear()
            try:
                ready = await self.start(codec=self.ready["codec"], resume=resume_token)
                break
            except SessionMoved as moved:  # its replica was drained meanwhile: follow it to the peer
                resume_token = moved.resume_token
        else:
            raise SessionClosed(f"the session kept moving: {MAX_MOVE_HOPS} replicas in a row sent it on")
        if ready.resume is None:
            raise wire.WireError("a resumed session's ready came without its resume ticket")
        return ResumeGap(
            session_id=ready.session_id,
            seconds=time.perf_counter() - dropped_at,
            last_chunk_index=self.last_chunk_index,
            next_chunk_index=ready.resume.next_chunk_index,
        )

    async def tick(
        self,
        *,
        keys: Sequence[str] | None = None,
        controls: dict[str, Any] | None = None,
        prompt: str | None = None,
        rewind_to: int | None = None,
        reset: bool = False,
        close: bool = False,
    ) -> int:
        """Ask for one chunk holding ``keys`` (or the model's ``controls``); return its tick id."""
        if keys is not None:
            controls = {**(controls or {}), "keys": list(keys)}
        return await self.send_tick(controls=controls, prompt=prompt, rewind_to=rewind_to, reset=reset, close=close)

    async def rewind(self, to: int, *, keys: Sequence[str] | None = None) -> int:
        """Go back to chunk boundary ``to`` and ask for the chunk from there (its ``chunk_index`` is ``to``)."""
        return await self.tick(keys=keys, rewind_to=to)

    async def send_tick(self, *, rewind_to: int | None = None, **fields: Any) -> int:
        """Ask for one chunk (``tick_message`` fields: controls, prompt, reset, close; ``rewind_to``: first go
        back to that chunk boundary); return its id."""
        tick_id = self.next_tick_id
        text = tick_message(tick_id, rewind_to=rewind_to, **fields)
        self.next_tick_id += 1
        self.tick_sent_at[tick_id] = time.perf_counter()
        await self._send(text)
        return tick_id

    @property
    def ice_servers(self) -> list[dict[str, Any]] | None:
        """``ready.webrtc.ice_servers``: the ICE servers for a peer connection (None: the server did not say)."""
        webrtc = self.ready.get("webrtc")
        return None if not isinstance(webrtc, dict) else list(webrtc.get("ice_servers") or [])

    async def offer_webrtc(self, receiver: TrackReceiver) -> None:
        """Offer ``receiver``'s track (PROTOCOL.md, "WebRTC video"): chunks come on it once the server says
        ``connected``; a refusal (``webrtc_failed``) is kept in ``receiver.refused`` and the frames stay here."""
        self.track = receiver
        await self._send(_checked(WebRTCOfferMessage, {"type": "webrtc_offer", "sdp": await receiver.offer_sdp()}))

    async def wait_for_track(self, timeout_s: float) -> str:
        """Before the first tick: read until the server says how the offered track went (``connected``, another
        state, or refused); at most ``timeout_s`` (then the frames come on the WebSocket until it connects)."""
        track = self.track
        assert track is not None, "offer_webrtc first"

        async def settled() -> None:
            while track.state == "new" and track.refused is None:
                data = await self._recv()
                if isinstance(data, bytes):
                    raise wire.WireError(f"unexpected binary message of {len(data)} bytes before any tick")
                self._note(json.loads(data))

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(settled(), timeout_s)
        return "refused" if track.refused is not None else track.state

    async def record(self, on: bool = True) -> None:
        """Record the session from its next chunk on (``on`` false: stop); :attr:`recording` follows the answer."""
        await self._send(record_message(on))

    async def pass_control(self, viewer_id: str) -> None:
        """Hand the controls to a viewer (an id from the controller's ``viewers`` message)."""
        await self._send(pass_control_message(viewer_id))

    async def send_input(self, *, controls: dict[str, Any] | None = None, prompt: str | None = None) -> int:
        """Send an ``input`` event; return its id."""
        event_id = self.next_event_id
        text = input_message(event_id, controls=controls, prompt=prompt)
        self.next_event_id += 1
        self.event_sent_at[event_id] = time.perf_counter()
        self._event_sent_after[event_id] = -1 if self.last_chunk_index is None else self.last_chunk_index
        await self._send(text)
        return event_id

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Every chunk as it comes: a player's until no tick is in flight, a viewer's until its session ends."""
        while self.ticks_in_flight or self.role == "viewer":
            try:
                yield await self.receive_chunk()
            except SessionClosed as ended:
                if self.role == "viewer" and ended.reason == "session_ended":
                    return
                raise

    async def receive_chunk(self) -> Chunk:
        """Read the next ``chunk`` message and all of its frames."""
        message = await self._next_control_message()
        if not isinstance(message, ChunkMessage):
            raise wire.WireError(f"expected 'chunk', got {message.type!r}")
        tick_id = message.tick_id
        if self.role == "viewer" or tick_id <= self.inherited_ticks_up_to:
            # The controller's tick: a viewer sent none, so it has no latency to measure.
            sent_at = self.tick_sent_at.pop(tick_id, math.nan)
            self.skipped_chunks += message.skipped_before or 0
        elif tick_id in self.tick_sent_at:
            sent_at = self.tick_sent_at.pop(tick_id)
        else:
            raise wire.WireError(f"chunk for tick {tick_id}, which is not in flight")
        chunk = Chunk(header=message, tick_sent_at=sent_at, message_at=time.perf_counter())
        on_track = message.delivery == "webrtc"  # its frames come on the track, not as binary messages here
        for index in range(0 if on_track else message.frames):
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
            await self.ws.send(close_message())
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
        if not math.isnan(chunk.latency_s):
            self.chunk_latencies_s.append(chunk.latency_s)
        self.frames_received += len(chunk.frames)
        self.last_chunk_index = chunk.chunk_index
        if chunk.frames and math.isnan(self.first_frame_at):
            self.first_frame_at = chunk.first_frame_at
        if chunk.header.delivery == "webrtc" and self.track is not None and chunk.header.track_frame is not None:
            for event_id in chunk.applied_event_ids:
                self._event_sent_after.pop(event_id, None)
            sent = [self.event_sent_at.pop(event_id, math.nan) for event_id in chunk.applied_event_ids]
            self.track.chunk_on_track(
                chunk.header.track_frame, chunk.header.frames, [at for at in sent if not math.isnan(at)]
            )
            return  # the receiver times them when it shows the chunk's first frame
        for event_id in chunk.applied_event_ids:
            sent_at = self.event_sent_at.pop(event_id, None)
            if sent_at is not None:
                self.action_to_frame_s.append(chunk.first_frame_at - sent_at)
                self.action_to_frame_chunks.append(self.last_chunk_index - self._event_sent_after.pop(event_id))

    def _take_role(self, message: RoleMessage) -> None:
        """``role``: control passed to us (our tick ids start past the session's ``last_tick_id``) or away."""
        self.role = message.role
        floor = message.last_tick_id
        if self.role == "controller" and floor is not None:
            self.next_tick_id = max(self.next_tick_id, floor + 1)
            self.inherited_ticks_up_to = floor

    async def _send(self, text: str) -> None:
        try:
            await self.ws.send(text)
        except websockets.ConnectionClosed:
            # The server may have refused the session (an ``error``, then the close) before this
            # message went out; that reason is still queued for reading, so report it instead.
            while True:
                data = await self._recv()  # raises SessionClosed once nothing is left to read
                if isinstance(data, str):
                    self._note(json.loads(data))

    async def _recv(self) -> str | bytes:
        try:
            data: str | bytes = await self.ws.recv()
            return data
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is None:
                raise ConnectionDropped(f"connection dropped without a close frame ({exc})") from None
            raise SessionClosed(f"connection closed (code {exc.code}, reason {exc.reason!r})") from None

    async def _next_control_message(self) -> ReadyMessage | ChunkMessage:
        """The next ``ready`` or ``chunk``; ``error``, ``moved`` and ``closed`` raise, the rest is noted or skipped."""
        while True:
            data = await self._recv()
            if isinstance(data, bytes):
                raise wire.WireError(f"unexpected binary message of {len(data)} bytes between chunks")
            message = self._note(json.loads(data))
            if isinstance(message, (ReadyMessage, ChunkMessage)):
                return message

    def _note(self, obj: Any) -> ServerMessage | None:
        """Take in one JSON message: ``error``, ``moved`` and ``closed`` raise; ``viewers`` and ``role`` are
        noted; ``ack``, ``pong`` and types added after this client pass."""
        try:
            message = parse_server_message(obj) if isinstance(obj, dict) else None
        except ValidationError as exc:
            raise wire.WireError(f"a server message that is not protocol 1: {exc}") from None
        if message is None and not isinstance(obj, dict):
            raise wire.WireError(f"a server message that is not a JSON object: {type(obj).__name__}")
        if isinstance(message, ViewersMessage):
            self.viewers = message.wire()
        elif isinstance(message, RecordingMessage):
            self.recording = message.on
        elif isinstance(message, RoleMessage):
            self._take_role(message)
            if self.role == "controller":
                raise ControlPassed("the player passed control to this client")
        elif isinstance(message, WebRTCAnswerMessage) and self.track is not None:
            self.track.answered(message)
        elif isinstance(message, WebRTCStateMessage) and self.track is not None:
            self.track.state = message.state
        elif isinstance(message, ErrorMessage) and message.code == ErrorCode.WEBRTC_FAILED and self.track is not None:
            self.track.refused = message.message  # the session goes on, its frames on the WebSocket
        elif isinstance(message, ErrorMessage):
            raise ServerError(message)
        elif isinstance(message, MovedMessage):
            raise SessionMoved(message)
        elif isinstance(message, ClosedMessage):
            reason = str(message.reason)
            raise SessionClosed(f"server closed the session (reason {reason!r})", reason)
        return message


__all__ = [
    "Chunk", "ConnectionDropped", "ControlPassed", "ErrorCode", "ResumeGap", "ServerError", "Session", "StartFields",
    "SessionClosed", "SessionMoved", "connect", "http_base_url", "session_url",
]
