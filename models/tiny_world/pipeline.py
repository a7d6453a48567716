"""TinyWorldPipeline: the shipped tiny-world model behind the runner's pipeline contract.

The runner owns the KV memory: each chunk's passes read and write the bound
:class:`~arstream.runner.kv_state.SessionKVState`. The pipeline owns only the weights
and, per session, the noise generator (seeded from the session's seed on the
first chunk of a rollout) and the controls: the last ones and the camera
position they add up to, which places the world-aligned canvas and the view
inside it. All of it is dropped on reset and close. Given the same seed and
controls, a session replays the same frames.

Sessions batch (``generate_chunks``): rows are sessions, each with its own
noise generator, frame positions, camera and KV history, so a batched chunk
is the chunk the session would get alone (up to float rounding). Model-owned
state changes only once the whole batched forward succeeded; on failure the
generators are rewound, as the runner's batching contract asks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from arstream.models.tiny_world.decoder import blank_previous
from arstream.models.tiny_world.model import TinyWorldConfig, TinyWorldDiT
from arstream.models.tiny_world.sampling import (
    ChunkKV,
    PagedKV,
    PagedKVRows,
    canvas_origin,
    crop_view,
    sample_chunk,
    to_uint8,
)
from arstream.models.tiny_world.weights import DEFAULT_WEIGHTS, WeightsError, load_model
from arstream.models.tiny_world.world import KEYS, direction_index, velocity
from arstream.runner.binding import SessionStateBinding
from arstream.runner.contract import ModelState
from arstream.runner.snapshot import weights_digest
from arstream.runner.spec import KVCacheSpec
from arstream.runner.types import TickRequest

DEFAULT_SEED = 0

CONTROLS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "keys": {"type": "array", "items": {"enum": list(KEYS)}, "uniqueItems": True, "maxItems": 4},
    },
    "additionalProperties": False,
}

__all__ = ["TinyWorldPipeline", "WeightsError", "load_tiny_world", "CONTROLS_SCHEMA"]


@dataclass
class _TinyWorldSession:
    """What the model keeps per session between chunks (the KV lives in the runner)."""

    generator: torch.Generator
    controls: dict[str, Any]
    # camera pixel position, the running sum of the controls' motion since the rollout began
    camera_x: int = 0
    camera_y: int = 0
    # the last decoded canvas and its corner cell (models with a frame decoder), for the next chunk's first frame
    last_canvas: torch.Tensor | None = None
    last_cell: tuple[int, int] | None = None


@dataclass(frozen=True)
class _ChunkPlan:
    """One session's inputs to a chunk, worked out before the forward and applied only after it."""

    session_id: str
    session: _TinyWorldSession
    controls: dict[str, Any]
    direction: int
    camera_x: int
    camera_y: int
    # per frame: the canvas corner's world cell and the view's pixel offset inside the canvas
    cells: tuple[tuple[int, int], ...]
    offsets: tuple[tuple[int, int], ...]


class TinyWorldPipeline(SessionStateBinding):
    """Implements ``ARPipeline`` and ``SupportsWarmup`` for a loaded :class:`TinyWorldDiT`."""

    def __init__(self, model: TinyWorldDiT, device: torch.device, *, session_capacity: int = 64) -> None:
        super().__init__()
        self.model = model.to(device).eval()
        self.cfg: TinyWorldConfig = model.cfg
        self.device = device
        self.session_capacity = session_capacity
        self._sessions: dict[str, _TinyWorldSession] = {}
        self._weights_digest: str | None = None

    # ---- contract -------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.cfg
        return KVCacheSpec(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_heads,
            head_size=cfg.head_size,
            tokens_per_frame=cfg.tokens_per_frame,
            frames_per_chunk=cfg.frames_per_chunk,
            sink_frames=cfg.sink_frames,
            window_frames=cfg.history_frames + cfg.frames_per_chunk,  # the runner's window counts the chunk
            session_capacity=self.session_capacity,
        )

    def model_card(self) -> dict[str, Any]:
        return {
            "name": "tiny-world",
            "width": self.cfg.image_size,
            "height": self.cfg.image_size,
            "fps": self.cfg.fps,
            "frames_per_chunk": self.cfg.frames_per_chunk,
            "reads_prompt": False,
            "description": "a top-down map seen through a camera that you move",
            "controls": CONTROLS_SCHEMA,
        }

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        return self._generate([tick], PagedKV(self.bound_state(tick.session_id)))[0]

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        """One forward for several bound sessions (equal history lengths); row ``i`` is ``ticks[i]``."""
        return self._generate(ticks, PagedKVRows([self.bound_state(t.session_id) for t in ticks]))

    def _plan(self, tick: TickRequest) -> _ChunkPlan:
        state = self.bound_state(tick.session_id)
        session = self._sessions.get(tick.session_id)
        if session is None or state.chunk_index == 0:
            seed = DEFAULT_SEED if tick.seed is None else int(tick.seed)
            session = _TinyWorldSession(generator=torch.Generator().manual_seed(seed), controls={})
        keys = tick.controls.get("keys", [])
        dx, dy = velocity(keys)
        x, y = session.camera_x, session.camera_y
        cells, offsets = [], []
        for _ in range(self.cfg.frames_per_chunk):
            x, y = x + dx, y + dy
            cell_x, cell_y, off_x, off_y = canvas_origin(x, y, self.cfg.patch_size)
            cells.append((cell_x, cell_y))
            offsets.append((off_x, off_y))
        return _ChunkPlan(
            tick.session_id, session, dict(tick.controls), direction_index(keys), x, y, tuple(cells), tuple(offsets)
        )

    def _generate(self, ticks: Sequence[TickRequest], kv: ChunkKV) -> list[np.ndarray]:
        plans = [self._plan(tick) for tick in ticks]
        generators = [plan.session.generator for plan in plans]
        rewind = [g.get_state() for g in generators]
        fpc = self.cfg.frames_per_chunk
        directions = torch.tensor([[plan.direction] * fpc for plan in plans], dtype=torch.long, device=self.device)
        cell_origins = torch.tensor([plan.cells for plan in plans], dtype=torch.long, device=self.device)
        previous = self._previous(plans) if self.cfg.decoder_channels else None
        try:
            with torch.inference_mode():
                canvases = sample_chunk(self.model, kv, directions, cell_origins, generators, previous)
            chunks = [self._views(canvases[row], plan) for row, plan in enumerate(plans)]
        except BaseException:
            for generator, state in zip(generators, rewind):
                generator.set_state(state)
            raise
        for row, plan in enumerate(plans):
            if self.cfg.decoder_channels:
                # a copy: a view would keep the whole batch's canvases alive as long as this session
                plan.session.last_canvas, plan.session.last_cell = canvases[row, -1].clone(), plan.cells[-1]
            plan.session.controls = plan.controls
            plan.session.camera_x, plan.session.camera_y = plan.camera_x, plan.camera_y
            self._sessions[plan.session_id] = plan.session
        return chunks

    def _previous(self, plans: Sequence[_ChunkPlan]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's last decoded canvas and its cell; a row starting a rollout gets none (a blank one)."""
        canvases, cells = [], []
        for plan in plans:
            session = plan.session
            if session.last_canvas is None or session.last_cell is None:
                first = torch.tensor([plan.cells[0]], dtype=torch.long, device=self.device)
                blank, far = blank_previous(first, self.cfg.canvas_size, self.cfg.patch_size)
                canvases.append(blank[0])
                cells.append(far[0])
            else:
                canvases.append(session.last_canvas)
                cells.append(torch.tensor(session.last_cell, dtype=torch.long, device=self.device))
        return torch.stack(canvases), torch.stack(cells)

    def _views(self, canvases: torch.Tensor, plan: _ChunkPlan) -> np.ndarray:
        """The camera's uint8 views ``[F, H, W, 3]`` cropped out of one row's canvases ``[F, C, C, 3]``."""
        size = self.cfg.image_size
        views = [crop_view(canvases[f], ox, oy, size) for f, (ox, oy) in enumerate(plan.offsets)]
        return to_uint8(torch.stack(views)).cpu().numpy()

    def reset_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def close_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        keys: tuple[list[str], ...] = ([], ["d"], ["w", "a"])
        return [TickRequest(session_id=session_id, request_id=i, controls={"keys": k}) for i, k in enumerate(keys)]

    # ---- moving a session (SupportsSessionTransfer) -----------------------------------------

    def transfer_fingerprint(self) -> dict[str, Any]:
        if self._weights_digest is None:  # computed once: the weights never change while serving
            self._weights_digest = weights_digest(self.model)
        return {"config": self.cfg.to_dict(), "weights_sha256": self._weights_digest}

    def export_session_state(self, session_id: str) -> ModelState:
        """Noise generator, controls, camera and the last decoded canvas: what the next chunk reads."""
        session = self._sessions.get(session_id)
        if session is None:
            return ModelState({"session": None})
        tensors = {"generator": session.generator.get_state()}
        if session.last_canvas is not None:
            tensors["last_canvas"] = session.last_canvas
        values = {
            "controls": session.controls,
            "camera": [session.camera_x, session.camera_y],
            "last_cell": None if session.last_cell is None else list(session.last_cell),
        }
        return ModelState({"session": values}, tensors)

    def import_session_state(self, session_id: str, state: ModelState) -> None:
        values = state.json.get("session")
        if values is None:
            return
        generator = torch.Generator()
        generator.set_state(state.tensors["generator"])
        canvas = state.tensors.get("last_canvas")
        cell = values["last_cell"]
        self._sessions[session_id] = _TinyWorldSession(
            generator=generator,
            controls=dict(values["controls"]),
            camera_x=int(values["camera"][0]),
            camera_y=int(values["camera"][1]),
            last_canvas=None if canvas is None else canvas.to(self.device),
            last_cell=None if cell is None else (int(cell[0]), int(cell[1])),
        )

    # ---- introspection ------------------------------------------------------------------

    def session_ids(self) -> list[str]:
        """Sessions with model-owned state (for tests of release on reset/close)."""
        return list(self._sessions)


def load_tiny_world(
    device: torch.device | str = "cpu",
    weights_path: str | Path | None = None,
    *,
    config_path: str | Path | None = None,
    session_capacity: int = 64,
    **options: Any,
) -> TinyWorldPipeline:
    """Load the shipped (or given) weights; raise :class:`WeightsError` naming the bad file.

    ``config_path`` defaults to ``config.json`` next to the weights.
    """
    if options:
        raise TypeError(f"load_tiny_world got unknown options {sorted(options)}; expected config_path, session_capacity")
    path = Path(weights_path) if weights_path is not None else DEFAULT_WEIGHTS
    model, _training = load_model(path, Path(config_path) if config_path is not None else None)
    return TinyWorldPipeline(model, torch.device(device), session_capacity=session_capacity)
