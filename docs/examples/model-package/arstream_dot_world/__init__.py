"""dot-world: the smallest real ARStream model, kept out of ARStream's tree (docs/models.md, "Bring your own model").

A dot moves with W/A/S/D. Each frame's K and V hold the dot's position; the next chunk reads
the positions back from the runner's paged KV (sink frame + sliding window) and draws them as a
trail, so what the picture shows is exactly what the runner kept for this session.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from arstream.runner import KVCacheSpec, TickRequest, write_and_gather_rows
from arstream.runner.binding import SessionStateBinding

SIZE = 32
STEP = {"w": (0, -1), "s": (0, 1), "a": (-1, 0), "d": (1, 0)}


def load(device: torch.device, **options: Any) -> DotWorld:
    """The entry point: ``arstream serve --model dot-world --model-options '{"window_frames": 8}'``."""
    return DotWorld(**options)


class DotWorld(SessionStateBinding):
    """An :class:`arstream.runner.ARPipeline`: spec, card, one forward per chunk, reset and close."""

    def __init__(self, *, window_frames: int = 12, session_capacity: int = 16) -> None:
        super().__init__()
        self.spec = KVCacheSpec(
            num_layers=1, num_kv_heads=1, head_size=2, tokens_per_frame=1, frames_per_chunk=2,
            sink_frames=1, window_frames=window_frames, session_capacity=session_capacity,
        )

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.spec

    def model_card(self) -> dict[str, Any]:
        return {
            "name": "dot-world", "width": SIZE, "height": SIZE, "fps": 16, "frames_per_chunk": 2,
            "description": "a dot that leaves a trail as you move it",
            "controls": {
                "type": "object",
                "properties": {"keys": {"type": "array", "items": {"enum": list(STEP)}, "uniqueItems": True}},
                "additionalProperties": False,
            },
        }

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        state = self.bound_state(tick.session_id)
        chunk = self.spec.frames_per_chunk
        # A pass that does not commit (a real model's denoising step): its K/V go to scratch and the
        # gather returns what the runner kept, the sink and window frames' positions, then this chunk's.
        state.begin_pass(commit=False)
        draft = torch.zeros(1, chunk, 1, 2)
        _, seen = write_and_gather_rows([state], 0, draft, draft)
        state.end_pass()
        trail = seen[0, :-chunk, 0].round().long().tolist()
        x, y = trail[-1] if trail else (SIZE // 2, SIZE // 2)
        dx = sum(STEP[k][0] for k in tick.controls.get("keys", []))
        dy = sum(STEP[k][1] for k in tick.controls.get("keys", []))
        positions = []
        for _ in range(chunk):
            x, y = (x + dx) % SIZE, (y + dy) % SIZE
            positions.append((x, y))
        # The committing pass stores this chunk's positions as its frames' K and V.
        new = torch.tensor(positions, dtype=torch.float32)[None, :, None, :]
        state.begin_pass(commit=True)
        write_and_gather_rows([state], 0, new, new)
        state.end_pass()
        frames = np.zeros((len(positions), SIZE, SIZE, 3), dtype=np.uint8)
        for i, (px, py) in enumerate(positions):
            for tx, ty in trail + positions[:i]:
                frames[i, ty, tx] = (40, 90, 160)
            frames[i, py, px] = (255, 220, 80)
        return frames

    def reset_session(self, session_id: str) -> None:
        pass  # all of this model's state is in the runner's KV, which the runner releases

    def close_session(self, session_id: str) -> None:
        pass
