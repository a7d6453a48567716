"""The events of vLLM-Omni's realtime video API (``WS /v1/realtime/video``), checked and mapped onto ARStream's.

vLLM-Omni's schema, field by field (its ``serving_video_output_stream.py``
and ``VideoGenerationRequest`` in ``vllm-omni==0.30.0``): :func:`parse_start`
checks a ``session.start`` against it and the served model's card,
:func:`parse_interaction` a ``session.interaction`` (in vLLM-Omni's order of
checks, with its messages), and :func:`camera_move` turns a
structural SE3 camera velocity or target into the model's own controls. Every refusal
is a :class:`RealtimeVideoError`, sent in vLLM-Omni's error shape
(:func:`error_event`). The connection that uses them is
:mod:`arstream.app.realtime_video`.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .prompts import prompt_problem
from .protocol import ErrorCode, Prompt
from ..runner.contract import DEFAULT_PROMPT_TRANSITION_CHUNKS, default_num_frames, prompt_switch

OUTPUT_FORMAT = "m4s"
# vLLM-Omni's limit on a control message after session.start (its _MAX_CONTROL_MESSAGE_SIZE), this dialect's too.
MAX_CONTROL_MESSAGE_BYTES = 128 * 1024
# vLLM-Omni takes any int64 seed; torch seeds a generator from a negative one as from it plus 2**64, and so does
# this dialect (ARStream's sessions and models take seeds from 0).
SEED_WRAP = 2**64
# vLLM-Omni's camera default: an event without ``mode`` is a target; a target takes one chunk unless told.
DEFAULT_CAMERA_MODE = "target"
DEFAULT_TARGET_TRANSITION_CHUNKS = 1
# vLLM-Omni's LingBot-World helper turns 6 degrees a frame for one look key; Matrix-Game's key-driven camera
# turns 0.1 of its units a frame. Equating the two gives the scale of a rotation in the model's camera units.
CAMERA_UNITS_PER_DEGREE = 0.1 / 6.0
# Translation components smaller than this (per frame, Unity units) press no key: the helper's step is 0.05.
TRANSLATION_DEAD_ZONE = 1e-3
# Fields of vLLM-Omni's request that ask for something no ARStream model does: refused rather than ignored.
UNSUPPORTED_FIELDS = ("video_reference", "audio_reference", "lora")
DATA_URL_BASE64 = ";base64,"
# An interaction's event_id, at most (vLLM-Omni sets none; its examples use short names and UUIDs, 36 bytes).
MAX_EVENT_ID_BYTES = 128


class RealtimeVideoError(Exception):
    """A refusal in vLLM-Omni's error shape; ``code`` is ARStream's (or vLLM-Omni's) name for it."""

    def __init__(self, message: str, code: str | None = None, *, event_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.event_id = event_id


def error_event(
    message: str, code: str | None = None, *, request_id: str | None = None, event_id: str | None = None
) -> dict[str, Any]:
    """vLLM-Omni's ``error`` event: ``message`` always, the other fields only when known."""
    payload: dict[str, Any] = {"type": "error", "message": message}
    if code is not None:
        payload["code"] = code
    if request_id is not None:
        payload["request_id"] = request_id
    if event_id is not None:
        payload["event_id"] = event_id
    return payload


# ---- session.start ---------------------------------------------------------------------------


class VideoParamsBlock(BaseModel):
    """vLLM-Omni's optional ``video_params`` block (the top-level fields win over it)."""

    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    num_frames: int | None = Field(None, ge=1)
    fps: float | None = Field(None, ge=1, allow_inf_nan=False)


class SessionStart(BaseModel):
    """The fields of vLLM-Omni's ``session.start`` (its ``VideoGenerationRequest``) that ARStream reads.

    Unknown fields are ignored, as vLLM-Omni's pydantic model ignores them; the
    diffusion sampling knobs (``num_inference_steps``, ``guidance_scale``,
    ``negative_prompt``, ...) are among them: an ARStream model's steps are
    fixed by its distillation.
    """

    model_config = ConfigDict(extra="ignore")

    type: Literal["session.start"]
    model: str | None = None
    prompt: Prompt  # bounded as protocol 1's (app/prompts.py)
    # Digits bounded: a 400-digit ``seconds`` overflows a float and a 5000-digit ``size`` is past Python's
    # int parsing limit; no model makes a frame wider than 99999 px or a session longer than 10^9 s.
    seconds: str | None = Field(None, pattern=r"^[1-9]\d{0,8}$")
    size: str | None = Field(None, pattern=r"^\d{1,5}x\d{1,5}$")
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    fps: float | None = Field(None, ge=1, allow_inf_nan=False)
    num_frames: int | None = Field(None, ge=1)
    video_params: VideoParamsBlock | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # vLLM-Omni's int64
    image_reference: Any = None  # checked by start_image_request: vLLM-Omni's {image_url} or {file_id}
    num_outputs_per_prompt: int = Field(1, ge=1, le=1)
    generate_sound: bool = False
    enable_frame_interpolation: bool = False
    extra_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class StartRequest:
    """An accepted ``session.start``, resolved against the model card."""

    start: SessionStart
    width: int
    height: int
    fps: float
    num_frames: int  # the frames asked for, or the model's default length (vLLM-Omni's default_num_frames)
    controls: dict[str, Any] | None  # ARStream's extra_params.controls, the first chunk's controls
    image: tuple[str | None, str | None] | None  # the start image asked for: (name, base64 data), or None

    def config(self) -> dict[str, Any]:
        """``video.start``'s ``config``: the request as accepted (vLLM-Omni echoes its request, Nones left out).

        An uploaded image is not echoed back (it may be megabytes); a named one is.
        """
        echoed = self.start.model_dump(exclude_none=True, exclude={"type", "video_params", "image_reference"})
        if self.image is not None and self.image[0] is not None:
            echoed["image_reference"] = {"file_id": self.image[0]}
        echoed.update(width=self.width, height=self.height, fps=self.fps, num_frames=self.num_frames)
        return echoed

    @property
    def seed(self) -> int | None:
        """The session's seed: a negative int64 as torch takes it (plus 2**64)."""
        seed = self.start.seed
        return seed + SEED_WRAP if seed is not None and seed < 0 else seed


def fold_sampling_params(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM-Omni's ``sampling_params`` folding: known fields move up (unless set), the rest into extra_params."""
    fields = {k: v for k, v in message.items() if k not in ("format", "sampling_params")}
    sampling = message.get("sampling_params")
    if isinstance(sampling, dict):
        extra = dict(fields.get("extra_params") or {})
        for key, value in sampling.items():
            if key in SessionStart.model_fields and key not in fields:
                fields[key] = value
            else:
                extra[key] = value
        if extra:
            fields["extra_params"] = extra
    return fields


def parse_start(message: Any, model_card: dict[str, Any]) -> StartRequest:
    """Check a ``session.start`` against vLLM-Omni's schema and the served model; raises RealtimeVideoError."""
    if not isinstance(message, dict):
        raise RealtimeVideoError("session.start must be a JSON object", ErrorCode.INVALID_MESSAGE)
    if message.get("type") != "session.start":
        raise RealtimeVideoError(f"Expected session.start, got: {message.get('type')}", ErrorCode.START_REQUIRED)
    if message.get("format", OUTPUT_FORMAT) != OUTPUT_FORMAT:
        raise RealtimeVideoError("Invalid session.start format: expected 'm4s'.", ErrorCode.INVALID_MESSAGE)
    for name in UNSUPPORTED_FIELDS:
        if message.get(name) is not None:
            raise RealtimeVideoError(f"{name} is not supported by ARStream's models", ErrorCode.INVALID_MESSAGE)
    try:
        start = SessionStart.model_validate(fold_sampling_params(message))
    except ValidationError as exc:
        raise RealtimeVideoError(f"Invalid session.start: {exc}", ErrorCode.INVALID_MESSAGE) from None
    served = model_card.get("name")
    if start.model is not None and start.model != served:
        raise RealtimeVideoError(
            f"Model mismatch: request specifies '{start.model}' but server is running '{served}'.",
            ErrorCode.INVALID_MESSAGE,
        )
    if start.generate_sound or start.enable_frame_interpolation:
        raise RealtimeVideoError(
            "generate_sound and enable_frame_interpolation are not supported by ARStream's models",
            ErrorCode.INVALID_MESSAGE,
        )
    block = start.video_params or VideoParamsBlock()
    width, height = start.width or block.width, start.height or block.height
    if start.size is not None:
        width, height = (int(v) for v in start.size.split("x"))
    card_width, card_height, card_fps = int(model_card["width"]), int(model_card["height"]), float(model_card["fps"])
    if (width is not None and width != card_width) or (height is not None and height != card_height):
        raise RealtimeVideoError(
            f"this model makes {card_width}x{card_height} video, not {width or card_width}x{height or card_height}",
            ErrorCode.INVALID_MESSAGE,
        )
    fps = start.fps or block.fps
    if fps is not None and fps != card_fps:
        raise RealtimeVideoError(
            f"this model makes video at {card_fps:g} fps, not {fps:g}: its controls and motion are per frame",
            ErrorCode.INVALID_MESSAGE,
        )
    num_frames = start.num_frames or block.num_frames
    if num_frames is None and start.seconds is not None:
        num_frames = int(float(start.seconds) * card_fps)
    if num_frames is None:
        num_frames = default_num_frames(model_card)
    controls = (start.extra_params or {}).get("controls")
    if controls is not None and not isinstance(controls, dict):
        raise RealtimeVideoError("extra_params.controls must be a JSON object", ErrorCode.INVALID_CONTROLS)
    image = None if start.image_reference is None else start_image_request(start.image_reference)
    return StartRequest(start, card_width, card_height, card_fps, num_frames, controls, image)


def start_image_request(reference: Any) -> tuple[str | None, str | None]:
    """vLLM-Omni's ``image_reference`` as ARStream's start image: (name, None) or (None, base64 data).

    ``{"file_id": name}`` names one of the model card's ``start_images``;
    ``{"image_url": "data:<type>;base64,<data>"}`` uploads a picture, as
    ``start.image.data`` does. URLs to fetch are refused: the server fetches
    nothing on a client's behalf.
    """
    if isinstance(reference, list):
        raise RealtimeVideoError("image_reference must be a single image reference.", ErrorCode.INVALID_IMAGE)
    if isinstance(reference, dict) and set(reference) == {"file_id"} and isinstance(reference["file_id"], str):
        return reference["file_id"], None
    url = reference.get("image_url") if isinstance(reference, dict) and set(reference) == {"image_url"} else None
    if not isinstance(url, str):
        shapes = '{"image_url": "data:..."} or {"file_id": "..."}'
        raise RealtimeVideoError(f"image_reference must be {shapes}", ErrorCode.INVALID_IMAGE)
    if not url.startswith("data:"):
        raise RealtimeVideoError(
            "image_reference URLs are not fetched: send the picture as a data: URL, or a file_id naming one of "
            "the model's start_images",
            ErrorCode.INVALID_IMAGE,
        )
    if DATA_URL_BASE64 not in url:
        raise RealtimeVideoError(
            "an image_reference data: URL must be base64 (data:<type>;base64,...)", ErrorCode.INVALID_IMAGE
        )
    return None, url.split(DATA_URL_BASE64, 1)[1]


def chunks_for_frames(num_frames: int, model_card: dict[str, Any]) -> int:
    """Chunks that make at least ``num_frames`` frames (a model's first chunk may be shorter: Matrix-Game's)."""
    per_chunk = int(model_card["frames_per_chunk"])
    first = int(model_card.get("first_chunk_frames", per_chunk))
    return 1 + max(0, -(-(num_frames - first) // per_chunk))


# ---- session.interaction ---------------------------------------------------------------------------


def _numbers(value: Any, count: int, where: str) -> list[float]:
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    ):
        raise ValueError(f"{where} must be a list of {count} finite numbers")
    return [float(v) for v in value]


def yaw_pitch_degrees(rotation: list[float]) -> tuple[float, float]:
    """Yaw (about +Y, positive looks right) and pitch (about +X, positive looks up) of a unit quaternion.

    Inverts vLLM-Omni's helper, which composes ``pitch (x) yaw``; a roll component is dropped.
    """
    norm = math.sqrt(sum(v * v for v in rotation))
    if norm == 0.0:
        raise ValueError("camera rotation must be a non-zero quaternion [x, y, z, w]")
    x, y, z, w = (v / norm for v in rotation)
    yaw = math.atan2(2 * (w * y + x * z), w * w + x * x - y * y - z * z)
    pitch = math.atan2(2 * (w * x + y * z), w * w - x * x + y * y - z * z)
    return math.degrees(yaw), math.degrees(pitch)


@dataclass(frozen=True)
class CameraMove:
    """A camera event as the model's controls: held until replaced, or for a target's chunks then released."""

    controls: dict[str, Any]
    hold_chunks: int | None = None  # None: until another controls change (velocity); N: a target's chunks
    release: dict[str, Any] | None = None  # the controls after those chunks: no key pressed, no turn


def camera_move(camera: Any, model_card: dict[str, Any], transition_chunks: int | None = None) -> CameraMove:
    """A structural SE3 camera payload as the model's controls; raises ValueError saying what does not fit.

    ``mode`` defaults to ``target``, as in vLLM-Omni. A ``velocity`` (a
    per-frame delta) holds until replaced. A ``target`` (a pose, relative to
    where the camera is when the target starts: ARStream's models report no
    pose) becomes the per-frame delta that reaches it over
    ``transition_chunks`` chunks (default 1; 0 also takes one chunk, the least
    a model can move in), held for those chunks and then released: no key,
    no turn. Either delta maps through :func:`motion_controls`.
    """
    if not isinstance(camera, dict):
        raise ValueError("multi_modal_data.camera must be an object")
    mode = camera.get("mode", DEFAULT_CAMERA_MODE)
    if mode not in ("velocity", "target"):
        raise ValueError(f"camera mode must be 'target' or 'velocity', got {mode!r}")
    data = camera.get("data")
    if not isinstance(data, dict):
        raise ValueError("camera.data must be an object with translation and rotation")
    if "actions" in data:
        raise ValueError("camera.data.actions (key tokens) is not accepted: send structural SE3")
    dx, _dy, dz = _numbers(data.get("translation", [0.0, 0.0, 0.0]), 3, "camera.data.translation")
    yaw, pitch = yaw_pitch_degrees(_numbers(data.get("rotation", [0.0, 0.0, 0.0, 1.0]), 4, "camera.data.rotation"))
    if mode == "velocity":
        return CameraMove(motion_controls(dx, dz, yaw, pitch, model_card))
    chunks = max(1, DEFAULT_TARGET_TRANSITION_CHUNKS if transition_chunks is None else transition_chunks)
    frames = chunks * int(model_card["frames_per_chunk"])
    per_frame = motion_controls(dx / frames, dz / frames, yaw / frames, pitch / frames, model_card)
    return CameraMove(per_frame, chunks, motion_controls(0.0, 0.0, 0.0, 0.0, model_card))


def camera_to_controls(camera: Any, model_card: dict[str, Any]) -> dict[str, Any]:
    """The controls a camera payload sets first (see :func:`camera_move`)."""
    return camera_move(camera, model_card).controls


def motion_controls(dx: float, dz: float, yaw: float, pitch: float, model_card: dict[str, Any]) -> dict[str, Any]:
    """A per-frame camera motion as the model's controls; raises ValueError where the model has no control for it.

    It maps onto what ARStream's models take per frame: the translation's sign
    along +Z/-Z and +X/-X presses W/S and D/A (keys have no magnitude), the
    yaw and pitch (degrees a frame) set the camera axes
    (``CAMERA_UNITS_PER_DEGREE``, clamped to the schema).
    """
    properties = model_card.get("controls", {}).get("properties", {})
    pressed = []
    if dz > TRANSLATION_DEAD_ZONE:
        pressed.append("w")
    elif dz < -TRANSLATION_DEAD_ZONE:
        pressed.append("s")
    if dx > TRANSLATION_DEAD_ZONE:
        pressed.append("d")
    elif dx < -TRANSLATION_DEAD_ZONE:
        pressed.append("a")
    allowed_keys = properties.get("keys", {}).get("items", {}).get("enum", [])
    if not set(pressed) <= set(allowed_keys):
        raise ValueError(f"this model cannot move along {pressed} (its keys: {allowed_keys})")
    controls: dict[str, Any] = {"keys": pressed} if "keys" in properties else {}

    camera_field = model_card.get("mouse", "camera")
    axes = properties.get(camera_field, {}).get("properties", {})
    turn = {"yaw": yaw, "pitch": pitch}
    if any(abs(turn[a]) > 1e-9 for a in turn if a not in axes):
        raise ValueError(f"this model cannot turn its camera that way (its camera axes: {sorted(axes)})")
    if axes:
        values = {}
        for axis, spec in axes.items():
            value = turn.get(axis, 0.0) * CAMERA_UNITS_PER_DEGREE
            values[axis] = min(max(value, spec.get("minimum", -math.inf)), spec.get("maximum", math.inf))
        controls[camera_field] = values
    return controls


@dataclass(frozen=True)
class Interaction:
    """A checked ``session.interaction``: its event_id and what it changes."""

    event_id: str
    prompt: str | None
    controls: dict[str, Any] | None
    transition_chunks: int | None
    # A camera target's: its controls hold for this many chunks, then ``release`` applies (None: until replaced).
    hold_chunks: int | None = None
    release: dict[str, Any] | None = None
    # The chunks a prompt change blends over (0: at the next chunk; the model card's prompt_switch decides).
    prompt_transition_chunks: int = 0


def parse_interaction(message: dict[str, Any], model_card: dict[str, Any]) -> Interaction:
    """vLLM-Omni's interaction checks, in its order, then the mapping onto controls; raises RealtimeVideoError."""
    interaction = message.get("interaction")
    if not isinstance(interaction, dict):
        raise RealtimeVideoError("session.interaction requires an interaction object", ErrorCode.INVALID_MESSAGE)
    event_id = interaction.get("event_id")
    if event_id is None:
        event_id = secrets.token_hex(16)
    elif not isinstance(event_id, str) or not event_id:
        raise RealtimeVideoError("session.interaction event_id must be a non-empty string", ErrorCode.INVALID_MESSAGE)
    elif len(event_id) > MAX_EVENT_ID_BYTES or len(event_id.encode()) > MAX_EVENT_ID_BYTES:
        # Ids are remembered for event_id_conflict and listed in chunk metadata: their size is what those hold.
        raise RealtimeVideoError(
            f"session.interaction event_id must be at most {MAX_EVENT_ID_BYTES} bytes (UTF-8), "
            f"got {len(event_id.encode())}",
            ErrorCode.INVALID_MESSAGE,
        )
    event = interaction.get("event")
    if not isinstance(event, dict):
        raise RealtimeVideoError("session.interaction requires event object", ErrorCode.INVALID_MESSAGE)
    prompt, mm, native = event.get("prompt"), event.get("multi_modal_data"), event.get("controls")
    has_prompt = isinstance(prompt, str) and bool(prompt.strip())
    has_mm = isinstance(mm, dict) and bool(mm)
    if not has_prompt and not has_mm and native is None:
        raise RealtimeVideoError(
            "session.interaction requires a non-empty event.prompt and/or non-empty event.multi_modal_data",
            ErrorCode.INVALID_MESSAGE,
        )
    if prompt is not None and not has_prompt:
        raise RealtimeVideoError(
            "session.interaction event.prompt must be a non-empty string when provided", ErrorCode.INVALID_MESSAGE
        )
    problem = prompt_problem(prompt) if isinstance(prompt, str) and has_prompt else None
    if problem is not None:
        raise RealtimeVideoError(f"session.interaction event.prompt: {problem}", ErrorCode.INVALID_MESSAGE)
    if mm is not None and not has_mm:
        raise RealtimeVideoError(
            "session.interaction event.multi_modal_data must be a non-empty object when provided",
            ErrorCode.INVALID_MESSAGE,
        )
    if event.get("negative_prompt") is not None:
        raise RealtimeVideoError(
            "session.interaction negative_prompt is not supported in this release", ErrorCode.INVALID_MESSAGE
        )
    transition_chunks = interaction.get("transition_chunks")
    if transition_chunks is not None:
        if (
            isinstance(transition_chunks, bool)
            or not isinstance(transition_chunks, (int, float))
            or (isinstance(transition_chunks, float) and not transition_chunks.is_integer())
        ):
            raise RealtimeVideoError(
                "session.interaction transition_chunks must be an integer", ErrorCode.INVALID_MESSAGE
            )
        transition_chunks = int(transition_chunks)
        if transition_chunks < 0:
            raise RealtimeVideoError("session.interaction transition_chunks must be >= 0", ErrorCode.INVALID_MESSAGE)

    switch = prompt_switch(model_card)
    if has_prompt and switch is None:
        # vLLM-Omni refuses a prompt for a pipeline without a prompt handler ("Failed to apply interaction").
        raise RealtimeVideoError(
            f"this model ({model_card.get('name')}) reads no prompt: a prompt change cannot be applied",
            "interaction_failed",
            event_id=event_id,
        )
    blend = DEFAULT_PROMPT_TRANSITION_CHUNKS if transition_chunks is None else transition_chunks
    controls: dict[str, Any] | None = None
    move = CameraMove({})
    if isinstance(mm, dict) and mm:  # has_mm, spelled so the type checker sees a dict
        unknown = sorted(set(mm) - {"camera"})
        if unknown:
            raise RealtimeVideoError(
                f"this model takes no {unknown} interaction (only camera)", "interaction_failed", event_id=event_id
            )
        try:
            move = camera_move(mm["camera"], model_card, transition_chunks)
        except ValueError as exc:
            raise RealtimeVideoError(str(exc), "interaction_failed", event_id=event_id) from None
        controls = move.controls
    if native is not None:
        # ARStream's addition: the model's own controls, as protocol 1's `input` carries them (they win).
        if not isinstance(native, dict):
            raise RealtimeVideoError("event.controls must be an object", ErrorCode.INVALID_CONTROLS, event_id=event_id)
        controls = {**(controls or {}), **native}
    return Interaction(
        event_id,
        prompt if has_prompt else None,
        controls,
        transition_chunks,
        hold_chunks=move.hold_chunks,
        release=move.release,
        prompt_transition_chunks=blend if switch == "blend" else 0,
    )
