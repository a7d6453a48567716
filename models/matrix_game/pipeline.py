"""MatrixGamePipeline: the causal Wan DiT + streaming Wan VAE behind the runner's pipeline contract.

The runner owns the self-attention KV (one pool block per latent frame).
The pipeline owns, per session, everything else that carries over between
chunks: the noise generator, the recent controls (each latent frame reads
the 12 video frames of controls before it), the action module's caches and
the VAE decoder's feature cache. All of it is counted in capacity
(``model_owned_bytes_per_session``) and changes only once a whole forward
succeeded: a batch that fails leaves every session as it was (generators
rewound), as the runner's batching contract asks.

A chunk is 3 latent frames; the client gets 12 video frames, 9 on the first
chunk of a rollout (the causal VAE turns the first latent frame into one).
Sessions batch through the DiT (rows stack like tiny-world's) and through
the VAE (each row with its own cache, stacked for the decode).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from arstream.models.matrix_game import checkpoint as ckpt
from arstream.models.matrix_game.clip import ClipImageEncoder
from arstream.models.matrix_game.config import MatrixGameConfig, get_config
from arstream.models.matrix_game.controls import ControlHistory, controls_schema, extend, trimmed, windows
from arstream.models.matrix_game.dit import CausalWanDiT
from arstream.models.matrix_game.kv import ActionHistory, PagedChunkContext, action_history_bytes
from arstream.models.matrix_game.sampler import sample_chunk
from arstream.models.matrix_game.vae import FeatureCache, StreamingVAE, build_vae, cache_bytes
from arstream.runner.binding import SessionStateBinding
from arstream.runner.contract import ModelState
from arstream.runner.snapshot import tensors_digest, weights_digest
from arstream.runner.spec import KVCacheSpec
from arstream.runner.types import TickRequest

log = logging.getLogger("arstream.models.matrix_game")

DEFAULT_SEED = 0
# Latent frames of image conditioning encoded at load; later frames reuse the last (black frames settle).
CONDITION_FRAMES = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class _Session:
    """What carries over between a session's chunks besides the runner's KV (immutable: replaced on success)."""

    generator: torch.Generator
    controls: ControlHistory | None = None
    actions: ActionHistory = field(default_factory=ActionHistory)
    vae_cache: FeatureCache | None = None


@dataclass
class ChunkTimings:
    """Seconds of the last forward spent in DiT passes and in VAE decode (the rest is everything else)."""

    dit_s: float = 0.0
    vae_s: float = 0.0


def default_image(cfg: MatrixGameConfig) -> torch.Tensor:
    """A built-in start image ``[3, H, W]`` in [-1, 1]: sky over ground with a horizon."""
    h, w = cfg.height, cfg.width
    y = torch.linspace(0, 1, h)[:, None].expand(h, w)
    x = torch.linspace(0, 1, w)[None, :].expand(h, w)
    sky = torch.stack([0.3 + 0.3 * y, 0.5 + 0.3 * y, 0.9 + 0 * y])
    ground = torch.stack([0.35 + 0.1 * x, 0.55 - 0.2 * y, 0.25 + 0 * y])
    image = torch.where(y[None] < 0.45, sky, ground)
    return image.clamp(0, 1) * 2 - 1


def read_image(path: str | Path, cfg: MatrixGameConfig) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as img:
        rgb = img.convert("RGB").resize((cfg.width, cfg.height), Image.Resampling.BICUBIC)
        array = np.asarray(rgb, dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1


class MatrixGamePipeline(SessionStateBinding):
    """Implements ``ARPipeline``, ``SupportsBatchedChunks`` and ``SupportsWarmup``."""

    def __init__(
        self,
        model: CausalWanDiT,
        vae: StreamingVAE,
        *,
        device: torch.device,
        clip_features: torch.Tensor,
        image: torch.Tensor,
        session_capacity: int = 8,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.cfg = model.cfg
        self.vae = vae
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.session_capacity = session_capacity
        self._sessions: dict[str, _Session] = {}
        self.last_latents: dict[str, torch.Tensor] = {}
        self.timings = ChunkTimings()
        with torch.inference_mode():
            self.context = model.image_context(clip_features.to(device, self.dtype)[None])
            image_latents = vae.encode_condition(image.to(device), CONDITION_FRAMES)
        mask = torch.zeros(4, CONDITION_FRAMES, *image_latents.shape[2:], device=device)
        mask[:, 0] = 1.0
        self.condition = torch.cat([mask, image_latents.to(mask.dtype)])  # [20, CONDITION_FRAMES, h, w]
        self.vae_cache_bytes = self._measure_vae_cache()
        self.action_bytes = action_history_bytes(self.cfg, self.dtype)

    def _measure_vae_cache(self) -> int:
        """Bytes of a steady-state decoder cache (after a first and a later chunk of zeros)."""
        cfg = self.cfg
        zeros = torch.zeros(1, cfg.out_dim, cfg.frames_per_chunk, cfg.latent_height, cfg.latent_width, device=self.device)
        _, cache = self.vae.decode(zeros, None)
        _, cache = self.vae.decode(zeros, cache)
        return cache_bytes(cache)

    # ---- contract ------------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.cfg
        return KVCacheSpec(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_heads,
            head_size=cfg.head_dim,
            tokens_per_frame=cfg.tokens_per_frame,
            frames_per_chunk=cfg.frames_per_chunk,
            sink_frames=cfg.sink_size,
            window_frames=cfg.local_attn_size,
            session_capacity=self.session_capacity,
            model_owned_bytes_per_session=self.vae_cache_bytes + self.action_bytes,
            dtype=self.dtype,
            max_position_frames=cfg.rope_frames,
        )

    def model_card(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "name": "matrix-game-2",
            "width": cfg.width,
            "height": cfg.height,
            "fps": cfg.fps,
            "frames_per_chunk": cfg.video_frames_per_chunk,
            "first_chunk_frames": cfg.first_chunk_frames,
            "controls": controls_schema(cfg),
            "mouse": "camera",
            "config": cfg.name,
        }

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        return self._generate([tick])[0]

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        """One DiT forward for several bound sessions (equal history lengths); row ``i`` is ``ticks[i]``."""
        return self._generate(ticks)

    def reset_session(self, session_id: str) -> None:
        self._drop(session_id)

    def close_session(self, session_id: str) -> None:
        self._drop(session_id)

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        controls = ({}, {"keys": ["w"], "camera": {"yaw": 0.1}})
        return [TickRequest(session_id=session_id, request_id=i, controls=c) for i, c in enumerate(controls)]

    def session_ids(self) -> list[str]:
        """Sessions with model-owned state (for tests of release on reset/close)."""
        return list(self._sessions)

    # ---- moving a session (SupportsSessionTransfer) -----------------------------------------

    def transfer_fingerprint(self) -> dict[str, Any]:
        """Config, DiT and VAE weights, and the conditioning (image latents, image context) the chunks read."""
        if getattr(self, "_fingerprint", None) is None:  # computed once: none of it changes while serving
            self._fingerprint = {
                "config": self.cfg.name,
                "dit": weights_digest(self.model),
                "vae": weights_digest(self.vae.vae),
                "condition": tensors_digest({"condition": self.condition, "context": self.context}),
            }
        return self._fingerprint

    def export_session_state(self, session_id: str) -> ModelState:
        """Noise generator, control history, action caches and the VAE decoder's feature cache."""
        session = self._sessions.get(session_id)
        if session is None:
            return ModelState({"session": None})
        tensors: dict[str, torch.Tensor] = {"generator": session.generator.get_state()}
        values: dict[str, Any] = {"controls": None, "action_frames": session.actions.frames, "vae": None}
        if session.controls is not None:
            c = session.controls
            values["controls"] = {"start": c.start}
            tensors.update({"controls/first_keyboard": c.first_keyboard, "controls/first_mouse": c.first_mouse,
                            "controls/keyboard": c.keyboard, "controls/mouse": c.mouse})
        values["action_layers"] = sorted(session.actions.layers)
        for layer, kv in session.actions.layers.items():
            for i, tensor in enumerate(kv):
                tensors[f"actions/{layer}/{i}"] = tensor
        if session.vae_cache is not None:
            # Entries are tensors, None, or diffusers' "Rep" marker (repeat the first frame).
            kinds = []
            for i, entry in enumerate(session.vae_cache):
                if isinstance(entry, torch.Tensor):
                    tensors[f"vae/{i}"] = entry
                    kinds.append("tensor")
                else:
                    kinds.append(entry)
            values["vae"] = kinds
        latents = self.last_latents.get(session_id)
        if latents is not None:
            tensors["last_latents"] = latents
        return ModelState({"session": values}, tensors)

    def import_session_state(self, session_id: str, state: ModelState) -> None:
        values = state.json.get("session")
        if values is None:
            return
        # Caches and latents live on the model's device; the generator and control history on the CPU, as they are made.
        on_device = ("actions/", "vae/", "last_latents")
        t = {n: v.to(self.device) if n.startswith(on_device) else v.cpu() for n, v in state.tensors.items()}
        generator = torch.Generator()
        generator.set_state(t["generator"])
        controls = None
        if values["controls"] is not None:
            controls = ControlHistory(
                first_keyboard=t["controls/first_keyboard"], first_mouse=t["controls/first_mouse"],
                keyboard=t["controls/keyboard"], mouse=t["controls/mouse"], start=int(values["controls"]["start"]),
            )
        layers = {int(layer): tuple(t[f"actions/{layer}/{i}"] for i in range(4)) for layer in values["action_layers"]}
        actions = ActionHistory(frames=int(values["action_frames"]), layers=layers)  # type: ignore[arg-type]
        cache = None
        if values["vae"] is not None:
            cache = [t[f"vae/{i}"] if kind == "tensor" else kind for i, kind in enumerate(values["vae"])]
        self._sessions[session_id] = _Session(generator, controls, actions, cache)
        if "last_latents" in t:
            self.last_latents[session_id] = t["last_latents"]

    def _drop(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self.last_latents.pop(session_id, None)

    # ---- one chunk for a batch of sessions ----------------------------------------------------

    def _session(self, tick: TickRequest, chunk_index: int) -> _Session:
        session = self._sessions.get(tick.session_id)
        if session is None or chunk_index == 0:
            seed = DEFAULT_SEED if tick.seed is None else int(tick.seed)
            session = _Session(generator=torch.Generator().manual_seed(seed))
        return session

    def _condition(self, frame_start: int) -> torch.Tensor:
        last = self.condition.shape[1] - 1
        index = [min(p, last) for p in range(frame_start, frame_start + self.cfg.frames_per_chunk)]
        return self.condition[:, index]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generate(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        cfg = self.cfg
        states = [self.bound_state(t.session_id) for t in ticks]
        sessions = [self._session(t, s.chunk_index) for t, s in zip(ticks, states)]
        generators = [s.generator for s in sessions]
        rewind = [g.get_state() for g in generators]
        fpc = cfg.frames_per_chunk
        try:
            controls, mouse, keyboard = [], [], []
            for tick, state, session in zip(ticks, states, sessions):
                frames = cfg.first_chunk_frames if state.chunk_index == 0 else cfg.video_frames_per_chunk
                history = extend(session.controls, tick.controls, frames, cfg)
                m, k = windows(history, range(state.frame_start, state.frame_start + fpc), cfg)
                controls.append(trimmed(history, cfg))
                mouse.append(m)
                keyboard.append(k)
            shape = (cfg.out_dim, fpc, cfg.latent_height, cfg.latent_width)

            def draw() -> torch.Tensor:
                return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(self.device)

            started = time.perf_counter()
            with torch.inference_mode():
                ctx = PagedChunkContext(states, [s.actions for s in sessions], cfg)
                cond = torch.stack([self._condition(s.frame_start) for s in states])
                latents = sample_chunk(
                    self.model,
                    ctx,
                    draw(),
                    draw,
                    cond,
                    self.context.expand(len(ticks), -1, -1),
                    torch.stack(mouse).to(self.device),
                    torch.stack(keyboard).to(self.device),
                )
                actions = ctx.updated_histories()
                self._sync()
                decoded = time.perf_counter()
                videos, caches = self.vae.decode_rows(latents, [s.vae_cache for s in sessions])
                frames_out = [_to_uint8(v) for v in videos]
            self.timings = ChunkTimings(dit_s=decoded - started, vae_s=time.perf_counter() - decoded)
        except BaseException:
            for generator, state in zip(generators, rewind):
                generator.set_state(state)
            raise
        for row, (tick, session) in enumerate(zip(ticks, sessions)):
            self._sessions[tick.session_id] = _Session(session.generator, controls[row], actions[row], caches[row])
            self.last_latents[tick.session_id] = latents[row]
        return frames_out


def _optional_file(directory: Path, explicit: str | None, candidates: tuple[str, ...]) -> Path | None:
    """A file named explicitly must exist; otherwise the first candidate present, or None."""
    if explicit is not None:
        return ckpt.find_file(directory, explicit, candidates, "CLIP")
    return next((directory / name for name in candidates if (directory / name).is_file()), None)


def _to_uint8(video: torch.Tensor) -> np.ndarray:
    """``[1, 3, F, H, W]`` in [-1, 1] -> uint8 ``[F, H, W, 3]``."""
    pixels = ((video[0].float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return np.ascontiguousarray(pixels.permute(1, 2, 3, 0).cpu().numpy())


def load_matrix_game(
    device: torch.device | str = "cpu",
    *,
    config: str = "1.3b",
    checkpoint: str | None = None,
    random_init: bool = False,
    seed: int = 0,
    dtype: str | None = None,
    image: str | None = None,
    clip_features: str | None = None,
    dit_file: str | None = None,
    vae_file: str | None = None,
    clip_file: str | None = None,
    session_capacity: int = 8,
) -> MatrixGamePipeline:
    """Build the model from a checkpoint directory, or with seeded random weights (``random_init``).

    The start image's CLIP tokens come from the CLIP file in the directory
    (its vision tower runs once, here), or from ``clip_features`` (a file
    holding a ``[257, 1280]`` tensor named ``clip_features``), which wins;
    with neither, the image context is zeros (with a warning).
    """
    device = torch.device(device)
    cfg = get_config(config)
    if (checkpoint is None) == (not random_init):
        raise ValueError("matrix-game-2 needs either checkpoint=DIR or random_init=true (not both)")
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    start = read_image(image, cfg) if image is not None else default_image(cfg)
    encoder: ClipImageEncoder | None = None
    # Built without memory, then filled: a 1.3B model is neither default-initialised nor held twice.
    with torch.device("meta"):
        model = CausalWanDiT(cfg)
    model = model.to_empty(device="cpu")
    if checkpoint is not None:
        directory = Path(checkpoint)
        dit_path = ckpt.find_file(directory, dit_file, ckpt.DIT_FILES, "DiT")
        vae_path = ckpt.find_file(directory, vae_file, ckpt.VAE_FILES, "VAE")
        clip_path = _optional_file(directory, clip_file, ckpt.CLIP_FILES)
        ckpt.load_dit(model, dit_path)
        vae_module = build_vae(cfg)
        ckpt.load_vae(vae_module, vae_path)
        if clip_path is not None and clip_features is None:
            with torch.device("meta"):
                encoder = ClipImageEncoder(cfg.clip)
            encoder = encoder.to_empty(device="cpu")
            ckpt.load_clip_visual(encoder, clip_path)
    else:
        model.init_random(seed)
        torch.manual_seed(seed)
        vae_module = build_vae(cfg)  # diffusers' own random init, seeded
        torch.manual_seed(seed + 1)
        with torch.device(device):
            encoder = ClipImageEncoder(cfg.clip)
    if clip_features is not None:
        loaded = ckpt.read_state_dict(Path(clip_features))
        features = loaded.get("clip_features", torch.empty(0))
        if features.shape != (cfg.clip_tokens, cfg.clip_dim):
            raise ckpt.CheckpointError(
                f"{clip_features}: clip_features must be [{cfg.clip_tokens}, {cfg.clip_dim}], got {list(features.shape)}"
            )
    elif encoder is not None:
        features = encoder.to(device).encode(start.to(device)).cpu()
        del encoder  # used once: the tokens are all the DiT needs
    else:
        features = torch.zeros(cfg.clip_tokens, cfg.clip_dim)
        log.warning("no CLIP file and no clip_features: the image context is zeros")
    model = model.to(device=device, dtype=torch_dtype)
    vae_module = vae_module.to(device=device)
    if torch_dtype != torch.float32:
        vae_module = vae_module.to(dtype=torch_dtype)
    vae = StreamingVAE(vae_module)
    return MatrixGamePipeline(
        model, vae, device=device, clip_features=features, image=start, session_capacity=session_capacity
    )
