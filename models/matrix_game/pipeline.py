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

Each session has its own start image (``TickRequest.start_image``, read when
a rollout begins): one the model offers by name, or the client's own pixels.
Its encodings (CLIP context, conditioning stream: :mod:`.images`) are shared
by every session with that image; rows with different images still batch
(the condition and the context are per row).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint as ckpt
from .clip import ClipImageEncoder
from .config import CONFIGS, MatrixGameConfig, get_config
from .decoders import LatentDecoder, StreamingTAEHV, build_decoder, decoder_device, decoder_digest
from .controls import ControlHistory, controls_schema, extend, trimmed, windows
from .dit import CausalWanDiT
from .images import (
    DEFAULT_NAME,
    MAX_CONDITION_FRAMES,
    ConditionStream,
    ImageEncodings,
    StartImages,
    default_image,
    image_files,
    read_image,
    stack_conditions,
)
from .kv import ActionHistory, PagedChunkContext, action_history_bytes
from ..wan.components import component, held_as
from ..wan.loading import check_weights_source, torch_dtype
from ..quantize import check_weights_option, quantize_blocks
from ..wan.compile import compile_blocks
from ..wan.geometry import backbone_kv_spec
from ..wan.parallel import HeadParallel
from ..wan.sampler import sample_chunk
from ..wan.vae import FeatureCache, StreamingVAE, build_vae, cache_bytes, to_uint8
from ...runner.binding import SessionStateBinding
from ...runner.contract import ModelState
from ...runner.decode_states import DecoderStates
from ...runner.snapshot import tensors_digest, weights_digest
from ...runner.spec import KVCacheSpec
from ...runner.types import PendingDecode, StartImage, TickRequest

log = logging.getLogger("arstream.models.matrix_game")

DEFAULT_SEED = 0
# Sessions whose start-image choice is remembered past a reset, close or eviction (the choice, not its encodings).
REMEMBERED_CHOICES_PER_SESSION_SLOT = 4


@dataclass(frozen=True)
class _MatrixGameSession:
    """What carries over between a session's chunks besides the runner's KV (immutable: replaced on success)."""

    generator: torch.Generator
    controls: ControlHistory | None = None
    actions: ActionHistory = field(default_factory=ActionHistory)
    image: ImageEncodings | None = None  # the rollout's start image (fixed for the rollout)


@dataclass
class ChunkTimings:
    """Seconds of the last forward spent in DiT passes and in VAE decode (the rest is everything else)."""

    dit_s: float = 0.0
    vae_s: float = 0.0


class MatrixGamePipeline(HeadParallel, SessionStateBinding):
    """Implements ``ARPipeline``, ``SupportsBatchedChunks``, ``SupportsSplitDecode`` and ``SupportsWarmup``."""

    random_weights = False  # built with ``random_init`` (the model card says so: its pictures mean nothing)

    def __init__(
        self,
        model: CausalWanDiT,
        vae: StreamingVAE,
        *,
        device: torch.device,
        images: dict[str, torch.Tensor],
        clip: ClipImageEncoder | None = None,
        clip_features: torch.Tensor | None = None,
        image_cache: int = 4,
        condition_frames: int = MAX_CONDITION_FRAMES,
        session_capacity: int = 8,
        decoder: LatentDecoder | None = None,
        kv_dtype: torch.dtype | None = None,
        components: list[dict[str, Any]] | None = None,
    ) -> None:
        """``images``: the offered start images by name, ``[3, H, W]`` in [-1, 1], the default first.

        Each image's CLIP tokens come from ``clip`` (the vision tower); without
        it, ``clip_features`` ``[tokens, dim]`` are the default image's, and any
        other image's context is zeros.
        """
        super().__init__()
        self.model = model.eval()
        self.cfg = model.cfg
        self.vae = vae
        # what decodes the latents into frames: the VAE itself unless another decoder was chosen
        self.decoder: LatentDecoder = vae if decoder is None else decoder
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = self.dtype if kv_dtype is None else kv_dtype
        # where each module lives and what it holds (the model card's ``components``; the loader measures them)
        self.components = components or []
        self.session_capacity = session_capacity
        self.condition_frames = condition_frames
        self._clip = clip
        self._default_features = clip_features
        self._default_name = next(iter(images))
        self._sessions: dict[str, _MatrixGameSession] = {}
        # each session's start-image choice, kept past reset and eviction (bounded: ids of closed sessions age out)
        self._choices: OrderedDict[str, StartImage | None] = OrderedDict()
        self.last_latents: dict[str, torch.Tensor] = {}
        # each session's decoder cache, apart from the rest: a split decode writes it on the decode stage's thread
        self._decoder_states: DecoderStates[FeatureCache] = DecoderStates()
        self.timings = ChunkTimings()
        self.images = StartImages(images, self._encode_image, self.cfg, capacity=image_cache)
        log.info(
            "start images: %s offered; up to %d clients' images cached; conditioning encoded lazily, at most %d "
            "latent frames an image (%d KiB each) plus the encoder cache until it settles",
            len(images), image_cache, condition_frames, self.images.default.stream.frame_bytes >> 10,
        )
        self.vae_cache_bytes = self._measure_vae_cache()
        self.action_bytes = action_history_bytes(self.cfg, self.dtype)

    @property
    def context(self) -> torch.Tensor:
        """The default image's cross-attention context ``[1, tokens, dim]``."""
        return self.images.default.context

    def _encode_image(self, image: torch.Tensor, name: str | None) -> ImageEncodings:
        cfg = self.cfg
        with torch.inference_mode():
            if self._clip is not None:
                features = self._clip.encode(image.to(self.device))
            elif name == self._default_name and self._default_features is not None:
                features = self._default_features
            else:
                features = torch.zeros(cfg.clip_tokens, cfg.clip_dim)
            context = self.model.image_context(features.to(self.device, self.dtype)[None])
        stream = ConditionStream(self.vae, image.to(self.device), dtype=self.dtype, max_frames=self.condition_frames)
        return ImageEncodings(context=context, stream=stream)

    def _measure_vae_cache(self) -> int:
        """Bytes of a steady-state decoder cache (after a first and a later chunk of zeros)."""
        cfg = self.cfg
        zeros = torch.zeros(1, cfg.out_dim, cfg.frames_per_chunk, cfg.latent_height, cfg.latent_width, device=self.device)
        _, caches = self.decoder.decode_rows(zeros, [None])
        _, caches = self.decoder.decode_rows(zeros, caches)  # type: ignore[arg-type]
        return cache_bytes(caches[0])

    def compile_forward(self) -> None:
        """``--compile``: the DiT's blocks compiled on their first forward of each shape (the warm-up's)."""
        compile_blocks(self.model, self.device)

    # ---- contract ------------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.cfg
        return backbone_kv_spec(
            cfg,
            self.kv_heads(cfg.num_heads),
            sink_frames=cfg.sink_size,
            window_frames=cfg.local_attn_size,
            session_capacity=self.session_capacity,
            model_owned_bytes_per_session=self.vae_cache_bytes + self.action_bytes,
            dtype=self.kv_dtype,
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
            "mouse": "camera" if cfg.action.enable_mouse else None,
            "config": cfg.name,
            # seeded random weights (a test set-up): the picture is noise, and the page says why
            **({"weights": "random"} if self.random_weights else {}),
            # offered by name (the first is the default); a model that lists any also takes a client's own pixels
            "start_images": self.images.names,
            "components": self.components,
            "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
        }

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        return self._generate([tick], decode_inline=True)[0].payload  # type: ignore[no-any-return]

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        """One DiT forward for several bound sessions (equal history lengths); row ``i`` is ``ticks[i]``.

        The decode runs inside: nothing is stored unless both succeed (the batching contract).
        """
        pending = self._generate(ticks, decode_inline=True)
        return [p.payload for p in pending]

    def generate_latents(self, ticks: Sequence[TickRequest]) -> list[PendingDecode]:
        """The DiT forward only: every state but the decoder's is stored; the latents wait for :meth:`decode_latents`."""
        return self._generate(ticks, decode_inline=False)

    def decode_latents(self, chunks: Sequence[PendingDecode]) -> list[np.ndarray]:
        """Decode one round's chunks (rows decode together where the decoder can), each from its session's state."""
        caches = [self._decoder_states.before(c.session_id, c.chunk_index) for c in chunks]
        # a failure stores nothing: the runner may retry each chunk alone
        frames, new_caches = self._decode(torch.stack([c.payload for c in chunks]), caches)
        for c, cache in zip(chunks, new_caches):
            self._decoder_states.finish(c.session_id, c.chunk_index, cache)
        return frames

    def _decode(
        self, latents: torch.Tensor, caches: list[FeatureCache | None]
    ) -> tuple[list[np.ndarray], list[FeatureCache]]:
        started = time.perf_counter()
        with torch.inference_mode():
            videos, new_caches = self.decoder.decode_rows(latents, caches)
            frames = [to_uint8(v) for v in videos]
        self.timings.vae_s = time.perf_counter() - started
        return frames, new_caches

    def reset_session(self, session_id: str) -> None:
        self._drop(session_id)

    def close_session(self, session_id: str) -> None:
        # The runner evicts a session through close too; its start-image choice stays remembered (bounded).
        self._drop(session_id)

    def warmup_requests(self, session_id: str) -> Iterable[TickRequest]:
        controls = ({}, {"keys": ["w"], "camera": {"yaw": 0.1}})
        return [TickRequest(session_id=session_id, request_id=i, controls=c) for i, c in enumerate(controls)]

    def session_ids(self) -> list[str]:
        """Sessions with model-owned state (for tests of release on reset/close)."""
        return [*self._sessions, *(s for s in self._decoder_states.sessions() if s not in self._sessions)]

    # ---- moving a session (SupportsSessionTransfer) -----------------------------------------

    def transfer_fingerprint(self) -> dict[str, Any]:
        """Config, DiT, VAE and CLIP weights, and the offered start images' encodings (by name) the chunks read.

        A client's own start image travels with the session (export_session_state) and is encoded again on
        the peer by the same weights, so equal weights give equal encodings.
        """
        if getattr(self, "_fingerprint", None) is None:  # computed once: none of it changes while serving
            offered = {name: self.images.resolve(StartImage(f"name:{name}", name=name)) for name in self.images.names}
            self._fingerprint = {
                "config": self.cfg.name,
                "dit": weights_digest(self.model),
                "vae": weights_digest(self.vae.vae),
                "decoder": decoder_digest(self.decoder),
                "clip": None if self._clip is None else weights_digest(self._clip),
                "start_images": tensors_digest(
                    {f"{name}/{part}": tensor for name, encodings in offered.items()
                     for part, tensor in (("context", encodings.context), ("first", encodings.stream.condition(0, 1)))}
                ),
            }
        return self._fingerprint

    def export_session_state(self, session_id: str) -> ModelState:
        """Noise generator, control history, action caches and the decoder's state (the VAE's feature cache)."""
        return self.export_forward_state(session_id).merge(self.export_decoder_state(session_id))

    def decode_in_flight(self, session_id: str) -> bool:
        return self._decoder_states.in_flight(session_id)

    def forget_decodes(self, chunks: Sequence[PendingDecode]) -> None:
        for chunk in chunks:
            self._decoder_states.drop(chunk.session_id)

    def export_decoder_state(self, session_id: str, chunks: int | None = None) -> ModelState:
        """The decoder's state after the session's last chunk (a whole chunk's: waits for one in flight), or
        after its first ``chunks`` chunks (a rewind point's)."""
        decoded = self._decoder_states.settled(session_id, chunks)
        if decoded is None:
            return ModelState({"decoder": None})
        chunks, cache = decoded
        # Entries are tensors, None, or diffusers' "Rep" marker (repeat the first frame).
        kinds: list[Any] = []
        tensors: dict[str, torch.Tensor] = {}
        for i, entry in enumerate(cache):
            if isinstance(entry, torch.Tensor):
                tensors[f"vae/{i}"] = entry
                kinds.append("tensor")
            else:
                kinds.append(entry)
        return ModelState({"decoder": {"chunks": chunks, "kinds": kinds}}, tensors)

    def export_forward_state(self, session_id: str) -> ModelState:
        """Everything but the decoder's state: noise generator, control history, action caches, start image."""
        session = self._sessions.get(session_id)
        if session is None:
            return ModelState({"session": None})
        tensors: dict[str, torch.Tensor] = {"generator": session.generator.get_state()}
        values: dict[str, Any] = {"controls": None, "action_frames": session.actions.frames}
        if session.controls is not None:
            c = session.controls
            values["controls"] = {"start": c.start}
            tensors.update({"controls/first_keyboard": c.first_keyboard, "controls/first_mouse": c.first_mouse,
                            "controls/keyboard": c.keyboard, "controls/mouse": c.mouse})
        values["action_layers"] = sorted(session.actions.layers)
        for layer, kv in session.actions.layers.items():
            for i, tensor in enumerate(kv):
                tensors[f"actions/{layer}/{i}"] = tensor
        latents = self.last_latents.get(session_id)
        if latents is not None:
            tensors["last_latents"] = latents
        # The rollout's start image: the peer encodes it again (or has it: an offered name), as it would at a reset.
        choice = self._choices.get(session_id)
        values["image"] = None if choice is None else {"digest": choice.digest, "name": choice.name}
        if choice is not None and choice.pixels is not None:
            tensors["image/pixels"] = torch.from_numpy(np.array(choice.pixels))  # a writable copy (the choice is read-only)
        return ModelState({"session": values}, tensors)

    def import_session_state(self, session_id: str, state: ModelState) -> None:
        values = state.json.get("session")
        if values is None:
            return
        # Caches and latents live on the model's device; the generator and control history on the CPU, as they are made.
        on_device = ("actions/", "last_latents")
        states_device = decoder_device(self.decoder, self.device)  # the decoder's state lives where it decodes
        t = {
            n: v.to(states_device) if n.startswith("vae/") else v.to(self.device) if n.startswith(on_device) else v.cpu()
            for n, v in state.tensors.items()
        }
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
        self._decoder_states.drop(session_id)
        decoder = state.json.get("decoder")
        if decoder is not None:
            cache = [t[f"vae/{i}"] if kind == "tensor" else kind for i, kind in enumerate(decoder["kinds"])]
            self._decoder_states.store(session_id, int(decoder["chunks"]) - 1, cache)
        choice = None
        if values.get("image") is not None:
            pixels = t["image/pixels"].numpy() if "image/pixels" in t else None
            choice = StartImage(digest=values["image"]["digest"], name=values["image"]["name"], pixels=pixels)
            self._choices[session_id] = choice
        image = self.images.resolve(choice)
        self._sessions[session_id] = _MatrixGameSession(generator, controls, actions, image=image)
        if "last_latents" in t:
            self.last_latents[session_id] = t["last_latents"]

    def _drop(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._decoder_states.drop(session_id)
        self.last_latents.pop(session_id, None)

    # ---- one chunk for a batch of sessions ----------------------------------------------------

    def _choice(self, tick: TickRequest) -> StartImage | None:
        """The tick's start image; a tick without one keeps the session's earlier choice (None: the default)."""
        return tick.start_image if tick.start_image is not None else self._choices.get(tick.session_id)

    def _session(self, tick: TickRequest, chunk_index: int) -> _MatrixGameSession:
        session = self._sessions.get(tick.session_id)
        if session is None or chunk_index == 0:
            seed = DEFAULT_SEED if tick.seed is None else int(tick.seed)
            image = self.images.resolve(self._choice(tick))  # a bad choice fails this tick only
            session = _MatrixGameSession(generator=torch.Generator().manual_seed(seed), image=image)
        return session

    def _remember(self, tick: TickRequest) -> None:
        self._choices[tick.session_id] = self._choice(tick)
        self._choices.move_to_end(tick.session_id)
        while len(self._choices) > REMEMBERED_CHOICES_PER_SESSION_SLOT * self.session_capacity:
            self._choices.popitem(last=False)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generate(self, ticks: Sequence[TickRequest], *, decode_inline: bool) -> list[PendingDecode]:
        """The DiT passes for ``ticks``; with ``decode_inline`` the decode too (payloads are then frames)."""
        cfg = self.cfg
        states = [self.bound_state(t.session_id) for t in ticks]
        indices = [s.chunk_index for s in states]  # before the forward commits
        sessions = [self._session(t, i) for t, i in zip(ticks, indices)]
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
                images = [s.image for s in sessions]
                cond = stack_conditions([i.stream for i in images], [s.frame_start for s in states], fpc)
                context = torch.cat([i.context for i in images])
                mouse_in, keyboard_in = torch.stack(mouse).to(self.device), torch.stack(keyboard).to(self.device)
                latents = sample_chunk(
                    lambda x, t: self.model(x, t, cond, context, mouse_in, keyboard_in, ctx),
                    ctx,
                    draw(),
                    draw,
                    cfg.denoise_timesteps,
                    cfg.timestep_shift,
                )
                actions = ctx.updated_histories()
                self._sync()
            self.timings = ChunkTimings(dit_s=time.perf_counter() - started)
            payloads: list[Any] = list(latents)
            if decode_inline:
                caches = [self._decoder_states.before(t.session_id, i) for t, i in zip(ticks, indices)]
                payloads, new_caches = self._decode(latents, caches)
        except BaseException:
            for generator, state in zip(generators, rewind):
                generator.set_state(state)
            raise
        for row, (tick, session) in enumerate(zip(ticks, sessions)):
            self._sessions[tick.session_id] = _MatrixGameSession(
                session.generator, controls[row], actions[row], session.image
            )
            self._remember(tick)
            self.last_latents[tick.session_id] = latents[row]
            if decode_inline:
                self._decoder_states.store(tick.session_id, indices[row], new_caches[row])
            else:
                self._decoder_states.begin(tick.session_id, indices[row])
        return [PendingDecode(t.session_id, i, p) for t, i, p in zip(ticks, indices, payloads)]


def _optional_file(directory: Path, explicit: str | None, candidates: tuple[str, ...]) -> Path | None:
    """A file named explicitly must exist; otherwise the first candidate present, or None."""
    if explicit is not None:
        return ckpt.find_file(directory, explicit, candidates, "CLIP")
    return next((directory / name for name in candidates if (directory / name).is_file()), None)


def configs_fitting(shapes: dict[str, torch.Size]) -> list[str]:
    """The configs whose DiT has exactly these parameter names and shapes (built on the meta device: no memory)."""
    fits = []
    for name, cfg in CONFIGS.items():
        with torch.device("meta"):
            expected = {k: v.shape for k, v in CausalWanDiT(cfg).state_dict().items()}
        if expected == shapes:
            fits.append(name)
    return fits


def _offered_images(image: str | None, images: str | None, cfg: MatrixGameConfig) -> dict[str, torch.Tensor]:
    """The default (the `image` file, named by its stem, or the built-in picture) first, then the directory's."""
    default_name = Path(image).stem if image is not None else DEFAULT_NAME
    offered = {default_name: read_image(image, cfg) if image is not None else default_image(cfg)}
    for name, path in (image_files(images) if images is not None else {}).items():
        if name not in offered:  # the `image` option's file may sit in the directory too: it stays the default
            offered[name] = read_image(path, cfg)
    return offered


def load_matrix_game(
    device: torch.device | str = "cpu",
    *,
    config: str = "1.3b",
    checkpoint: str | None = None,
    random_init: bool = False,
    seed: int = 0,
    dtype: str | None = None,
    vae_dtype: str | None = None,
    image: str | None = None,
    images: str | None = None,
    image_cache: int = 4,
    condition_frames: int = MAX_CONDITION_FRAMES,
    clip_features: str | None = None,
    dit_file: str | None = None,
    vae_file: str | None = None,
    clip_file: str | None = None,
    session_capacity: int = 8,
    decoder: str = "wan-vae",
    decoder_file: str | None = None,
    decode_device: str | None = None,
    weights: str | None = None,
    kv_dtype: str | None = None,
) -> MatrixGamePipeline:
    """Build the model from a checkpoint directory, or with seeded random weights (``random_init``).

    Precision as Matrix-Game runs it on CUDA: the DiT, the VAE encoder and
    the CLIP tower in bf16 (``dtype``), the VAE decoder in fp16
    (``vae_dtype``); on the CPU everything defaults to fp32.

    Start images' CLIP tokens come from the CLIP file in the directory (its
    vision tower is kept to encode clients' images), or, for the default
    image only, from ``clip_features`` (a file holding a ``[257, 1280]``
    tensor named ``clip_features``), which wins; with neither, the image
    context is zeros (with a warning).

    ``decoder`` ``taehv`` decodes with TAEHV (``decoder_file`` in the
    checkpoint directory, default ``taew2_1.pth``; seeded random with
    ``random_init``) in ``vae_dtype`` instead of the Wan VAE's decoder, on
    ``decode_device`` if given (another GPU: the latents go there, frames come back).

    ``weights`` ``int8``, ``fp8`` or ``w8a8`` quantizes the DiT's block weights after
    loading (:mod:`arstream.models.quantize`); the KV pool holds ``kv_dtype``
    (default: ``dtype``). On the meta device nothing is read or initialised:
    the pipeline has the shapes and bytes of one on a GPU (``arstream plan``).
    """
    device = torch.device(device)
    cfg = get_config(config)
    planning = device.type == "meta"
    if not planning:
        check_weights_source("matrix-game-2", checkpoint, random_init)
    check_weights_option(weights, device)
    on_gpu = device.type in ("cuda", "meta")
    weights_dtype = torch_dtype(dtype, "bfloat16" if on_gpu else "float32", "dtype")
    decode_dtype = torch_dtype(vae_dtype, "float16" if on_gpu else "float32", "vae_dtype")
    cache_dtype = None if kv_dtype is None else torch_dtype(kv_dtype, "", "kv_dtype")
    offered = _offered_images(image, images, cfg)
    encoder: ClipImageEncoder | None = None
    # Built without memory, then filled: a 1.3B model is neither default-initialised nor held twice.
    with torch.device("meta"):
        model = CausalWanDiT(cfg)
    if planning:  # what a served one holds with a checkpoint: the VAE and, without clip_features, CLIP's tower
        with torch.device("meta"):
            vae_module = build_vae(cfg)
            encoder = None if clip_features is not None else ClipImageEncoder(cfg.clip)
    elif checkpoint is not None:
        model = model.to_empty(device="cpu")
        directory = Path(checkpoint)
        dit_path = ckpt.find_file(directory, dit_file, ckpt.dit_files(cfg.dit_file), "DiT")
        vae_path = ckpt.find_file(directory, vae_file, ckpt.VAE_FILES, "VAE")
        clip_path = _optional_file(directory, clip_file, ckpt.CLIP_FILES)
        ckpt.load_dit(model, dit_path, configs_fitting)
        vae_module = build_vae(cfg)
        ckpt.load_vae(vae_module, vae_path)
        if clip_path is not None and clip_features is None:
            with torch.device("meta"):
                encoder = ClipImageEncoder(cfg.clip)
            encoder = encoder.to_empty(device="cpu")
            ckpt.load_clip_visual(encoder, clip_path)
    else:
        model = model.to_empty(device="cpu")
        model.init_random(seed)
        torch.manual_seed(seed)
        vae_module = build_vae(cfg)  # diffusers' own random init, seeded
        torch.manual_seed(seed + 1)
        encoder = ClipImageEncoder(cfg.clip)
    features: torch.Tensor | None = None
    if clip_features is not None and planning:
        features = torch.zeros(cfg.clip_tokens, cfg.clip_dim, device=device)
    elif clip_features is not None:
        encoder = None
        loaded = ckpt.read_state_dict(Path(clip_features))
        features = loaded.get("clip_features", torch.empty(0))
        if features.shape != (cfg.clip_tokens, cfg.clip_dim):
            raise ckpt.CheckpointError(
                f"{clip_features}: clip_features must be [{cfg.clip_tokens}, {cfg.clip_dim}], got {list(features.shape)}"
            )
    elif encoder is None:
        log.warning("no CLIP file and no clip_features: the image context is zeros")
    model = model.to(device=device, dtype=weights_dtype)
    quantize_blocks(model, weights)
    # Matrix-Game encodes the start image in bf16 and decodes in fp16 (inference.py): one module, two dtypes.
    vae_module = vae_module.to(device=device)
    for part, part_dtype in (("encoder", weights_dtype), ("quant_conv", weights_dtype), ("post_quant_conv", decode_dtype),
                             ("decoder", decode_dtype)):
        getattr(vae_module, part).to(dtype=part_dtype)
    if encoder is not None:
        encoder = encoder.to(device=device, dtype=weights_dtype)
    if random_init and decoder_file is not None:
        raise ValueError("decoder_file names a file in the checkpoint directory; random_init has none")
    streaming_vae = StreamingVAE(vae_module)
    chosen = build_decoder(
        decoder, streaming_vae, cfg, device=device, dtype=decode_dtype,
        checkpoint=None if checkpoint is None else Path(checkpoint), decoder_file=decoder_file, seed=seed,
        decode_device=decode_device,
    )
    components = [
        component("dit", model, device, held_as(weights_dtype, weights)),
        component("vae", vae_module, device, held_as(weights_dtype) + f" encoder, {held_as(decode_dtype)} decoder"),
    ]
    if encoder is not None:
        components.append(component("clip", encoder, device, held_as(weights_dtype)))
    if chosen is not streaming_vae:
        assert isinstance(chosen, StreamingTAEHV)
        components.append(component("decoder", chosen.module, decode_device or device, held_as(decode_dtype)))
    pipeline = MatrixGamePipeline(
        model,
        streaming_vae,
        decoder=None if chosen is streaming_vae else chosen,
        device=device,
        images=offered,
        clip=encoder,
        clip_features=features,
        image_cache=image_cache,
        condition_frames=condition_frames,
        session_capacity=session_capacity,
        kv_dtype=cache_dtype,
        components=components,
    )
    pipeline.random_weights = checkpoint is None
    return pipeline
