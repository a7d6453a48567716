"""FakeKVPipeline: a deterministic test pipeline whose frames depend on the KV it reads.

Each committed frame writes K = V = a code for (absolute frame position,
controls) into the pool. Every output frame is computed from the values it
gathers back, so a wrong block id, a leaked scratch block or a bad eviction
shows up as a wrong pixel value that a test can predict from a dense
reference (:func:`expected_frame_value`).

It also serves integration tests of the server: controls ``{"fail": true}``
raise inside the forward, and ``compute_delay_s`` simulates a slow model.
With ``start_images`` its card offers those names, and ``start_images_seen``
records the start image every tick carried (session id, StartImage or None).
It batches sessions (``generate_chunks``): one forward runs every row's passes,
and a row asking to fail fails the whole batched forward, as a real model's
error would; the runner then retries each session alone.

With ``reads_prompt`` it blends prompt changes (card ``prompt_switch:
"blend"``, :class:`~arstream.runner.prompt_blend.PromptBlend`) and records,
in ``prompt_weights_seen``, the prompts and weights each chunk was
conditioned on (session id, chunk index, weights): what a real model's
embedding mix would be.

It splits its forward from its decode (``SupportsSplitDecode``): the forward
makes the frames' values, the decode (``decode_delay_s``, a sleep that holds
no GIL, like a GPU kernel's wait) hands them over and counts, per session,
the chunks decoded: its decoder state, which must follow the chunks in order.
Controls ``{"fail_decode": true}`` raise in that chunk's decode.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..runner.binding import SessionStateBinding
from ..runner.contract import ModelState
from ..runner.decode_states import DecoderStates
from ..runner.kv_state import write_and_gather_rows
from ..runner.prompt_blend import PromptBlend, Weights
from ..runner.spec import KVCacheSpec
from ..runner.types import PendingDecode, StartImage, TickRequest

KEYS = ("w", "a", "s", "d")
SCRATCH_POISON = -1.0e6


class FakeForwardError(RuntimeError):
    """Raised on purpose when a tick's controls ask the fake to fail."""


def controls_code(controls: dict[str, Any]) -> int:
    """A small integer for a set of held keys (bit per key)."""
    keys = controls.get("keys", [])
    return sum(1 << KEYS.index(k) for k in set(keys) if k in KEYS)


def frame_code(position: int, controls: dict[str, Any]) -> float:
    return float(position + 1 + 16 * controls_code(controls))


def expected_frame_value(visible_codes: list[float]) -> int:
    """The pixel value the fake emits for a frame that saw ``visible_codes``."""
    return int(round(sum(visible_codes))) % 251


class FakeKVPipeline(SessionStateBinding):
    """Implements ARPipeline and SupportsBatchedChunks with a few KB of KV per session."""

    def __init__(
        self,
        *,
        sink_frames: int = 1,
        window_frames: int = 6,
        frames_per_chunk: int = 2,
        session_capacity: int = 64,
        width: int = 8,
        height: int = 8,
        compute_delay_s: float = 0.0,
        decode_delay_s: float = 0.0,
        denoise_passes: int = 1,
        reads_prompt: bool = False,
        start_images: Sequence[str] = (),
        head_size: int = 4,
        strided_window_frames: int = 0,
        frame_stride: int = 1,
    ) -> None:
        super().__init__()
        # ``head_size`` makes a session's KV as large as a test or bench needs (a streamed move's memory bound);
        # ``strided_window_frames`` and ``frame_stride`` declare a strided tail (its frames' codes add to the pixels).
        self.spec = KVCacheSpec(
            num_layers=2,
            num_kv_heads=1,
            head_size=head_size,
            tokens_per_frame=2,
            frames_per_chunk=frames_per_chunk,
            sink_frames=sink_frames,
            window_frames=window_frames,
            session_capacity=session_capacity,
            strided_window_frames=strided_window_frames,
            frame_stride=frame_stride,
        )
        self.width = width
        self.height = height
        self.compute_delay_s = compute_delay_s
        self.decode_delay_s = decode_delay_s
        # chunks decoded per session: the decoder state a split decode keeps in order
        self.decoder_states: DecoderStates[int] = DecoderStates()
        self.denoise_passes = denoise_passes
        # The fake's pixels ignore prompts; with ``reads_prompt`` it blends them and records each chunk's weights.
        self.reads_prompt = reads_prompt
        self.prompt_weights_seen: list[tuple[str, int, Weights]] = []
        # Start image names the card offers; the fake only records what each tick carries.
        self.start_images = tuple(start_images)
        self.start_images_seen: list[tuple[str, StartImage | None]] = []
        self.sessions: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str]] = []

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.spec

    def model_card(self) -> dict[str, Any]:
        card = {
            "name": "fake-kv",
            "width": self.width,
            "height": self.height,
            "fps": 16,
            "frames_per_chunk": self.spec.frames_per_chunk,
            "reads_prompt": self.reads_prompt,
            **({"prompt_switch": "blend"} if self.reads_prompt else {}),
            "controls": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": {
                    "keys": {"type": "array", "items": {"enum": list(KEYS)}, "uniqueItems": True, "maxItems": 4},
                    "fail": {"type": "boolean"},
                    "fail_decode": {"type": "boolean"},
                },
                "additionalProperties": False,
            },
        }
        if self.start_images:
            card["start_images"] = list(self.start_images)
        return card

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        return self._decode(self._forward([tick]))[0]

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        """The batched forward: every pass runs all rows, row ``i`` on ``ticks[i]``'s session KV."""
        return self._decode(self._forward(ticks))

    def generate_latents(self, ticks: Sequence[TickRequest]) -> list[PendingDecode]:
        chunks = self._forward(ticks)
        for chunk in chunks:
            self.decoder_states.begin(chunk.session_id, chunk.chunk_index)
        return chunks

    def decode_latents(self, chunks: Sequence[PendingDecode]) -> list[np.ndarray]:
        """:meth:`_decode`, each session's chunks in order (counted in its decoder state)."""
        decoded = [self.decoder_states.before(c.session_id, c.chunk_index) or 0 for c in chunks]
        frames = self._decode(chunks)  # a failure stores nothing: the runner may retry each chunk alone
        for c, count in zip(chunks, decoded):
            self.decoder_states.finish(c.session_id, c.chunk_index, count + 1)
        return frames

    def _decode(self, chunks: Sequence[PendingDecode]) -> list[np.ndarray]:
        """Wait ``decode_delay_s`` and hand the frames over, or fail where a tick asked to."""
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)
        failing = [c.session_id for c in chunks if c.payload[1]]
        if failing:
            raise FakeForwardError(f"fake pipeline asked to fail the decode of session(s) {', '.join(failing)}")
        return [c.payload[0] for c in chunks]

    def _forward(self, ticks: Sequence[TickRequest]) -> list[PendingDecode]:
        states = [self.bound_state(t.session_id) for t in ticks]
        self.start_images_seen.extend((t.session_id, t.start_image) for t in ticks)
        spec = self.spec
        rows, fpc, tpf = len(ticks), spec.frames_per_chunk, spec.tokens_per_frame
        for _ in range(self.denoise_passes):
            # Scratch gets a poison value: if it ever leaked into history the frames would be off.
            for state in states:
                state.begin_pass(commit=False)
            poison = torch.full((rows, fpc * tpf, 1, spec.head_size), SCRATCH_POISON)
            for layer in range(spec.num_layers):
                write_and_gather_rows(states, layer, poison, poison)
            for state in states:
                state.end_pass()
        if self.compute_delay_s:
            time.sleep(self.compute_delay_s)
        failing = [t.session_id for t in ticks if t.controls.get("fail")]
        if failing:
            raise FakeForwardError(f"fake pipeline asked to fail on session(s) {', '.join(failing)}")
        frame_starts = [state.frame_start for state in states]
        chunk_indices = [state.chunk_index for state in states]
        codes = [[frame_code(start + i, t.controls) for i in range(fpc)] for start, t in zip(frame_starts, ticks)]
        kv = torch.tensor(codes).repeat_interleave(tpf, dim=1)[:, :, None, None].expand(-1, -1, 1, spec.head_size)
        for state in states:
            state.begin_pass(commit=True)
        values: list[list[int]] = []
        for layer in range(spec.num_layers):
            _k, v_all = write_and_gather_rows(states, layer, kv.clone(), kv.clone())
            per_frame = v_all[:, :, 0, 0].reshape(rows, -1, tpf)[:, :, 0].tolist()
            if layer == spec.num_layers - 1:
                # Frame i sees the history plus the chunk's frames up to and including itself.
                values = [
                    [expected_frame_value(seen[: len(seen) - fpc] + row_codes[: i + 1]) for i in range(fpc)]
                    for seen, row_codes in zip(per_frame, codes)
                ]
        for state in states:
            state.end_pass()
        for tick, index in zip(ticks, chunk_indices):  # model-owned state changes only once the forward went through
            session = self.sessions.setdefault(tick.session_id, {"seed": tick.seed})
            if self.reads_prompt:
                self._blend_prompt(session, tick, index)
        chunks = []
        for start, row_values, tick in zip(frame_starts, values, ticks):
            frames = np.zeros((fpc, self.height, self.width, 3), dtype=np.uint8)
            for i, value in enumerate(row_values):
                frames[i, :, :, 0] = value
                frames[i, :, :, 1] = (start + i) % 256
                frames[i, :, :, 2] = controls_code(tick.controls)
            chunks.append(frames)
        return [
            PendingDecode(t.session_id, index, (frames, bool(t.controls.get("fail_decode"))))
            for t, index, frames in zip(ticks, chunk_indices, chunks)
        ]

    def _blend_prompt(self, session: dict[str, Any], tick: TickRequest, chunk_index: int) -> None:
        prompt = tick.prompt or ""
        held = session.get("prompt_blend")
        blend = (
            PromptBlend.holding(prompt)
            if held is None
            else PromptBlend.from_json(held).next_chunk(prompt, tick.prompt_transition_chunks)
        )
        session["prompt_blend"] = blend.to_json()
        self.prompt_weights_seen.append((tick.session_id, chunk_index, blend.weights()))

    def reset_session(self, session_id: str) -> None:
        self.events.append(("reset", session_id))
        self.sessions.pop(session_id, None)
        self.decoder_states.drop(session_id)

    def close_session(self, session_id: str) -> None:
        self.events.append(("close", session_id))
        self.sessions.pop(session_id, None)
        self.decoder_states.drop(session_id)

    # ---- moving a session (SupportsSessionTransfer) -----------------------------------------

    def transfer_fingerprint(self) -> dict[str, Any]:
        return {"fake-kv": 1}

    def export_session_state(self, session_id: str) -> ModelState:
        return self.export_forward_state(session_id).merge(self.export_decoder_state(session_id))

    def export_forward_state(self, session_id: str) -> ModelState:
        session = self.sessions.get(session_id)
        return ModelState({"session": None if session is None else dict(session)})

    def export_decoder_state(self, session_id: str, chunks: int | None = None) -> ModelState:
        # a whole chunk's: waits for a decode in flight
        return ModelState({"decoded": self.decoder_states.settled(session_id, chunks)})

    def decode_in_flight(self, session_id: str) -> bool:
        return self.decoder_states.in_flight(session_id)

    def forget_decodes(self, chunks: Sequence[PendingDecode]) -> None:
        for chunk in chunks:
            self.decoder_states.drop(chunk.session_id)

    def import_session_state(self, session_id: str, state: ModelState) -> None:
        session = state.json.get("session")
        if session is not None:
            self.sessions[session_id] = dict(session)
        self.decoder_states.drop(session_id)
        decoded = state.json.get("decoded")
        if decoded is not None:
            self.decoder_states.store(session_id, int(decoded[0]) - 1, int(decoded[1]))

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        return [TickRequest(session_id=session_id, request_id=i) for i in range(3)]
