"""Reading LongLive's published files: ``longlive_base.pt``, ``lora.pt`` (merged at load), umT5, the Wan VAE.

Layout, as LongLive v1.0 ships it and Wan2.1 publishes the rest, all in one
directory: ``longlive_base.pt`` (a dict whose ``generator`` key holds the
DiT, its keys prefixed ``model.``; Self-Forcing's ``self_forcing_dmd.pt`` and
CausVid's ``model.pt`` are the same layout, Self-Forcing's weights read from
``generator_ema``), ``lora.pt`` (peft's LoRA layout, under a
``generator_lora`` key or bare: ``base_model.model.blocks.N.<linear>.lora_A.weight``
/ ``lora_B.weight`` for every linear layer of every block, rank 256, alpha
256), ``models_t5_umt5-xxl-enc-bf16.pth`` (umT5's encoder in Wan's layout),
``Wan2.1_VAE.pth`` and the tokenizer directory ``google/umt5-xxl``. The LoRA
is merged into the DiT by peft itself (``merge_and_unload``), so the merged
weights compute what peft's adapter forward does. Any missing or mismatched
file fails with :class:`CheckpointError` naming it and the keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from torch import nn

from .config import LongLiveConfig
from .dit import LongLiveDiT
from .text import wan_t5_to_transformers
from ..wan.checkpoint import CheckpointError, load_into, read_state_dict

T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
VAE_FILE = "Wan2.1_VAE.pth"
DIT_PREFIX = "model."
FSDP_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
LORA_KEY = "generator_lora"
LISTED = 6


def lora_targets(model: LongLiveDiT) -> list[str]:
    """The linear layers LongLive's LoRA adapts: every ``nn.Linear`` inside an attention block."""
    return [name for name, module in model.named_modules() if name.startswith("blocks.") and isinstance(module, nn.Linear)]


def dit_key(name: str) -> str:
    """A published DiT key as the model names it: FSDP's wrapper segments gone (training scripts' EMA copies keep
    them; LongLive's loader strips them the same way), then the wrapper's ``model.`` prefix."""
    for segment in FSDP_SEGMENTS:
        name = name.replace(segment, "")
    return name.removeprefix(DIT_PREFIX)


def load_dit(model: LongLiveDiT, path: Path, entry: str = "generator") -> None:
    """The DiT file's ``entry`` (``generator``; Self-Forcing's EMA weights: ``generator_ema``), keys prefixed
    ``model.``; a bare state dict is read too."""
    state = read_state_dict(path, entry)
    load_into(model, {dit_key(k): v for k, v in state.items()}, path)


def read_lora(path: Path) -> dict[str, torch.Tensor]:
    """A LoRA file's tensors (the ``generator_lora`` dict, or a bare peft state dict)."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader error becomes one message naming the file
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, dict) and LORA_KEY in loaded:
        loaded = loaded[LORA_KEY]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path} does not hold a LoRA state dict of tensors")
    return loaded


def merge_lora(model: LongLiveDiT, state: dict[str, torch.Tensor], path: Path, cfg: LongLiveConfig) -> LongLiveDiT:
    """Merge a peft LoRA state dict into ``model`` (peft's ``merge_and_unload``); every adapted layer must be there."""
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - the extra is part of the test install
        raise ImportError("merging LongLive's LoRA needs peft: pip install 'arstream[longlive]'") from exc
    config = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                             target_modules=lora_targets(model))  # fmt: skip
    wrapped = peft.get_peft_model(model, config)
    expected = set(peft.get_peft_model_state_dict(wrapped))
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    wrong = [
        f"{k} {tuple(state[k].shape)}"
        for k, v in peft.get_peft_model_state_dict(wrapped).items()
        if k in state and state[k].shape != v.shape
    ]
    problems = [f"{what}: {', '.join(keys[:LISTED])}{' ...' if len(keys) > LISTED else ''}"
                for what, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", wrong))
                if keys]  # fmt: skip
    if problems:
        raise CheckpointError(f"{path} does not fit the model's LoRA (rank {cfg.lora_rank}): " + "; ".join(problems))
    peft.set_peft_model_state_dict(wrapped, state)
    return cast(LongLiveDiT, wrapped.merge_and_unload())


def load_text_encoder(module: nn.Module, path: Path) -> None:
    """umT5's encoder in Wan's layout, mapped onto ``UMT5EncoderModel``'s names."""
    load_into(module, wan_t5_to_transformers(read_state_dict(path)), path)
