"""Wire protocol v1 (docs/PROTOCOL.md): strict JSON parsing, client message models, server messages.

Errors a client can cause, as raised here and answered by the server::

    ProtocolError(code, message, tick_id=None)
      code is an ErrorCode; ERROR_CLOSE_CODES says whether it is fatal and
      which WebSocket close code follows it.

Parsing is strict: only JSON objects, no NaN/Infinity or numbers that
overflow a float, nesting at most 32 levels, ids are integers (never bools)
in ``0 <= id < 2**32``, ``prompt`` is a string or null (bounded: app/prompts.py). Unknown fields are
ignored so clients may send additive extensions.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .codecs import CODECS, CodecName
from .limits import count_exceeds
from .prompts import PromptAllowance, PromptPreparer, PromptRateExceeded, prompt_problem
from .wire import ID_LIMIT, PROTOCOL_VERSION
# Strict parsing is shared with the snapshot header; both names are part of this module's interface too.
from ..strict_json import MAX_JSON_DEPTH as MAX_JSON_DEPTH
from ..strict_json import loads_strict as loads_strict

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

# An error's message never grows with what the client sent: at most this many bytes as sent (docs/public.md).
MAX_ERROR_MESSAGE_CHARS = 480
EXCERPT_CHARS = 64
# A \u escape of a UTF-16 surrogate: the only way a lone one gets into a parsed string.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
MAX_RESUME_TOKEN_CHARS = 256
MAX_START_IMAGE_NAME_CHARS = 256
MAX_VIEWER_ID_CHARS = 64


class ErrorCode(StrEnum):
    INVALID_MESSAGE = "invalid_message"
    INVALID_CONTROLS = "invalid_controls"
    STALE_TICK = "stale_tick"
    TOO_MANY_TICKS = "too_many_ticks"
    STALE_EVENT = "stale_event"
    SESSION_FAILED = "session_failed"
    MESSAGE_TOO_LARGE = "message_too_large"
    START_REQUIRED = "start_required"
    UNAUTHORIZED = "unauthorized"
    OVER_CAPACITY = "over_capacity"
    IDLE_TIMEOUT = "idle_timeout"
    RESUME_FAILED = "resume_failed"
    TAKEN_OVER = "taken_over"
    INTERNAL = "internal"
    INVALID_IMAGE = "invalid_image"
    SHARE_FAILED = "share_failed"
    NOT_CONTROLLER = "not_controller"
    UNKNOWN_VIEWER = "unknown_viewer"
    REWIND_UNAVAILABLE = "rewind_unavailable"
    CONTROL_REFUSED = "control_refused"
    WEBRTC_FAILED = "webrtc_failed"


# Fatal codes and the WebSocket close code that follows their `error` message.
ERROR_CLOSE_CODES: dict[ErrorCode, int] = {
    ErrorCode.MESSAGE_TOO_LARGE: 1009,
    ErrorCode.START_REQUIRED: 1008,
    ErrorCode.UNAUTHORIZED: 1008,
    ErrorCode.OVER_CAPACITY: 1013,
    ErrorCode.IDLE_TIMEOUT: 4001,
    ErrorCode.RESUME_FAILED: 4002,
    ErrorCode.TAKEN_OVER: 4003,
    ErrorCode.INTERNAL: 1011,
    ErrorCode.INVALID_IMAGE: 4004,
    ErrorCode.SHARE_FAILED: 4005,
}
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server is going away: shutdown, or the session moved to a peer


class CloseReason(StrEnum):
    CLIENT = "client"
    TICK_CLOSE = "tick_close"
    IDLE_TIMEOUT = "idle_timeout"
    SERVER_SHUTDOWN = "server_shutdown"
    TAKEN_OVER = "taken_over"
    MOVED = "moved"
    ERROR = "error"
    SESSION_ENDED = "session_ended"  # to a viewer: the session it watched ended
    NOT_READING = "not_reading"  # to a viewer: it took nothing for viewer_stall_timeout_s, or left too much untaken


class ProtocolError(Exception):
    """A client message the server refuses; ``code`` decides fatality and close code."""

    def __init__(
        self, code: ErrorCode, message: str, *, tick_id: int | None = None, message_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.tick_id = tick_id
        # The refused message's `type` when it had a known one (a malformed `start` is not "no start").
        self.message_type = message_type

    @property
    def fatal(self) -> bool:
        return self.code in ERROR_CLOSE_CODES


# ---- what a client sent, as errors and logs show it ------------------------------------


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """A client-controlled string as logs and error messages show it: its first ``limit`` characters,
    printable ASCII only (escapes for newlines, control characters and the rest), and how much was left out."""
    shown = ascii(text[:limit])[1:-1]
    return shown if len(text) <= limit else f"{shown}… ({len(text) - limit} more characters)"


def _wire_length(text: str) -> int:
    return len(json.dumps(text)) - 2  # as it goes out: non-ASCII characters become \\uXXXX escapes


def _shown(value: Any) -> str:
    """A JSON value from a client as an error message quotes it: strings as an :func:`excerpt`."""
    return f"'{excerpt(value)}'" if isinstance(value, str) else excerpt(repr(value))


def _bounded(message: str) -> str:
    """``message``, or its start and how much was left out, within MAX_ERROR_MESSAGE_CHARS on the wire."""
    if _wire_length(message[: MAX_ERROR_MESSAGE_CHARS + 1]) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    keep = MAX_ERROR_MESSAGE_CHARS
    while True:
        tail = f"… ({len(message) - keep} more characters)"
        shortened = message[:keep] + tail
        if _wire_length(shortened) <= MAX_ERROR_MESSAGE_CHARS or keep == 0:
            return shortened
        keep = keep * 3 // 4


def _has_lone_surrogate(text: str, obj: Any) -> bool:
    """Whether a parsed message holds a string with an unpaired UTF-16 surrogate (not valid Unicode text)."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return False
    try:
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


def dumps(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"), allow_nan=False)


# ---- client messages -------------------------------------------------------------------

WireId = Annotated[int, Field(ge=0, lt=ID_LIMIT)]


def _bounded_prompt(text: str) -> str:
    problem = prompt_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


# A prompt's size is bounded when its message is parsed (app/prompts.py: MAX_PROMPT_CHARS, MAX_PROMPT_LINES).
Prompt = Annotated[str, AfterValidator(_bounded_prompt)]


class _ClientMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StartImageSpec(_ClientMessage):
    """``start.image``: exactly one of ``name`` (offered by the model card) or ``data`` (base64 of a file).

    Only the shape is checked here; :mod:`arstream.app.start_image` checks the name and decodes the data.
    """

    name: Annotated[str, Field(min_length=1, max_length=MAX_START_IMAGE_NAME_CHARS)] | None = None
    data: str | None = Field(None, repr=False)  # megabytes of base64: kept out of logs and reprs

    @model_validator(mode="after")
    def _exactly_one(self) -> StartImageSpec:
        if (self.name is None) == (self.data is None):
            raise ValueError("give exactly one of name (an offered start image) or data (base64 of a file)")
        return self


ShareToken = Annotated[str, Field(min_length=1, max_length=MAX_RESUME_TOKEN_CHARS)]


class BranchSpec(_ClientMessage):
    """``start.branch``: a new session from chunk boundary ``chunk`` of the session ``share`` names (absent:
    its latest boundary, where it is when the branch is made)."""

    share: ShareToken
    chunk: WireId | None = None


class StartMessage(_ClientMessage):
    type: Literal["start"]
    prompt: Prompt | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    codec: CodecName | None = None
    quality: Annotated[int, Field(ge=1, le=100)] | None = None
    # A resume ticket's token (PROTOCOL.md, "Resume after a dropped connection").
    resume: Annotated[str, Field(min_length=1, max_length=MAX_RESUME_TOKEN_CHARS)] | None = None
    # The session's start image (PROTOCOL.md, "Start images"); ignored on a resume.
    image: StartImageSpec | None = None
    # PROTOCOL.md, "Rewind, branch and watch": watch a session (a share token), or branch from one.
    watch: ShareToken | None = None
    branch: BranchSpec | None = None
    # PROTOCOL.md, "Recording": record what this session's player sees (on a server with --record-dir).
    record: bool | None = None

    @model_validator(mode="after")
    def _one_way_in(self) -> StartMessage:
        given = [name for name in ("resume", "watch", "branch") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of resume, watch and branch, got {' and '.join(given)}")
        return self

    @field_validator("codec")
    @classmethod
    def _codec_available(cls, value: str | None) -> str | None:
        # A codec's dependency may be an optional extra: a server without it says so at start, not at the first chunk.
        reason = None if value is None else CODECS[value].unavailable_reason()
        if reason is not None:
            usable = [name for name, codec in CODECS.items() if codec.available()]
            raise ValueError(f"this server cannot encode {value} ({reason}); use one of {usable}")
        return value


class TickMessage(_ClientMessage):
    type: Literal["tick"]
    tick_id: WireId
    controls: dict[str, Any] | None = None
    prompt: Prompt | None = None
    reset: bool = False
    close: bool = False
    rewind_to: WireId | None = None  # go back to this chunk boundary first (PROTOCOL.md, "Rewind ...")


class InputMessage(_ClientMessage):
    type: Literal["input"]
    event_id: WireId
    controls: dict[str, Any] | None = None
    prompt: Prompt | None = None


class CloseMessage(_ClientMessage):
    type: Literal["close"]


class PingMessage(_ClientMessage):
    type: Literal["ping"]
    t: int | float | None = None  # echoed back as sent


class PassControlMessage(_ClientMessage):
    type: Literal["pass_control"]
    to: Annotated[str, Field(min_length=1, max_length=MAX_VIEWER_ID_CHARS)]


class WebRTCOfferMessage(_ClientMessage):
    """``webrtc_offer``: a complete SDP offer (its ICE candidates inside), answered by ``webrtc_answer``."""

    type: Literal["webrtc_offer"]
    sdp: Annotated[str, Field(min_length=1)]


class RecordMessage(_ClientMessage):
    """``record``: record this session from its next chunk on (PROTOCOL.md, "Recording"); ``on`` false stops (the
    file being written ends). Answered by ``recording``."""

    type: Literal["record"]
    on: bool = True


ClientMessage = (
    StartMessage | TickMessage | InputMessage | CloseMessage | PingMessage | PassControlMessage | WebRTCOfferMessage
    | RecordMessage
)

MESSAGE_TYPES: dict[str, type[_ClientMessage]] = {
    "start": StartMessage,
    "tick": TickMessage,
    "input": InputMessage,
    "close": CloseMessage,
    "ping": PingMessage,
    "pass_control": PassControlMessage,
    "webrtc_offer": WebRTCOfferMessage,
    "record": RecordMessage,
}


def _tick_id_of(obj: dict[str, Any]) -> int | None:
    """The tick id to echo in an error, when the message carried a usable one."""
    value = obj.get("tick_id")
    if type(value) is int and 0 <= value < ID_LIMIT:
        return value
    return None


def describe_errors(error: ValidationError) -> str:
    """A pydantic error as error messages and logs show it: each field named as an excerpt, values never quoted."""
    parts = []
    for item in error.errors(include_url=False):
        where = ".".join(excerpt(str(p)) for p in item["loc"]) or "message"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_client_message(text: str) -> ClientMessage:
    """Parse one text message; raises :class:`ProtocolError` (``invalid_message``) on anything off-spec."""
    try:
        obj = loads_strict(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"not strict JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"expected a JSON object, got {type(obj).__name__}")
    if _has_lone_surrogate(text, obj):
        # Python keeps "\ud800" as a one-character string that cannot be encoded; nothing downstream expects it.
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            "a string holds a lone UTF-16 surrogate (not Unicode text)",
            tick_id=_tick_id_of(obj),
        )
    kind = obj.get("type")
    model = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"unknown message type {_shown(kind)}; expected one of {sorted(MESSAGE_TYPES)}",
            tick_id=_tick_id_of(obj),
        )
    try:
        return model.model_validate(obj)  # type: ignore[return-value]
    except ValidationError as exc:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"invalid {kind} message: {describe_errors(exc)}",
            tick_id=_tick_id_of(obj),
            message_type=kind,
        ) from None


# ---- server messages -------------------------------------------------------------------
#
# One model per message the server sends; the builders below fill them in, clients parse with
# :func:`parse_server_message`, and the JSON Schema (app/protocol_schema.py) is generated from them.
# Servers may add fields (extra="allow"): a client keeps what it does not know instead of refusing it.


class _ServerMessage(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    def wire(self) -> dict[str, Any]:
        """The message as sent: the fields given when it was built (a null one given is sent as null)."""
        return self.model_dump(mode="json", exclude_unset=True)


class ModelCard(_ServerMessage):
    """``ready.model`` and ``GET /v1/model``: the model's size, pace and controls (more fields may come)."""

    name: str
    width: int
    height: int
    fps: int | float
    frames_per_chunk: int
    controls: dict[str, Any] = Field(default_factory=dict)  # a JSON Schema of `tick.controls`
    first_chunk_frames: int | None = None
    reads_prompt: bool | None = None
    description: str | None = None
    start_images: list[str] | None = None
    runtime: str | None = None
    default_prompt: str | None = None
    prompt_switch: str | None = None
    default_num_frames: int | None = None


class Limits(_ServerMessage):
    max_pending_ticks: int
    max_message_bytes: int
    idle_timeout_s: int | float
    max_start_image_bytes: int | None = None


class ResumeTicket(_ServerMessage):
    """A session's resume ticket: reconnect within ``grace_s`` with ``start.resume = token``."""

    token: str
    grace_s: int | float | None = None
    next_chunk_index: int


class ShareInfo(_ServerMessage):
    token: str


class BranchedFrom(_ServerMessage):
    chunk: int


class IceServer(_ServerMessage):
    """The WebRTC API's RTCIceServer: STUN or TURN URLs, and a TURN server's credentials."""

    urls: str | list[str]
    username: str | None = None
    credential: str | None = None


class ReadyWebRTC(_ServerMessage):
    """``ready.webrtc``, from a server that answers ``webrtc_offer``: the ICE servers for the peer connection."""

    ice_servers: list[IceServer]


class ReadyMessage(_ServerMessage):
    type: Literal["ready"] = "ready"
    protocol: int
    session_id: str
    model: ModelCard
    codec: CodecName
    limits: Limits
    resume: ResumeTicket | None = None
    resumed: bool | None = None
    role: Literal["controller", "viewer"] = "controller"
    viewer_id: str | None = None
    quality: int | None = None
    share: ShareInfo | None = None
    rewind_points: int | None = None
    rewind_seconds: int | float | None = None
    branched_from: BranchedFrom | None = None
    record: bool | None = None  # on a server that records: whether this session is recorded (PROTOCOL.md, "Recording")
    webrtc: ReadyWebRTC | None = None  # on a server that answers webrtc_offer (PROTOCOL.md, "WebRTC video")


class ChunkTimings(_ServerMessage):
    queue_ms: float
    compute_ms: float
    encode_ms: float


class ChunkMessage(_ServerMessage):
    """A chunk's header: exactly ``frames`` binary frame messages follow it."""

    type: Literal["chunk"] = "chunk"
    tick_id: int
    chunk_index: int
    frames: int
    applied_event_ids: list[int]
    restarted: Literal["reset", "evicted", "rewind"] | None
    timings: ChunkTimings
    rewind_points: list[int] | None = None  # [oldest, newest] boundary a rewind_to may name
    rewind_held: list[int] | None = None
    skipped_before: int | None = None  # to a viewer: chunks it missed since the last one it got
    # on the WebRTC track instead of binary messages (PROTOCOL.md, "WebRTC video"): the track frame that holds the
    # chunk's first frame, and that frame's RTP timestamp when it is known
    delivery: Literal["webrtc"] | None = None
    track_frame: int | None = None
    rtp_timestamp: int | None = None


class AckMessage(_ServerMessage):
    type: Literal["ack"] = "ack"
    event_id: int
    status: Literal["accepted", "duplicate"]


class PongMessage(_ServerMessage):
    type: Literal["pong"] = "pong"
    t: int | float | None
    server_time: float


class ErrorMessage(_ServerMessage):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    tick_id: int | None
    fatal: bool


class MovedMessage(_ServerMessage):
    type: Literal["moved"] = "moved"
    resume: str
    next_chunk_index: int


class ClosedMessage(_ServerMessage):
    type: Literal["closed"] = "closed"
    reason: CloseReason


class RoleMessage(_ServerMessage):
    """After ``pass_control``: ``controller`` (with the tick-id floor and a resume ticket) or ``viewer``."""

    type: Literal["role"] = "role"
    role: Literal["controller", "viewer"]
    viewer_id: str | None = None
    last_tick_id: int | None = None
    resume: ResumeTicket | None = None
    rewind_seconds: int | float | None = None


class ViewersMessage(_ServerMessage):
    """How many viewers a session has; the controller's copy lists their ids (to pass control)."""

    type: Literal["viewers"] = "viewers"
    count: int
    ids: list[str] | None = None


class WebRTCAnswerMessage(_ServerMessage):
    """The answer to ``webrtc_offer``: a complete SDP (the server's candidates inside) and the codec chosen."""

    type: Literal["webrtc_answer"] = "webrtc_answer"
    sdp: str
    codec: str


class WebRTCStateMessage(_ServerMessage):
    """The peer connection's state: chunks go on the track while ``connected``, on the WebSocket otherwise."""

    type: Literal["webrtc_state"] = "webrtc_state"
    state: str


class RecordingMessage(_ServerMessage):
    """The answer to ``record``: whether the session is recorded from now on."""

    type: Literal["recording"] = "recording"
    on: bool


ServerMessage = (
    ReadyMessage | ChunkMessage | AckMessage | PongMessage | ErrorMessage | MovedMessage | ClosedMessage
    | RoleMessage | ViewersMessage | WebRTCAnswerMessage | WebRTCStateMessage | RecordingMessage
)

SERVER_MESSAGE_TYPES: dict[str, type[_ServerMessage]] = {
    "ready": ReadyMessage,
    "chunk": ChunkMessage,
    "ack": AckMessage,
    "pong": PongMessage,
    "error": ErrorMessage,
    "moved": MovedMessage,
    "closed": ClosedMessage,
    "role": RoleMessage,
    "viewers": ViewersMessage,
    "webrtc_answer": WebRTCAnswerMessage,
    "webrtc_state": WebRTCStateMessage,
    "recording": RecordingMessage,
}


def parse_server_message(obj: dict[str, Any]) -> ServerMessage | None:
    """A decoded server message as its model; None for a type this side does not know (a later addition).

    Raises :class:`pydantic.ValidationError` when a known message does not match its model.
    """
    model = SERVER_MESSAGE_TYPES.get(obj.get("type"))  # type: ignore[arg-type]
    return None if model is None else model.model_validate(obj)  # type: ignore[return-value]


def ready_message(
    *, session_id: str, model_card: dict[str, Any], codec: str, max_pending_ticks: int, max_message_bytes: int,
    idle_timeout_s: float, resume: dict[str, Any] | None = None, resumed: bool = False,
    max_start_image_bytes: int | None = None, share: str | None = None, rewind_points: int = 0,
    rewind_seconds: float = 0.0, role: str = "controller", viewer_id: str | None = None, branched_from: int | None = None,
    quality: int | None = None, record: bool | None = None, ice_servers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The `ready` message; ``resume`` is the session's resume ticket (absent when resume is off).

    ``max_start_image_bytes`` goes in ``limits`` when the model offers start images. ``share`` (the share
    token), ``rewind_points`` and ``rewind_seconds``, ``role``, ``viewer_id`` and ``branched_from`` are PROTOCOL.md's
    "Rewind, branch and watch" fields; ``quality``, a viewer's, is the quality it is served; ``record`` (None: the
    server does not record) whether the session is recorded; ``ice_servers`` (None: the server does not answer
    ``webrtc_offer``) goes in ``webrtc``.
    """
    limits: dict[str, Any] = {
        "max_pending_ticks": max_pending_ticks,
        "max_message_bytes": max_message_bytes,
        "idle_timeout_s": int(idle_timeout_s) if float(idle_timeout_s).is_integer() else idle_timeout_s,
    }
    if max_start_image_bytes is not None:
        limits["max_start_image_bytes"] = max_start_image_bytes
    fields: dict[str, Any] = {
        "type": "ready", "protocol": PROTOCOL_VERSION, "session_id": session_id, "model": model_card, "codec": codec,
        "limits": limits,
    }
    if resume is not None:
        fields["resume"] = resume
    if resumed:
        fields["resumed"] = True
    fields["role"] = role
    if viewer_id is not None:
        fields["viewer_id"] = viewer_id
    if quality is not None:
        fields["quality"] = quality
    if share is not None:
        fields["share"] = {"token": share}
    if rewind_points:
        fields["rewind_points"] = rewind_points
        fields["rewind_seconds"] = round(rewind_seconds, 3)
    if branched_from is not None:
        fields["branched_from"] = {"chunk": branched_from}
    if record is not None:
        fields["record"] = record
    if ice_servers is not None:
        fields["webrtc"] = {"ice_servers": ice_servers}
    return ReadyMessage.model_validate(fields).wire()


def chunk_message(
    *, tick_id: int, chunk_index: int, frames: int, applied_event_ids: list[int], restarted: str | None,
    queue_ms: float, compute_ms: float, encode_ms: float, rewind_points: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The `chunk` header; ``rewind_points`` lists every boundary a later ``rewind_to`` may name, oldest first.

    On the wire it is ``rewind_points: [oldest, newest]`` (as protocol 1 had it) and ``rewind_held``, the
    whole list (older boundaries are thinned out, so not every index between the two is held).
    """
    timings = ChunkTimings(queue_ms=round(queue_ms, 3), compute_ms=round(compute_ms, 3), encode_ms=round(encode_ms, 3))
    fields: dict[str, Any] = {}
    if rewind_points:
        fields = {"rewind_points": [rewind_points[0], rewind_points[-1]], "rewind_held": list(rewind_points)}
    return ChunkMessage(
        type="chunk", tick_id=tick_id, chunk_index=chunk_index, frames=frames, applied_event_ids=applied_event_ids,
        restarted=restarted, timings=timings, **fields,
    ).wire()


def role_message(role: str, *, viewer_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """The `role` message after ``pass_control``: ``controller`` (with the tick-id floor and a resume ticket)
    or ``viewer`` (with its viewer id)."""
    given = {name: value for name, value in fields.items() if value is not None}
    if viewer_id is not None:
        given["viewer_id"] = viewer_id
    return RoleMessage.model_validate({"type": "role", "role": role, **given}).wire()


def viewers_message(count: int, ids: list[str] | None = None) -> dict[str, Any]:
    """How many viewers a session has (``ids``: the controller's copy)."""
    return ViewersMessage(type="viewers", count=count, **({"ids": ids} if ids is not None else {})).wire()


def ack_message(event_id: int, *, duplicate: bool) -> dict[str, Any]:
    return AckMessage(type="ack", event_id=event_id, status="duplicate" if duplicate else "accepted").wire()


def recording_message(on: bool) -> dict[str, Any]:
    """The answer to ``record``: whether the session is recorded from now on."""
    return RecordingMessage(type="recording", on=on).wire()


def pong_message(t: int | float | None) -> dict[str, Any]:
    return PongMessage(type="pong", t=t, server_time=time.time()).wire()


def error_message(code: ErrorCode, message: str, *, tick_id: int | None = None) -> dict[str, Any]:
    """The `error` message; its text is bounded (MAX_ERROR_MESSAGE_CHARS), whatever part of the input it quotes."""
    return ErrorMessage(
        type="error", code=code, message=_bounded(message), tick_id=tick_id, fatal=code in ERROR_CLOSE_CODES
    ).wire()


def moved_message(*, resume: str, next_chunk_index: int) -> dict[str, Any]:
    """The session moved to another replica: reconnect with ``resume`` (PROTOCOL.md, "Moved to another replica")."""
    return MovedMessage(type="moved", resume=resume, next_chunk_index=next_chunk_index).wire()


def closed_message(reason: CloseReason) -> dict[str, Any]:
    return ClosedMessage(type="closed", reason=reason).wire()


def too_large(text: str, limit: int) -> bool:
    """Whether a text message is over ``limit`` UTF-8 bytes."""
    # Characters first: the UTF-8 byte count is taken only of a text that could still be too large.
    return len(text) > limit or len(text.encode()) > limit


def controls_problem(controls: dict[str, Any], max_items: int, validator: Validator | None) -> str | None:
    """What is wrong with ``controls`` (more than ``max_items`` JSON values, or not the model's schema), or None."""
    if count_exceeds(controls, max_items):
        # Refused before the schema walks it: a schema check costs time per item, on the event loop.
        return f"controls hold more than {max_items} JSON values (max_control_items)"
    error = None if validator is None else next(iter(validator.iter_errors(controls)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "controls"
    return f"{where}: {error.message}"


_Prompted = TypeVar("_Prompted", TickMessage, InputMessage)


def with_prepared_prompt(message: _Prompted, prompts: PromptPreparer, allowance: PromptAllowance) -> _Prompted:
    """``message`` with its prompt as the model reads it, prepared here once (bounded at parse time; the session
    holds what the model reads); raises ProtocolError (too_many_ticks) past the session's new-prompt allowance."""
    if message.prompt is None:
        return message
    try:
        prepared = prompts.prepare(message.prompt, allowance)
    except PromptRateExceeded as exc:
        tick_id = message.tick_id if isinstance(message, TickMessage) else None
        raise ProtocolError(ErrorCode.TOO_MANY_TICKS, str(exc), tick_id=tick_id) from None
    return message.model_copy(update={"prompt": prepared})
