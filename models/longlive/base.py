"""PromptedPipeline: what LongLive and Krea Realtime share around their chunk loops.

Both run a Wan T2V DiT under a umT5 prompt, with the streaming Wan VAE, and
keep per session an immutable record (replaced only once a whole forward
succeeded) whose ``generator`` is the session's noise and whose ``prompt``
holds one reference in the shared prompt cache. This base owns that session
table: starting a session, dropping it (its prompt reference and last
latents), moving it to a peer (the generator, the prompt's text and the last
latents; each model adds its own fields) and the fingerprint a peer checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from .config import LongLiveConfig
from .dit import LongLiveDiT, PromptKV
from .prompts import PromptEntry, Prompts
from .text import TextEncoder, clean_prompt
from ..wan.vae import StreamingVAE
from ...runner.binding import SessionStateBinding
from ...runner.contract import ModelState
from ...runner.snapshot import weights_digest
from ...runner.types import TickRequest

DEFAULT_SEED = 0


class PromptedSession(Protocol):
    """A session's record: its noise generator and the cleaned prompt it holds a reference to."""

    @property
    def generator(self) -> torch.Generator: ...

    @property
    def prompt(self) -> str: ...


S = TypeVar("S", bound=PromptedSession)


@dataclass
class PipelineCounters:
    """What the tests and the GPU check read: re-caches run, and the time of the last forward's parts."""

    recaches: int = 0
    recache_s: float = 0.0
    dit_s: float = 0.0
    vae_s: float = 0.0


class PromptedPipeline(SessionStateBinding, Generic[S]):
    """The session table, prompts and transfer plumbing of a prompted Wan T2V pipeline; a model adds its loop."""

    random_weights = False  # built with ``random_init`` (the model card says so: its pictures mean nothing)

    def __init__(
        self,
        model: LongLiveDiT,
        vae: StreamingVAE,
        text: TextEncoder,
        *,
        device: torch.device,
        session_capacity: int,
        prompt_cache: int,
        default_prompt: str | None,
        components: list[dict[str, Any]] | None,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.cfg: LongLiveConfig = model.cfg
        self.vae = vae
        self.text = text
        self.device = device
        self.dtype = next(model.parameters()).dtype
        # where each module lives and what it holds (the model card's ``components``; the loader measures them)
        self.components = components or []
        self.session_capacity = session_capacity
        self.default_prompt = clean_prompt(default_prompt if default_prompt is not None else self.cfg.default_prompt)
        self.prompts = Prompts(self._encode, self._project, spare=prompt_cache)
        self._sessions: dict[str, S] = {}
        self.last_latents: dict[str, torch.Tensor] = {}
        self.counters = PipelineCounters()
        cfg = self.cfg
        self.vae_cache_bytes = vae.steady_cache_bytes((cfg.out_dim, cfg.frames_per_chunk, cfg.latent_height,
                                                       cfg.latent_width))  # fmt: skip
        default = self.prompts.get(self.default_prompt)  # warmed at load: the first chunk encodes nothing
        self.prompt_bytes = _prompt_bytes(cfg, self.dtype, default)

    def prepare_prompt(self, prompt: str) -> str:
        """Wan's cleaning of a client's prompt (the server runs it once, as the prompt arrives: a chunk's prompt is
        looked up as it comes, never cleaned on the model thread)."""
        return clean_prompt(prompt)

    def _encode(self, prompt: str) -> torch.Tensor:
        return self.text.encode(prompt)

    def _project(self, tokens: torch.Tensor) -> PromptKV:
        with torch.inference_mode():
            # the encoder may run elsewhere (text_encoder_device): its outputs come to the model's device
            return self.model.cross_kv(self.model.text_context(tokens.to(self.device, self.dtype)))

    # ---- what each model adds ----------------------------------------------------------------

    def _generate(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        raise NotImplementedError

    def _new_session(self, generator: torch.Generator, prompt: str) -> S:
        """A session's record before its first chunk."""
        raise NotImplementedError

    def _export_session(self, session: S, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The model's own fields of ``session``: its tensors added to ``tensors``, the rest returned (with the
        prompt)."""
        raise NotImplementedError

    def _import_session(self, generator: torch.Generator, prompt: str, values: dict[str, Any],
                        tensors: dict[str, torch.Tensor]) -> S:  # fmt: skip
        """The record :meth:`_export_session` wrote, on this pipeline's device."""
        raise NotImplementedError

    # ---- contract ------------------------------------------------------------------------

    def _prompted_card(self, *, prompt_switch: str) -> dict[str, Any]:
        """The model card's video, prompt and controls fields (a text-to-video model: no controls)."""
        cfg = self.cfg
        return {
            "width": cfg.width,
            "height": cfg.height,
            "fps": cfg.fps,
            "frames_per_chunk": cfg.video_frames_per_chunk,
            "first_chunk_frames": cfg.first_chunk_frames,
            "reads_prompt": True,
            "prompt_switch": prompt_switch,
            "default_prompt": self.default_prompt,
            "controls": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": {},
                "additionalProperties": False,
            },
            "config": cfg.name,
        }

    def generate_chunk(self, tick: TickRequest) -> np.ndarray:
        return self._generate([tick])[0]

    def generate_chunks(self, ticks: Sequence[TickRequest]) -> list[np.ndarray]:
        return self._generate(ticks)

    def reset_session(self, session_id: str) -> None:
        self._drop(session_id)

    def close_session(self, session_id: str) -> None:
        self._drop(session_id)

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def _session(self, tick: TickRequest, chunk_index: int) -> S:
        session = self._sessions.get(tick.session_id)
        if session is None or chunk_index == 0:
            seed = DEFAULT_SEED if tick.seed is None else int(tick.seed)
            return self._new_session(torch.Generator().manual_seed(seed), self.default_prompt)
        return session

    def _drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self.prompts.drop(session.prompt)
        self.last_latents.pop(session_id, None)

    def _undo(self, generators: Sequence[torch.Generator], rewind: Sequence[torch.Tensor],
              entries: Sequence[PromptEntry]) -> None:  # fmt: skip
        """A failed forward: the generators rewound, the prompts it referenced let go."""
        for generator, saved in zip(generators, rewind):
            generator.set_state(saved)
        for entry in entries:
            self.prompts.drop(entry.text)

    # ---- moving a session (SupportsSessionTransfer) -----------------------------------------

    def transfer_fingerprint(self) -> dict[str, Any]:
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = {
                "config": self.cfg.name,
                "dit": weights_digest(self.model),
                "vae": weights_digest(self.vae.vae),
                "text": weights_digest(self.text.model),
            }
        return self._fingerprint

    def export_session_state(self, session_id: str) -> ModelState:
        """Noise generator, the prompt (its text: the peer encodes it), the model's fields and the last latents."""
        session = self._sessions.get(session_id)
        if session is None:
            return ModelState({"session": None})
        tensors: dict[str, torch.Tensor] = {"generator": session.generator.get_state()}
        values = self._export_session(session, tensors)
        latest = self.last_latents.get(session_id)
        if latest is not None:
            tensors["last_latents"] = latest
        return ModelState({"session": values}, tensors)

    def import_session_state(self, session_id: str, state: ModelState) -> None:
        values = state.json.get("session")
        if values is None:
            return
        t = {n: v.cpu() if n == "generator" else v.to(self.device) for n, v in state.tensors.items()}
        generator = torch.Generator()
        generator.set_state(t["generator"])
        entry = self.prompts.acquire(str(values["prompt"]))  # referenced first: the drop below cannot evict it
        self._drop(session_id)
        self._sessions[session_id] = self._import_session(generator, entry.text, values, t)
        if "last_latents" in t:
            self.last_latents[session_id] = t["last_latents"]


def _prompt_bytes(cfg: LongLiveConfig, dtype: torch.dtype, entry: PromptEntry) -> int:
    """One prompt's cross-attention K/V (every layer, ``text_len`` tokens) plus its umT5 outputs (up to ``text_len``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    kv = 2 * cfg.num_layers * cfg.text_len * cfg.dim * elem
    tokens = cfg.text_len * cfg.text.dim * entry.tokens.element_size()
    return kv + tokens
