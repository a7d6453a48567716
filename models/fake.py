"""FakeKVPipeline: a deterministic test pipeline whose frames depend on the KV it reads.

Each committed frame writes K = V = a code for (absolute frame position,
controls) into the pool. Every output frame is computed from the values it
gathers back, so a wrong block id, a leaked scratch block or a bad eviction
shows up as a wrong pixel value that a test can predict from a dense
reference (:func:`expected_frame_value`).

It also serves integration tests of the server: controls ``{"fail": true}``
raise inside the forward, and ``compute_delay_s`` simulates a slow model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from runner.binding import SessionStateBinding
from runner.spec import KVCacheSpec
from runner.types import TickRequest

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
    """Implements the ARPipeline contract with a few KB of KV per session."""

    def __init__(
        self,
        *,
        sink_frames: int = 1,
        window_frames: int = 4,
        frames_per_chunk: int = 2,
        session_capacity: int = 64,
        width: int = 8,
        height: int = 8,
        compute_delay_s: float = 0.0,
        denoise_passes: int = 1,
    ) -> None:
        super().__init__()
        self.spec = KVCacheSpec(
            num_layers=2,
            num_kv_heads=1,
            head_size=4,
            tokens_per_frame=2,
            frames_per_chunk=frames_per_chunk,
            sink_frames=sink_frames,
            window_frames=window_frames,
            session_capacity=session_capacity,
        )
        self.width = width
        self.height = height
        self.compute_delay_s = compute_delay_s
        self.denoise_passes = denoise_passes
        self.sessions: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str]] = []

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.spec

    def model_card(self) -> dict[str, Any]:
        return {
            "name": "fake-kv",
            "width": self.width,
            "height": self.height,
            "fps": 16,
            "frames_per_chunk": self.spec.frames_per_chunk,
            "controls": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": {
                    "keys": {"type": "array", "items": {"enum": list(KEYS)}, "uniqueItems": True, "maxItems": 4},
                    "fail": {"type": "boolean"},
                },
                "additionalProperties": False,
            },
        }

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        state = self.bound_state(tick.session_id)
        self.sessions.setdefault(tick.session_id, {"seed": tick.seed})
        spec = self.spec
        tokens = spec.frames_per_chunk * spec.tokens_per_frame
        for _ in range(self.denoise_passes):
            # Scratch gets a poison value: if it ever leaked into history the frames would be off.
            state.begin_pass(commit=False)
            poison = torch.full((tokens, 1, spec.head_size), SCRATCH_POISON)
            for layer in range(spec.num_layers):
                state.write_and_gather(layer, poison, poison)
            state.end_pass()
        if self.compute_delay_s:
            time.sleep(self.compute_delay_s)
        if tick.controls.get("fail"):
            raise FakeForwardError(f"fake pipeline asked to fail on session {tick.session_id}")
        state.begin_pass(commit=True)
        codes = [frame_code(state.frame_start + i, tick.controls) for i in range(spec.frames_per_chunk)]
        kv = torch.tensor(codes).repeat_interleave(spec.tokens_per_frame)[:, None, None].expand(-1, 1, spec.head_size)
        values: list[int] = []
        for layer in range(spec.num_layers):
            _k, v_all = state.write_and_gather(layer, kv.clone(), kv.clone())
            per_frame = v_all[:, 0, 0].reshape(-1, spec.tokens_per_frame)[:, 0].tolist()
            history = per_frame[: len(per_frame) - spec.frames_per_chunk]
            if layer == spec.num_layers - 1:
                # Frame i sees the history plus the chunk's frames up to and including itself.
                values = [expected_frame_value(history + codes[: i + 1]) for i in range(spec.frames_per_chunk)]
        state.end_pass()
        frames = np.zeros((spec.frames_per_chunk, self.height, self.width, 3), dtype=np.uint8)
        for i, value in enumerate(values):
            frames[i, :, :, 0] = value
            frames[i, :, :, 1] = (state.frame_start - spec.frames_per_chunk + i) % 256
            frames[i, :, :, 2] = controls_code(tick.controls)
        return frames

    def reset_session(self, session_id: str) -> None:
        self.events.append(("reset", session_id))
        self.sessions.pop(session_id, None)

    def close_session(self, session_id: str) -> None:
        self.events.append(("close", session_id))
        self.sessions.pop(session_id, None)

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        return [TickRequest(session_id=session_id, request_id=i) for i in range(3)]
