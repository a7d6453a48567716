"""WaypointPipeline: Waypoint on the runner's contract (one latent frame and one control input per chunk).

A chunk is the published engine's ``gen_frame`` (``world_engine`` commit
208c909824d906bf441122b7c40b9b4e1050d7c3): noise drawn for one latent frame,
the scheduler's sigmas walked with one non-committing pass each (Euler steps of
the predicted velocity), then one committing pass of the clean frame at sigma 0
that writes its K/V into the session's history, then the decode. The runner keeps
the local window's frames and, of the dilated global window, the frames on the
dilation's beat (a strided tail; no sink): each layer masks the kept frames it
does not see (:meth:`~arstream.models.waypoint.config.WaypointConfig.layer_window`),
by their absolute indexes.

A rollout's first chunk (a start, a ``reset``) is instead the published
``append_frame`` of the session's start image (:mod:`~arstream.models.waypoint.seed`):
its clean latent committed at frame 0, the picture shown; with no encoder
(``from_noise``) a rollout starts from noise.

Per session the pipeline keeps the noise generator (seeded from the session's
seed on its first chunk) and the last controls; both are exported with a
snapshot, a rewind point or a parked session. Waypoint-1's decoder is
stateless: one frame a chunk. Waypoint-1.5's (``taehv_ae``) makes
``temporal_compression`` frames of each latent frame, so a chunk carries four
frames made under one control input, and its stream state (TAEHV's memory) is
the session's too, exported with the rest
(:mod:`~arstream.models.waypoint.taehv_frames`).

Controls (the card's JSON Schema): ``buttons``, the ids of the buttons held
(any of the model's ``n_buttons``: keys and mouse buttons), ``mouse``, the
pointer's velocity ``[dx, dy]``, and ``scroll``, the wheel's sign. The card's
``inputs`` says which browser input drives each (keys by ``KeyboardEvent.code``,
pointer deltas, the wheel), so a client maps inputs from the card alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .config import WaypointConfig
from .decoder import Decoder, to_uint8
from .encoder import PictureEncoder
from .seed import SeedImages, append_seeds, choice_from, choice_json, default_pixels
from .taehv_frames import FramesDecoder
from .dit import WaypointDiT, rope_tables, rotate
from ..matrix_game.images import DEFAULT_NAME
from ..wan.components import component, held_as
from ...runner.binding import SessionStateBinding
from ...runner.contract import ModelState
from ...runner.kv_state import SessionKVState, write_and_gather_rows
from ...runner.snapshot import tensors_digest
from ...runner.spec import KVCacheSpec
from ...runner.types import StartImage, TickRequest

DEFAULT_SEED = 0
# Sessions whose start-image choice is remembered past a reset, close or eviction (the choice, not its encoding).
REMEMBERED_CHOICES_PER_SESSION_SLOT = 4
# The largest mouse velocity a control may carry (the published engine takes any float; a bound keeps
# a malformed client from feeding the embedding values it never saw).
MOUSE_LIMIT = 1000.0
# Control units per pixel of pointer movement: Overworld's own client (Biome) sends the movement in pixels times
# its default mouse sensitivity, 1.8, and its server sums it between generations: one movement per latent frame.
MOUSE_PER_PIXEL = 1.8

# Browser keys (KeyboardEvent.code) and mouse buttons -> the model's button ids: Windows virtual-key codes, as
# Overworld's own client (Biome's keymap) sends them: letters and digits their ASCII capitals, one code for either
# Shift (16) and either Ctrl (17), mouse buttons left 1, right 2, middle 4. Alt, Escape and Backspace, which that
# client does not send, take their virtual-key codes too.
_NAMED_KEYS = {
    "Space": 32, "Enter": 13, "Escape": 27, "Tab": 9, "Backspace": 8,
    "ShiftLeft": 16, "ShiftRight": 16, "ControlLeft": 17, "ControlRight": 17, "AltLeft": 18, "AltRight": 18,
    "ArrowLeft": 37, "ArrowUp": 38, "ArrowRight": 39, "ArrowDown": 40,
}


def key_codes(n_buttons: int) -> dict[str, int]:
    """The browser keys a model with ``n_buttons`` buttons reads, by ``KeyboardEvent.code``."""
    codes = dict(_NAMED_KEYS)
    codes.update({f"Key{chr(c)}": c for c in range(ord("A"), ord("Z") + 1)})
    codes.update({f"Digit{d}": ord(str(d)) for d in range(10)})
    return {name: code for name, code in codes.items() if code < n_buttons}


def mouse_buttons(n_buttons: int) -> dict[str, int]:
    """Mouse buttons (``MouseEvent.button``: 0 left, 1 middle, 2 right) -> button ids."""
    return {str(b): code for b, code in ((0, 1), (1, 4), (2, 2)) if code < n_buttons}


def controls_schema(cfg: WaypointConfig) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "buttons": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": cfg.n_buttons - 1},
                "uniqueItems": True,
                "maxItems": 16,
            },
            "mouse": {
                "type": "array",
                "items": {"type": "number", "minimum": -MOUSE_LIMIT, "maximum": MOUSE_LIMIT},
                "minItems": 2,
                "maxItems": 2,
            },
            "scroll": {"enum": [-1, 0, 1]},
        },
        "additionalProperties": False,
    }


def control_vector(controls: dict[str, Any], cfg: WaypointConfig) -> torch.Tensor:
    """``[mouse x, mouse y, buttons one-hot..., scroll sign]``: the published embedding's input order."""
    vector = torch.zeros(cfg.n_buttons + 3)
    mouse = controls.get("mouse", (0.0, 0.0))
    vector[0], vector[1] = float(mouse[0]), float(mouse[1])
    for button in controls.get("buttons", ()):
        vector[2 + int(button)] = 1.0
    vector[-1] = float(np.sign(controls.get("scroll", 0)))
    return vector


def visible_frames(frames: torch.Tensor, window: int, dilation: int) -> torch.Tensor:
    """Which of ``frames`` (absolute indexes ``[B, F]``, the last of each row the current frame) a layer with
    ``window`` frames and ``dilation`` attends to: the current frame, and those of the ``window - 1`` before it
    whose index is a multiple of ``dilation`` (the published ring cache keeps only those)."""
    current = frames[:, -1:]
    kept = (frames > current - window) & (frames % dilation == 0)
    return kept | (frames == current)


class PagedAttention:
    """:class:`~arstream.models.waypoint.dit.AttentionContext` over the runner's bound sessions (row ``i``)."""

    def __init__(self, states: Sequence[SessionKVState], cos: torch.Tensor, sin: torch.Tensor, cfg: WaypointConfig):
        self.states = list(states)
        tokens = cfg.tokens_per_frame
        positions = torch.tensor([s.frame_positions() for s in self.states], device=cos.device)  # [B, frames]
        index = (positions[:, :, None] * tokens + torch.arange(tokens, device=cos.device)).flatten(1)
        self.key_cos, self.key_sin = cos[index][:, None], sin[index][:, None]  # [B, 1, visible tokens, D/2]
        self.query_cos, self.query_sin = self.key_cos[:, :, -tokens:], self.key_sin[:, :, -tokens:]
        self.groups = cfg.n_heads // cfg.n_kv_heads
        # Each layer's mask over the gathered frames (absolute indexes: the dilation's phase), None where a layer
        # sees them all; [B, 1, 1, visible tokens] for SDPA.
        # Built on the CPU (no device round trip to find a mask that hides nothing).
        frames = torch.tensor([s.history_frame_indexes() for s in self.states])
        masks: dict[tuple[int, int], torch.Tensor | None] = {}
        for window, dilation in {cfg.layer_window(layer) for layer in range(cfg.n_layers)}:
            seen = visible_frames(frames, window, dilation)
            hides = not bool(seen.all())
            masks[window, dilation] = seen.repeat_interleave(tokens, 1)[:, None, None].to(cos.device) if hides else None
        self.masks = [masks[cfg.layer_window(layer)] for layer in range(cfg.n_layers)]

    def begin_pass(self, *, commit: bool) -> None:
        for state in self.states:
            state.begin_pass(commit=commit)

    def end_pass(self) -> None:
        for state in self.states:
            state.end_pass()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # K is stored unrotated: the gathered history is rotated with this chunk's positions
        k_all, v_all = write_and_gather_rows(self.states, layer, k.transpose(1, 2), v.transpose(1, 2))
        keys = rotate(k_all.transpose(1, 2), self.key_cos, self.key_sin)
        values = v_all.transpose(1, 2)
        if self.groups > 1:
            keys, values = keys.repeat_interleave(self.groups, 1), values.repeat_interleave(self.groups, 1)
        query = rotate(q, self.query_cos, self.query_sin)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=self.masks[layer])


def denoise_frame(
    model: WaypointDiT, ctx: Any, noise: torch.Tensor, controls: torch.Tensor, sigmas: Sequence[float]
) -> torch.Tensor:
    """The published ``gen_frame`` less the decode: Euler steps over ``sigmas``, then the committing pass."""
    x = noise
    batch = x.shape[0]
    for sigma, next_sigma in zip(sigmas[:-1], sigmas[1:]):
        ctx.begin_pass(commit=False)
        velocity = model(x, x.new_full((batch,), sigma), controls, ctx)
        ctx.end_pass()
        x = x + (next_sigma - sigma) * velocity
    ctx.begin_pass(commit=True)
    model(x, x.new_zeros(batch), controls, ctx)
    ctx.end_pass()
    return x


@dataclass
class _Session:
    generator: torch.Generator
    controls: dict[str, Any]
    decoder_state: list[torch.Tensor] | None = None  # TAEHV's stream memory (Waypoint-1.5); None before a frame


class WaypointPipeline(SessionStateBinding):
    """Implements ``ARPipeline``, ``SupportsBatchedChunks``, ``SupportsWarmup`` and ``SupportsSessionTransfer``."""

    weights: str | None = None  # the DiT's quantized weights (the loader's ``weights`` option), None: in its dtype

    def __init__(
        self, model: WaypointDiT, decoder: Decoder | FramesDecoder, device: torch.device, *, name: str = "waypoint-1.5",
        session_capacity: int = 64, random_weights: bool = False, encoder: PictureEncoder | None = None,
        start_images: dict[str, np.ndarray] | None = None, image_cache: int = 4,
    ) -> None:
        """With ``encoder`` a rollout starts from a start image (:mod:`.seed`): ``start_images`` by name, uint8
        ``[H, W, 3]`` at the frame's size, the default first (None: the built-in picture). Without, from noise."""
        super().__init__()
        self.cfg: WaypointConfig = model.cfg
        self.random_weights = random_weights
        self.model = model.to(device).eval()
        self.decoder = decoder.to(device).eval()
        self.device = device
        self.name = name
        self.session_capacity = session_capacity
        self.dtype = next(model.parameters()).dtype
        cos, sin = rope_tables(self.cfg)
        self.cos, self.sin = cos.to(device), sin.to(device)
        self._sessions: dict[str, _Session] = {}
        self._digest: str | None = None
        self.decoder_state_bytes = 0
        if isinstance(self.decoder, FramesDecoder):
            self.decoder_state_bytes = self.decoder.state_bytes(self.cfg.latent_shape, self.dtype)
        self.last_latents: dict[str, torch.Tensor] = {}  # each session's last clean latent (tests compare them)
        self.encoder = None if encoder is None else encoder.to(device).eval()
        self.seeds: SeedImages | None = None
        if self.encoder is not None:
            pictures = start_images or {DEFAULT_NAME: default_pixels(self.cfg.image_height, self.cfg.image_width)}
            size = (self.cfg.image_height, self.cfg.image_width)
            self.seeds = SeedImages(
                pictures, self._encode_seed, self.cfg.temporal_compression, size, capacity=image_cache
            )
        # each session's start-image choice, kept past reset and eviction (bounded: ids of closed sessions age out)
        self._choices: OrderedDict[str, StartImage | None] = OrderedDict()

    # ---- contract -------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.cfg
        # the local window dense, the dilated global window's frames on its beat behind it
        dense, strided, stride = cfg.kept_windows
        return KVCacheSpec(
            num_layers=cfg.n_layers,
            num_kv_heads=cfg.n_kv_heads,
            head_size=cfg.head_size,
            tokens_per_frame=cfg.tokens_per_frame,
            frames_per_chunk=1,
            sink_frames=0,
            window_frames=dense,
            strided_window_frames=strided,
            frame_stride=stride,
            session_capacity=self.session_capacity,
            dtype=self.dtype,
            max_position_frames=cfg.n_frames,
            model_owned_bytes_per_session=self.decoder_state_bytes,
        )

    def model_card(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "name": self.name,
            "width": cfg.image_width,
            "height": cfg.image_height,
            "fps": cfg.fps,
            "frames_per_chunk": cfg.temporal_compression,
            "reads_prompt": False,
            "description": "Overworld's Waypoint: a world you walk with any key and look around with the mouse",
            "controls": controls_schema(cfg),
            "inputs": {
                "buttons": {"kind": "keys", "codes": key_codes(cfg.n_buttons),
                            "mouse_buttons": mouse_buttons(cfg.n_buttons)},
                "mouse": {"kind": "pointer_delta", "per_pixel": MOUSE_PER_PIXEL},
                "scroll": {"kind": "wheel_sign"},
            },
            **({"weights": "random"} if self.random_weights else {}),
            # offered by name (the first is the default); a model that lists any also takes a client's own pixels
            **({"start_images": self.seeds.names} if self.seeds is not None else {}),
            "components": [
                component("dit", self.model, self.device, held_as(self.dtype, self.weights)),
                component("decoder", self.decoder, self.device, held_as(self.dtype)),
                *([component("encoder", self.encoder, self.device, held_as(self.dtype))]
                  if self.encoder is not None else []),
            ],
        }

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        return self.generate_chunks([tick])[0]

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        states = [self.bound_state(t.session_id) for t in ticks]
        sessions = [self._session(tick, state) for tick, state in zip(ticks, states, strict=True)]
        # a rollout's first chunk appends its start image (:mod:`.seed`); the others generate a frame
        seeding = [self.seeds is not None and state.chunk_index == 0 for state in states]
        rewind = [s.generator.get_state() for s in sessions]
        frames: list[np.ndarray] = [np.empty(0)] * len(ticks)
        latents: list[torch.Tensor | None] = [None] * len(ticks)
        decoder_states: list[list[torch.Tensor] | None] = [None] * len(ticks)
        try:
            with torch.inference_mode():
                seeded = [row for row, first in enumerate(seeding) if first]
                if seeded:
                    for row, (latent, shown) in zip(seeded, self._append_seeds(
                            [ticks[r] for r in seeded], [states[r] for r in seeded]), strict=True):
                        latents[row], frames[row] = latent, shown
                generated = [row for row, first in enumerate(seeding) if not first]
                if generated:
                    made = self._generate([ticks[r] for r in generated], [states[r] for r in generated],
                                          [sessions[r] for r in generated])
                    for row, (latent, shown, streamed) in zip(generated, made, strict=True):
                        latents[row], frames[row], decoder_states[row] = latent, shown, streamed
        except BaseException:
            for session, saved in zip(sessions, rewind, strict=True):
                session.generator.set_state(saved)
            raise
        for row, (tick, session) in enumerate(zip(ticks, sessions, strict=True)):
            session.controls = {} if seeding[row] else dict(tick.controls)
            session.decoder_state = decoder_states[row]
            self._sessions[tick.session_id] = session
            clean = latents[row]
            assert clean is not None
            self.last_latents[tick.session_id] = clean.clone()
            if self.seeds is not None and seeding[row]:
                self._remember(tick)
        return frames

    def _session(self, tick: TickRequest, state: SessionKVState) -> _Session:
        session = self._sessions.get(tick.session_id)
        if session is None or state.chunk_index == 0:
            seed = DEFAULT_SEED if tick.seed is None else int(tick.seed)
            session = _Session(torch.Generator().manual_seed(seed), {})
        return session

    def _generate(
        self, ticks: Sequence[TickRequest], states: Sequence[SessionKVState], sessions: Sequence[_Session]
    ) -> list[tuple[torch.Tensor, np.ndarray, list[torch.Tensor] | None]]:
        """The published ``gen_frame`` for each row: its clean latent, its frames and its decoder's new state."""
        # drawn on the CPU, one generator per session: the same noise on any device and in any batch
        noise = torch.stack([torch.randn(self.cfg.latent_shape, generator=s.generator) for s in sessions])
        controls = torch.stack([control_vector(t.controls, self.cfg) for t in ticks])
        ctx = PagedAttention(states, self.cos, self.sin, self.cfg)
        latents = denoise_frame(
            self.model, ctx, noise.to(self.device, self.dtype), controls.to(self.device, self.dtype),
            self.cfg.scheduler_sigmas,
        )
        decoder_dtype = next(self.decoder.parameters()).dtype
        if isinstance(self.decoder, FramesDecoder):
            videos, streamed = self.decoder.decode_frames(
                latents.to(decoder_dtype), [s.decoder_state for s in sessions]
            )
            decoder_states: list[list[torch.Tensor] | None] = list(streamed)
            frames = videos.cpu().numpy()
        else:
            frames = to_uint8(self.decoder(latents.to(decoder_dtype))).cpu().numpy()[:, None]
            decoder_states = [None] * len(sessions)
        return [(latents[row], np.ascontiguousarray(frames[row]), decoder_states[row]) for row in range(len(ticks))]

    # ---- start images (:mod:`.seed`) ----------------------------------------------------

    def _encode_seed(self, pixels: np.ndarray) -> torch.Tensor:
        assert self.encoder is not None
        return self.encoder.encode(pixels).to(self.dtype)

    def _choice(self, tick: TickRequest) -> StartImage | None:
        """The tick's start image; a tick without one keeps the session's earlier choice (None: the default)."""
        return tick.start_image if tick.start_image is not None else self._choices.get(tick.session_id)

    def _remember(self, tick: TickRequest) -> None:
        self._choices[tick.session_id] = self._choice(tick)
        self._choices.move_to_end(tick.session_id)
        while len(self._choices) > REMEMBERED_CHOICES_PER_SESSION_SLOT * self.session_capacity:
            self._choices.popitem(last=False)

    def _append_seeds(
        self, ticks: Sequence[TickRequest], states: Sequence[SessionKVState]
    ) -> list[tuple[torch.Tensor, np.ndarray]]:
        """The published ``append_frame`` for each row (a rollout's first chunk): its seed latent and its frames."""
        assert self.seeds is not None
        seeds = [self.seeds.resolve(self._choice(t)) for t in ticks]  # a bad choice fails this tick only
        latents = torch.stack([s.latent for s in seeds]).to(self.device, self.dtype)
        no_controls = torch.stack([control_vector({}, self.cfg) for _ in ticks]).to(self.device, self.dtype)
        append_seeds(self.model, PagedAttention(states, self.cos, self.sin, self.cfg), latents, no_controls)
        return [(latents[row], s.frames.copy()) for row, s in enumerate(seeds)]  # the cached seed stays unchanged

    def reset_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self.last_latents.pop(session_id, None)

    def close_session(self, session_id: str) -> None:
        self.reset_session(session_id)

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        moves: tuple[dict[str, Any], ...] = ({}, {"buttons": [min(87, self.cfg.n_buttons - 1)], "mouse": [0.5, 0.0]})
        return [TickRequest(session_id=session_id, request_id=i, controls=c) for i, c in enumerate(moves)]

    # ---- moving a session (SupportsSessionTransfer) -----------------------------------------

    def transfer_fingerprint(self) -> dict[str, Any]:
        if self._digest is None:  # once: the weights never change while serving
            named = {f"dit.{k}": v for k, v in self.model.state_dict().items()}
            named.update({f"decoder.{k}": v for k, v in self.decoder.state_dict().items()})
            if self.encoder is not None and self.seeds is not None:  # what a moved session's reset starts from
                named.update({f"encoder.{k}": v for k, v in self.encoder.state_dict().items()})
                named.update({f"start_images.{k}": v for k, v in self.seeds.offered_latents().items()})
            self._digest = tensors_digest(named)
        return {"config": self.cfg.to_dict(), "weights_sha256": self._digest}

    def export_session_state(self, session_id: str) -> ModelState:
        """The noise generator, the last controls, the decoder's stream state (Waypoint-1.5's TAEHV) and the start
        image (a peer encodes it again, or has it: an offered name, as it would at a reset)."""
        session = self._sessions.get(session_id)
        if session is None:
            return ModelState({"session": None})
        tensors = {"generator": session.generator.get_state()}
        decoder = session.decoder_state or []
        tensors.update({f"decoder/{i}": entry for i, entry in enumerate(decoder)})
        choice = self._choices.get(session_id)
        if choice is not None and choice.pixels is not None:
            tensors["image/pixels"] = torch.from_numpy(np.array(choice.pixels))  # a writable copy
        values = {"controls": session.controls, "decoder_entries": len(decoder), "image": choice_json(choice)}
        return ModelState({"session": values}, tensors)

    def import_session_state(self, session_id: str, state: ModelState) -> None:
        values = state.json.get("session")
        if values is None:
            self._sessions.pop(session_id, None)
            return
        generator = torch.Generator()
        generator.set_state(state.tensors["generator"])
        entries = int(values.get("decoder_entries", 0))
        decoder = [state.tensors[f"decoder/{i}"].to(self.device) for i in range(entries)] or None
        self._sessions[session_id] = _Session(generator, dict(values["controls"]), decoder)
        choice = choice_from(values.get("image"), state.tensors.get("image/pixels"))
        if choice is not None:
            self._choices[session_id] = choice
            self._choices.move_to_end(session_id)

    def session_ids(self) -> list[str]:
        return list(self._sessions)
